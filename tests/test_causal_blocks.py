"""Causal self-attention on XLA's path cut into query blocks (`model.causal_blocks`): block i attends
only the keys up to its last row, so the scores above the diagonal blocks are never computed."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfx import ops
from tfx.ops import attention as attn
from tfx.ops import dropout
from tests.test_ops import random_packed

jax.config.update("jax_enable_x64", False)


def test_block_bounds_cover_the_rows_in_order():
  """The blocks tile [0, t) in order, their ends multiples of 8 but the last; 0 is four blocks from
  256 tokens and one below; more blocks than rows of 8 give fewer; a negative count is refused."""
  for t in (8, 37, 114, 128, 256, 1000, 1024):
    for n in (0, 1, 2, 3, 4, 7, 16):
      bounds = attn.causal_block_bounds(t, n)
      assert bounds[0][0] == 0 and bounds[-1][1] == t
      assert all(a < e for a, e in bounds) and all(e == a2 for (_, e), (a2, _) in zip(bounds, bounds[1:]))
      assert all(e % 8 == 0 for _, e in bounds[:-1])
      assert len(bounds) <= max(n, 4)
  assert attn.causal_block_bounds(256, 0) == ((0, 64), (64, 128), (128, 192), (192, 256))
  assert attn.causal_block_bounds(255, 0) == ((0, 255),)
  assert attn.causal_block_bounds(114, 4) == ((0, 32), (32, 64), (64, 88), (88, 114))
  with pytest.raises(ValueError, match=">= 0"):
    attn.causal_block_bounds(64, -1)


def test_a_blocks_keep_bits_are_the_whole_arrays():
  """`keep_bits` of a block (its first query and the whole row's columns) is that block of the
  whole [b, h, t, s] array's bits: a blocked attention drops what the unblocked one drops."""
  seed = dropout.seed(jax.random.key(5))
  whole = np.asarray(dropout.keep_bits(seed, (2, 3, 40, 40), 0.3))
  for first, end in ((0, 8), (8, 24), (24, 40)):
    block = dropout.keep_bits(seed, (2, 3, end - first, end), 0.3, first_query=first, columns=40)
    np.testing.assert_array_equal(np.asarray(block), whole[:, :, first:end, :end])
  with pytest.raises(ValueError, match="three or more axes"):
    dropout.keep_bits(seed, (4, 40), 0.3, first_query=8)


def _largest_product(jaxpr) -> int:
  """The most elements of any matmul's output in a jaxpr (its nested jaxprs included)."""
  shapes = re.findall(r"\[([\d,]+)\] = dot_general", str(jaxpr))
  assert shapes
  return max(int(np.prod([int(n) for n in shape.split(",")])) for shape in shapes)


def _packed_ids(rng, b, t):
  """Segment ids [b, t] of packed documents with padding at the end (queries with no key)."""
  return jnp.asarray(random_packed(rng, b, t, pad=5)[0])


CASES = ["packed", "lengths_bias", "gqa_dropout", "bf16"]


@pytest.mark.parametrize("case", CASES)
def test_blocks_compute_the_unblocked_attention(case):
  """`dot_product_attention` on XLA's path with the queries in 2, 3 and 4 blocks against one block:
  values and the q, k, v and bias gradients, for packed rows with padding (rows with no key stay
  exactly zero), a `LengthMask` with a bias shared by the batch (T5's decoder), grouped-query heads
  with attention dropout (`softmax_attention`, the same keep bits) and bf16; and the blocked
  program computes no [t, s] scores at all."""
  rng = np.random.default_rng(3)
  b, t, h, kh, d = 2, 48, 4, 4, 8
  dtype, tol, rate, bias = jnp.float32, 2e-5, 0.0, None
  mask = ops.SegmentMask(_packed_ids(rng, b, t), causal=True).prebuilt()
  if case == "lengths_bias":
    mask = ops.LengthMask(jnp.asarray([t, 30]), jnp.asarray([t, 30]), (t, t), causal=True)
    bias = jnp.asarray(rng.normal(size=(1, h, t, t)), jnp.float32)
  elif case == "gqa_dropout":
    kh, rate = 2, 0.25
  elif case == "bf16":
    dtype, tol = jnp.bfloat16, 2e-2
  q = jnp.asarray(rng.normal(size=(b, t, h, d)), dtype)
  k, v = (jnp.asarray(rng.normal(size=(b, t, kh, d)), dtype) for _ in range(2))
  cot = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
  seed = dropout.seed(jax.random.key(1))

  def attend(blocks):
    def f(q, k, v, bias):
      if rate:
        out = attn.softmax_attention(q, k, v, ops.dense_mask(mask), bias, d**-0.5, dropout_rate=rate, seed=seed,
                                     causal_blocks=blocks)
      else:
        out = ops.dot_product_attention(q, k, v, mask=mask, bias=bias, implementation="xla", causal_blocks=blocks)
      return jnp.sum(out.astype(jnp.float32) * cot), out

    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True)), f

  (_, want), want_grads = attend(1)[0](q, k, v, bias)
  rows = np.asarray(ops.rows_attend(ops.dense_mask(mask)))[:, 0]  # [b, t]
  for blocks in (2, 3, 4):
    step, f = attend(blocks)
    (_, got), grads = step(q, k, v, bias)
    assert np.all(np.asarray(got, np.float32)[~rows] == 0.0)
    for g, w in zip((got, *grads[:3], *([grads[3]] if bias is not None else [])),
                    (want, *want_grads[:3], *([want_grads[3]] if bias is not None else []))):
      np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=tol, atol=tol)
    jaxpr = jax.make_jaxpr(jax.grad(lambda *a: f(*a)[0], argnums=(0, 1, 2)))(q, k, v, bias)
    assert _largest_product(jaxpr) < b * h * t * t  # no matmul gives the whole [b, h, t, t] scores or dP


def test_a_decoder_in_blocks_is_the_same_function():
  """A decoder with its self-attention in 4 query blocks (`model.causal_blocks=4`, 32 rows: blocks
  of 8) against 1, the same parameters: logits of packed rows with padding and the parameters'
  gradients of a loss over them."""
  from tests.test_model import make_model, packed_row

  rng = np.random.default_rng(4)
  tokens, seg, pos = (jnp.asarray(np.stack(a)) for a in zip(packed_row(rng, [9, 14, 5], 32),
                                                              packed_row(rng, [30], 32)))
  model_1, params = make_model("--config.model.causal_blocks=1", length=32)
  model_4, _ = make_model("--config.model.causal_blocks=4", length=32)
  weights = jnp.asarray(rng.normal(size=(2, 32, 1)), jnp.float32) * (seg > 0)[..., None]

  def run(model):
    loss = lambda p: jnp.sum(model.apply({"params": p}, tokens, seg, pos) * weights)
    return jax.jit(lambda p: (model.apply({"params": p}, tokens, seg, pos), jax.grad(loss)(p)))(params)

  (want, want_grads), (got, got_grads) = run(model_1), run(model_4)
  scores = 2 * model_1.cfg.num_heads * 32 * 32  # [b, h, t, t]
  grad = lambda model: jax.make_jaxpr(jax.grad(lambda p: jnp.sum(model.apply({"params": p}, tokens, seg, pos))))(params)
  assert _largest_product(grad(model_1)) == scores and _largest_product(grad(model_4)) < scores
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_attention_dropout_in_blocks_drops_what_one_block_drops(platform):
  """The model's XLA attention with dropout (`tfx.nn.attention.xla_dropout_attention`: autodiff's
  einsum attention off a TPU, `softmax_attention` traced for one) in 4 query blocks against 1: the
  same values and q, k, v gradients (so the same keep bits), and fewer scores computed."""
  from tfx.nn.attention import xla_dropout_attention
  from tfx.ops import target

  rng = np.random.default_rng(6)
  b, t, h, d = 2, 64, 4, 8
  q, k, v = (jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32) for _ in range(3))
  mask = ops.SegmentMask(_packed_ids(rng, b, t), causal=True).dense()
  cot = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
  key = jax.random.key(2)

  def f(blocks):
    return lambda q, k, v: jnp.sum(xla_dropout_attention(q, k, v, mask, None, 0.3, 0.2, key, causal_blocks=blocks) * cot)

  with target.lowering_for(platform):
    want = jax.jit(jax.value_and_grad(f(1), argnums=(0, 1, 2)))(q, k, v)
    got = jax.jit(jax.value_and_grad(f(4), argnums=(0, 1, 2)))(q, k, v)
    largest = [_largest_product(jax.make_jaxpr(jax.grad(f(n), argnums=(0, 1, 2)))(q, k, v)) for n in (1, 4)]
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)
  assert largest[0] == b * h * t * t and largest[1] < b * h * t * t
