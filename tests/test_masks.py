"""Masks given as rows' lengths (`ops.LengthMask`, what cuDNN reads as sequence lengths) against the
segment masks they stand for, and the objectives that promise rows of one segment each; a mask's
query rows (`ops.mask_rows`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfx import ops
from tfx.objectives.base import SpecialIds
from tfx.ops import attention as attn
from tfx.ops import cudnn


def one_segment_ids(rng, b: int, t: int) -> np.ndarray:
  """[b, t] segment ids: each row 1 on its first n tokens, 0 after; one full row, one empty row,
  one row of a single token, the rest random."""
  lengths = rng.integers(1, t + 1, size=b)
  lengths[:3] = (t, 0, 1)
  return (np.arange(t)[None, :] < lengths[:, None]).astype(np.int32)


@pytest.mark.parametrize("kind", ["self", "causal", "cross", "causal_cross"])
def test_length_mask_is_the_segment_mask_of_one_segment_rows(kind):
  rng = np.random.default_rng(0)
  q_ids = jnp.asarray(one_segment_ids(rng, 6, 10))
  k_ids = jnp.asarray(one_segment_ids(rng, 6, 7)) if "cross" in kind else None
  causal = kind.startswith("causal")
  want = {"self": lambda: ops.segment_mask(q_ids), "causal": lambda: ops.decoder_mask(q_ids),
          "cross": lambda: ops.segment_mask(q_ids, k_ids),
          "causal_cross": lambda: ops.segment_mask(q_ids, k_ids) & ops.causal_mask(10, 7)}[kind]()  # [b, 1, t, s]
  lengths = ops.rows_mask(q_ids, k_ids, causal=causal, lengths=True)
  assert isinstance(lengths, ops.LengthMask) and lengths.causal == causal
  np.testing.assert_array_equal(lengths.dense(), want)
  np.testing.assert_array_equal(lengths.attending_rows(), ops.rows_attend(want)[:, 0])
  # Without lengths: the arrays packed rows get, exactly.
  packed = ops.dense_mask(ops.rows_mask(q_ids, k_ids, causal=causal))
  np.testing.assert_array_equal(packed, want)
  # A pytree: through jit and scan as its leaves, the shape and the flag static.
  leaves, tree = jax.tree.flatten(lengths)
  assert len(leaves) == 2 and jax.tree.unflatten(tree, leaves).shape == lengths.shape


@pytest.mark.parametrize("impl", ["xla", "reference"])
def test_attention_with_lengths_equals_the_dense_mask(impl):
  """Values and the q, k, v and bias gradients, cross attention with a T5-like bias per head."""
  rng = np.random.default_rng(1)
  b, t, s, h, d = 4, 8, 6, 2, 8
  q = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(b, s, h, d)), jnp.float32) for _ in range(2))
  bias = jnp.asarray(rng.normal(size=(1, h, t, s)), jnp.float32)
  q_ids, k_ids = jnp.asarray(one_segment_ids(rng, b, t)), jnp.asarray(one_segment_ids(rng, b, s))
  cot = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)

  def run(mask):
    f = lambda q, k, v, bias: ops.dot_product_attention(q, k, v, mask=mask, bias=bias, implementation=impl)
    loss = lambda *a: jnp.sum(f(*a) * cot)
    return [np.asarray(x) for x in (f(q, k, v, bias), *jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, bias))]

  got = run(ops.rows_mask(q_ids, k_ids, lengths=True))
  want = run(ops.segment_mask(q_ids, k_ids))
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
  assert np.all(got[0][1] == 0.0)  # the empty row: zeros, not the mean of V


def test_padding_positions_get_no_gradient():
  """cuDNN with sequence lengths leaves the gradients of the positions past them to itself: tfx
  zeroes them before they reach a weight."""
  x = jnp.arange(12.0).reshape(2, 3, 2)  # [b, t, d]
  valid = jnp.asarray([[True, True, False], [True, False, False]])
  out, pull = jax.vjp(lambda x: cudnn._real_only_gradient(x, valid), x)
  np.testing.assert_array_equal(out, x)
  (g,) = pull(jnp.full_like(x, jnp.nan))
  np.testing.assert_array_equal(np.isnan(g), np.broadcast_to(valid[..., None], g.shape))
  assert np.all(np.asarray(g)[~np.asarray(valid)] == 0.0)


def test_cudnn_refusal_with_lengths_falls_back_to_the_dense_mask(monkeypatch):
  """'On a GPU' here but really on CPU: JAX refuses cuDNN with sequence lengths at trace time, and
  tfx attends with the lengths' dense mask instead, the same numbers as XLA's."""
  monkeypatch.setattr(attn, "_on_gpu", lambda: True)
  rng = np.random.default_rng(2)
  q, k, v = (jnp.asarray(rng.normal(size=(3, 8, 2, 16)), jnp.bfloat16) for _ in range(3))
  mask = ops.rows_mask(jnp.asarray(one_segment_ids(rng, 3, 8)), causal=True, lengths=True)
  with ops.recorded_choices() as chosen:
    out = ops.dot_product_attention(q, k, v, mask=mask, implementation="auto")
  assert chosen[0][0] == "xla" and chosen[0][1].startswith("cuDNN refused"), chosen
  want = ops.dot_product_attention(q, k, v, mask=mask.dense(), implementation="xla")
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))


IDS = SpecialIds(vocab_size=1000, pad=0, eos=1, unk=2, bos=3, sentinels=tuple(999 - i for i in range(100)))


def raw_batch(rng, b: int, length: int) -> dict[str, jax.Array]:
  """Two documents a row; the last rows end in padding, the very last is all padding."""
  tokens = rng.integers(10, 900, size=(b, length)).astype(np.int32)
  seg = np.ones((b, length), np.int32)
  seg[:, length // 3:] = 2
  for r, real in ((b - 3, length // 2), (b - 2, 3), (b - 1, 0)):
    seg[r, real:], tokens[r, real:] = 0, 0
  return {"tokens": jnp.asarray(tokens), "segment_ids": jnp.asarray(seg)}


@pytest.mark.parametrize("name", ["span_corruption", "ul2"])
def test_seq2seq_objectives_give_rows_of_one_segment(name):
  """What `one_segment=True` (and so the lengths cuDNN reads) relies on: span corruption's and
  UL2's inputs and targets hold one segment a row, real tokens first, whatever the raw rows held
  (packed documents, padding, an empty row)."""
  from tfx.objectives.span_corruption import SpanCorruption
  from tfx.objectives.ul2 import UL2

  objective = SpanCorruption(IDS) if name == "span_corruption" else UL2(IDS, layout="encoder_decoder")
  rng = np.random.default_rng(3)
  batch = raw_batch(rng, 8, objective.raw_length(64))
  for seed in range(3):
    x = jax.jit(objective.corrupt)(batch, jax.random.key(seed))
    for key in ("input_segment_ids", "target_segment_ids"):
      ids = np.asarray(x[key])
      n = (ids > 0).sum(axis=1, keepdims=True)
      np.testing.assert_array_equal(ids, (np.arange(ids.shape[1])[None, :] < n).astype(ids.dtype), err_msg=key)
      assert n[-1, 0] == 0 and n[:-1].min() > 0, (key, n.ravel())


def test_encoder_decoder_with_lengths_equals_packed_masks(monkeypatch):
  """The whole model (scanned, rematerialised stacks; encoder, causal decoder and cross attention)
  with its masks as lengths computes what it computes with the arrays: 'on a GPU' (patched) in bf16
  the model picks lengths for cuDNN, which refuses here, so XLA attends with their dense masks."""
  from tests.conftest import tiny_config
  from tfx.models import build_model
  import flax.linen as nn

  monkeypatch.setattr(attn, "_on_gpu", lambda: True)
  kinds = []  # the masks cuDNN was offered
  offered = cudnn.attention
  monkeypatch.setattr(cudnn, "attention",
                      lambda q, k, v, mask, *a: kinds.append(type(mask)) or offered(q, k, v, mask, *a))
  cfg = tiny_config("--config.model.family=encoder_decoder", "--config.model.position=relative",
                    "--config.model.num_layers=2", "--config.model.d_model=32", "--config.model.d_ff=64",
                    "--config.model.dtype=bfloat16", "--config.model.remat=dots_attention")
  model = build_model(cfg.model, vocab_size=1000, max_length=32)
  params = nn.unbox(jax.jit(model.init)(jax.random.key(0), **type(model).init_inputs(1, 32))["params"])
  rng = np.random.default_rng(4)
  enc_ids, dec_ids = jnp.asarray(one_segment_ids(rng, 5, 16)), jnp.asarray(one_segment_ids(rng, 5, 8))
  dec_ids = dec_ids.at[1].set(0)  # the empty row is empty on both sides, as the objectives make it
  enc_tok = jnp.asarray(rng.integers(4, 1000, size=(5, 16)), jnp.int32) * enc_ids
  dec_tok = jnp.asarray(rng.integers(4, 1000, size=(5, 8)), jnp.int32) * dec_ids
  enc_pos, dec_pos = jnp.arange(16) * enc_ids, jnp.arange(8) * dec_ids

  def loss(params, one_segment):
    logits = model.apply({"params": params}, enc_tok, enc_ids, enc_pos, dec_tok, dec_ids, dec_pos,
                         one_segment=one_segment)  # [b, t, v]
    return jnp.sum(jnp.where(dec_ids[..., None] > 0, logits, 0.0) ** 2) * 1e-3, logits

  kinds.clear()  # init's
  with ops.recorded_choices() as chosen:
    (value, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)(params, True)
  assert {c for c, _ in chosen} == {"xla"} and all(w.startswith("cuDNN refused") for _, w in chosen), set(chosen)
  assert set(kinds) == {ops.LengthMask}, kinds  # encoder, decoder and cross attention alike
  kinds.clear()
  (want_value, want_logits), want_grads = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)(
      params, False)
  assert ops.LengthMask not in kinds and ops.SegmentMask in kinds, kinds
  np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(float(value), float(want_value), rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                                       rtol=1e-4, atol=1e-6), grads, want_grads)


@pytest.mark.parametrize("causal", [False, True])
def test_mask_rows_are_the_dense_masks_rows_in_every_form(causal):
  """`mask_rows` of a `SegmentMask` with its array, without it (the segment-id kernels' form,
  rebuilt from the rows' ids; bidirectional, the `CrossMask` of the rows' ids over the keys') and
  of the dense array: row i of the [b, 1, n, t] result is row rows[:, i] of the [b, 1, t, t] mask,
  padding, repeats and causality included."""
  rng = np.random.default_rng(3)
  b, t, n = 4, 24, 7
  ids = np.sort(rng.integers(0, 4, (b, t)), axis=1)[:, ::-1].copy()  # packed documents, then padding (0)
  rows = jnp.asarray(rng.integers(0, t, (b, n)), jnp.int32)
  rows = rows.at[:, 0].set(t - 1)  # a padding row in most
  mask = ops.SegmentMask(jnp.asarray(ids), causal)
  dense = np.asarray(mask.dense())  # [b, 1, t, t]
  want = np.take_along_axis(dense, np.asarray(rows)[:, None, :, None], axis=2)
  for form in (mask, mask.prebuilt(), mask.dense()):
    got = ops.mask_rows(form, rows)
    assert isinstance(got, ops.CrossMask) == (not causal and isinstance(form, ops.SegmentMask))
    got = np.asarray(ops.dense_mask(got))
    assert got.shape == (b, 1, n, t)
    np.testing.assert_array_equal(got, want)
  pad = ids[:, -1] == 0  # rows whose last position is padding: their first gathered row attends nothing
  assert pad.any() and not want[pad][:, :, 0].any()
  assert ops.mask_rows(None, rows) is None
