"""The peer benchmark's own logic (benchmarks/hf_flax/bench_peer.py and ab_step.py): paired ratios,
sizes and depths, the classifier row, FLOP counting, profiles, and the in-process A/B."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench_peer():
  import importlib.util

  spec = importlib.util.spec_from_file_location("bench_peer", os.path.join(ROOT, "benchmarks", "hf_flax", "bench_peer.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)  # transformers is imported only when a model is built
  return module


def test_peer_bench_ratio_is_paired_with_an_interval():
  """The peer table's step ratio is the median of the per-step ratios (step i of both sides ran
  back to back) with a 95% bootstrap interval: a slow spell that hits both sides of one pair
  does not move it, a constant ratio has a zero-width interval, and the interval holds the median."""
  peer = _bench_peer()
  tfx = [0.10, 0.11, 0.30, 0.10, 0.12, 0.10, 0.11]
  hf = [0.20, 0.22, 0.60, 0.20, 0.24, 0.20, 0.22]  # the third pair ran in a slow spell
  assert peer.paired_ratio(tfx, hf) == (0.5, 0.5, 0.5)
  noisy = [t * f for t, f in zip(hf, (0.9, 1.1, 1.0, 0.8, 1.2, 1.05, 0.95))]
  ratio, low, high = peer.paired_ratio(noisy, hf)
  assert ratio == pytest.approx(1.0) and low < ratio < high and (low, high) == peer.paired_ratio(noisy, hf)[1:]
  row = dict(model="gpt2", hf_class="FlaxGPT2LMHeadModel", shape="2L", step_s_tfx=0.1, step_s_hf=0.2, step_ratio=0.5,
             step_ratio_ci95=[0.45, 0.55], temp_bytes_tfx=2**20, temp_bytes_hf=2**21, compile_s_tfx=1.0,
             compile_s_hf=2.0, gflop_tfx=1.0, gflop_hf=1.0)
  assert "| 100 / 200 | 0.50x (0.45-0.55) | 1.0 / 2.0 | 0.50x |" in peer.table([row])


def test_peer_bench_layers_replace_a_size_depth_and_bad_arguments_stop_first():
  """`--layers` runs a size at other depths (its width, rows and vocabulary kept; T5's encoder and
  decoder both), and unknown names or depths stop the run before any model is built."""
  peer = _bench_peer()
  assert peer.size_spec("small") == peer.SIZES["small"]
  assert peer.size_spec("small", 8) == (8, *peer.SIZES["small"][1:])
  t5 = peer.tfx_config("t5", "small", layers=6)
  assert (t5.model.num_layers, t5.model.num_decoder_layers, t5.model.d_model) == (6, 6, peer.SIZES["small"][1])
  for argv, message in ((["--sizes", "tiny"], "unknown size 'tiny'"), (["--models", "llama"], "unknown model 'llama'"),
                        (["--layers", "4,0"], "--layers needs counts >= 1"), (["--layers", "4;8"], "comma-separated")):
    with pytest.raises(SystemExit, match=message):
      peer.main(argv)


def test_peer_bench_config_file_keeps_its_own_dropout_at_the_sizes_shape():
  """A config file in place of a peer model (ab_step.py's `--models configs/X.py`) is built at the
  size's shape with its own dropout; a peer model's dropout is off (HF's side has none)."""
  peer = _bench_peer()
  layers, d, heads, _, seq, batch, vocab = peer.size_spec("small")
  own = peer.tfx_config("configs/electra_base.py", "small")
  assert (own.model.num_layers, own.model.d_model, own.model.num_heads) == (layers, d, heads)
  assert (own.data.seq_len, own.train.batch_size, own.data.vocab_size) == (seq, batch, vocab)
  assert own.model.dropout == own.model.attention_dropout == 0.1 and own.objective.name == "electra"
  bert = peer.tfx_config("bert", "small")
  assert bert.model.dropout == bert.model.attention_dropout == 0.0


def test_peer_bench_classifier_is_the_finetune_step_at_the_sizes_shape():
  """`bert_cls` times tfx.finetune's step (a two-class Classifier pooling [CLS], no dropout) at the
  size's rows and batch; its state has no objective part."""
  peer = _bench_peer()
  exp, objective = peer.tfx_experiment("bert_cls", "small", layers=3)
  layers, d, _, _, seq, batch, _ = peer.size_spec("small", 3)
  assert objective is None and (exp.model.num_classes, exp.model.pooling) == (peer.CLASSES, "first")
  assert (exp.config.model.num_layers, exp.config.model.d_model) == (layers, d)
  assert (exp.config.train.batch_size, exp.config.finetune.max_length, exp.config.finetune.dropout) == (batch, seq, 0)
  assert exp.objective.last_layer_queries == 1


def test_peer_bench_counts_flops_again_only_for_a_loop():
  """XLA's cost analysis counts a while loop's body once: the peer benchmark compiles tfx's step
  unscanned for its FLOPs only when the compiled step has a loop (a scan that XLA keeps)."""
  peer = _bench_peer()
  x = jax.numpy.ones((8, 8))
  looped = jax.jit(lambda x: jax.lax.fori_loop(0, x[0, 0].astype(int), lambda i, y: y @ y, x)).lower(x).compile()
  straight = jax.jit(lambda x: (x @ x) @ x).lower(x).compile()
  assert peer.has_loop(looped) and not peer.has_loop(straight)


def test_peer_bench_profile_traces_each_side_and_compares_kinds(tmp_path):
  """`--profile`: a side's steps run under their own trace (the state handed from step to step),
  its optimized HLO is written beside it, and both sides' kernel time is printed by kind."""
  from tfx import bench_profile

  peer = _bench_peer()
  step = jax.jit(lambda s, x: (s + 1, jnp.tanh(x @ x).sum()))
  x = jnp.ones((128, 128))
  compiled = step.lower(jnp.int32(0), x).compile()
  summaries = {}
  for side in ("tfx", "hf"):
    summaries[side], (state, loss) = peer.profile_steps(compiled, (jnp.int32(0), x), str(tmp_path / side), steps=2)
    assert int(state) == 2 and np.isfinite(float(loss))
    assert (tmp_path / side / bench_profile.HLO_FILE).read_text() == compiled.as_text()
    assert summaries[side]["steps"] == 2 and "matmul" in summaries[side]["kinds"]
  text = peer.compare_profiles("toy/small", summaries["tfx"], summaries["hf"])
  assert text.splitlines()[0].startswith("toy/small: kernel ms a step by kind, tfx / HF")
  rows = {line.split()[0]: line for line in text.splitlines()[1:]}
  assert "matmul" in rows and rows["all"].endswith("x")


def test_ab_step_traces_the_swap_for_b_and_restores_the_original(tmp_path, capsys):
  """benchmarks/hf_flax/ab_step.py: B's step is traced with the replacement, the module's own
  function is back afterwards, the same function gives the same loss; with `--override` only B's
  config changes, with `--compiler-option` only B's compile (an option XLA does not know fails there);
  a malformed or unknown swap, a malformed option, or nothing to compare, stops before any model is
  built."""
  import importlib.util

  from tfx.ops import attention

  spec = importlib.util.spec_from_file_location("ab_step", os.path.join(ROOT, "benchmarks", "hf_flax", "ab_step.py"))
  ab = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(ab)
  variant = tmp_path / "variant.py"
  variant.write_text("from tfx.ops import attention\nCALLS = []\n"
                     "_original = attention._grouped\n"
                     "def grouped(x, kv_heads):\n  CALLS.append(kv_heads)\n  return _original(x, kv_heads)\n")
  original = attention._grouped
  swap = ab.load_swap(f"tfx.ops.attention._grouped={variant}:grouped")
  calls = swap[2].__globals__["CALLS"]
  ab.run("gpt2", "small", 1, swap, [])
  assert attention._grouped is original and calls  # traced for B, then put back
  out = capsys.readouterr().out
  losses = [line.split("loss ")[1] for line in out.splitlines() if " loss " in line]
  assert len(losses) == 2 and losses[0] == losses[1] and "B / A" in out
  # --override: B alone is built from the changed config (another seed: other initial weights),
  # and the peer benchmark's own overrides are left as they were
  ab.run("gpt2", "small", 1, None, ["--config.train.seed=7"])
  out = capsys.readouterr().out
  losses = [line.split("loss ")[1] for line in out.splitlines() if " loss " in line]
  assert len(losses) == 2 and losses[0] != losses[1] and not ab.bench_peer.EXTRA_OVERRIDES
  # --compiler-option: B alone is compiled with it (an option XLA does not know fails B's compile)
  assert [ab.compiler_option(text) for text in ("a=true", "b=False", "c=-3", "d=LIBRARY_FUSION_TYPE_REDUCE")] == [
      ("a", True), ("b", False), ("c", -3), ("d", "LIBRARY_FUSION_TYPE_REDUCE")]
  with pytest.raises(Exception, match="no_such_option"):
    ab.run("gpt2", "small", 1, None, [], {"no_such_option": 1})
  assert "gpt2/small A: compiled" in capsys.readouterr().out
  with pytest.raises(SystemExit, match="expected KEY=VALUE"):
    ab.compiler_option("no_value")
  with pytest.raises(SystemExit, match="nothing to compare"):
    ab.main(["--models", "gpt2"])
  with pytest.raises(SystemExit, match="no such config file"):
    ab.main(["--models", "configs/nothing.py", "--override=--config.train.seed=7"])
  for bad, message in (("tfx.ops.attention._grouped", "expected MODULE.ATTR"),
                       (f"tfx.ops.attention.nothing={variant}:grouped", "has no nothing")):
    with pytest.raises(SystemExit, match=message):
      ab.load_swap(bad)
