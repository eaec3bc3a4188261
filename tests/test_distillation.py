"""DistilBERT-style distillation (tfx/objectives/distillation.py) and frozen objective inputs."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import ROOT, train_and_resume
from tfx.config import load_config
from tfx.models import build_model
from tfx.objectives import placeholder_ids
from tfx.objectives.distillation import Distillation
from tfx.registry import OBJECTIVES

SEQ = 24


def _setup(**fields):
  from tfx import parallel, steps

  c = load_config(os.path.join(ROOT, "configs", "distilbert_tiny.py"), [f"--config.data.seq_len={SEQ}"])
  ids = placeholder_ids(512)
  objective = Distillation(ids=ids, teacher="init", **fields)
  model = build_model(c.model, vocab_size=512, max_length=SEQ)
  mesh = parallel.make_mesh(c.mesh, jax.devices()[:1])
  tx, _ = steps.make_optimizer(c)
  _, shardings = steps.state_shardings(model, tx, mesh, SEQ, objective)
  state = steps.init_state(model, tx, mesh, SEQ, 0, shardings, objective)
  rng = np.random.default_rng(0)
  tokens = rng.integers(10, 400, size=(3, SEQ)).astype(np.int32)
  segment_ids = np.ones_like(tokens)
  segment_ids[1, 10:] = 2
  segment_ids[2, 15:] = 0
  positions = np.tile(np.arange(SEQ, dtype=np.int32), (3, 1))
  positions[1, 10:] -= 10
  batch = {"tokens": tokens, "segment_ids": segment_ids, "positions": positions}
  return objective, model, state, batch, objective.load_frozen(model, mesh)


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_loss_equals_an_independent_numpy_computation():
  objective, model, state, batch, teacher = _setup(temperature=3.0, ce_weight=5.0, mlm_weight=2.0, cos_weight=1.5)
  key = jax.random.key(2)
  loss, m = jax.jit(lambda p, f: objective.loss(model, p, batch, key, train=False, frozen=f))(state.params, teacher)
  (inputs, targets, weights, _), (s, hs), (t, ht) = jax.device_get(jax.jit(
      lambda p, f: objective._forward(model, p, batch, key, f, train=False))(state.params, teacher))
  # The teacher is the teacher: its logits are a plain forward of its own parameters on the same masked row.
  t_direct = jax.jit(lambda f: model.apply({"params": f}, inputs, batch["segment_ids"], batch["positions"]))(teacher)
  np.testing.assert_allclose(t, np.asarray(t_direct), rtol=1e-5, atol=1e-5)
  s, t, hs, ht = (np.asarray(x, np.float64) for x in (s, t, hs, ht))
  real = batch["segment_ids"] > 0
  soft = 9.0 * -(np.exp(_log_softmax(t / 3.0)) * _log_softmax(s / 3.0)).sum(-1)[real].mean()
  sel = np.asarray(weights) > 0
  mlm = -np.take_along_axis(_log_softmax(s), np.asarray(targets)[..., None], -1)[..., 0][sel].mean()
  cos = (hs * ht).sum(-1) / (np.linalg.norm(hs, axis=-1) * np.linalg.norm(ht, axis=-1))
  cosine = (1 - cos)[real].mean()
  np.testing.assert_allclose([float(m["soft_loss"]), float(m["mlm_loss"]), float(m["cos_loss"])],
                             [soft, mlm, cosine], rtol=2e-5)
  np.testing.assert_allclose(float(loss), 5.0 * soft + 2.0 * mlm + 1.5 * cosine, rtol=2e-5)
  assert float(m["num_tokens"]) == real.sum() and sel.sum() > 0

  # The teacher gets no gradient (it is not a parameter), the student does.
  g_student, g_teacher = jax.jit(jax.grad(lambda p, f: objective.loss(model, p, batch, key, train=False, frozen=f)[0],
                                          argnums=(0, 1)))(state.params, teacher)
  assert all(float(np.abs(x).max()) == 0.0 for x in jax.tree.leaves(g_teacher))
  assert float(np.abs(g_student["token_embed"]["embedding"]).max()) > 0


def test_fields_and_teacher_errors(tmp_path):
  opts = {o.name: o for o in OBJECTIVES.get("distillation").options()}
  assert (opts["temperature"].default, opts["ce_weight"].default, opts["mlm_weight"].default,
          opts["cos_weight"].default) == (2.0, 5.0, 2.0, 1.0)
  assert all(o.doc for o in opts.values())
  c = load_config(os.path.join(ROOT, "configs", "distilbert_tiny.py"))
  assert Distillation.check_config(c) == []
  with c.unlocked():
    c.objective.teacher = ""
  assert "needs a teacher" in " ".join(Distillation.check_config(c))
  with c.unlocked():
    c.objective.teacher = str(tmp_path)
  assert "has no config.json" in " ".join(Distillation.check_config(c))
  with pytest.raises(ValueError, match="temperature"):
    Distillation(ids=placeholder_ids(512), teacher="init", temperature=0.0)


@pytest.mark.slow
def test_distils_a_trained_run_resumes_exactly_and_never_saves_the_teacher(tmp_path, shared_tokenizer):
  """A 3-layer bert_tiny teacher trained 2 steps; the 2-layer student distils it through
  tfx.train.run: 4 steps equal 2 + stop + 2 resumed; the teacher is the jitted step's argument
  (changing it changes the loss, no recompilation), no checkpoint holds a 3-layer tensor, and an
  HF export of the teacher loads (hf:DIR) to the same parameters."""
  import orbax.checkpoint as ocp

  from tfx import steps, train
  from tfx.convert import to_hf

  data = [f"--config.data.tokenizer={shared_tokenizer}", "--config.data.max_documents=40",
          "--config.data.eval_batches=1"]
  teacher_dir = str(tmp_path / "teacher")
  teacher_cfg = load_config(os.path.join(ROOT, "configs", "bert_tiny.py"),
                            [*data, "--config.train.steps=2", "--config.model.num_layers=3"])
  teacher_run = train.run(teacher_cfg, teacher_dir)

  overrides = [*data, f"--config.objective.teacher={teacher_dir}", "--config.train.steps=4",
               "--config.train.log_every=1", "--config.train.eval_every=2", "--config.train.checkpoint_every=2",
               "--config.model.dropout=0.1"]
  config = lambda *extra: load_config(os.path.join(ROOT, "configs", "distilbert_tiny.py"), [*overrides, *extra])
  full, _, records = train_and_resume(config, tmp_path)
  part = tmp_path / "part"
  assert all(np.isfinite(r["loss"]) and "soft_loss" in r for r in records if r["split"] == "train")

  # The teacher is the run's, passed as an argument of the jitted steps: another teacher changes
  # the loss through the same compiled function (no new trace: it is not a constant).
  from tfx import parallel

  exp = full["experiment"]
  np.testing.assert_array_equal(np.asarray(exp.frozen["token_embed"]["embedding"]),
                                np.asarray(teacher_run["state"].params["token_embed"]["embedding"]))
  _, shardings = steps.state_shardings(exp.model, exp.tx, exp.mesh, 64, exp.objective, 8)
  eval_step = steps.make_eval_step(exp, shardings)
  batch = parallel.global_batch(dict(exp.pipeline.eval_batches()[0]), exp.mesh)
  params = full["state"].params
  base = float(eval_step(params, batch)["loss"])
  with parallel.context(exp.mesh):
    other = float(eval_step.jitted(params, batch, jax.tree.map(lambda x: x * 0.5, exp.frozen))["loss"])
  assert other != base and eval_step.jitted._cache_size() == 1
  # No checkpoint holds the teacher: the student has 2 layers, the teacher 3.
  for step in (2, 4):
    meta = ocp.StandardCheckpointer().metadata(os.path.join(part, "checkpoints", str(step), "state"))
    tree = getattr(meta, "item_metadata", meta)
    shapes = [tuple(x.shape) for x in jax.tree.leaves(tree) if hasattr(x, "shape")]
    assert shapes and not any(s and s[0] == 3 for s in shapes)

  # hf:DIR: the teacher exported to HF and read back through tfx.convert is the same teacher.
  hf_dir = str(tmp_path / "hf")
  to_hf(teacher_run["experiment"].config, jax.device_get(teacher_run["state"].params), hf_dir)
  from_hf = Distillation(ids=exp.objective.ids, teacher=f"hf:{hf_dir}").load_frozen(exp.model, exp.mesh)
  np.testing.assert_allclose(np.asarray(from_hf["token_embed"]["embedding"]),
                             np.asarray(exp.frozen["token_embed"]["embedding"]), rtol=1e-6)


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_soft_cross_entropy_is_the_log_softmax_form_with_a_one_pass_gradient(platform):
  """`ops.soft_cross_entropy` equals -sum softmax(t / T) log_softmax(s / T) and its autodiff
  gradient (float32; traced for a CPU and for a GPU, whose log-sum-exp is one reduction), sends
  the teacher no gradient, and with bf16 logits keeps only the logits and two [b, t] statistics
  for its backward pass (no float32 [b, t, v] array), its gradient within bf16 rounding."""
  from jax._src.ad_checkpoint import saved_residuals

  from tfx import ops
  from tfx.ops import target

  rng = np.random.default_rng(4)
  s, t = (jnp.asarray(rng.normal(size=(2, 5, 33)) * 3, jnp.float32) for _ in range(2))
  g = jnp.asarray(rng.normal(size=(2, 5)), jnp.float32)
  formula = lambda s, t: -jnp.sum(jax.nn.softmax(t / 2.0, axis=-1) * jax.nn.log_softmax(s / 2.0, axis=-1), axis=-1)
  with target.lowering_for(platform):
    op = jax.jit(lambda s, t: ops.soft_cross_entropy(s, t, 2.0))
    np.testing.assert_allclose(op(s, t), formula(s, t), rtol=1e-6, atol=1e-6)
    grads = jax.jit(jax.grad(lambda s, t: jnp.sum(ops.soft_cross_entropy(s, t, 2.0) * g), argnums=(0, 1)))(s, t)
    want = jax.grad(lambda s: jnp.sum(formula(s, t) * g))(s)
    np.testing.assert_allclose(grads[0], want, rtol=1e-5, atol=1e-7)
    assert not np.any(np.asarray(grads[1]))
    sb, tb = s.astype(jnp.bfloat16), t.astype(jnp.bfloat16)
    saved = saved_residuals(lambda s: ops.soft_cross_entropy(s, tb, 2.0), sb)
    assert sorted(str(aval) for aval, _ in saved) == ["bfloat16[2,5,33]"] * 2 + ["float32[2,5]"] * 2, saved
    got = jax.grad(lambda s: jnp.sum(ops.soft_cross_entropy(s, tb, 2.0) * g))(sb)
    assert got.dtype == jnp.bfloat16
    wanted = jax.grad(lambda s: jnp.sum(formula(s, tb.astype(jnp.float32)) * g))(sb.astype(jnp.float32))
    np.testing.assert_allclose(np.asarray(got, np.float32), wanted, rtol=1e-2, atol=1e-2 * float(np.abs(wanted).max()))
