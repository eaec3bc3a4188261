"""UL2 mixture of denoisers (tfx/objectives/ul2.py): mixture spec and weights, mode tokens, static
lengths, per-row reconstruction for R/X/S on both layouts, determinism, padding rows, what each
prediction may see (checked by perturbing raw tokens), and training end to end with exact resume."""

import functools
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import ROOT, tiny_config
from tfx.config import load_config
from tfx.objectives.base import SpecialIds
from tfx.objectives.ul2 import (
    DEFAULT_MIXTURE, UL2, choose_denoisers, decoder_row, mode_id, parse_mixture, span_ids, static_lengths)
from tfx.registry import OBJECTIVES

VOCAB = 1000
IDS = SpecialIds(vocab_size=VOCAB, pad=0, eos=1, unk=2, bos=3, sentinels=tuple(VOCAB - 1 - k for k in range(100)),
                 special=(0, 1, 2, 3, *range(VOCAB - 100, VOCAB)))
ORDINARY = np.arange(104, VOCAB - 100)
LAYOUTS = ("encoder_decoder", "decoder")


def test_registered_with_documented_fields():
  assert OBJECTIVES.get("ul2") is UL2 and UL2.families == LAYOUTS
  options = {o.name: o for o in UL2.options()}
  assert {"mixture", "layout", "targets_length", "z_loss"} <= set(options)
  assert all(options[k].doc for k in ("mixture", "layout", "targets_length"))
  assert options["mixture"].default == DEFAULT_MIXTURE


def test_default_mixture_is_the_papers():
  d = parse_mixture(DEFAULT_MIXTURE)
  assert [(x.mode, x.mean_span_length, x.noise_density) for x in d] == [
      ("R", 3, .15), ("R", 8, .15), ("X", 3, .5), ("X", 8, .5), ("X", 64, .15), ("X", 64, .5), ("S", 0, 0)]
  np.testing.assert_allclose([x.weight for x in d], [2 / 15] * 6 + [0.2])


@pytest.mark.parametrize("spec, message", [
    ("", "cannot read"), ("R:3", "cannot read"), ("Q:3:0.1", "cannot read"), ("S:3:0.1", "cannot read"),
    ("R:a:0.1", "cannot read"), ("R:3:0.15=0", "positive"), ("R:3:0.15=x", "cannot read"),
    ("R:0.5:0.15", "mean span"), ("X:3:1.0", "rate"), ("R:3:0.15,R:3:0.15=2", "twice")])
def test_bad_mixtures_are_refused(spec, message):
  with pytest.raises(ValueError, match=message):
    UL2(IDS, mixture=spec)


def test_mode_tokens_are_the_top_sentinels():
  assert [mode_id(IDS, m) for m in "RSX"] == [IDS.sentinels[97], IDS.sentinels[98], IDS.sentinels[99]]
  assert span_ids(IDS).sentinels == IDS.sentinels[:97]
  few = SpecialIds(vocab_size=VOCAB, pad=0, eos=1, sentinels=(999, 998, 997))
  with pytest.raises(ValueError, match="at least 4 sentinels"):
    UL2(few)
  UL2(few, mixture="S")  # the prefix LM needs no span sentinels
  with pytest.raises(ValueError, match="97 sentinels are left"):  # X (3, .5) at 1024: 190 spans
    UL2(IDS).raw_length(1024)
  with pytest.raises(ValueError, match="layout"):
    UL2(IDS, layout="encoder")
  with pytest.raises(ValueError, match="targets_length"):
    UL2(IDS, layout="decoder", targets_length=100)


@pytest.mark.parametrize("layout, seq_len, raw, inputs, targets", [
    ("encoder_decoder", 512, 567, 512, 380), ("encoder_decoder", 64, 69, 64, 46), ("decoder", 64, 45, 46, 45),
    ("decoder", 512, 381, 382, 381)])
def test_static_lengths_fit_every_denoiser_and_are_maximal(layout, seq_len, raw, inputs, targets):
  objective = UL2(IDS, layout=layout)
  assert objective.raw_length(seq_len) == raw
  x = objective.lengths(raw)
  assert (x.inputs, x.targets) == (inputs, targets)
  denoisers = objective.denoisers
  bigger = static_lengths(layout, raw + 1, denoisers)
  if layout == "decoder":
    assert x.row <= seq_len < bigger.row
  else:
    assert max(x.inputs, x.targets) <= seq_len < max(bigger.inputs, bigger.targets)
  assert UL2(IDS, targets_length=120).lengths(69).targets == 120


def test_denoiser_frequencies_match_the_weights():
  weights = tuple(d.weight for d in parse_mixture(DEFAULT_MIXTURE))
  n = 60000
  counts = np.bincount(np.asarray(jax.jit(lambda k: choose_denoisers(k, n, weights))(jax.random.key(0))),
                       minlength=len(weights))
  p = np.asarray(weights)
  assert (np.abs(counts - n * p) <= 4 * np.sqrt(n * p * (1 - p))).all(), counts / n


def random_batch(rng, b, length, pad_rows=0, empty_rows=0):
  """Ordinary tokens in two documents per row (ignored: one stream); the last `pad_rows` rows end
  with padding and the last `empty_rows` are all padding."""
  tokens = rng.choice(ORDINARY, size=(b, length)).astype(np.int32)
  seg = np.ones((b, length), np.int32)
  seg[:, length // 3:] = 2
  for r in range(b - pad_rows, b):
    real = 0 if r >= b - empty_rows else rng.integers(1, length)
    seg[r, real:], tokens[r, real:] = 0, 0
  positions = np.broadcast_to(np.arange(length, dtype=np.int32), (b, length))
  return {"tokens": jnp.asarray(tokens), "segment_ids": jnp.asarray(seg), "positions": jnp.asarray(positions)}


def real_part(values, segment_ids):
  return [int(v) for v, s in zip(values, segment_ids) if s > 0]


def reconstruct(inputs, targets, sentinels):
  """Inputs (after the mode token, without EOS) with each sentinel replaced by its target span."""
  spans, k = {}, None
  for t in targets[:-1]:
    if t in sentinels:
      k = t
      spans[k] = []
    else:
      spans[k].append(t)
  out = []
  for t in inputs[:-1]:
    out.extend(spans.pop(t) if t in sentinels else [t])
  assert not spans, "a target span has no sentinel in the inputs"
  return out


@functools.lru_cache(maxsize=2)
def jitted_corrupt(layout):
  return jax.jit(UL2(IDS, layout=layout).corrupt)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_row_reconstructs_with_its_mode_token(layout):
  objective = UL2(IDS, layout=layout)
  length = objective.raw_length(64)
  lengths = objective.lengths(length)
  batch = random_batch(np.random.default_rng(0), 300, length, pad_rows=60, empty_rows=2)
  x = jitted_corrupt(layout)(batch, jax.random.key(1))
  row = jax.jit(lambda x: decoder_row(x, lengths.row, IDS.pad))(x)
  x, row = jax.tree.map(np.asarray, x), jax.tree.map(np.asarray, row)
  assert x["inputs"].shape == (300, lengths.inputs) and x["targets"].shape == (300, lengths.targets)
  assert row["tokens"].shape == (300, lengths.row) and (lengths.row <= 64 or layout != "decoder")
  denoisers, span_sentinels = objective.denoisers, set(span_ids(IDS).sentinels)
  seen = set()
  for r in range(300):
    raw = real_part(batch["tokens"][r], batch["segment_ids"][r])
    inp = real_part(x["inputs"][r], x["input_segment_ids"][r])
    tgt = real_part(x["targets"][r], x["target_segment_ids"][r])
    if not raw:  # all padding: nothing at all
      assert not inp and not tgt and not row["segment_ids"][r].any() and not row["weights"][r].any()
      continue
    d = denoisers[x["denoiser"][r]]
    seen.add(d)
    assert inp[0] == mode_id(IDS, d.mode) and inp[-1] == IDS.eos and tgt[-1] == IDS.eos
    assert not set(inp[1:] + tgt) & {mode_id(IDS, m) for m in "RSX"}
    if d.mode == "S":
      assert inp[1:-1] + tgt[:-1] == raw
      assert (len(tgt) > 1 and len(inp) > 2) or len(raw) == 1
    else:
      assert reconstruct(inp[1:], tgt, span_sentinels) == raw
      assert tgt[0] in span_sentinels or (tgt == [IDS.eos] and len(raw) < length)  # noise all on padding
    # The decoder layout: [mode, inputs..., targets...], bidirectional prefix, loss on the targets.
    n = len(inp) + len(tgt)
    assert row["tokens"][r, :n].tolist() == inp + tgt and (row["tokens"][r, n:] == IDS.pad).all()
    assert row["segment_ids"][r].sum() == n and row["prefix"][r] == len(inp)
    assert row["weights"][r].tolist() == [0.0] * len(inp) + [1.0] * len(tgt) + [0.0] * (lengths.row - n)
  assert seen == set(denoisers)


def test_same_key_same_rows_other_key_other_rows():
  batch = random_batch(np.random.default_rng(2), 300, 69)  # the shape of the test above: compiled once
  f = jitted_corrupt("encoder_decoder")
  a, b, c = f(batch, jax.random.key(0)), f(batch, jax.random.key(0)), f(batch, jax.random.key(1))
  for key in a:
    np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]))
  assert not np.array_equal(np.asarray(a["inputs"]), np.asarray(c["inputs"]))
  assert not np.array_equal(np.asarray(a["denoiser"]), np.asarray(c["denoiser"]))


# The model tests use two denoisers, one per code path (span corruption, here X's dense 50% with
# many spans, and the S prefix LM): each span denoiser adds about a second to every compilation, and
# R runs the same code; the row tests above and the ul2_tiny run below use all seven.
SMALL_MIXTURE = "X:3:0.5=1,S=1"


@functools.lru_cache(maxsize=2)
def tiny_setup(layout):
  """(objective, model, params, jitted value_and_grad of the loss, jitted predictions), once per layout."""
  from tfx.models import build_model

  family = ["--config.model.family=encoder_decoder", "--config.model.position=relative"] if layout != "decoder" else []
  cfg = tiny_config(*family, "--config.model.num_layers=2", "--config.model.d_model=32", "--config.model.d_ff=64")
  model = build_model(cfg.model, vocab_size=VOCAB, max_length=64)
  params = nn.unbox(jax.jit(model.init)(jax.random.key(0), **type(model).init_inputs(1, 64))["params"])
  objective = UL2(IDS, layout=layout, mixture=SMALL_MIXTURE)
  loss = jax.jit(jax.value_and_grad(lambda p, b: objective.loss(model, p, b, jax.random.key(5), train=False),
                                    has_aux=True))
  predictions = jax.jit(lambda b: objective.predictions(model, params, b, jax.random.key(5)))
  return objective, model, params, loss, predictions


def padded_batch(objective):
  """4 rows (the last ends in padding) + 2 all-padding rows."""
  return random_batch(np.random.default_rng(3), 6, objective.raw_length(64), pad_rows=3, empty_rows=2)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_padding_rows_change_neither_loss_nor_grads(layout):
  objective, _, params, f, _ = tiny_setup(layout)
  batch = padded_batch(objective)
  (loss_a, metrics_a), grads_a = f(params, jax.tree.map(lambda a: a[:4], batch))
  (loss_b, metrics_b), grads_b = f(params, batch)
  assert float(metrics_a["num_tokens"]) == float(metrics_b["num_tokens"]) > 0
  np.testing.assert_allclose(float(loss_a), float(loss_b), rtol=1e-6)
  # Within float32 rounding of the largest gradient entries: the relative-position bias's gradient
  # is a sum over the rows computed as a dot (tfx.ops.attention._sum_to_bias), whose accumulation
  # order depends on how many rows there are (4 against 6 here), so its small entries move by an ulp
  # of the large ones (2e-8 at 0.15). A leak from the padding rows would move them by far more.
  atol = 1e-6 * max(float(np.abs(g).max()) for g in jax.tree.leaves(grads_b))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=atol), grads_a, grads_b)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_predictions_match_loss_and_declare_what_they_see(layout):
  """Predictions give the loss; each slot's source holds its target; and perturbing any raw token
  changes only slots that declare it visible (never a slot predicting that token)."""
  objective, model, params, f, predictions = tiny_setup(layout)
  batch = jax.tree.map(lambda a: a[:4], padded_batch(objective))
  b, length = batch["tokens"].shape
  p = predictions(batch)
  (loss, _), _ = f(params, batch)
  logp = jax.nn.log_softmax(p.logits, -1)
  ce = -jnp.take_along_axis(logp, p.targets[..., None], -1)[..., 0]
  np.testing.assert_allclose(float(jnp.sum(ce * p.weights) / jnp.sum(p.weights)), float(loss), rtol=1e-5)
  n = p.targets.shape[1]
  source, weights, visible = np.asarray(p.source), np.asarray(p.weights), np.asarray(p.visible)
  assert {int(d) for d in objective.corrupt(batch, jax.random.split(jax.random.key(5))[0])["denoiser"]} == {0, 1}
  flat = np.asarray(batch["tokens"]).reshape(-1)
  has = source >= 0
  assert has.sum() > 0 and (weights[has] > 0).all()
  np.testing.assert_array_equal(flat[source[has]], np.asarray(p.targets)[has])
  rows, slots = np.nonzero(has)
  assert not visible[rows, slots, source[has]].any()  # a slot never sees its own token
  other_row = np.arange(b)[:, None, None] != (np.arange(b * length) // length)[None, None, :]
  assert not (visible & other_row).any()  # nor another row's

  # Perturb each raw token (the masks do not depend on token values) and see which slots move.
  projection = jax.random.normal(jax.random.key(9), (VOCAB,))
  tokens = batch["tokens"].reshape(-1)
  variants = jnp.stack([tokens] + [tokens.at[q].set(ORDINARY[0] + (tokens[q] - ORDINARY[0] + 1) % 300)
                                   for q in range(b * length)])  # [1 + b*L, b*L]

  def slots_of(t):
    out = objective.predictions(model, params, dict(batch, tokens=t.reshape(b, length)), jax.random.key(5))
    return out.logits @ projection  # [b, n]

  moved = np.asarray(jax.jit(lambda v: jax.lax.map(slots_of, v))(variants))
  changed = moved[1:] != moved[0]  # [b*L, b, n]
  real = np.asarray(batch["segment_ids"]).reshape(-1) > 0
  assert changed[real].any()
  leaks = changed & ~np.moveaxis(visible, 2, 0) & (weights > 0)[None]
  assert not leaks.any(), np.argwhere(leaks)[:5]
  # The declaration is not vacuous: R/X targets see every input token, S targets see the prefix.
  assert (changed & np.moveaxis(visible, 2, 0) & (weights > 0)[None]).sum() > b * n


def ul2_config(tokenizer, *overrides):
  return load_config(os.path.join(ROOT, "configs", "ul2_tiny.py"), [
      f"--config.data.tokenizer={tokenizer}", "--config.data.max_documents=60", "--config.data.eval_batches=1",
      "--config.train.steps=4", "--config.train.log_every=1", "--config.train.eval_every=2",
      "--config.train.checkpoint_every=2", "--config.model.dropout=0.1", *overrides])


DECODER = ["--config.model.family=decoder", "--config.objective.layout=decoder", "--config.model.position=rotary"]


def train_losses(workdir):
  from tfx.metrics import read_metrics

  records = read_metrics(workdir)
  losses = [r["loss"] for r in records if r["split"] == "train"]
  assert len(losses) == 4 and np.isfinite(losses).all() and losses[-1] < losses[0], losses
  assert all(r["num_tokens"] > 0 for r in records if r["split"] == "train")
  return records


@pytest.mark.slow  # long: make test-slow runs it
def test_ul2_tiny_trains_end_to_end(tmp_path, shared_tokenizer):
  """configs/ul2_tiny.py as it is (encoder-decoder, the default seven denoisers) through tfx.train.run."""
  from tfx import train

  assert train.run(ul2_config(shared_tokenizer), str(tmp_path / "run"))["step"] == 4
  train_losses(str(tmp_path / "run"))


@pytest.mark.slow  # long: make test-slow runs it
def test_decoder_layout_trains_and_resumes_exactly(tmp_path, shared_tokenizer):
  """The decoder (prefix-LM) layout through tfx.train.run; 4 steps in one go equal 2 + stop +
  resume 2, bitwise (metrics and parameters), with dropout on and denoisers drawn from the step's
  key. (SMALL_MIXTURE, to keep the three runs' compilations short.)"""
  from tfx import train
  from tfx.metrics import read_metrics

  overrides = [*DECODER, f"--config.objective.mixture={SMALL_MIXTURE}"]
  full = train.run(ul2_config(shared_tokenizer, *overrides), str(tmp_path / "full"))
  records = train_losses(str(tmp_path / "full"))
  part = str(tmp_path / "part")
  assert train.run(ul2_config(shared_tokenizer, *overrides, "--config.train.stop_after=2"), part)["step"] == 2
  resumed = train.run(ul2_config(shared_tokenizer, *overrides), part)
  assert resumed["step"] == 4
  timing = ("tokens_per_sec", "mfu")
  strip = lambda rs: [{k: v for k, v in r.items() if k not in timing} for r in rs]
  assert strip(read_metrics(part)) == strip(records)
  a, b = (jax.tree.map(np.asarray, jax.device_get(r["state"].params)) for r in (full, resumed))
  jax.tree.map(np.testing.assert_array_equal, a, b)
