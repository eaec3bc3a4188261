"""T5 span corruption invariants (OBJECTIVES.md §3.1, §5): lengths, mask shape, sentinels,
exact reconstruction, determinism, and teacher-forcing information flow."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import tiny_config
from tfx.objectives.base import SpecialIds
from tfx.objectives.span_corruption import (
    SpanCorruption, compute_lengths, noise_counts, noise_masks, random_spans_noise_mask, span_corrupt)
from tfx.objectives.causal_lm import shift_right_by_segment
from tfx.registry import OBJECTIVES

VOCAB = 1000
DESCENDING = SpecialIds(vocab_size=VOCAB, pad=0, eos=1, unk=2, bos=3,
                        sentinels=tuple(VOCAB - 1 - k for k in range(100)),
                        special=(0, 1, 2, 3, *range(VOCAB - 100, VOCAB)))
ASCENDING = SpecialIds(vocab_size=VOCAB, pad=0, eos=1, unk=2, bos=3,
                       sentinels=tuple(range(4, 104)), special=tuple(range(104)))
ORDINARY = np.arange(104, VOCAB - 100)  # ordinary under both id sets


def test_registered():
  assert OBJECTIVES.get("span_corruption") is SpanCorruption
  assert SpanCorruption.families == ("encoder_decoder",)


@pytest.mark.parametrize("inputs_length, density, mu, raw, targets", [
    (512, 0.15, 3.0, 568, 114), (64, 0.15, 3.0, 70, 14), (128, 0.15, 3.0, 141, 29),
    (256, 0.15, 3.0, 284, 58), (1024, 0.15, 3.0, 1137, 229), (2048, 0.15, 3.0, 2274, 456),
    (1024, 0.15, 20.0, 1193, 189), (512, 0.5, 3.0, 766, 512)])
def test_lengths_table(inputs_length, density, mu, raw, targets):
  assert compute_lengths(inputs_length, density, mu) == (raw, targets)


@pytest.mark.parametrize("mu", [3.0, 8.0, 20.0])
def test_lengths_are_the_ones_the_noise_mask_makes(mu):
  """Short rows too: the raw length makes at most the promised encoder row and exactly the promised targets."""
  for inputs_length in range(4, 300):
    raw, targets = compute_lengths(inputs_length, 0.15, mu)
    n, s = noise_counts(raw, 0.15, mu)
    assert raw - n + s + 1 <= inputs_length and n + s + 1 == targets, (inputs_length, raw, targets)


def test_objective_lengths_and_sentinel_check():
  objective = SpanCorruption(DESCENDING)
  assert objective.raw_length(512) == 568 and objective.targets_length(512) == 114
  assert SpanCorruption(DESCENDING, inputs_length=64).raw_length(512) == 70
  with pytest.raises(ValueError, match="sentinels"):
    SpanCorruption(DESCENDING, noise_density=0.5, inputs_length=512)  # 128 spans > 100 sentinels
  with pytest.raises(ValueError, match="sentinels"):
    SpanCorruption(DESCENDING, noise_density=0.5).raw_length(512)


def runs(mask: np.ndarray) -> list[tuple[bool, int]]:
  """[(value, length)] of the maximal runs of a 1-D bool array."""
  out = []
  for v in mask:
    if out and out[-1][0] == v:
      out[-1] = (v, out[-1][1] + 1)
    else:
      out.append((bool(v), 1))
  return out


@pytest.mark.parametrize("length, density, mu", [(568, 0.15, 3.0), (10, 0.15, 3.0), (101, 0.5, 8.0),
                                                 (1193, 0.15, 20.0), (37, 0.3, 1.0)])
def test_noise_mask_shape(length, density, mu):
  n, s = noise_counts(length, density, mu)
  assert n == min(max(round(length * density), 1), length - 1) and s == max(1, round(n / mu))
  masks = np.asarray(jax.jit(lambda k: noise_masks(k, 64, length, density, mu))(jax.random.key(0)))
  for mask in masks:
    assert not mask[0] and mask[-1]
    assert mask.sum() == n
    r = runs(mask)
    assert len(r) == 2 * s  # s non-noise spans then s noise spans, alternating, each >= 1 token
    assert [v for v, _ in r] == [False, True] * s
  if s > 1:
    assert len({m.tobytes() for m in masks}) > 1


def test_example_of_ten_tokens():
  tokens = np.arange(104, 114, dtype=np.int32)[None]  # t0..t9
  mask = np.asarray(jax.jit(lambda k: random_spans_noise_mask(10, k, 0.15, 3.0))(jax.random.key(3)))
  np.testing.assert_array_equal(mask, [False] * 8 + [True] * 2)
  out = jax.jit(lambda t, k: span_corrupt(t, jnp.ones_like(t), k, ids=DESCENDING))(tokens, jax.random.key(3))
  s0, eos = DESCENDING.sentinels[0], DESCENDING.eos
  assert s0 == 999
  np.testing.assert_array_equal(out["inputs"][0], [*tokens[0, :8], s0, eos])
  np.testing.assert_array_equal(out["targets"][0], [s0, tokens[0, 8], tokens[0, 9], eos])


def random_rows(rng, b, length, pad_rows=0):
  """Ordinary tokens in several documents; the last `pad_rows` rows end with padding."""
  tokens = rng.choice(ORDINARY, size=(b, length)).astype(np.int32)
  seg = np.ones((b, length), np.int32)
  seg[:, length // 3:] = 2  # documents inside a row are ignored (one stream)
  for r in range(b - pad_rows, b):
    real = rng.integers(1, length)
    seg[r, real:] = 0
    tokens[r, real:] = 0
  return tokens, seg


def parse_targets(targets: np.ndarray, sentinels: tuple[int, ...], eos: int) -> list[list[int]]:
  """The noise spans of one target row, in order: [sentinel_0, a, b, sentinel_1, c, ..., EOS]."""
  spans = []
  for k, token in enumerate(targets):
    if token == eos:
      assert not (targets[k + 1:] != 0).any()
      return spans
    if token in sentinels:
      assert token == sentinels[len(spans)], "target sentinels out of order"
      spans.append([])
    else:
      spans[-1].append(int(token))
  raise AssertionError("no EOS in targets")


def reconstruct(inputs: np.ndarray, targets: np.ndarray, ids: SpecialIds) -> list[int]:
  spans = parse_targets(targets, ids.sentinels, ids.eos)
  out, used = [], 0
  for token in inputs:
    if token == ids.eos:
      break
    if token in ids.sentinels:
      assert token == ids.sentinels[used], "input sentinels out of order"
      out.extend(spans[used])
      used += 1
    else:
      out.append(int(token))
  assert used == len(spans)
  return out


@pytest.mark.parametrize("ids", [DESCENDING, ASCENDING], ids=["descending", "ascending"])
def test_sentinels_lengths_and_reconstruction(ids):
  """568 raw tokens -> exactly 512 / 114 with EOS and no padding; s sentinels on each side in the
  order of ids.sentinels; (len(in)-1) + (len(tgt)-1) = L + 2s; exact reconstruction."""
  length = 568
  n, s = noise_counts(length, 0.15, 3.0)
  assert (n, s) == (85, 28)
  rng = np.random.default_rng(0)
  tokens, seg = random_rows(rng, 128, length)
  out = jax.jit(lambda t, g, k: span_corrupt(t, g, k, ids=ids))(tokens, seg, jax.random.key(1))
  out = {k: np.asarray(v) for k, v in out.items()}
  assert out["inputs"].shape == (128, 512) and out["targets"].shape == (128, 114)
  assert (out["input_segment_ids"] == 1).all() and (out["target_segment_ids"] == 1).all()
  assert (out["inputs"][:, -1] == ids.eos).all() and (out["targets"][:, -1] == ids.eos).all()
  sentinels = np.asarray(ids.sentinels)
  for r in range(128):
    inp, tgt = out["inputs"][r], out["targets"][r]
    in_sentinels = inp[np.isin(inp, sentinels)]
    tgt_sentinels = tgt[np.isin(tgt, sentinels)]
    np.testing.assert_array_equal(in_sentinels, sentinels[:s])
    np.testing.assert_array_equal(tgt_sentinels, sentinels[:s])
    if ids is DESCENDING:
      assert (np.diff(in_sentinels) < 0).all() and in_sentinels[0] == VOCAB - 1
    assert tgt[0] == sentinels[0]
    assert (len(inp) - 1) + (len(tgt) - 1) == length + 2 * s
    assert reconstruct(inp, tgt, ids) == tokens[r].tolist()


def test_reconstruction_with_padding_and_many_rows():
  """>= 200 random rows of several lengths, some ending in padding: the real tokens come back
  exactly, padding is never a target, and there are never more than s spans."""
  rng = np.random.default_rng(1)
  checked = 0
  for length, b in [(141, 160), (37, 64), (284, 32)]:
    tokens, seg = random_rows(rng, b, length, pad_rows=b // 2)
    n, s = noise_counts(length, 0.15, 3.0)
    out = jax.jit(lambda t, g, k: span_corrupt(t, g, k, ids=DESCENDING))(tokens, seg, jax.random.key(length))
    out = {k: np.asarray(v) for k, v in out.items()}
    for r in range(b):
      real = tokens[r][seg[r] > 0].tolist()
      inp = out["inputs"][r][out["input_segment_ids"][r] > 0]
      tgt = out["targets"][r][out["target_segment_ids"][r] > 0]
      assert inp[-1] == DESCENDING.eos and tgt[-1] == DESCENDING.eos
      assert reconstruct(inp, tgt, DESCENDING) == real
      assert (out["inputs"][r][out["input_segment_ids"][r] == 0] == DESCENDING.pad).all()
      assert (out["targets"][r][out["target_segment_ids"][r] == 0] == DESCENDING.pad).all()
      assert len(parse_targets(tgt, DESCENDING.sentinels, DESCENDING.eos)) <= s
      checked += 1
  assert checked >= 200


def test_a_row_of_padding_predicts_nothing():
  """A short held-out split fills eval batches with rows of padding: such a row has no input and
  no target (not an EOS that would count in the loss and accuracy); the other rows are unchanged."""
  rng = np.random.default_rng(2)
  tokens, seg = random_rows(rng, 3, 60, pad_rows=0)
  full = span_corrupt(tokens, seg, jax.random.key(0), ids=DESCENDING)
  seg[1] = 0
  out = span_corrupt(tokens, seg, jax.random.key(0), ids=DESCENDING)
  assert not np.asarray(out["input_segment_ids"][1]).any() and not np.asarray(out["target_segment_ids"][1]).any()
  assert (np.asarray(out["targets"][1]) == DESCENDING.pad).all()
  for name in ("inputs", "input_segment_ids", "targets", "target_segment_ids"):
    np.testing.assert_array_equal(np.asarray(out[name])[[0, 2]], np.asarray(full[name])[[0, 2]])


def test_jittable_and_deterministic_per_rng():
  tokens, seg = random_rows(np.random.default_rng(2), 4, 141)
  f = jax.jit(lambda k: span_corrupt(tokens, seg, k, ids=DESCENDING))
  a, b, c = f(jax.random.key(0)), f(jax.random.key(0)), f(jax.random.key(1))
  for key in a:
    np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]))
  assert not np.array_equal(np.asarray(a["inputs"]), np.asarray(c["inputs"]))
  with pytest.raises(ValueError, match="needs"):
    span_corrupt(tokens, seg, jax.random.key(0), ids=DESCENDING, inputs_length=100)


def t5_model(length: int):
  from tfx.models import build_model

  cfg = tiny_config("--config.model.family=encoder_decoder", "--config.model.num_layers=2",
                    "--config.model.d_model=32", "--config.model.d_ff=64", "--config.model.position=relative",
                    "--config.model.tie_embeddings=false")
  model = build_model(cfg.model, vocab_size=VOCAB, max_length=length)
  params = nn.unbox(jax.jit(model.init)(jax.random.key(0), **type(model).init_inputs(1, length))["params"])
  return model, params


def test_decoder_position_does_not_see_its_target():
  """With the real encoder-decoder: decoder logits[i] do not depend on the decoder inputs at
  positions > i, which hold targets[>= i]; so no target reaches its own or earlier predictions.
  The manual model call below is the one `loss` makes (checked by comparing the losses)."""
  raw = 70
  tokens, seg = random_rows(np.random.default_rng(3), 1, raw, pad_rows=0)
  batch = {"tokens": jnp.asarray(tokens), "segment_ids": jnp.asarray(seg),
           "positions": jnp.broadcast_to(jnp.arange(raw), (1, raw))}
  objective = SpanCorruption(DESCENDING)
  rng = jax.random.key(4)
  x = jax.jit(objective.corrupt)(batch, jax.random.split(rng)[0])
  t_in, t_tgt = x["inputs"].shape[1], x["targets"].shape[1]
  assert (t_in, t_tgt) == (64, 14)
  model, params = t5_model(t_in)
  dec_in = shift_right_by_segment(x["targets"], x["target_segment_ids"], DESCENDING.pad)
  np.testing.assert_array_equal(np.asarray(dec_in[0, 1:]), np.asarray(x["targets"][0, :-1]))
  assert int(dec_in[0, 0]) == DESCENDING.pad
  args = (x["inputs"], x["input_segment_ids"], jnp.arange(t_in)[None] * x["input_segment_ids"],
          dec_in, x["target_segment_ids"], jnp.arange(t_tgt)[None] * x["target_segment_ids"])
  perturb = jax.tree.map(jnp.zeros_like, jax.eval_shape(model.init, jax.random.key(0), *args)["perturbations"])

  @jax.jit
  def jacobian(eps):
    f = lambda e: model.apply({"params": params, "perturbations": e}, *args)[0].sum(-1)  # [t]
    return jax.jacrev(f)(eps)["decoder_embeddings"][:, 0]  # [t (logits), t (decoder inputs), e]

  jac = np.abs(np.asarray(jacobian(perturb))).sum(-1)  # [t, t]
  for i in range(t_tgt):
    assert (jac[i, i + 1:] == 0).all(), i
    assert jac[i, i] > 0
  loss, metrics = jax.jit(lambda p: objective.loss(model, p, batch, rng, train=False))(params)
  logits = jax.jit(model.apply)({"params": params}, *args)
  manual = -jnp.mean(jax.nn.log_softmax(logits[0], -1)[jnp.arange(t_tgt), x["targets"][0]])
  np.testing.assert_allclose(float(loss), float(manual), rtol=1e-5)
  assert float(metrics["num_tokens"]) == t_tgt
