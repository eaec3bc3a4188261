"""tfx.bench: the train step timed on synthetic data, and the FLOPs formula against a hand count."""

import dataclasses
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfx import bench, flops
from tfx.config import load_config
from tfx.errors import UserError
from tfx.models import build_model
from tfx.objectives.base import OBJECTIVE_PARAMS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--config.model.num_layers=2", "--config.model.d_model=64", "--config.model.d_ff=128",
        "--config.data.seq_len=32", "--config.data.vocab_size=512", "--config.train.batch_size=4"]


def config(*overrides: str):
  return load_config(os.path.join(ROOT, "configs", "base.py"), [*TINY, *overrides])


@pytest.fixture(scope="module")
def result():
  return bench.benchmark(config(), steps=2, warmup=1)


def test_benchmark_reports_throughput(result):
  assert result["step_s"] > 0 and result["tokens_per_s"] > 0 and result["compile_s"] > 0
  assert len(result["step_s_all"]) == 2
  assert result["tokens_per_s"] == pytest.approx(4 * 32 / result["step_s"])
  assert result["parameters"] > 0 and result["device_count"] == jax.device_count()
  assert result["model_tflops_per_s"] > 0 and np.isfinite(result["loss"])
  json.dumps(result)  # plain numbers and strings only


def test_timed_runs_a_step_to_completion_and_counts_its_first_touches(result):
  """`timed`: a step that writes a fresh 64 MiB buffer touches fresh pages (minor faults > 0), and
  the benchmark reports the median of its timed steps' faults."""
  step = jax.jit(lambda x: jnp.broadcast_to(x, (16 << 20,)) + 1.0)
  step(jnp.float32(0)).block_until_ready()
  _, faults, out = bench.timed(step, jnp.float32(1))  # (seconds, faults, outputs): the time is not tested
  assert faults > 0 and float(out[-1]) == 2.0
  assert result["page_faults_per_step"] >= 0 and "page faults" in bench.format_table(result)
  # the hint to start with huge pages: a CPU step that faults in most of its temporaries
  faulting = dict(result, platform="cpu", temp_memory_bytes=64 << 20, page_faults_per_step=16 << 10)  # 64 MiB of 4 KiB pages
  assert bench.HUGE_PAGES_HINT in bench.page_faults_row(faulting)
  assert bench.HUGE_PAGES_HINT not in bench.page_faults_row(dict(faulting, page_faults_per_step=300))
  assert bench.HUGE_PAGES_HINT not in bench.page_faults_row(dict(faulting, platform="gpu"))


def test_result_names_the_attention_kernel_that_ran(result):
  """The benchmark reports the attention kernel the compiled step runs (recorded while tracing,
  not the first-time-only log): XLA's on this CPU for the default config."""
  assert result["attention"] == f"xla (no GPU (backend {jax.default_backend()}))"
  assert "attention" in bench.format_table(result)


def test_attention_summary_counts_mixed_kernels():
  """One kernel: its name and reason; several (a family whose self-attention takes the fused
  kernel and whose cross or prefix-LM attention falls back): each with its call-site count."""
  assert bench.attention_summary([]) == "none"
  assert bench.attention_summary([("cudnn", "GPU, bfloat16")] * 3) == "cudnn (GPU, bfloat16)"
  mixed = [("pallas", "GPU, segment ids"), ("xla", "refused: bias"), ("pallas", "GPU, segment ids")]
  assert bench.attention_summary(mixed) == "pallas x2 (GPU, segment ids) + xla x1 (refused: bias)"


def test_mfu_is_not_applicable_on_cpu(result):
  assert jax.devices()[0].platform == "cpu"
  assert result["mfu"] is None and result["peak_tflops_per_device"] is None
  table = bench.format_table(result)
  assert "MFU" in table and "n/a" in table and "TFLOP/s" in table


@pytest.mark.parametrize("kind, tflops", [
    ("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756), ("NVIDIA H100 NVL", 835), ("NVIDIA H200", 989),
    ("NVIDIA H200 NVL", 835), ("NVIDIA A100-SXM4-80GB", 312), ("TPU v4", 275), ("TPU v4 lite", 138),
    ("TPU v5 lite", 197), ("TPU v5", 459), ("TPU v6 lite", 918), ("NVIDIA B200", None)])
def test_device_peaks_are_dense_bf16_by_device_kind(kind, tflops):
  """The longest name that matches wins (an H100 PCIe is not an SXM part); an unknown device has no peak."""
  device = type("Device", (), {"platform": "gpu", "device_kind": kind})()
  peak = flops.device_peak_flops(device)
  assert (peak and peak / 1e12) == tflops


def test_timed_compiles_bypass_the_persistent_compilation_cache(tmp_path):
  """With JAX_COMPILATION_CACHE_DIR set (tfx.launch sets it) and the cache already in use, a compile
  inside bench.no_compilation_cache() neither reads nor writes it, so it is timed as a compile; a
  compile after the block writes it again. A fresh process: the cache is process-wide."""
  import subprocess
  import sys

  code = ("import jax, os\n"
          "from tfx import bench\n"
          "f = lambda x: (x @ x.T).sum()\n"
          "x = jax.ShapeDtypeStruct((64, 64), 'float32')\n"
          "count = lambda: len(os.listdir(os.environ['JAX_COMPILATION_CACHE_DIR']))\n"
          "jax.jit(lambda x: x.sum()).lower(x).compile()  # the cache is in use from here\n"
          "before = count()\n"
          "with bench.no_compilation_cache():\n"
          "  jax.jit(f).lower(x).compile()\n"
          "inside = count()\n"
          "jax.jit(lambda x: (x @ x).sum()).lower(x).compile()\n"
          "print(before, inside, count())\n")
  env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
         "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  before, inside, after = map(int, out.stdout.split())
  assert before == inside == 1 and after == 2, out.stderr


def test_flops_per_token_matches_a_hand_count():
  cfg = config("--config.model.num_layers=2", "--config.model.d_model=4", "--config.model.num_heads=2",
               "--config.model.d_ff=8").model
  model = build_model(cfg, vocab_size=10, max_length=3)
  # Per layer: q, k, v, out 4 * 4*4 = 64; MLP in + out 2 * 4*8 = 64; output projection 4*10 = 40.
  matmul = 2 * (64 + 64) + 40
  assert flops.matmul_params(model.cfg) == matmul == 296
  # 2 FLOPs per multiply-add; attention QK^T and PV: 2 * 2 * T * e per layer; backward = 2x forward.
  assert flops.flops_per_token(model.cfg, 3) == 3 * (2 * matmul + 2 * 2 * 2 * 3 * 4) == 2064

  # The same count read off the real parameters: every matmul kernel plus the tied embedding.
  params = nn.unbox(jax.eval_shape(lambda: model.init(jax.random.key(0), **type(model).init_inputs(1, 3)))["params"])
  kernels = [x for path, x in jax.tree_util.tree_leaves_with_path(params)
             if jax.tree_util.keystr(path).endswith("['kernel']")]
  assert sum(int(np.prod(k.shape)) for k in kernels) + 10 * 4 == matmul


def test_gated_mlp_counts_two_input_projections():
  cfg = config("--config.model.d_model=4", "--config.model.num_heads=2", "--config.model.d_ff=8",
               "--config.model.mlp=swiglu").model
  model = build_model(cfg, vocab_size=10, max_length=3)
  assert flops.matmul_params(model.cfg) == 2 * (64 + 3 * 32) + 40


def test_synthetic_data_needs_no_tokenizer():
  ids = bench.synthetic_ids(512)
  assert (ids.pad, ids.eos, ids.unk, ids.bos, ids.mask, ids.cls, ids.sep) == tuple(range(7))
  assert len(ids.sentinels) == 100 and ids.sentinels[0] == 511 and min(ids.sentinels) == 412
  b = bench.synthetic_batch(3, 8, 512)
  assert {k: v.shape for k, v in b.items()} == {k: (3, 8) for k in ("tokens", "segment_ids", "positions")}
  assert b["tokens"].min() >= 7 and b["tokens"].max() < 412
  assert (b["segment_ids"] == 1).all() and (b["positions"][1] == np.arange(8)).all()
  # --documents N: N packed documents a row, numbered along it, positions from 0 in each
  b = bench.synthetic_batch(2, 10, 512, documents=3)
  assert b["segment_ids"].tolist() == [[1, 1, 1, 1, 2, 2, 2, 3, 3, 3]] * 2
  assert b["positions"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1, 2]] * 2
  assert bench.synthetic_batch(1, 4, 512, documents=9)["segment_ids"].tolist() == [[1, 2, 3, 4]]


@pytest.mark.parametrize("args, message", [(["--documents", "0"], "at least 1"),
                                           (["--documents", "2", "--finetune", "3"], "not with --finetune"),
                                           (["--documents", "2", "--lower", "gpu"], "same program")])
def test_documents_needs_a_training_step_it_runs(args, message, capsys):
  with pytest.raises(SystemExit):
    bench.main(["--config", os.path.join(ROOT, "configs", "base.py"), *args])
  assert message in capsys.readouterr().err


def test_invalid_config_is_rejected_before_compiling():
  with pytest.raises(UserError, match="num_heads"):
    bench.benchmark(config("--config.model.num_heads=5"), steps=1, warmup=0)


def test_cli_writes_json(tmp_path, capsys):
  path = tmp_path / "bench.json"
  bench.main(["--config", os.path.join(ROOT, "configs", "base.py"), *TINY, "--steps", "1", "--warmup", "0",
              "--json", str(path)])
  out = json.loads(path.read_text())
  assert out["step_s"] > 0 and out["mfu"] is None
  assert out["mesh"] == {"data": jax.device_count(), "fsdp": 1, "tensor": 1}
  assert "tokens/s" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["bert_tiny.py", "t5_tiny.py", "xlnet_tiny.py"])
def test_benchmark_runs_every_family(name):
  r = bench.benchmark(load_config(os.path.join(ROOT, "configs", name)), steps=1, warmup=0)
  assert r["step_s"] > 0 and np.isfinite(r["loss"])


XLNET = ["--config.model.family=xlnet", "--config.objective.name=permutation_lm", "--config.model.position=relative",
         "--config.model.norm=post", "--config.objective.reuse_len=32", "--config.objective.perm_size=32"]


@pytest.mark.parametrize("overrides", [
    [],
    ["--config.model.family=encoder", "--config.objective.name=masked_lm"],
    ["--config.model.family=encoder", "--config.objective.name=sop"],
    ["--config.model.family=encoder_decoder", "--config.objective.name=span_corruption",
     "--config.model.position=relative", "--config.model.num_heads=6", "--config.model.head_dim=16"],  # 96 wide
    XLNET,
    XLNET + ["--config.model.mem_len=32", "--config.model.reuse_len=32"],
    XLNET + ["--config.model.mem_len=32", "--config.model.reuse_len=32", "--config.objective.bi_data=true"],
    ["--config.model.family=encoder", "--config.objective.name=permutation_lm", "--config.model.type_vocab_size=3",
     "--config.objective.reuse_len=32", "--config.objective.perm_size=32"],
    ["--config.model.family=encoder", "--config.objective.name=electra"],
    ["--config.model.family=encoder", "--config.objective.name=electra", "--config.objective.gather_predictions=False"],
], ids=["decoder_clm", "encoder_mlm", "encoder_sop", "t5_spans", "xlnet", "xlnet_memory", "xlnet_bi_data",
        "encoder_plm", "electra", "electra_dense"])
def test_objective_flops_match_xla_cost_analysis(overrides):
  """Each objective's analytic forward count (train_flops_per_row / 3) against XLA's own count
  of the compiled loss: only elementwise work (norms, softmax, GELU: a few %) separates them
  (XLNet's W_r projection, done once per batch without bi_data and once per half of it with bi_data
  and no dropout, is not in the per-row count: the test adds it). Span corruption's decoder runs on 20
  positions against 64 encoder positions, and the xlnet query stream on 11 slots, so a
  per-position count would be far off."""
  seq, batch = 64, 2
  model, objective, xla = _xla_flops(config(*overrides, "--config.model.scan_layers=false"), seq, batch)
  analytic = objective.train_flops_per_row(model.cfg, seq) / 3 * batch
  if model.cfg.family == "xlnet":  # plus W_r R(d) of the s + t - 1 distances, once per batch (bi_data: per half)
    memory = model.cfg.mem_len if objective.init_state(batch, model.cfg) is not None else 0
    encodings = 2 if objective.bi_data and memory else 1  # (evaluation reads bi_data's layout with memory)
    analytic += encodings * model.cfg.num_layers * 2 * model.cfg.d_model ** 2 * (memory + 2 * seq - 1)
  print(f"xla / analytic = {xla / analytic:.4f}")
  # ELECTRA draws a Gumbel sample for every generator logit: elementwise work at [b, n, v] that the
  # count leaves out (5.3% here gathered, 8.2% at every position; a head counted at the wrong
  # number of positions is 10-27% off either way).
  high = 1.09 if "--config.objective.name=electra" in overrides else 1.04
  assert 0.98 < xla / analytic < high, (xla, analytic)


def _xla_flops(cfg, seq: int, batch: int, *, grad: bool = False):
  """(model, objective, XLA's FLOPs of the objective's compiled loss, or of its gradient) for
  `cfg` at a small width, without dropout."""
  cfg.model.d_model, cfg.model.num_heads, cfg.model.d_ff = 128, 4, 512
  cfg.data.seq_len, cfg.data.vocab_size, cfg.train.batch_size = seq, 1000, batch
  cfg.model.dropout = cfg.model.attention_dropout = 0.0
  exp = bench.build_experiment(cfg)
  model, objective = exp.model, exp.objective
  params = nn.unbox(jax.eval_shape(lambda: model.init(jax.random.key(0), **type(model).init_inputs(1, seq)))["params"])
  own = jax.eval_shape(lambda: objective.init_params(jax.random.key(1), model, seq))  # sop's sentence head
  if own is not None:
    params = {**params, OBJECTIVE_PARAMS: nn.unbox(own)}
  data = bench.synthetic_batch(batch, objective.raw_length(seq), model.cfg.vocab_size)
  state = objective.init_state(batch, model.cfg)
  kwargs = {} if state is None else {"state": jax.ShapeDtypeStruct(state.shape, state.dtype)}
  loss = lambda p, b, **k: objective.loss(model, p, b, jax.random.key(0), train=False, **k)[0]
  fn = jax.grad(loss) if grad else loss
  return model, objective, jax.jit(fn).lower(params, data, **kwargs).compile().cost_analysis()["flops"]


MLM = ("--config.objective.name=masked_lm",)


@pytest.mark.parametrize("overrides", [
    [],
    ["--config.model.family=encoder", *MLM, "--config.model.type_vocab_size=2"],
    ["--config.model.family=encoder", *MLM, "--config.finetune.pooling=mean"],
    ["--config.model.family=encoder", *MLM, "--config.model.position=relative"],
    ["--config.model.family=encoder_decoder", "--config.objective.name=span_corruption",
     "--config.model.position=relative"],
    XLNET,
], ids=["decoder_last", "encoder_first", "encoder_mean", "encoder_relative", "t5_mean", "xlnet_last"])
def test_classifier_flops_match_xla_cost_analysis(overrides):
  """A fine-tuning row's analytic count (`ClassificationLoss.train_flops_per_row` / 3) against XLA's
  count of the compiled classification loss: the last layer at the pooled token alone where the
  family runs it so (decoder, encoder without a relative bias, XLNet: XLA's count is 0.60x a count
  of the full last layer at these 2 layers), in full otherwise (XLNet's W_r projection, once per
  batch, is added as in the objectives' test)."""
  seq, batch = 64, 2
  cfg = config(*overrides, "--config.model.scan_layers=false", "--config.model.d_model=128",
               "--config.model.num_heads=4", "--config.model.d_ff=512", f"--config.data.seq_len={seq}",
               "--config.data.vocab_size=1000", f"--config.finetune.batch_size={batch}", "--config.finetune.dropout=0")
  exp = bench.build_finetune_experiment(cfg, 3)
  model, objective = exp.model, exp.objective
  alone = model.pooling != "mean" and (model.backbone.cfg.family == "xlnet" or "--config.model.position=relative"
                                        not in overrides)
  assert (objective.last_layer_queries == 1) == alone
  params = nn.unbox(jax.eval_shape(lambda: model.init(jax.random.key(0), **type(model).init_inputs(1, seq)))["params"])
  data = bench.classification_batch(batch, seq, 1000, 3)
  loss = lambda p, b: objective.loss(model, p, b, jax.random.key(0), train=False)[0]
  xla = jax.jit(loss).lower(params, data).compile().cost_analysis()["flops"]
  analytic = objective.train_flops_per_row(model.backbone.cfg, seq) / 3 * batch
  if model.backbone.cfg.family == "xlnet":  # plus W_r R(d) of the 2t - 1 distances, once per batch
    analytic += model.backbone.cfg.num_layers * 2 * model.backbone.cfg.d_model ** 2 * (2 * seq - 1)
  whole = dataclasses.replace(objective, last_layer_queries=None)  # the count of a full last layer
  full = whole.train_flops_per_row(model.backbone.cfg, seq) / 3 * batch
  print(f"xla / analytic = {xla / analytic:.4f}, xla / full last layer = {xla / full:.4f}")
  assert 0.98 < xla / analytic < 1.04, (xla, analytic)


def test_benchmark_times_a_finetuning_step():
  r = bench.benchmark(load_config(os.path.join(ROOT, "configs", "bert_tiny.py"), ["--config.finetune.batch_size=4"]),
                      steps=1, warmup=0, finetune=3)
  assert r["objective"] == "finetune (3 classes, pooling first)" and r["batch_size"] == 4
  assert r["step_s"] > 0 and np.isfinite(r["loss"]) and r["flops_per_token"] > 0


@pytest.mark.parametrize("overrides", [
    XLNET + ["--config.model.mem_len=32", "--config.model.reuse_len=32"],
    ["--config.model.family=encoder", "--config.objective.name=permutation_lm", "--config.objective.reuse_len=32",
     "--config.objective.perm_size=32"],
    ["--config.model.family=encoder", "--config.objective.name=masked_lm"],
], ids=["xlnet_memory", "encoder_plm", "encoder_mlm"])
def test_a_scanned_stack_computes_no_more_than_unrolled_layers(overrides):
  """Where the loss reads only part of the last layer (a two-stream model's query stream; masked
  LM's selected tokens), XLA prunes the rest of unrolled layers, and a scanned stack must not
  compute it either (its last layer's content stream, inside the loop, would be kept). The
  gradient's FLOPs with the scanned loop unrolled (XLA counts a loop body once), remat off,
  against `scan_layers=False`: 1.24x (XLNet) and 1.29x (two-stream encoder) at these 3 layers
  before the last layer left the loop."""
  base = ["--config.model.remat=none", "--config.model.num_layers=3"]
  _, _, unrolled = _xla_flops(config(*overrides, *base, "--config.model.scan_layers=false"), 64, 2, grad=True)
  _, _, scanned = _xla_flops(config(*overrides, *base, "--config.model.scan_unroll=0"), 64, 2, grad=True)
  print(f"scanned / unrolled = {scanned / unrolled:.4f}")
  assert abs(scanned / unrolled - 1) < 0.005, (scanned, unrolled)


@pytest.mark.slow
def test_data_benchmark_runs_and_reports_every_column(tmp_path, capsys):
  """tfx.bench_data end to end on a small corpus (it reports; nothing asserts speed)."""
  from tfx import bench_data

  bench_data.main(["--out", str(tmp_path), "--sizes-mb", "3", "--workers", "1", "--vocab-size", "2000"])
  lines = capsys.readouterr().out.strip().splitlines()
  row = json.loads(lines[0])
  for key in ("tokenizer_s", "prepare_s", "prepare_mb_s_per_worker", "first_batch_s", "verified_s",
              "host_ms_per_batch", "peak_rss_gb"):
    assert row[key] > 0, key
  assert row["tokens"] > 500_000 and row["corpus_mb"] >= 3
  assert lines[-1].startswith("| 3 |")


def test_sweep_over_remat_policies_same_loss():
  """--sweep runs one benchmark per value; remat changes what is recomputed, never the result."""
  results = bench.sweep(os.path.join(ROOT, "configs", "base.py"), TINY, "model.remat", ["none", "dots_saveable"],
                        steps=1, warmup=0)
  assert [r["sweep_value"] for r in results] == ["none", "dots_saveable"]
  assert results[0]["loss"] == pytest.approx(results[1]["loss"], rel=1e-6)
  assert all(r["temp_memory_bytes"] > 0 for r in results)
  table = bench.format_sweep(results).splitlines()
  assert table[0].split()[:3] == ["model.remat", "compile", "s"] and len(table) == 3


def test_data_only_part_is_what_does_not_touch_the_parameters():
  """The accelerator suite times an objective's own work as the loss's equations that read the
  batch and the key but no parameter: here a masking transform and a mask, beside a model."""
  from tfx import bench_suite

  def loss(model_args, data_args):
    (w,) = model_args
    tokens, key = data_args
    keep = jax.random.bernoulli(key, 0.85, tokens.shape)  # the objective: masking
    inputs = jax.numpy.where(keep, tokens, 0)
    visible = (tokens[:, :, None] >= tokens[:, None, :]).astype(jax.numpy.float32)  # a mask from the batch
    h = jax.numpy.take(w, inputs, axis=0)  # [b, t, e]: the model from here on
    return jax.numpy.sum(jax.numpy.einsum("bts,bse->bte", visible, h) * w[0])

  tokens = jax.numpy.asarray(np.random.default_rng(0).integers(1, 50, (2, 8)), jax.numpy.int32)
  key = jax.random.key(3)
  w = jax.numpy.ones((50, 4))
  part, n_eqns = bench_suite.data_only_part(loss, (w,), (tokens, key))
  outs = jax.jit(part)((tokens, key))
  want_inputs = np.where(np.asarray(jax.random.bernoulli(key, 0.85, tokens.shape)), np.asarray(tokens), 0)
  want_visible = (np.asarray(tokens)[:, :, None] >= np.asarray(tokens)[:, None, :]).astype(np.float32)
  got = sorted((np.asarray(o) for o in outs), key=lambda a: a.ndim)
  assert len(got) == 2 and n_eqns >= 4
  np.testing.assert_array_equal(got[0], want_inputs)
  np.testing.assert_array_equal(got[1], want_visible)


@pytest.mark.slow
def test_accelerator_suite_runs_tiny_on_cpu(tmp_path, capsys):
  """`tfx.bench --suite accel --tiny`: the four reference models in bf16 and GPT-2's compile time by
  depth, on this CPU (its numbers say nothing about speed; this checks that the suite runs and
  reports every column). XLNet's carried memory keeps its float32 dtype under bf16 compute (the
  AOT-compiled step refuses a state whose dtype changed)."""
  path = tmp_path / "suite.json"
  bench.main(["--suite", "accel", "--tiny", "--steps", "1", "--warmup", "1", "--json", str(path)])
  out = json.loads(path.read_text())
  assert [r["name"] for r in out["models"]] == ["gpt2_small", "bert_base", "t5_base", "xlnet_base"]
  for r in out["models"]:
    assert r["step_s"] > 0 and np.isfinite(r["loss"]) and r["mfu"] is None, r["name"]
    assert r["transform_ms"] > 0 and r["transform_equations"] > 0 and 0 < r["transform_share"], r["name"]
    assert r["batch_size"] == 2 * jax.device_count() and r["temp_memory_bytes"] > 0
  assert sorted(int(k) for k in out["compile_layers"]) == [2, 8]
  table = capsys.readouterr().out
  assert "objective share" in table and "gpt2_small compile: 2 layers" in table
  with pytest.raises(SystemExit, match="unknown model"):
    bench.main(["--suite", "accel", "--tiny", "--only", "gpt3"])


@pytest.mark.slow
def test_accelerator_suite_sweeps_a_setting(tmp_path, capsys):
  """`--suite accel --sweep model.attention=xla,reference --config.model.remat=none`: the overrides
  reach every model, one run of the suite per swept value, each reporting the kernel that ran;
  the attention kernel changes the step, not the loss. A bad value stops it before compiling."""
  path = tmp_path / "sweep.json"
  bench.main(["--suite", "accel", "--tiny", "--only", "bert_base", "--steps", "1", "--warmup", "0",
              "--sweep", "model.attention=xla,reference", "--config.model.remat=none", "--json", str(path)])
  out = json.loads(path.read_text())
  assert out["sweep"] == "model.attention=xla,reference"
  runs = out["runs"]
  assert [r["overrides"] for r in runs] == [["model.remat=none", "model.attention=xla"],
                                            ["model.remat=none", "model.attention=reference"]]
  (xla,), (ref,) = (r["models"] for r in runs)
  assert xla["attention"].startswith("xla (") and ref["attention"] == "reference (model.attention)"
  assert xla["loss"] == pytest.approx(ref["loss"], rel=2e-2)  # bf16 compute, two attention kernels
  assert capsys.readouterr().out.count("model.attention=") == 2
  with pytest.raises(SystemExit, match="model.attention='flash'"):
    bench.main(["--suite", "accel", "--tiny", "--only", "bert_base", "--sweep", "model.attention=xla,flash"])
  with pytest.raises(SystemExit, match="--config.KEY=VALUE"):
    bench.main(["--suite", "accel", "--tiny", "--config.model.remat", "none"])


def test_profile_traces_steps_and_sums_kernels_by_kind(tmp_path, capsys):
  from tfx import bench_profile

  out = bench.benchmark(config(), steps=1, warmup=0, profile=str(tmp_path))
  summary = out["profile"]
  assert summary["trace"] == bench_profile.find_trace(str(tmp_path)) and summary["trace"].endswith(".xplane.pb")
  kinds = summary["kinds"]
  assert summary["busy_ms_per_step"] > 0 and "matmul" in kinds and "xla fusions" in kinds
  assert sum(k["ms_per_step"] for k in kinds.values()) == pytest.approx(summary["busy_ms_per_step"])
  assert all(k["once_a_step_ms"] <= k["ms_per_step"] for k in kinds.values())
  assert summary["top"] and "ms of kernels a step" in bench_profile.format_summary(summary)
  # every kernel's time joined with the bytes tfx.bench_traffic counts for its HLO instruction
  joined = summary["bytes"]
  rows = joined["kernels"]
  assert joined["matched_share"] > 0.9 and 0 < len(rows) <= bench_profile.KEPT_ROWS
  assert [r["ms_per_step"] for r in rows] == sorted((r["ms_per_step"] for r in rows), reverse=True)
  assert sum(r["ms_per_step"] for r in rows) <= summary["busy_ms_per_step"] * 1.001
  moving = [r for r in rows if r["gb_per_step"] > 0]
  assert moving and all(r["tb_per_s"] > 0 for r in moving)
  assert any(r["kind"] == "matmul" and "dot_general" in r["op"] for r in rows)
  outside = joined["outside_layers"]  # the head's matmul at least
  assert 0 < outside["ms_per_step"] < summary["busy_ms_per_step"] and outside["gb_per_step"] > 0
  hlo = tmp_path / bench_profile.HLO_FILE  # written beside the trace, so the CLI can read both again
  assert "ENTRY" in hlo.read_text()
  bench_profile.main([str(tmp_path), "--top", "3"])
  printed = capsys.readouterr().out
  assert "with their bytes" in printed and ("TB/s" in printed or "GB/s" in printed)
  json.dumps(out)
  with pytest.raises(FileNotFoundError, match="no .xplane.pb"):
    bench_profile.find_trace(str(tmp_path / "none"))


def test_join_bytes_matches_kernels_to_instructions_under_either_spelling():
  """A device kernel is traced under its instruction (`hlo_op`) or, without one, under its symbol,
  which spells the instruction's '.' as '_': both find the instruction's bytes."""
  from tfx import bench_profile, bench_traffic

  x = jax.ShapeDtypeStruct((256, 512), np.float32)
  text = jax.jit(lambda a, b: jnp.tanh(a @ b.T) * 2.0).lower(x, x).compile().as_text()
  kernels = {k.name: k for k in bench_traffic.kernels(text)}
  dot = next(k for k in kernels.values() if k.kind == "matmul")
  other = next(k for k in kernels.values() if k is not dot and k.read + k.written)
  times = {dot.name: 6_000_000, other.name.replace(".", "_"): 3_000_000, "not_in_this_program": 1_000_000}
  joined = bench_profile.join_bytes(times, text, steps=3, devices=1)
  assert joined["matched_share"] == pytest.approx(0.9)
  first, second = joined["kernels"]
  assert (first["kernel"], second["kernel"]) == (dot.name, other.name)
  assert first["ms_per_step"] == pytest.approx(2.0) and second["ms_per_step"] == pytest.approx(1.0)
  assert first["gb_per_step"] == pytest.approx((dot.read + dot.written) / 1e9)
  assert first["tb_per_s"] == pytest.approx((dot.read + dot.written) / 2e-3 / 1e12)
  assert bench_profile.join_bytes(times, text, steps=3, devices=2)["kernels"][0]["ms_per_step"] == pytest.approx(1.0)


def test_slowest_per_byte_lists_the_slow_elementwise_kernels_first():
  """`slowest_per_byte`: of the kernels over 0.5% of the step, the fusions, copies and in-place
  updates by the bandwidth they reached, lowest first; matrix products, attention and kernels
  without bytes are not candidates. The summary prints them after the heaviest."""
  from tfx import bench_profile

  row = lambda name, kind, ms, gb: {"kernel": name, "kind": kind, "op": "op/" + name, "ms_per_step": ms,
                                    "gb_per_step": gb, "tb_per_s": gb / ms if gb else None}  # GB / ms = TB/s
  joined = {"matched_share": 1.0, "outside_layers": {"ms_per_step": 0.0, "gb_per_step": 0.0}, "kernels": [
      row("dot", "matmul", 50.0, 0.01), row("attn", "attention", 20.0, 0.01), row("norm", "fusion", 5.0, 0.05),
      row("slow_reduce", "fusion", 4.0, 0.004), row("update", "in-place update", 2.0, 0.01),
      row("tiny", "fusion", 0.2, 0.00001), row("nothing", "fusion", 3.0, 0.0)]}
  slow = bench_profile.slowest_per_byte(joined, busy_ms=100.0, n=3)
  assert [r["kernel"] for r in slow] == ["slow_reduce", "update", "norm"]
  assert [r["kernel"] for r in bench_profile.slowest_per_byte(joined, busy_ms=100.0, n=1)] == ["slow_reduce"]
  summary = {"trace": "t", "source": "host", "steps": 3, "busy_ms_per_step": 100.0, "kinds": {}, "top": [],
             "bytes": joined}
  printed = bench_profile.format_summary(summary, top=10)
  tail = printed[printed.index("the slowest per byte"):]
  assert tail.index("slow_reduce") < tail.index("update") < tail.index("norm") and "dot" not in tail
  assert "1.00 GB/s" in tail and "10.00 GB/s" in tail  # below 0.1 TB/s in GB/s


TPU_TRACE = """
planes { id: 1 name: "/device:TPU:0"
  lines { id: 1 name: "XLA Modules" events { metadata_id: 1 offset_ps: 0 duration_ps: 10000000 } }
  lines { id: 2 name: "XLA Ops"
    events { metadata_id: 2 offset_ps: 0 duration_ps: 4000000 }
    events { metadata_id: 3 offset_ps: 4000000 duration_ps: 6000000 stats { metadata_id: 9 str_value: "fusion.3" } } }
  event_metadata { key: 1 value { id: 1 name: "jit_step_fn(1)" } }
  event_metadata { key: 2 value { id: 2 name: "fusion.2" } }
  event_metadata { key: 3 value { id: 3 name: "fusion.3" } }
  stat_metadata { key: 9 value { id: 9 name: "hlo_op" } }
}
"""


def test_a_tpu_trace_counts_each_op_once(tmp_path):
  """A TPU's device plane has its ops on the "XLA Ops" line beside lines that span them (the
  module, the steps): only the ops are summed, under their instruction names."""
  from jax.profiler import ProfileData

  from tfx import bench_profile

  path = tmp_path / "vm.xplane.pb"
  path.write_bytes(ProfileData.text_proto_to_serialized_xspace(TPU_TRACE))
  total, calls, by_op, where, threads = bench_profile.trace_times(str(path))
  assert where == "device" and threads == 0 and dict(total) == {"fusion.2": 4000, "fusion.3": 6000}
  assert dict(by_op) == {"fusion.2": 4000, "fusion.3": 6000}
  assert bench_profile.summarize(str(path), steps=1)["busy_ms_per_step"] == pytest.approx(0.01)


def _host_trace(names_by_thread: dict[str, list[tuple[str, int]]]) -> str:
  """A CPU trace's text proto: per intra-op thread line, thunk events (instruction, ns) with hlo_op."""
  names = sorted({name for events in names_by_thread.values() for name, _ in events})
  ids = {name: i + 1 for i, name in enumerate(names)}
  lines = []
  for number, (thread, events) in enumerate(names_by_thread.items()):
    body = " ".join(f'events {{ metadata_id: {ids[n]} offset_ps: 0 duration_ps: {ns * 1000} '
                    f'stats {{ metadata_id: 99 str_value: "{n}" }} }}' for n, ns in events)
    lines.append(f'lines {{ id: {number + 1} name: "{thread}" {body} }}')
  metadata = " ".join(f'event_metadata {{ key: {i} value {{ id: {i} name: "{n}" }} }}' for n, i in ids.items())
  return (f'planes {{ id: 1 name: "/host:CPU" {" ".join(lines)} {metadata} '
          'stat_metadata { key: 99 value { id: 99 name: "hlo_op" } } }')


def test_a_cpu_trace_takes_kinds_from_the_hlo_and_flags_concurrent_threads(tmp_path):
  """On a CPU the thunks are named after their instructions, so the optimized HLO tells a YNNPACK or
  Eigen matmul from an elementwise fusion (their names do not); a trace from more than one intra-op
  thread carries the caveat that kernel times overlap and Eigen's matmuls show their hand-off only."""
  from jax.profiler import ProfileData

  from tfx import bench_profile, bench_traffic

  x = jax.ShapeDtypeStruct((256, 512), np.float32)
  text = jax.jit(lambda a, b: jnp.tanh(a @ b.T) * 2.0).lower(x, x).compile().as_text()
  kernels = bench_traffic.kernels(text)
  dot = next(k.name for k in kernels if k.kind == "matmul")
  other = next(k.name for k in kernels if k.kind == "fusion")
  for threads, caveat in ((1, False), (2, True)):
    events = {f"tf_XLAEigen/{i}": [(dot, 3000), (other, 1000)] for i in range(threads)}
    path = tmp_path / f"{threads}.xplane.pb"
    path.write_bytes(ProfileData.text_proto_to_serialized_xspace(_host_trace(events)))
    summary = bench_profile.summarize(str(path), steps=1, hlo_text=text)
    assert summary["source"].startswith("host") and summary["intra_op_threads"] == threads
    assert summary["kinds"]["matmul"]["ms_per_step"] == pytest.approx(0.003 * threads)
    assert summary["kinds"]["xla fusions"]["ms_per_step"] == pytest.approx(0.001 * threads)
    assert ("caveat" in summary) == caveat
    assert ("taskset" in bench_profile.format_summary(summary)) == caveat


@pytest.mark.parametrize("kernel, kind", [  # names from a GPT-2 step's trace on an H200
    ("nvjet_sm90_tst_192x192_64x3_1x2_h_bz_coopB_splitK_NTN", "matmul"),
    ("gemm_fusion_dot_general_30", "matmul"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float>", "matmul"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64", "attention"),
    ("void cudnn::fusion::compute_dot_do_o_specialized<true, 64>", "attention"),
    ("memcpy128", "copies"), ("Memset 0", "copies"),
    ("input_add_multiply_reduce_fusion", "xla fusions"), ("loop_convert_fusion", "xla fusions"),
])
def test_kernel_kinds(kernel, kind):
  from tfx import bench_profile

  assert bench_profile.kind_of(kernel) == kind
