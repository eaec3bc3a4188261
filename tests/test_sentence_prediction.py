"""BERT's next-sentence prediction and ALBERT's sentence-order prediction beside masked LM
(tfx/objectives/sentence_prediction.py)."""

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import ROOT, train_and_resume
from tfx import ops
from tfx.config import load_config
from tfx.models import build_model
from tfx.objectives import OBJECTIVE_PARAMS, placeholder_ids
from tfx.objectives.sentence_prediction import SentenceOrderPrediction, bert_pair_rows
from tfx.registry import OBJECTIVES

IDS = placeholder_ids(4096)


def _unique_rows(b, raw):
  tokens = 9 + jnp.arange(b * raw, dtype=jnp.int32).reshape(b, raw)  # every raw token unique
  return tokens, jnp.ones((b, raw), jnp.int32)


def _split(row):
  """([CLS] A [SEP] B [SEP]) -> (A, B) as arrays, checking the frame."""
  seps = np.flatnonzero(row == IDS.sep)
  assert row[0] == IDS.cls and len(seps) == 2 and seps[1] == len(row) - 1
  return row[1:seps[0]], row[seps[0] + 1:-1]


@pytest.mark.parametrize("task", ["nsp", "sop"])
def test_rows_are_cls_a_sep_b_sep_with_the_label_they_say(task):
  b, raw = 256, 29
  tokens, segment_ids = _unique_rows(b, raw)
  rows = jax.jit(lambda k: bert_pair_rows(tokens, segment_ids, k, task=task, negative_rate=0.5, sep=IDS.sep,
                                          cls=IDS.cls, pad=IDS.pad))(jax.random.key(3))
  rows = jax.device_get(rows)
  x, raw_np = rows["tokens"], np.asarray(tokens)
  for r in range(b):
    a, bb = _split(x[r])
    assert len(a) >= 1 and len(bb) >= 1 and len(a) + len(bb) == raw
    first_sep = 1 + len(a)
    np.testing.assert_array_equal(rows["token_types"][r], (np.arange(raw + 3) > first_sep).astype(int))
    label = rows["label"][r]
    if task == "nsp":
      np.testing.assert_array_equal(a, raw_np[r, :len(a)])
      if label == 0:  # IsNext: B continues A in the raw row
        np.testing.assert_array_equal(bb, raw_np[r, len(a):])
      else:  # NotNext: a contiguous stretch of another row
        source = (bb[0] - 9) // raw
        assert source != r and (bb[-1] - 9) // raw == source
        np.testing.assert_array_equal(np.diff(bb), 1)
    else:  # SOP: the two consecutive segments, swapped exactly when the label says so
      first, second = (bb, a) if label == 1 else (a, bb)
      np.testing.assert_array_equal(np.concatenate([first, second]), raw_np[r])
    # source: the flat raw index of each text position, -1 at CLS / SEP.
    text = ~np.isin(x[r], (IDS.cls, IDS.sep))
    np.testing.assert_array_equal(np.asarray(tokens).reshape(-1)[rows["source"][r][text]], x[r][text])
    assert (rows["source"][r][~text] == -1).all()
  assert abs(rows["label"].mean() - 0.5) < 4 * math.sqrt(0.25 / b)
  assert (rows["segment_ids"] == 1).all()


def test_padding_stays_padding():
  tokens, segment_ids = _unique_rows(4, 20)
  segment_ids = segment_ids.at[0].set(0).at[1, 12:].set(0)
  rows = jax.device_get(bert_pair_rows(tokens, segment_ids, jax.random.key(0), task="sop", negative_rate=0.5,
                                       sep=IDS.sep, cls=IDS.cls, pad=IDS.pad))
  text = ~np.isin(rows["tokens"], (IDS.cls, IDS.sep))
  assert not rows["segment_ids"][0].any() and (rows["tokens"][(rows["segment_ids"] == 0) & text] == IDS.pad).all()
  assert rows["segment_ids"][1].sum() == 12 + 3  # its 12 tokens, CLS and the two SEPs


def _setup(cls, *overrides, **fields):
  from tfx import parallel, steps

  c = load_config(os.path.join(ROOT, "configs", "nsp_tiny.py"), ["--config.data.seq_len=24", *overrides])
  objective = cls(ids=IDS, **fields)
  model = build_model(c.model, vocab_size=IDS.vocab_size, max_length=24)
  tx, _ = steps.make_optimizer(c)
  mesh = parallel.make_mesh(c.mesh, jax.devices()[:1])
  _, shardings = steps.state_shardings(model, tx, mesh, 24, objective)
  state = steps.init_state(model, tx, mesh, 24, 0, shardings, objective)
  rng = np.random.default_rng(0)
  tokens = rng.integers(10, 3000, size=(6, 21)).astype(np.int32)
  segment_ids = np.ones_like(tokens)
  segment_ids[5, 8:] = 0
  batch = {"tokens": tokens, "segment_ids": segment_ids, "positions": np.tile(np.arange(21, dtype=np.int32), (6, 1))}
  return objective, model, state, batch


def test_loss_is_mlm_plus_the_sentence_loss_on_the_first_token():
  """(The head and loss are shared by nsp and sop; their rows differ, tested above.)"""
  objective, model, state, batch = _setup(SentenceOrderPrediction)
  assert set(state.params[OBJECTIVE_PARAMS]) == {"sentence_head"}
  key = jax.random.key(4)
  loss, m = jax.jit(lambda p: objective.loss(model, p, batch, key, train=False))(state.params)
  row, logits, _, targets, weights, _, sentence_logits = jax.jit(
      lambda p: objective._forward(model, p, batch, key, train=False))(state.params)
  # The captured hidden states are the encoder's final ones: recompute the head from them.
  params = {k: v for k, v in state.params.items() if k != OBJECTIVE_PARAMS}
  inputs = objective.mask(row, jax.random.split(key, 3)[1])[0]  # _forward's mask key
  hidden = jax.jit(lambda p: model.apply({"params": p}, inputs, row["segment_ids"], row["positions"],
                                         token_types=row["token_types"], return_hidden=True))(params)
  head = state.params[OBJECTIVE_PARAMS]["sentence_head"]
  pooled = np.tanh(np.asarray(hidden[:, 0]) @ np.asarray(head["pooler"]["kernel"]) + np.asarray(head["pooler"]["bias"]))
  z = pooled @ np.asarray(head["classifier"]["kernel"]) + np.asarray(head["classifier"]["bias"])
  np.testing.assert_allclose(np.asarray(sentence_logits), z, rtol=1e-5, atol=1e-6)
  # Independent sentence cross-entropy (numpy), over rows with text; the total is the plain sum.
  labels = np.asarray(row["label"])
  ce = np.log(np.exp(z).sum(-1)) - z[np.arange(len(z)), labels]
  np.testing.assert_allclose(float(m["sentence_loss"]), ce.mean(), rtol=1e-5)
  np.testing.assert_allclose(float(loss), float(m["mlm_loss"]) + float(m["sentence_loss"]), rtol=1e-6)
  # The loss gathers the selected tokens for the MLM head: the same as the head everywhere.
  assert objective.gather_slots(model, row["tokens"].shape[1]) is not None
  np.testing.assert_allclose(float(m["mlm_loss"]), float(ops.weighted_cross_entropy(logits, targets, weights)[0]),
                             rtol=1e-6)
  # MLM never selects CLS or SEP; the first token is CLS in every row.
  sel = np.asarray(weights) > 0
  assert not np.isin(np.asarray(row["tokens"])[sel], (IDS.cls, IDS.sep)).any() and sel.sum() > 0
  assert (np.asarray(inputs)[:, 0] == IDS.cls).all()
  # The sentence loss reaches the encoder (through the first token) and the head.
  g = jax.jit(jax.grad(lambda p: objective.loss(model, p, batch, key, train=False)[1]["sentence_loss"]))(state.params)
  assert float(jnp.abs(g[OBJECTIVE_PARAMS]["sentence_head"]["classifier"]["kernel"]).max()) > 0
  assert float(jnp.abs(g["token_embed"]["embedding"]).max()) > 0
  assert abs(objective.initial_loss(1000) - (math.log(1000) + math.log(2))) < 1e-12


def test_the_loss_keeps_bf16_logits_at_every_position():
  """Without `gather_predictions` the MLM head runs at every position and the loss reads its logits
  in the compute dtype, as masked LM's does: the loss and accuracy of the float32 logits the model
  returns by default, to the bit, the gradients within bf16's rounding, and no scatter of the
  targets' gradient into a float32 [b, t, v] buffer."""
  from tests.conftest import compare_with_float32_logits_loss

  objective, model, state, batch = _setup(SentenceOrderPrediction, "--config.model.dtype=bfloat16",
                                          gather_predictions=False)
  assert objective.gather_slots(model, 24) is None

  class Float32Logits(SentenceOrderPrediction):  # the loss of the float32 logits `_forward` gives otherwise
    def _forward(self, *args, gather=False, **kwargs):
      return super()._forward(*args, **kwargs)

  reference = Float32Logits(ids=IDS, gather_predictions=False)
  key = jax.random.key(5)
  assert objective._forward(model, state.params, batch, key, train=False)[1].dtype == jnp.float32
  ours, theirs = compare_with_float32_logits_loss(lambda p: objective.loss(model, p, batch, key, train=False),
                                                  lambda p: reference.loss(model, p, batch, key, train=False),
                                                  state.params)
  assert theirs == ours + 1  # the targets' logits' gradient


def test_registered_with_fields():
  for name in ("nsp", "sop"):
    opts = {o.name: o for o in OBJECTIVES.get(name).options()}
    assert opts["negative_rate"].default == 0.5 and opts["sentence_weight"].default == 1.0
    assert opts["mask_rate"].default == 0.15 and all(o.doc for o in opts.values())
  with pytest.raises(ValueError, match="negative_rate"):
    SentenceOrderPrediction(ids=IDS, negative_rate=2.0)


@pytest.mark.slow
def test_nsp_tiny_trains_and_resumes_exactly(tmp_path, shared_tokenizer):
  """configs/nsp_tiny.py through tfx.train.run: 4 steps in one go equal 2 + stop + 2 resumed
  (metrics, and every parameter with the sentence head's)."""
  overrides = [f"--config.data.tokenizer={shared_tokenizer}", "--config.data.max_documents=40",
               "--config.train.steps=4", "--config.train.log_every=1", "--config.train.eval_every=2",
               "--config.train.checkpoint_every=2", "--config.model.dropout=0.1", "--config.data.eval_batches=1"]
  config = lambda *extra: load_config(os.path.join(ROOT, "configs", "nsp_tiny.py"), [*overrides, *extra])
  full, _, records = train_and_resume(config, tmp_path)
  first = [r for r in records if r["split"] == "train"][0]
  assert abs(first["loss"] - (math.log(1000) + math.log(2))) < 1.0 and "sentence_accuracy" in first
