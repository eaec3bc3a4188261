"""The loop end to end: files a run writes, exact resume, gradient accumulation, bad workdirs."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import ROOT, tiny_config
from tfx import train
from tfx.checkpoint import CheckpointError
from tfx.metrics import read_metrics
from tests.test_sharding import ENCODER_MLM, T5_SPANS

TIMING = ("tokens_per_sec", "mfu")


def quick(tokenizer, *overrides):
  return tiny_config(f"--config.data.tokenizer={tokenizer}", "--config.data.max_documents=60",
                     "--config.train.steps=8", "--config.train.log_every=1", "--config.train.eval_every=4",
                     "--config.train.checkpoint_every=4", "--config.model.dropout=0.1", *overrides)


def params_of(result):
  return jax.tree.map(np.asarray, jax.device_get(result["state"].params))


def without_timing(records):
  return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


def test_logged_window_weights_the_objectives_metrics_by_tokens():
  """A log window of steps that predict different numbers of tokens (masked LM) logs the loss and
  accuracy of all its tokens, as evaluation and gradient accumulation weight them; grad norm and
  the grad norm is a plain mean; the learning rate is the one applied at the window's last step (the
  step logged), even when that step was skipped; a non-finite step is left out and counted."""
  from tfx.objectives import Objective, placeholder_ids
  from tfx.train import _train_values

  step = lambda loss, acc, n, norm, lr, bad=0.0: {"loss": np.float32(loss), "accuracy": np.float32(acc),
                                                  "num_tokens": np.float32(n), "grad_norm": np.float32(norm),
                                                  "learning_rate": np.float32(lr), "nonfinite": np.float32(bad)}
  values = _train_values([step(2.0, 0.5, 30, 1.0, 1e-4), step(4.0, 0.1, 10, 3.0, 2e-4),
                          step(np.nan, 0.0, 20, np.nan, 3e-4, 1.0)], Objective(placeholder_ids(8)))  # warming up
  assert values["loss"] == pytest.approx((2.0 * 30 + 4.0 * 10) / 40)
  assert values["accuracy"] == pytest.approx((0.5 * 30 + 0.1 * 10) / 40)
  assert values["grad_norm"] == pytest.approx(2.0) and values["num_tokens"] == pytest.approx(20.0)
  assert values["learning_rate"] == np.float32(3e-4)
  assert values["skipped"] == 1.0


def test_train_cli_end_to_end(tmp_path):
  """`python -m tfx.train` on the real corpus: files written, eval loss falls."""
  workdir = tmp_path / "run"
  proc = subprocess.run(
      [sys.executable, "-m", "tfx.train", "--config", os.path.join(ROOT, "configs", "tiny.py"), "--workdir", str(workdir),
       "--config.train.steps=40", "--config.train.eval_every=10", "--config.train.checkpoint_every=20"],
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert "eval loss" in proc.stdout and "tok/s" in proc.stdout
  config = json.loads((workdir / "config.json").read_text())
  assert config["train"]["steps"] == 40 and config["model"]["family"] == "decoder"
  assert (workdir / "tokenizer.model").exists()
  assert sorted(os.listdir(workdir / "checkpoints")) == ["20", "40"]
  records = read_metrics(str(workdir))
  for r in records:
    assert {"step", "split", "loss", "accuracy"} <= set(r)
    if r["split"] == "train":
      assert {"learning_rate", "tokens_per_sec", "mfu"} <= set(r)
  evals = [r["loss"] for r in records if r["split"] == "eval"]
  assert [r["step"] for r in records if r["split"] == "eval"] == [0, 10, 20, 30, 40]
  assert evals[-1] < evals[0] - 1.0, evals


@pytest.mark.slow
@pytest.mark.parametrize("config_name, extra", [("bert_tiny.py", []), ("roberta_tiny.py", []), ("t5_tiny.py", []),
                                                ("xlnet_tiny.py", []),
                                                ("tiny.py", ["--config.objective.name=prefix_lm"])])
def test_every_family_and_objective_trains_end_to_end(tmp_path, config_name, extra):
  """The tiny config of each family/objective trains through `python -m tfx.train` on the
  standard-library corpus and its eval loss falls."""
  workdir = tmp_path / "run"
  proc = subprocess.run(
      [sys.executable, "-m", "tfx.train", "--config", os.path.join(ROOT, "configs", config_name), "--workdir",
       str(workdir), "--config.train.eval_every=30", *extra], cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  evals = [r["loss"] for r in read_metrics(str(workdir)) if r["split"] == "eval"]
  assert len(evals) >= 2 and evals[-1] < evals[0] - 1.0, evals


XLNET_MEMORY = ["--config.model.family=xlnet", "--config.objective.name=permutation_lm", "--config.model.norm=post",
                "--config.model.position=relative", "--config.model.mlp=gelu_exact", "--config.model.scan_layers=false",
                "--config.model.mem_len=48", "--config.model.reuse_len=32", "--config.objective.reuse_len=32",
                "--config.objective.perm_size=32", "--config.objective.row_layout=xlnet", "--config.objective.bi_data=true",
                "--config.objective.word_spans=true"]


@pytest.mark.parametrize("overrides", [[], ENCODER_MLM, T5_SPANS,
                                       pytest.param(XLNET_MEMORY, marks=pytest.mark.slow)],  # ~55 s: `make test-slow`
                         ids=["decoder_clm", "encoder_mlm", "t5_spans", "xlnet_memory"])
def test_exact_resume(tmp_path, shared_tokenizer, overrides):
  """Stopping after a checkpoint and resuming gives the same metrics and the same parameters,
  bitwise, as an uninterrupted run (dropout on, and MLM / span masks drawn from the step's key,
  so the PRNG state matters too; the stop falls inside a log window, which the checkpoint keeps)."""
  overrides = [*overrides, "--config.train.log_every=3"]  # the stop at 4 cuts the log window of steps 4-6
  full = train.run(quick(shared_tokenizer, *overrides), str(tmp_path / "full"))
  part = tmp_path / "part"
  first = train.run(quick(shared_tokenizer, *overrides, "--config.train.stop_after=4"), str(part))
  assert first["step"] == 4
  resumed = train.run(quick(shared_tokenizer, *overrides), str(part))
  assert resumed["step"] == 8
  assert without_timing(read_metrics(str(part))) == without_timing(read_metrics(str(tmp_path / "full")))
  a, b = params_of(full), params_of(resumed)
  jax.tree.map(np.testing.assert_array_equal, a, b)
  if XLNET_MEMORY[0] in overrides:  # the memory is carried, checkpointed and restored too
    memory = np.asarray(full["state"].objective_state)
    assert memory.shape == (2, 8, 48, 64) and np.abs(memory).sum() > 0
    np.testing.assert_array_equal(memory, np.asarray(resumed["state"].objective_state))


def test_resume_after_crash_between_checkpoints(tmp_path, shared_tokenizer):
  """A run that died after step 6 (checkpoint at 4) resumes at 4 and drops the orphan records."""
  workdir = str(tmp_path / "run")
  train.run(quick(shared_tokenizer, "--config.train.stop_after=4"), workdir)
  with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:  # records a crashed run left behind
    f.write(json.dumps({"step": 5, "split": "train", "loss": 123.0}) + "\n")
  train.run(quick(shared_tokenizer), workdir)
  steps = [r["step"] for r in read_metrics(workdir) if r["split"] == "train"]
  assert steps == list(range(1, 9))


def test_gradient_accumulation_matches_one_batch(tmp_path, shared_tokenizer):
  """grad_accum=2 computes the same update as the whole batch at once (dropout off)."""
  one = train.run(quick(shared_tokenizer, "--config.model.dropout=0", "--config.train.steps=3"), str(tmp_path / "a"))
  two = train.run(quick(shared_tokenizer, "--config.model.dropout=0", "--config.train.steps=3",
                        "--config.train.grad_accum=2"), str(tmp_path / "b"))
  la = [r["loss"] for r in read_metrics(str(tmp_path / "a")) if r["split"] == "train"]
  lb = [r["loss"] for r in read_metrics(str(tmp_path / "b")) if r["split"] == "train"]
  np.testing.assert_allclose(la, lb, rtol=1e-5)
  for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(params_of(one))[0], jax.tree.leaves(params_of(two))):
    name = jax.tree_util.keystr(path)
    if "'key'" in name and "'bias'" in name:
      # The key projection's bias has a zero gradient in exact arithmetic (it adds the same q.b to
      # every score of a row, and the softmax does not see that): Adam moves it by rounding noise
      # only, which the two summation orders make differently. It must stay at noise level.
      assert np.max(np.abs(x)) < 1e-5 and np.max(np.abs(y)) < 1e-5, name
    else:
      np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6, err_msg=name)


def test_corrupt_checkpoint_message(tmp_path, shared_tokenizer):
  workdir = tmp_path / "run"
  train.run(quick(shared_tokenizer, "--config.train.stop_after=4"), str(workdir))
  state_dir = workdir / "checkpoints" / "4" / "state"
  for root, _, files in os.walk(state_dir):
    for name in files:
      with open(os.path.join(root, name), "wb") as f:
        f.write(b"garbage")
  with pytest.raises(CheckpointError, match=r"no checkpoint in .*checkpoints could be restored \(step 4: .*new --workdir"):
    train.run(quick(shared_tokenizer), str(workdir))


def test_cli_reports_bad_config_without_traceback(tmp_path):
  proc = subprocess.run(
      [sys.executable, "-m", "tfx.train", "--config", os.path.join(ROOT, "configs", "tiny.py"), "--workdir",
       str(tmp_path), "--config.model.num_heads=5"], cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 1
  assert "num_heads=5 does not divide" in proc.stderr and "Traceback" not in proc.stderr
  proc = subprocess.run(
      [sys.executable, "-m", "tfx.train", "--config", os.path.join(ROOT, "configs", "tiny.py"), "--workdir",
       str(tmp_path), f"--config.data.source=text:{tmp_path}/nothing/*.txt"],
      cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 1 and "nothing/*.txt" in proc.stderr and "Traceback" not in proc.stderr


# A stateful objective: causal LM that also counts, per stream, the tokens it has predicted.
# The count lives in the objective state, so a resume that lost it would change the metrics.
import dataclasses  # noqa: E402

from tfx.objectives.causal_lm import CausalLM  # noqa: E402
from tfx.registry import OBJECTIVES  # noqa: E402


@dataclasses.dataclass(frozen=True)
class CountingCausalLM(CausalLM):
  stateful = True
  contiguous_rows = True

  def init_state(self, batch_size, model_cfg):
    return {"seen": jnp.zeros((batch_size,), jnp.float32)}

  def state_axes(self):
    return {"seen": ("act_batch",)}

  def loss(self, model, params, batch, rng, *, train, state=None):
    loss, metrics = super().loss(model, params, batch, rng, train=train)
    seen = jnp.zeros(batch["tokens"].shape[:1]) if state is None else state["seen"]
    seen = seen + jnp.sum(batch["segment_ids"] > 0, axis=-1)
    return loss, dict(metrics, seen_total=jnp.sum(seen), state={"seen": seen})


if "counting_causal_lm_for_tests" not in OBJECTIVES:
  OBJECTIVES.register("counting_causal_lm_for_tests")(CountingCausalLM)


def test_objective_state_is_carried_and_resumed(tmp_path, shared_tokenizer):
  overrides = ("--config.objective.name=counting_causal_lm_for_tests",)
  full = train.run(quick(shared_tokenizer, *overrides), str(tmp_path / "full"))
  seen = [r["seen_total"] for r in read_metrics(str(tmp_path / "full")) if r["split"] == "train"]
  per_step = 8 * 64  # batch rows x row length, no padding in training rows
  assert seen == [per_step * s for s in range(1, 9)]
  assert float(jnp.sum(full["state"].objective_state["seen"])) == seen[-1]
  part = str(tmp_path / "part")
  train.run(quick(shared_tokenizer, *overrides, "--config.train.stop_after=4"), part)
  train.run(quick(shared_tokenizer, *overrides), part)
  assert without_timing(read_metrics(part)) == without_timing(read_metrics(str(tmp_path / "full")))
  with pytest.raises(Exception, match="cannot accumulate"):
    train.run(quick(shared_tokenizer, *overrides, "--config.train.grad_accum=2"), str(tmp_path / "bad"))


@pytest.mark.slow  # long: make test-slow runs it
def test_eval_with_memory_carries_it_across_held_out_streams(tmp_path, shared_tokenizer):
  """train.eval_memory: the eval batches are contiguous held-out streams laid out as in training
  (row r of batch k+1 starts reuse_len tokens after row r of batch k, reversed rows included with
  bi_data), and the eval carries the memory from batch to batch: the reported eval loss is the
  token-weighted mean of the objective's loss with the memory threaded through by hand, and a later
  batch's loss depends on the earlier batch's tokens (without the option it does not)."""
  from tfx.steps import make_eval_step

  config = quick(shared_tokenizer, *XLNET_MEMORY, "--config.train.eval_memory=true", "--config.train.steps=4",
                 "--config.train.eval_every=0", "--config.data.eval_batches=3")
  result = train.run(config, str(tmp_path / "run"))
  exp, params = result["experiment"], result["state"].params
  batches = exp.pipeline.eval_batches()
  assert len(batches) == 3 and exp.pipeline.eval_streams
  stride, n = exp.pipeline.stride, exp.pipeline.row_length
  assert stride == 32 < n
  for before, after in zip(batches, batches[1:]):
    np.testing.assert_array_equal(after["tokens"][:, :n - stride], before["tokens"][:, stride:])
  assert [r for r in read_metrics(str(tmp_path / "run")) if r["split"] == "eval"][-1]["loss"] > 0

  _, shardings = train.state_shardings(exp.model, exp.tx, exp.mesh, config.data.seq_len, exp.objective,
                                       config.train.batch_size)
  eval_step = make_eval_step(exp, shardings)
  reported = train.evaluate(exp, eval_step, params, batches)

  @jax.jit
  def loss_of(params, batch, memory):  # -> (loss, num_tokens, memory after the batch)
    _, m = exp.objective.loss(exp.model, params, batch, jax.random.key(0), train=False, state=memory)
    return m["loss"], m["num_tokens"], m.get("state")

  memory, total, count, losses = exp.objective.init_state(config.train.batch_size, exp.model.cfg), 0.0, 0.0, []
  for batch in batches:  # the memory threaded through by hand
    loss, tokens, memory = loss_of(params, {k: jnp.asarray(v) for k, v in batch.items()}, memory)
    total, count = total + float(loss) * float(tokens), count + float(tokens)
    losses.append(float(loss))
  np.testing.assert_allclose(reported["loss"], total / count, rtol=2e-5)

  def second_batch_loss(first_tokens, carry):
    memory = exp.objective.init_state(config.train.batch_size, exp.model.cfg) if carry else None
    for batch in (dict(batches[0], tokens=first_tokens), batches[1]):
      loss, _, after = loss_of(params, {k: jnp.asarray(v) for k, v in batch.items()}, memory)
      memory = after if carry else None
    return float(loss)

  # (4 training steps: the memory moves the loss by ~1e-4 only, hence exact float comparisons)
  other = np.full_like(batches[0]["tokens"], 400)  # another first batch: another memory
  assert second_batch_loss(other, True) != losses[1]  # batch 1 saw what batch 0 left in the memory
  assert second_batch_loss(batches[0]["tokens"], False) == second_batch_loss(other, False) != losses[1]


def test_eval_memory_is_refused_without_memory(tmp_path):
  from tfx import config as config_lib

  with pytest.raises(config_lib.ConfigError, match="train.eval_memory=True: objective 'causal_lm' carries no memory"):
    config_lib.validate(tiny_config("--config.train.eval_memory=true"), num_devices=1)
  with pytest.raises(config_lib.ConfigError, match="train.eval_memory=True needs memory"):
    config_lib.validate(tiny_config(*XLNET_MEMORY, "--config.model.mem_len=0", "--config.train.eval_memory=true"),
                        num_devices=1)


@pytest.mark.parametrize("scan", ["true", "false"])
def test_weight_decay_skips_biases_and_norm_scales(scan):
  """Decay on matrices only, also when scanned layers stack each layer's vectors into [layers, d]
  and for [heads, head_dim] biases: one AdamW step on zero gradients moves exactly the kernels and
  embeddings."""
  import flax.linen as nn

  from tfx.models import build_model
  from tfx.steps import make_optimizer

  config = tiny_config(f"--config.model.scan_layers={scan}", "--config.optim.warmup_steps=0",
                       "--config.optim.weight_decay=0.5")
  model = build_model(config.model, vocab_size=config.data.vocab_size, max_length=16)
  init = jax.jit(lambda key: nn.unbox(model.init(key, **type(model).init_inputs(1, 16))["params"]))
  params = jax.tree.map(lambda p: p + 1.0, init(jax.random.key(0)))  # biases are 0 at init: decay would not show
  tx, _ = make_optimizer(config)
  updates, _ = jax.jit(lambda p: tx.update(jax.tree.map(jnp.zeros_like, p), tx.init(p), p))(params)
  moved = {jax.tree_util.keystr(k): bool(jnp.any(u != 0)) for k, u in jax.tree_util.tree_leaves_with_path(updates)}
  assert moved and all(v == (k.endswith("['kernel']") or k.endswith("['embedding']")) for k, v in moved.items()), moved


def test_learning_rate_metric_is_the_rate_the_update_applies():
  """A step skipped as non-finite restores the optimizer state, whose count then lags the train step:
  the logged rate is the schedule at the optimizer's count (the rate applied), not at the step."""
  from tfx.steps import applied_learning_rate, make_optimizer

  config = tiny_config("--config.optim.warmup_steps=10", "--config.train.steps=20")
  tx, schedule = make_optimizer(config)
  params = {"w": jnp.ones((2, 2))}
  state = tx.init(params)
  rates = []
  for step in range(4):
    rates.append(float(applied_learning_rate(schedule, state)))
    _, new = tx.update({"w": jnp.ones((2, 2))}, state, params)
    state = state if step == 1 else new  # step 1 skipped: its optimizer state is dropped
  assert rates == [float(schedule(0)), float(schedule(1)), float(schedule(1)), float(schedule(2))]
  assert float(schedule(1)) > 0 and len(set(rates)) == 3


def test_a_run_says_how_many_batches_fit_the_packed_layout(tmp_path, shared_tokenizer, monkeypatch):
  """With model.packed_runs, the first log says how many batches had rows of at most that many runs
  of one segment id (cuDNN's packed layout on a GPU; the mask for the others): counted on the host
  rows the loop feeds, the same count as `ops.runs_per_row`."""
  from tfx import ops
  from tfx.metrics import Progress

  said, fed = [], []
  monkeypatch.setattr(Progress, "note", lambda self, text: said.append(text))
  real_add = train._PackedFit.add
  monkeypatch.setattr(train._PackedFit, "add", lambda self, ids: fed.append(np.asarray(ids)) or real_add(self, ids))
  train.run(quick(shared_tokenizer, "--config.model.packed_runs=2", "--config.train.steps=3",
                  "--config.train.log_every=2"), str(tmp_path / "run"))
  (line,) = [text for text in said if text.startswith("model.packed_runs=")]
  most = [int(ops.runs_per_row(ids).max()) for ids in fed[:2]]  # the two batches before the first log
  assert line == (f"model.packed_runs=2: {sum(m <= 2 for m in most)} of the first 2 batches fit cuDNN's packed "
                  f"layout (rows of up to {max(most)} runs of one segment id seen); on a GPU the others attend "
                  "with the mask")
  assert ops.runs_per_row(np.asarray([[1, 1, 2, 0], [3, 3, 3, 3]])).tolist() == [3, 1]
