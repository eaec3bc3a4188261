"""Masked LM invariants (OBJECTIVES.md §5): rates, eligibility, determinism, whole words,
padding invariance, and that a [MASK]ed token cannot reach its own prediction."""

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import ROOT, compare_with_float32_logits_loss, tiny_config
from tfx import ops
from tfx.objectives.base import SpecialIds
from tfx.objectives.masked_lm import (MaskedLM, cap_selection, mask_tokens, ordinary_ids, prediction_slots,
                                      selected_positions, special_table)
from tfx.registry import OBJECTIVES

IDS = SpecialIds(vocab_size=1000, pad=0, eos=1, unk=2, bos=3, mask=4, cls=5, sep=6,
                 sentinels=tuple(range(7, 17)), special=tuple(range(17)))
SPECIAL = special_table(IDS)
N_ORDINARY = len(ordinary_ids(IDS))


def random_batch(rng: np.random.Generator, b: int, t: int, max_docs: int = 4, min_real: float = 0.5):
  """Random tokens (specials included) packed into up to `max_docs` documents, then padding
  (each row has between `min_real * t` and `t` real tokens)."""
  tokens = rng.integers(0, IDS.vocab_size, (b, t)).astype(np.int32)
  seg = np.zeros((b, t), np.int32)
  pos = np.zeros((b, t), np.int32)
  for r in range(b):
    real = rng.integers(int(t * min_real), t + 1)
    cuts = np.sort(rng.choice(np.arange(1, real), size=min(max_docs - 1, real - 1), replace=False))
    bounds = [0, *cuts, real]
    for k in range(len(bounds) - 1):
      seg[r, bounds[k]:bounds[k + 1]] = k + 1
      pos[r, bounds[k]:bounds[k + 1]] = np.arange(bounds[k + 1] - bounds[k])
  tokens = np.where(seg > 0, tokens, IDS.pad).astype(np.int32)
  return tokens, seg, pos


def within_3_sigma(count: int, n: int, p: float) -> bool:
  sigma = np.sqrt(n * p * (1 - p))
  return abs(count - n * p) <= 3 * sigma


def test_registered():
  assert OBJECTIVES.get("masked_lm") is MaskedLM
  assert MaskedLM.families == ("encoder",)


def test_rates_eligibility_and_untouched_inputs():
  """Over >= 10^6 eligible tokens: selection rate and the 80/10/10 split within 3 sigma."""
  tokens, seg, _ = random_batch(np.random.default_rng(0), 264, 4096, min_real=0.95)
  f = jax.jit(lambda tok, s, k: mask_tokens(tok, s, k, ids=IDS))
  inputs, targets, weights = (np.asarray(a) for a in f(tokens, seg, jax.random.key(0)))

  eligible = (seg > 0) & ~SPECIAL[tokens]
  selected = weights > 0
  n_eligible = int(eligible.sum())
  assert n_eligible >= 10**6
  assert not selected[~eligible].any(), "a special token or padding was selected"
  assert within_3_sigma(int(selected.sum()), n_eligible, 0.15), selected.sum() / n_eligible
  np.testing.assert_array_equal(targets, tokens)
  np.testing.assert_array_equal(inputs[~selected], tokens[~selected])

  n_sel = int(selected.sum())
  to_mask = selected & (inputs == IDS.mask)
  changed = selected & (inputs != IDS.mask) & (inputs != tokens)  # random, different from the original
  kept = selected & (inputs == tokens)
  assert to_mask.sum() + changed.sum() + kept.sum() == n_sel
  assert within_3_sigma(int(to_mask.sum()), n_sel, 0.8)
  assert within_3_sigma(int(changed.sum()), n_sel, 0.1 * (1 - 1 / N_ORDINARY))
  assert within_3_sigma(int(kept.sum()), n_sel, 0.1 + 0.1 / N_ORDINARY)
  assert not SPECIAL[inputs[selected & (inputs != IDS.mask)]].any(), "a random replacement is special"
  # The random replacements cover the ordinary vocabulary roughly uniformly.
  counts = np.bincount(inputs[changed], minlength=IDS.vocab_size)[~SPECIAL]
  assert counts.min() > 0


def test_other_rates():
  tokens, seg, _ = random_batch(np.random.default_rng(1), 64, 1024)
  inputs, _, weights = (np.asarray(a) for a in jax.jit(lambda k: mask_tokens(
      tokens, seg, k, ids=IDS, mask_rate=0.4, mask_token_rate=0.5, random_token_rate=0.0))(jax.random.key(3)))
  eligible = (seg > 0) & ~SPECIAL[tokens]
  selected = weights > 0
  assert within_3_sigma(int(selected.sum()), int(eligible.sum()), 0.4)
  assert within_3_sigma(int((inputs[selected] == IDS.mask).sum()), int(selected.sum()), 0.5)
  assert np.all((inputs[selected] == IDS.mask) | (inputs[selected] == tokens[selected]))


def test_mask_is_deterministic_per_rng_and_fresh_across_rngs():
  tokens, seg, _ = random_batch(np.random.default_rng(2), 8, 256)
  f = jax.jit(lambda k: mask_tokens(tokens, seg, k, ids=IDS))
  a, b, c = f(jax.random.key(7)), f(jax.random.key(7)), f(jax.random.key(8))
  for x, y in zip(a, b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert not np.array_equal(np.asarray(a[2]), np.asarray(c[2]))
  assert not np.array_equal(np.asarray(a[0]), np.asarray(c[0]))


def numpy_word_ids(tokens, seg, word_start):
  eligible = (seg > 0) & ~SPECIAL[tokens]
  starts = np.ones_like(eligible)
  starts[:, 1:] = word_start[tokens[:, 1:]] | ~eligible[:, 1:] | ~eligible[:, :-1] | (seg[:, 1:] != seg[:, :-1])
  return np.cumsum(starts, axis=1) - 1, starts, eligible


def test_whole_word_masking_is_all_or_none():
  rng = np.random.default_rng(3)
  word_start = rng.random(IDS.vocab_size) < 0.3
  word_start[SPECIAL] = True
  tokens, seg, _ = random_batch(rng, 64, 512)
  inputs, _, weights = (np.asarray(a) for a in jax.jit(lambda k: mask_tokens(
      tokens, seg, k, ids=IDS, word_start=word_start))(jax.random.key(0)))
  selected = weights > 0
  words, starts, eligible = numpy_word_ids(tokens, seg, word_start)
  assert not selected[~eligible].any()
  # Every token has the selection of the first token of its word.
  first = np.maximum.accumulate(np.where(starts, np.arange(tokens.shape[1]), 0), axis=1)
  np.testing.assert_array_equal(selected, np.take_along_axis(selected, first, axis=1))
  # Multi-token words exist and some of them are selected, and the word rate is about 0.15.
  continuation = eligible & ~starts
  assert (selected & continuation).sum() > 100
  word_selected = selected[starts & eligible]
  assert within_3_sigma(int(word_selected.sum()), word_selected.size, 0.15)
  # The 80/10/10 replacement is per token: within selected words, some tokens are [MASK] and some not.
  np.testing.assert_array_equal(inputs[~selected], tokens[~selected])
  mixed = 0
  for r in range(tokens.shape[0]):
    for w in np.unique(words[r][selected[r] & continuation[r]]):
      is_mask = inputs[r][words[r] == w] == IDS.mask
      mixed += bool(is_mask.any() and not is_mask.all())
  assert mixed > 0


def test_whole_word_objective_needs_word_starts():
  batch = {"tokens": jnp.full((1, 8), 20), "segment_ids": jnp.ones((1, 8), jnp.int32)}
  with pytest.raises(ValueError, match="with_word_start"):
    MaskedLM(IDS, whole_word=True).mask(batch, jax.random.key(0))
  word_start = np.ones(IDS.vocab_size, bool)
  objective = MaskedLM(IDS, whole_word=True).with_word_start(word_start)
  objective.mask(batch, jax.random.key(0))
  with pytest.raises(ValueError, match="mask_token_rate"):
    MaskedLM(IDS, mask_token_rate=0.95, random_token_rate=0.1)


class FakeEncoder(nn.Module):
  """Bidirectional within each document, padding masked, tied LM head (like BERT)."""

  vocab_size: int
  max_length: int = 128
  d: int = 16

  @nn.compact
  def __call__(self, tokens, segment_ids, positions, *, train: bool = False):
    embed = nn.Embed(self.vocab_size, self.d, name="token_embed")
    x = embed(tokens) + nn.Embed(self.max_length, self.d, name="position_embed")(positions)  # [b, t, e]
    allow = ops.segment_mask(segment_ids)[:, 0].astype(jnp.float32)  # [b, t, t]
    context = allow @ x / jnp.maximum(allow.sum(-1, keepdims=True), 1.0)  # [b, t, e]
    h = nn.tanh(nn.Dense(self.d)(x) + nn.Dense(self.d)(context))
    return embed.attend(h).astype(jnp.float32)  # [b, t, v]


def fake_model(length: int = 128):
  model = FakeEncoder(IDS.vocab_size, max_length=length)
  params = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 4), jnp.int32),
                      jnp.zeros((1, 4), jnp.int32))["params"]
  return model, params


def real_encoder(length: int = 64, *overrides: str):
  """The real `encoder` family with a tiny config (once tfx/models/encoder.py exists)."""
  from tfx.models import build_model

  cfg = tiny_config("--config.model.family=encoder", "--config.model.num_layers=2", "--config.model.d_model=32",
                    "--config.model.d_ff=64", *overrides)
  model = build_model(cfg.model, vocab_size=IDS.vocab_size, max_length=length)
  params = nn.unbox(model.init(jax.random.key(0), **type(model).init_inputs(1, length))["params"])
  return model, params


HAS_ENCODER = os.path.exists(os.path.join(ROOT, "tfx", "models", "encoder.py"))
MODELS = ["fake", pytest.param("real", marks=pytest.mark.skipif(not HAS_ENCODER, reason="no encoder family yet"))]


def test_the_cap_keeps_the_smallest_draws_and_whole_words():
  """cap_selection keeps at most `cap` per row, the eligible tokens with the smallest draws below
  the rate (a numpy sort says which); tokens sharing a draw (a word) go in or out together."""
  rng = np.random.default_rng(11)
  u = rng.random((200, 40)).astype(np.float32)
  eligible = rng.random((200, 40)) < 0.9
  got = np.asarray(cap_selection(jnp.asarray(u), jnp.asarray(eligible), 0.5, 12))
  uncapped = eligible & (u < 0.5)
  assert (got.sum(1) <= 12).all() and (uncapped.sum(1) > 12).sum() > 50  # the cap binds in many rows
  for r in range(len(u)):
    order = np.argsort(np.where(uncapped[r], u[r], 2.0))[:min(12, uncapped[r].sum())]
    np.testing.assert_array_equal(np.flatnonzero(got[r]), np.sort(order))
  # Words: one draw per word of 1-4 tokens.
  words = np.cumsum(rng.random((200, 40)) < 0.5, axis=1)
  shared = np.take_along_axis(u, words % 40, axis=1)
  got = np.asarray(cap_selection(jnp.asarray(shared), jnp.ones((200, 40), bool), 0.5, 12))
  assert (got.sum(1) <= 12).all() and (got.sum(1) >= 8).mean() > 0.5
  for r in range(len(u)):
    for w in np.unique(words[r]):
      assert got[r][words[r] == w].all() or not got[r][words[r] == w].any()
  # The default cap: mean + 4 sd, a multiple of 8, never above the row; BERT-base's 512 -> 112.
  assert prediction_slots(512, 0.15) == 112 and prediction_slots(128, 0.15) == 40
  assert prediction_slots(8, 0.15) == 8 and prediction_slots(64, 1.0) == 64


def test_whole_words_stay_whole_under_the_cap():
  rng = np.random.default_rng(12)
  word_start = rng.random(IDS.vocab_size) < 0.3
  word_start[SPECIAL] = True
  tokens, seg, _ = random_batch(rng, 32, 128, min_real=0.9)
  _, _, weights = jax.jit(lambda k: mask_tokens(tokens, seg, k, ids=IDS, word_start=word_start, mask_rate=0.5,
                                                max_selected=16))(jax.random.key(0))
  selected = np.asarray(weights) > 0
  assert (selected.sum(1) <= 16).all() and (selected.sum(1) >= 10).all()
  _, starts, _ = numpy_word_ids(tokens, seg, word_start)
  first = np.maximum.accumulate(np.where(starts, np.arange(tokens.shape[1]), 0), axis=1)
  np.testing.assert_array_equal(selected, np.take_along_axis(selected, first, axis=1))


@pytest.mark.parametrize("cap,model_overrides", [
    (0, ()),
    (12, ()),
    (0, ("--config.model.scan_layers=False", "--config.model.num_layers=3")),
    (0, ("--config.model.norm=pre", "--config.model.position=rotary", "--config.model.remat=dots_attention")),
    (0, ("--config.model.scan_unroll=0", "--config.model.num_layers=1")),
    (0, ("--config.model.position=relative",)),  # a bias: the last layer runs in full
], ids=["scanned", "cap", "unscanned", "pre_rotary_remat", "one_layer", "relative"])
def test_gathered_head_gives_the_dense_loss_and_gradients(cap, model_overrides):
  """The loss with the MLM head on the gathered selected tokens (and the last layer's queries,
  attention output and MLP there only: `Stack.last_layer_queries`) is the loss with the head at
  every position: value, accuracy, token count and every parameter's gradient; also where the
  cap binds (max_predictions=12 at a 40% rate) and rows hold fewer selected tokens than slots;
  scanned, unscanned, unrolled and one-layer stacks, pre- and post-LN."""
  t = 48
  model, params = real_encoder(t, *model_overrides)
  tokens, seg, pos = random_batch(np.random.default_rng(13), 6, t)
  batch = {"tokens": jnp.asarray(tokens), "segment_ids": jnp.asarray(seg), "positions": jnp.asarray(pos)}
  rng = jax.random.key(14)
  results = []
  for gather in (True, False):
    objective = MaskedLM(IDS, mask_rate=0.4, max_predictions=cap, gather_predictions=gather)
    assert (objective.gather_slots(model, t) is not None) == gather
    f = jax.jit(jax.value_and_grad(lambda p: objective.loss(model, p, batch, rng, train=False), has_aux=True))
    results.append(f(params))
  (loss_g, m_g), g_g = results[0]
  (loss_d, m_d), g_d = results[1]
  weights = jax.jit(objective.mask)(batch, jax.random.split(rng)[0])[2]
  counts = np.asarray(weights).sum(1)
  slots = objective.prediction_slots(t)
  assert counts.max() <= slots and counts.min() < slots and float(m_d["num_tokens"]) > 0
  if cap:
    assert counts.max() == cap
  np.testing.assert_allclose(float(loss_g), float(loss_d), rtol=1e-6)
  assert float(m_g["accuracy"]) == float(m_d["accuracy"]) and float(m_g["num_tokens"]) == float(m_d["num_tokens"])
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_g), jax.tree_util.tree_leaves(g_d)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))
  # The gather's order: each row's selected positions first, in order.
  where = np.asarray(selected_positions(weights, slots))
  for r in range(len(counts)):
    np.testing.assert_array_equal(where[r, :int(counts[r])], np.flatnonzero(np.asarray(weights)[r] > 0))


def test_loss_is_invariant_to_padding():
  """The same real rows padded to 32 or to 96 tokens give the same masks, loss and metrics."""
  model, params = fake_model()
  tokens, seg, pos = random_batch(np.random.default_rng(4), 6, 32)
  objective = MaskedLM(IDS, mask_rate=0.3)

  def padded(a, t):
    return jnp.asarray(np.pad(a, ((0, 0), (0, t - a.shape[1]))))

  short = {"tokens": jnp.asarray(tokens), "segment_ids": jnp.asarray(seg), "positions": jnp.asarray(pos)}
  long = {k: padded(v, 96) for k, v in short.items()}
  rng = jax.random.key(5)
  f = jax.jit(lambda batch: objective.loss(model, params, batch, rng, train=False))
  (loss_s, m_s), (loss_l, m_l) = f(short), f(long)
  assert float(m_s["num_tokens"]) > 0
  np.testing.assert_allclose(float(loss_s), float(loss_l), rtol=1e-6)
  np.testing.assert_allclose(float(m_s["accuracy"]), float(m_l["accuracy"]))
  assert float(m_s["num_tokens"]) == float(m_l["num_tokens"])
  mask_rng = jax.random.split(rng)[0]
  mask = jax.jit(objective.mask)
  inputs_s, _, w_s = mask(short, mask_rng)
  inputs_l, _, w_l = mask(long, mask_rng)
  np.testing.assert_array_equal(np.asarray(inputs_s), np.asarray(inputs_l)[:, :32])
  assert float(jnp.sum(w_l[:, 32:])) == 0.0


@pytest.mark.parametrize("which", MODELS)
def test_masked_token_does_not_reach_its_prediction(which):
  """d logits[p] / d embedding[original token] = 0 when the token at p became [MASK] and occurs
  nowhere else in the inputs. The objective differentiates sum_v c_v logits[p, v] with c = 0 at
  the original token, so a tied output embedding contributes nothing and only the input path counts."""
  t = 48
  model, params = fake_model(t) if which == "fake" else real_encoder(t)
  rng = np.random.default_rng(5)
  tokens = rng.choice(np.flatnonzero(~SPECIAL), size=(1, t), replace=False).astype(np.int32)  # all distinct
  seg = np.ones((1, t), np.int32)
  seg[0, 40:] = 0  # padding
  tokens[0, 40:] = IDS.pad
  pos = np.where(seg > 0, np.arange(t), 0).astype(np.int32)
  inputs, _, weights = mask_tokens(jnp.asarray(tokens), jnp.asarray(seg), jax.random.key(1), ids=IDS, mask_rate=0.4)
  inputs, weights = np.asarray(inputs), np.asarray(weights)
  table_path = ("token_embed", "embedding")

  @jax.jit
  def grad(params, p, c):
    def f(params):
      logits = model.apply({"params": params}, jnp.asarray(inputs), jnp.asarray(seg), jnp.asarray(pos))
      return jnp.sum(logits[0, p] * c)

    return jax.grad(f)(params)

  def influence(p: int, token: int) -> float:
    c = jnp.asarray(rng.normal(size=IDS.vocab_size), jnp.float32).at[token].set(0.0)
    grads = grad(params, p, c)
    table = grads[table_path[0]][table_path[1]] if which == "fake" else _find_table(grads)
    return float(jnp.abs(table[token]).sum())

  checked = 0
  for p in np.flatnonzero((weights[0] > 0) & (inputs[0] == IDS.mask))[:4]:
    original = tokens[0, p]
    assert not (inputs[0] == original).any()
    assert influence(p, original) == 0.0
    # Positive control: an unselected token of the same document does reach the prediction.
    q = np.flatnonzero((weights[0] == 0) & (seg[0] > 0))[0]
    assert influence(p, tokens[0, q]) > 0.0
    checked += 1
  assert checked >= 2


def _find_table(grads):
  """The token-embedding gradient [v, e] in a real model's parameter tree."""
  found = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(grads)
           if "token_embed" in jax.tree_util.keystr(path) and leaf.shape[0] == IDS.vocab_size]
  assert len(found) == 1, [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(grads)]
  return found[0]


@pytest.mark.parametrize("gather", [True, False])
def test_the_loss_keeps_bf16_logits(gather):
  """The loss reads bf16 logits, whether the gathered head computes it (`mlm_head(hidden, loss)`)
  or the head runs at every position (`gather_predictions=False`: the encoder's compute-dtype
  logits): the loss and metrics of the float32 logits the model returns by default, the gradients
  within bf16's rounding, and no scatter of the targets' gradient into a float32 [b, n, v] buffer."""
  t = 48
  model, params = real_encoder(t, "--config.model.dtype=bfloat16")
  tokens, seg, pos = random_batch(np.random.default_rng(15), 4, t)
  batch = {"tokens": jnp.asarray(tokens), "segment_ids": jnp.asarray(seg), "positions": jnp.asarray(pos)}
  objective = MaskedLM(IDS, mask_rate=0.3, gather_predictions=gather)
  rng = jax.random.key(16)

  def float32_logits_loss(p):  # the model's float32 logits, the loss computed from them outside
    if not gather:
      logits, targets, weights, _ = objective._forward(model, p, batch, rng, train=False)
    else:
      inputs, targets, weights = objective.mask(batch, jax.random.split(rng)[0])
      where = selected_positions(weights, objective.gather_slots(model, t))
      hidden = model.apply({"params": p}, inputs, batch["segment_ids"], batch["positions"], return_hidden=True,
                           rows=where)
      logits = model.apply({"params": p}, hidden, method="mlm_head")
      targets, weights = (jnp.take_along_axis(a, where, axis=1) for a in (targets, weights))
    assert logits.dtype == jnp.float32
    return ops.weighted_cross_entropy(logits, targets, weights)

  ours, reference = compare_with_float32_logits_loss(
      lambda p: objective.loss(model, p, batch, rng, train=False), float32_logits_loss, params)
  assert reference == ours + 1  # the targets' logits' gradient
