"""Gradient accumulation of a loss whose terms are means over different counts (Objective.loss_terms):
micro-batches give the whole batch's loss and gradient, and every aggregate weights a mean by its
own count (tfx.steps._loss_and_grads, tfx.objectives.add_metrics / mean_metrics)."""

import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import ROOT
from tfx import parallel, steps
from tfx.config import load_config
from tfx.models import build_model
from tfx.objectives import add_metrics, count_of, mean_metrics, placeholder_ids
from tfx.objectives.distillation import Distillation
from tfx.objectives.electra import Electra
from tfx.objectives.sentence_prediction import NextSentencePrediction

SEQ, ROWS, ACCUM = 32, 6, 3
IDS = placeholder_ids(512)


def _setup(config_name, objective):
  c = load_config(os.path.join(ROOT, "configs", config_name), [f"--config.data.seq_len={SEQ}"])
  model = build_model(c.model, vocab_size=IDS.vocab_size, max_length=SEQ)
  tx, _ = steps.make_optimizer(c)
  mesh = parallel.make_mesh(c.mesh, jax.devices()[:1])
  _, shardings = steps.state_shardings(model, tx, mesh, SEQ, objective)
  state = steps.init_state(model, tx, mesh, SEQ, 0, shardings, objective)
  raw = objective.raw_length(SEQ)
  rng = np.random.default_rng(0)
  tokens = rng.integers(9, 400, size=(ROWS, raw)).astype(np.int32)
  segment_ids = np.ones((ROWS, raw), np.int32)
  segment_ids[1, raw // 2:] = 2
  segment_ids[4, raw // 3:] = 0
  segment_ids[[2, 5]] = 0  # micro-batch 2 (rows 2 and 5) has no text at all: every count of it is 0
  tokens[segment_ids == 0] = IDS.pad
  positions = np.tile(np.arange(raw, dtype=np.int32), (ROWS, 1))
  batch = {"tokens": tokens, "segment_ids": segment_ids, "positions": positions}
  frozen = objective.load_frozen(model, mesh) if objective.frozen_inputs else None  # a teacher
  return model, state.params, batch, frozen


CASES = {"nsp": ("nsp_tiny.py", NextSentencePrediction(ids=IDS, sentence_weight=3.0)),
         "electra": ("electra_tiny.py", Electra(ids=IDS, rtd_weight=50.0)),
         # a random teacher of the student's shape (teacher=init), its soft and cosine terms over the real
         # tokens and the MLM term over the selected ones
         "distillation": ("distilbert_tiny.py", Distillation(ids=IDS, teacher="init", ce_weight=5.0, mlm_weight=40.0,
                                                             cos_weight=1.0))}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c == "electra" else c  # ~50 s
                                  for c in sorted(CASES)])
def test_accumulated_composite_loss_is_the_whole_batchs(case):
  """Reference: the whole batch's loss written out over the same micro-batches and keys (each
  term's sum over them divided by its total count), differentiated as one function."""
  config_name, objective = CASES[case]
  model, params, batch, frozen = _setup(config_name, objective)
  kwargs = {"frozen": frozen} if frozen is not None else {}
  rng = jax.random.key(5)
  terms = objective.loss_terms()
  assert terms and len({count_of(objective, name) for name in terms}) == 2

  def micro_metrics(p):
    return [objective.loss(model, p, {k: v[a::ACCUM] for k, v in batch.items()}, jax.random.fold_in(rng, a),
                           train=True, **kwargs)[1] for a in range(ACCUM)]

  def reference(p):
    ms = micro_metrics(p)
    total = 0.0
    for name, weight in terms.items():
      count = count_of(objective, name)
      total += weight * sum(m[name] * m[count] for m in ms) / jnp.maximum(sum(m[count] for m in ms), 1.0)
    return total

  def by_tokens(p):  # the plain mean's rule: whole micro-batch losses weighted by num_tokens
    ms = micro_metrics(p)
    return sum(m["loss"] * m["num_tokens"] for m in ms) / sum(m["num_tokens"] for m in ms)

  (ref_loss, ref_grads), approx_grads = jax.jit(lambda p: (jax.value_and_grad(reference)(p),
                                                           jax.grad(by_tokens)(p)))(params)
  exp = types.SimpleNamespace(objective=objective, model=model,
                              config=types.SimpleNamespace(train=types.SimpleNamespace(grad_accum=ACCUM)))
  metrics, grads, _ = jax.jit(lambda p: steps._loss_and_grads(exp, p, batch, rng, frozen=frozen))(params)
  np.testing.assert_allclose(float(metrics["loss"]), float(ref_loss), rtol=1e-5)
  for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))

  # The test can fail: the plain mean's rule gives another gradient here, as the terms' counts are
  # not in proportion across the micro-batches (micro-batch 2 counts nothing at all).
  ms = jax.device_get(jax.jit(micro_metrics)(params))
  assert float(ms[2]["num_tokens"]) == 0 and all(float(ms[2][c]) == 0 for c in objective.metric_counts().values())
  off = max(float(jnp.max(jnp.abs(a - r)) / jnp.max(jnp.abs(r))) for a, r in
            zip(jax.tree.leaves(approx_grads), jax.tree.leaves(ref_grads)) if float(jnp.max(jnp.abs(r))) > 0)
  assert off > 10 * 2e-4, off  # 10x the tolerance above
  # The logged metrics are the micro-batches' aggregate, each mean over its own count.
  totals = {}
  for m in ms:
    totals = add_metrics(objective, totals, m)
  for k, v in mean_metrics(objective, totals).items():
    np.testing.assert_allclose(float(metrics[k]), float(v), rtol=1e-5, err_msg=k)
