"""tfx's Pallas flash attention with dropout (`tfx.ops.flash_dropout`; the kernels interpreted on
this CPU): values and gradients against XLA attention that drops the same scores
(`tfx.ops.dropout.keep_bits`), nothing flowing from a future or a padding token, the keep bits' statistics, a
draw that neither the block size nor the mesh changes, and a model's wiring (the log line, the
step's seed) with `model.attention=pallas`."""

import json
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import ROOT, tiny_config
from tests.test_ops import random_packed
from tfx import ops
from tfx.models import build_model
from tfx.nn import attention as nn_attention
from tfx.ops import attention as attn
from tfx.ops import dropout
from tfx.ops import flash_dropout as fd
from tfx.ops import flash_dropout_kernels as fdk
from tfx.ops import target


reference = fd.reference_attention


def _qkv(rng, b, t, h, kh, d=16):
  q = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(b, t, kh, d)), jnp.float32) for _ in range(2))
  return q, k, v


CASES = {  # (b, t, heads, kv heads, causal, max documents, max padding, rate); t = 48: three 16-blocks
    "causal_packed": (2, 48, 2, 2, True, 4, 0, 0.1),
    "causal_padded": (2, 48, 2, 2, True, 2, 20, 0.3),
    "bidirectional_packed_padded": (2, 48, 2, 2, False, 3, 9, 0.1),
    "grouped_query_heads": (2, 32, 4, 2, True, 3, 5, 0.5),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_is_xla_attention_dropping_the_same_scores(case):
  """Output and q/k/v gradients equal XLA's attention under the same keep bits; padding queries
  give zeros and padding keys get no gradient; under a causal mask no query's output depends on a
  later key or value (every one of those gradients is exactly zero)."""
  b, t, h, kh, causal, docs, pad, rate = CASES[case]
  rng = np.random.default_rng(len(case))
  seg = jnp.asarray(random_packed(rng, b, t, max_docs=docs, pad=pad)[0])
  seg = seg.at[0, -pad:].set(0) if pad else seg
  q, k, v = _qkv(rng, b, t, h, kh)
  cot = jnp.asarray(rng.normal(size=(b, t, h, 16)), jnp.float32)
  seed = jnp.uint32(2024 + len(case))
  kernel = lambda q, k, v: fd.dropout_flash_attention(q, k, v, seg, causal=causal, scale=0.25, rate=rate, seed=seed)
  xla = lambda q, k, v: reference(q, k, v, seg, causal=causal, scale=0.25, rate=rate, seed=seed)
  grads = lambda fn: jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v) * cot), argnums=(0, 1, 2)))

  out = jax.jit(kernel)(q, k, v)
  np.testing.assert_allclose(out, xla(q, k, v), atol=2e-5, rtol=2e-5)
  assert not np.any(np.asarray(out)[~np.asarray(seg > 0)]), "padding queries must give zeros"
  (got_loss, got), (want_loss, want) = grads(kernel)(q, k, v), grads(xla)(q, k, v)
  np.testing.assert_allclose(got_loss, want_loss, atol=1e-4)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, atol=5e-5, rtol=5e-5)
  padding = ~np.asarray(seg > 0)
  assert not np.any(np.asarray(got[1])[padding]) and not np.any(np.asarray(got[2])[padding])
  if causal:  # query 20's output: the keys and values after it get exactly zero gradient
    at = lambda k, v: jnp.sum(kernel(q, k, v)[:, 20])
    d_k, d_v = jax.grad(at, argnums=(0, 1))(k, v)
    assert not np.any(np.asarray(d_k)[:, 21:]) and not np.any(np.asarray(d_v)[:, 21:])
    assert np.any(np.asarray(d_v)[:, :21])


def test_cross_attention_kernel_is_xla_attention_dropping_the_same_scores(monkeypatch):
  """A cross attention (48 decoder queries over 32 encoder keys, packed and padded on both sides):
  the kernel's output and q/k/v gradients equal XLA's attention over the `CrossMask` dropping the
  same scores, which is what a model's attention runs without the kernel
  (`tfx.nn.attention.xla_dropout_attention`); each query's output depends on the keys and
  values of its own document only; a decoder document with no encoder keys (id 3 here) and the
  padding queries give zeros and send no gradient anywhere."""
  rng = np.random.default_rng(5)
  b, t, s, h = 2, 48, 32, 2
  q_ids = jnp.asarray([[1] * 20 + [2] * 20 + [0] * 8, [1] * 30 + [3] * 10 + [0] * 8], jnp.int32)
  k_ids = jnp.asarray([[1] * 10 + [2] * 16 + [0] * 6, [1] * 28 + [0] * 4], jnp.int32)
  q = jnp.asarray(rng.normal(size=(b, t, h, 16)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(b, s, h, 16)), jnp.float32) for _ in range(2))
  cot = jnp.asarray(rng.normal(size=(b, t, h, 16)), jnp.float32)
  key, rate = jax.random.key(4242), 0.2
  seed = dropout.seed(key)
  kw = dict(causal=False, scale=0.25, rate=rate, seed=seed, key_segment_ids=k_ids)
  kernel = lambda q, k, v: fd.dropout_flash_attention(q, k, v, q_ids, **kw)
  xla = lambda q, k, v: reference(q, k, v, q_ids, **kw)
  model_path = lambda q, k, v: nn_attention.xla_dropout_attention(
      q, k, v, ops.rows_mask(q_ids, k_ids).dense(), None, 0.25, rate, key)
  grads = lambda fn: jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v) * cot), argnums=(0, 1, 2)))

  out, want = jax.jit(kernel)(q, k, v), xla(q, k, v)
  np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
  silent = ~np.asarray(jnp.any(ops.segment_mask(q_ids, k_ids), axis=-1))[:, 0]  # [b, t]: padding, document 3
  assert silent[1, 30:].all() and not np.any(np.asarray(out)[silent]) and np.any(np.asarray(out)[~silent])
  (got_loss, got), (want_loss, wanted) = grads(kernel)(q, k, v), grads(xla)(q, k, v)
  np.testing.assert_allclose(got_loss, want_loss, atol=1e-4)
  for g, w in zip(got, wanted):
    np.testing.assert_allclose(g, w, atol=5e-5, rtol=5e-5)
  assert not np.any(np.asarray(got[0])[silent])
  key_padding = ~np.asarray(k_ids > 0)
  assert not np.any(np.asarray(got[1])[key_padding]) and not np.any(np.asarray(got[2])[key_padding])
  # the model's XLA path (autodiff through tfx.ops.dropout) drops the same scores; traced for a TPU
  # it is XLA's attention with its own backward pass (XLA:TPU cannot compile autodiff's in a scanned
  # stack: test_bench_lower), the same numbers
  path_loss, path = grads(model_path)(q, k, v)
  np.testing.assert_allclose(path_loss, want_loss, atol=1e-4)
  for g, w in zip(path, wanted):
    np.testing.assert_allclose(g, w, atol=5e-5, rtol=5e-5)
  own, xla_attention = [], attn.softmax_attention
  monkeypatch.setattr(attn, "softmax_attention", lambda *a, **kw: own.append(kw) or xla_attention(*a, **kw))
  with target.lowering_for("tpu"):
    tpu_loss, tpu = grads(model_path)(q, k, v)
  assert [kw["dropout_rate"] for kw in own] == [rate]
  np.testing.assert_allclose(tpu_loss, want_loss, atol=1e-4)
  for g, w in zip(tpu, wanted):
    np.testing.assert_allclose(g, w, atol=5e-5, rtol=5e-5)
  # row 0's document 1 queries: the keys and values of document 2 get exactly zero gradient
  d_k, d_v = jax.grad(lambda k, v: jnp.sum(kernel(q, k, v)[0, :20]), argnums=(0, 1))(k, v)
  assert not np.any(np.asarray(d_k)[0, 10:]) and not np.any(np.asarray(d_v)[0, 10:])
  assert np.any(np.asarray(d_v)[0, :10])


def test_a_dense_mask_is_read_beside_the_scores(monkeypatch):
  """The two-stream encoder's form: 21 query-stream slots (padded to a block in the kernel) over 48
  keys under a permutation's dense mask [b, 1, t, s] and no bias, with a slot that has no key, as
  `fused_dropout_attention` sends it (the mask read block by block, every head's): the output and
  q, k, v gradients equal XLA's attention with that mask dropping the same scores; the keyless slot
  gives zeros and no gradient."""
  monkeypatch.setattr(attn, "_on_gpu", lambda: True)
  rng = np.random.default_rng(23)
  b, t, s, h, d = 2, 21, 48, 2, 16
  q = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(b, s, h, d)), jnp.float32) for _ in range(2))
  mask = jnp.asarray(rng.random((b, 1, t, s)) < 0.6).at[1, 0, 7].set(False)  # slot 7 of row 1: no key
  cot = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
  key, rate = jax.random.key(9), 0.2
  chosen = []
  kernel = lambda q, k, v: _logged(chosen, fd.fused_dropout_attention(q, k, v, mask, None, 0.25, rate, key, "pallas"))
  xla = lambda q, k, v: attn.softmax_attention(q, k, v, mask, None, 0.25, dropout_rate=rate, seed=dropout.seed(key))
  grads = lambda fn: jax.jit(jax.value_and_grad(lambda *a: jnp.sum(fn(*a) * cot), argnums=(0, 1, 2)))

  out = jax.jit(kernel)(q, k, v)
  assert chosen[0] == "GPU, a dense mask; dropout 0.2 drawn in the kernel"
  np.testing.assert_allclose(out, xla(q, k, v), atol=2e-5, rtol=2e-5)
  assert not np.any(np.asarray(out)[1, 7])
  (got_loss, got), (want_loss, want) = grads(kernel)(q, k, v), grads(xla)(q, k, v)
  np.testing.assert_allclose(got_loss, want_loss, atol=1e-4)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, atol=5e-5, rtol=5e-5)
  assert not np.any(np.asarray(got[0])[1, 7])


def _logged(chosen: list, result):
  out, why = result
  chosen.append(why)
  return out


@pytest.mark.parametrize("form", ["relative_slots", "causal_packed"])
def test_a_bias_of_every_row_and_head_carries_the_mask(form):
  """A bias [b, h, t, s] on the scores, beside the mask it carries (`fd.score_bias`): XLNet's form
  (21 query-stream slots, padded to a block in the kernel, over 48 keys; its relative terms as the
  bias, a permutation's dense mask; a slot with no key) and a causal self-attention over packed
  rows. The output and the gradients of q, k, v and the bias equal XLA's attention with that mask
  and bias dropping the same scores (`softmax_attention`, what XLNet runs without the kernel); a
  query with no key gives zeros and sends no gradient; a masked score's bias gets none either."""
  rng = np.random.default_rng(21)
  b, h, d = 2, 2, 16
  t, s = (21, 48) if form == "relative_slots" else (48, 48)
  q = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(b, s, h, d)), jnp.float32) for _ in range(2))
  bias = jnp.asarray(rng.normal(size=(b, h, t, s)), jnp.float32)
  cot = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
  seed, rate = dropout.seed(jax.random.key(8)), 0.2
  if form == "relative_slots":
    mask = jnp.asarray(rng.random((b, 1, t, s)) < 0.6).at[0, 0, 3].set(False)  # slot 3 of row 0: no key
    ids = {"segment_ids": jnp.ones((b, t), jnp.int32), "key_segment_ids": jnp.ones((b, s), jnp.int32),
           "causal": False}
  else:
    seg = jnp.asarray(random_packed(rng, b, t, max_docs=3, pad=7)[0])
    mask, ids = ops.SegmentMask(seg, causal=True).dense(), {"segment_ids": seg, "causal": True}
  kernel = lambda q, k, v, bias: fd.dropout_flash_attention(q, k, v, **ids, scale=0.25, rate=rate, seed=seed,
                                                            scores=fd.score_bias(bias, mask))
  xla = lambda q, k, v, bias: attn.softmax_attention(q, k, v, mask, bias, 0.25, dropout_rate=rate, seed=seed)
  grads = lambda fn: jax.jit(jax.value_and_grad(lambda *a: jnp.sum(fn(*a) * cot), argnums=(0, 1, 2, 3)))

  out = jax.jit(kernel)(q, k, v, bias)
  np.testing.assert_allclose(out, xla(q, k, v, bias), atol=2e-5, rtol=2e-5)
  silent = ~np.asarray(jnp.any(mask, axis=-1))[:, 0]  # [b, t]
  assert silent.any() and not np.any(np.asarray(out)[silent])
  (got_loss, got), (want_loss, want) = grads(kernel)(q, k, v, bias), grads(xla)(q, k, v, bias)
  np.testing.assert_allclose(got_loss, want_loss, atol=1e-4)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, atol=5e-5, rtol=5e-5)
  assert not np.any(np.asarray(got[0])[silent])
  assert not np.any(np.asarray(got[3])[~np.broadcast_to(np.asarray(mask), bias.shape)])
  with pytest.raises(ValueError, match=r"scores must be a bias \[b, h, t, s\]"):
    fd.dropout_flash_attention(q, k, v, **ids, scale=0.25, rate=rate, seed=seed, scores=bias[:1])


@pytest.mark.parametrize("causal", [True, False])
def test_a_stacked_projection_is_read_and_written_in_place(causal):
  """A self-attention's fused projection [b, t, h, 3, d] (slots k, v, q) handed to the kernels
  whole, with or without its bias [h, 3, d] (added by the kernels as they read): the output and
  the gradients of the projection and the bias are those of q, k and v passed apart after the
  bias's add (the kernels read the same blocks and write the same gradients, into one array: the
  dQ kernel into the dK / dV kernel's output, aliased; the bias's gradient summed in float32)."""
  rng = np.random.default_rng(21)
  seg = jnp.asarray(random_packed(rng, 2, 48, max_docs=3, pad=7)[0])
  y = jnp.asarray(rng.normal(size=(2, 48, 2, 3, 16)), jnp.float32)
  bias = jnp.asarray(rng.normal(size=(2, 3, 16)), jnp.float32)
  cot = jnp.asarray(rng.normal(size=(2, 48, 2, 16)), jnp.float32)
  kw = dict(causal=causal, scale=0.25, rate=0.2, seed=jnp.uint32(8))
  slots = lambda x: [x[:, :, :, fd.STACKED.index(name)] for name in ("q", "k", "v")]
  apart = lambda y, b: fd.dropout_flash_attention(*slots(y + b), seg, **kw)
  for whole in (lambda y, b: fd.dropout_flash_attention(*slots(y + b), seg, qkv=y + b, **kw),
                lambda y, b: fd.dropout_flash_attention(*slots(y + b), seg, qkv=y, qkv_bias=b, **kw)):
    grads = lambda f: jax.value_and_grad(lambda y, b: jnp.sum(f(y, b) * cot), argnums=(0, 1))(y, bias)
    (got, got_grads), (want, want_grads) = grads(whole), grads(apart)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-6)
    for g, w in zip(got_grads, want_grads):
      np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)
  with pytest.raises(ValueError, match="stacked"):
    fd.dropout_flash_attention(*slots(y), seg, qkv=y[:, :16], **kw)
  with pytest.raises(ValueError, match="bias"):
    fd.dropout_flash_attention(*slots(y), seg, qkv=y, qkv_bias=bias[:1], **kw)


def test_rate_zero_is_attention_without_dropout():
  rng = np.random.default_rng(3)
  seg = jnp.asarray(random_packed(rng, 2, 32, max_docs=3, pad=4)[0])
  q, k, v = _qkv(rng, 2, 32, 2, 2)
  got = fd.dropout_flash_attention(q, k, v, seg, causal=True, scale=0.25, rate=0.0, seed=jnp.uint32(1))
  want = ops.dot_product_attention(q, k, v, mask=ops.SegmentMask(seg, True).dense(), scale=0.25, implementation="xla")
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("rate", [0.1, 0.5])
def test_keep_bits_are_fair_and_independent(rate):
  """Over 2**20 scores: the kept share is P(keep) within 5 standard errors, and so is the share of
  pairs kept together at neighbouring queries, neighbouring keys, the next head, the next row and
  the next seed (independent draws: P(keep)**2); one seed's mask is the same array again."""
  p = fd.keep_probability(rate)
  assert abs(p - (1 - rate)) < 2**-22
  keep = np.asarray(dropout.keep_bits(jnp.uint32(7), (4, 4, 256, 256), rate))  # [b, h, t, s]
  n = keep.size
  assert abs(keep.mean() - p) < 5 * np.sqrt(p * (1 - p) / n), keep.mean()
  other = np.asarray(dropout.keep_bits(jnp.uint32(8), (4, 4, 256, 256), rate))
  pairs = {"query": (keep[:, :, 1:], keep[:, :, :-1]), "key": (keep[..., 1:], keep[..., :-1]),
           "head": (keep[:, 1:], keep[:, :-1]), "row": (keep[1:], keep[:-1]), "seed": (keep, other)}
  for name, (a, b) in pairs.items():
    both = np.mean(a & b)
    assert abs(both - p * p) < 5 * np.sqrt(p * p * (1 - p * p) / a.size), (name, both, p * p)
  np.testing.assert_array_equal(keep, dropout.keep_bits(jnp.uint32(7), (4, 4, 256, 256), rate))


def test_the_draw_is_the_same_for_every_block_size():
  """The forward and backward kernels at 16-, 32- and 64-token blocks give the same output and
  gradients (bitwise for the output of blocks that see the same keys in the same order: compared
  to float32 rounding here), as the keep bits come from global positions, not from blocks; so do
  a cross attention's (64 queries over 32 keys) with query and key blocks of different lengths,
  with a bias on the scores (theirs, and its gradient, the same too) and with a dense mask."""
  rng = np.random.default_rng(11)
  seg = jnp.asarray(random_packed(rng, 2, 64, max_docs=3, pad=6)[0])
  kv_seg = jnp.asarray(random_packed(rng, 2, 32, max_docs=3, pad=4)[0])
  q, k, v = _qkv(rng, 2, 64, 2, 2)
  bias = jnp.asarray(rng.normal(size=(2, 2, 64, 32)), jnp.float32)
  seeds = jnp.asarray([99, 0, 0, 0], jnp.int32)
  cases = {  # (causal, key ids, key length, score bias): (block_q, block_k, back_q, back_k) each
      "causal": (True, seg, 64, None, [(16, 16, 16, 16), (32, 32, 32, 32), (64, 64, 64, 64)]),
      "cross": (False, kv_seg, 32, None, [(16, 16, 16, 16), (64, 32, 32, 16), (32, 16, 16, 32)]),
      "cross_biased": (False, kv_seg, 32, bias, [(16, 16, 16, 16), (64, 32, 32, 16), (32, 16, 16, 32)]),
      "cross_masked": (False, kv_seg, 32, None, [(16, 16, 16, 16), (64, 32, 32, 16), (32, 16, 16, 32)]),
  }
  dense = jnp.asarray(rng.random((2, 64, 32)) < 0.7, jnp.int8)
  for name, (causal, k_ids, s, sb, blocks) in cases.items():
    results = []
    mask = dense if name == "cross_masked" else None
    for block_q, block_k, back_q, back_k in blocks:
      static = fdk.Static(scale=0.25, causal=causal, rate=0.2, block_q=block_q, block_k=block_k, back_q=back_q,
                          back_k=back_k, interpret=True, score_bias=sb is not None, dense_mask=mask is not None)
      attend = lambda q, k, v, sb, static=static, k_ids=k_ids, mask=mask: fdk.attend(q, k, v, seg, k_ids, sb, mask,
                                                                                      seeds, static)
      args = (q, k[:, :s], v[:, :s], sb)
      grads = jax.grad(lambda *a: jnp.sum(attend(*a) ** 2), argnums=(0, 1, 2, 3) if sb is not None else (0, 1, 2))
      results.append([attend(*args), *grads(*args)])
    for other in results[1:]:
      for got, want in zip(other, results[0]):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


_SHARDED_SCRIPT = r"""
import json, os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
import jax, jax.numpy as jnp, ml_collections, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from tfx import parallel
from tfx.ops import dropout
from tfx.ops import flash_dropout as fd

mesh = parallel.make_mesh(ml_collections.ConfigDict(dict(data=2, fsdp=2, tensor=2)))
rng = np.random.default_rng(0)
t = 32
q, k, v = (jnp.asarray(rng.normal(size=(4, t, 4, 16)), jnp.float32) for _ in range(3))
seg = jnp.asarray(np.repeat([[1] * 20 + [2] * 8 + [0] * 4], 4, 0), jnp.int32)
seed = jnp.uint32(31)
kv_seg = jnp.asarray(np.repeat([[1] * 10 + [2] * 4 + [0] * 2], 4, 0), jnp.int32)  # a cross attention's keys
attend = lambda q, k, v, s: fd.dropout_flash_attention(q, k, v, s, causal=True, scale=0.25, rate=0.3, seed=seed)
cross = lambda q, k, v, s: fd.dropout_flash_attention(q, k[:, :16], v[:, :16], s, causal=False, scale=0.25, rate=0.3,
                                                      seed=seed, key_segment_ids=kv_seg)
score_bias = jnp.asarray(rng.normal(size=(4, 4, 27, 16)), jnp.float32)
dense = jnp.asarray(rng.random((4, 1, 27, 16)) < 0.7)
def biased(q, k, v, s):  # 27 queries (padded to a block) over 16 keys, a bias of every row and head carrying a mask
  return fd.dropout_flash_attention(q[:, :27], k[:, :16], v[:, :16], jnp.ones((4, 27), jnp.int32), causal=False,
                                    scale=0.25, rate=0.3, seed=seed, key_segment_ids=jnp.ones((4, 16), jnp.int32),
                                    scores=fd.score_bias(score_bias, dense))
def masked(q, k, v, s):  # the same queries over 16 keys under the dense mask alone, every head's
  return fd.dropout_flash_attention(q[:, :27], k[:, :16], v[:, :16], jnp.ones((4, 27), jnp.int32), causal=False,
                                    scale=0.25, rate=0.3, seed=seed, key_segment_ids=jnp.ones((4, 16), jnp.int32),
                                    mask=dense[:, 0])
def stacked(q, k, v, s):  # slots k, v, q, and a bias [h, 3, d] taken from row 0 (its gradient: every shard's)
  qkv = jnp.stack([k, v, q], axis=3)
  bias = qkv[0, 0] * 0.5
  return fd.dropout_flash_attention(q, k, v, s, causal=True, scale=0.25, rate=0.3, seed=seed, qkv=qkv - bias,
                                    qkv_bias=bias)
diffs, gathers = [], 0
for fn in (attend, cross, biased, masked, stacked):
  loss = lambda q, k, v, s: jnp.sum(fn(q, k, v, s) ** 2)
  want = [fn(q, k, v, seg), *jax.grad(loss, argnums=(0, 1, 2))(q, k, v, seg)]
  with parallel.context(mesh):
    heads = NamedSharding(mesh, P(parallel.BATCH_AXES, None, "tensor", None))
    args = [jax.device_put(x, heads) for x in (q, k, v)] + [jax.device_put(seg, parallel.batch_sharding(mesh))]
    forward = jax.jit(fn)
    got = [forward(*args), *jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)]
    gathers += forward.lower(*args).compile().as_text().count("all-gather(")
  diffs.append([float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(got, want)])
print(json.dumps({"diff": diffs, "gathers": gathers, "out_sharding": str(got[0].sharding.spec)}))
"""


def test_a_mesh_draws_the_one_device_mask(tmp_path):
  """On 8 fake devices (rows over 2x2 data x FSDP, heads over 2 tensor shards) each device draws
  the keep bits of its global rows and heads, in a causal self-attention (q, k and v apart, and as
  a stacked projection with its bias, whose gradient sums every row shard's), in a cross
  attention (32 queries over 16 keys), in one with a bias of every row and head (27 queries, cut
  with the rows and heads) and in one with a dense mask (cut with the rows): the output equals one
  device's bitwise (a shard drawing another's bits would be off by whole probabilities), the
  gradients to float32 rounding (delta = rowsum(dO * O) is summed by XLA in another order on a
  shard), with no all-gather in the forward pass."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  proc = subprocess.run([sys.executable, "-c", _SHARDED_SCRIPT], env=env, capture_output=True, text=True, timeout=600,
                        cwd=str(tmp_path))
  assert proc.returncode == 0, proc.stderr[-4000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  assert all(diff[0] == 0.0 and max(diff) < 1e-5 for diff in out["diff"]), out
  assert out["gathers"] == 0, out
  assert out["out_sharding"] == "P(('data', 'fsdp'), None, 'tensor', None)", out


@pytest.mark.parametrize("family", ["encoder", "encoder_rows", "encoder_decoder"])
def test_a_model_draws_its_dropout_in_the_kernel(monkeypatch, family):
  """A BERT-style encoder (also with masked LM's rows: the last layer's queries are 16 selected
  tokens over all 32 keys) and a BART-style encoder-decoder (its decoder's cross attention over
  packed rows: 32 decoder tokens over 48 encoder tokens) with attention dropout and
  model.attention=pallas (a GPU faked for the choice) run the kernel at every self- and cross
  attention layer, logged with its reason; their training-mode logits and gradients equal those of
  the same model whose kernel is replaced by the XLA reference drawing the same keep bits (the
  step's seed reaches the kernel as it reaches the reference), and those of the model on XLA's
  attention (no GPU: what 'auto' runs), which draws the same bits since stop 64; and two dropout
  keys give different logits."""
  monkeypatch.setattr(attn, "_on_gpu", lambda: True)
  length, vocab = 32, 97
  kwargs = {}
  cfg = tiny_config(f"--config.model.family={family.removesuffix('_rows')}", "--config.model.num_layers=2",
                    "--config.model.d_model=32", "--config.model.d_ff=64", "--config.model.num_heads=2",
                    "--config.model.attention=pallas", "--config.model.attention_dropout=0.2",
                    "--config.model.num_decoder_layers=2")
  rng = np.random.default_rng(7)
  packed = lambda n: [jnp.asarray(a) for a in random_packed(rng, 2, n, max_docs=3, pad=6)]  # ids, positions
  tokens = lambda n: jnp.asarray(rng.integers(4, vocab, (2, n)), jnp.int32)
  seg, pos = packed(length)
  inputs = (tokens(length), seg, pos)
  if family == "encoder_decoder":  # the decoder's documents are the encoder's (ids 1.. in both)
    enc_seg, enc_pos = packed(48)
    seg = jnp.minimum(seg, jnp.max(enc_seg, axis=1, keepdims=True))
    inputs = (tokens(48), enc_seg, enc_pos, inputs[0], seg, pos)
  if family == "encoder_rows":  # 16 of the 32 positions, in no order
    kwargs["rows"] = jnp.asarray(np.stack([rng.permutation(length)[:16] for _ in range(2)]), jnp.int32)
    seg = jnp.take_along_axis(seg, kwargs["rows"], axis=1)
  model = build_model(cfg.model, vocab_size=vocab, max_length=48)
  params = nn.unbox(model.init(jax.random.key(0), **type(model).init_inputs(1, length))["params"])
  cot = jnp.asarray(rng.normal(size=(*seg.shape, vocab)), jnp.float32) * (seg > 0)[..., None]

  def run(key):
    def f(p):
      out = model.apply({"params": p}, *inputs, train=True, rngs={"dropout": key}, **kwargs)
      logits = out[0] if isinstance(out, tuple) else out
      return jnp.sum(logits.astype(jnp.float32) * cot), logits

    return jax.jit(jax.value_and_grad(f, has_aux=True))(params)

  with attn.recorded_choices() as chosen:
    (_, got), got_grads = run(jax.random.key(1))
  assert set(chosen) == {("pallas", "GPU, segment ids; dropout 0.2 drawn in the kernel")}, chosen
  (_, other), _ = run(jax.random.key(2))
  assert np.mean(np.abs(np.asarray(got - other))) > 1e-3

  # the reference on the slices the kernel would read (q, k and v with their bias already added)
  monkeypatch.setattr(fd, "dropout_flash_attention",
                      lambda *args, qkv=None, qkv_bias=None, **kwargs: reference(*args, **kwargs))
  (_, want), want_grads = run(jax.random.key(1))
  monkeypatch.setattr(attn, "_on_gpu", lambda: False)
  with attn.recorded_choices() as chosen:
    (_, xla), xla_grads = run(jax.random.key(1))
  assert {impl for impl, _ in chosen} == {"xla"}, chosen
  for logits, grads in ((want, want_grads), (xla, xla_grads)):
    np.testing.assert_allclose(got, logits, atol=2e-5, rtol=1e-5)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got_grads), jax.tree.leaves(grads)):
      np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-4, err_msg=jax.tree_util.keystr(path))


def test_what_the_kernel_refuses_goes_to_xla(monkeypatch):
  """Off a GPU, for 'auto', a bias shared by the rows, a float16 bias carrying a mask, a dense mask
  of another shape or an odd head dim the caller gets no output and a reason (it then runs XLA's
  attention with dropout); a dense mask, a bias of every row and head beside it or beside a
  family's segment ids run the kernel."""
  rng = np.random.default_rng(1)
  seg = jnp.asarray(random_packed(rng, 2, 32, max_docs=2, pad=0)[0])
  q, k, v = _qkv(rng, 2, 32, 2, 2)
  key = jax.random.key(0)
  run = lambda impl, mask=ops.SegmentMask(seg, True), bias=None, q=q, k=k, v=v: fd.fused_dropout_attention(
      q, k, v, mask, bias, 0.25, 0.1, key, impl)
  assert run("pallas") == (None, "model.attention_dropout=0.1: Pallas dropout attention needs a GPU: no GPU (backend cpu)")
  monkeypatch.setattr(attn, "_on_gpu", lambda: True)
  assert run("auto")[0] is None and "model.attention=pallas" in run("auto")[1]
  dense = ops.SegmentMask(seg, True).dense()
  # a bias of every row and head carries a dense mask (XLNet's relative terms); one shared by the
  # rows (T5's) or in float16 does not
  assert "every row and head" in run("pallas", bias=jnp.zeros((1, 2, 32, 32)))[1]
  assert "every row and head" in run("pallas", mask=dense, bias=jnp.zeros((1, 2, 32, 32)))[1]
  assert "float16" in run("pallas", mask=dense, bias=jnp.zeros((2, 2, 32, 32), jnp.float16))[1]
  out, why = run("pallas", mask=dense, bias=jnp.zeros((2, 2, 32, 32)))
  assert out.shape == q.shape and why == ("GPU, a bias of every row and head carrying the mask; dropout 0.1 drawn in "
                                          "the kernel")
  # a dense mask alone is read beside the scores; a bias beside segment ids is read as it is
  assert run("pallas", mask=dense)[1] == "GPU, a dense mask; dropout 0.1 drawn in the kernel"
  assert "dense mask must be" in run("pallas", mask=dense[:, :, :16])[1]
  assert run("pallas", bias=jnp.zeros((2, 2, 32, 32)))[1] == ("GPU, segment ids, a bias of every row and head; "
                                                              "dropout 0.1 drawn in the kernel")
  out, why = run("pallas", mask=None, q=q[:, :21])  # no mask: 21 queries over every key, padded to a block
  assert out.shape == (2, 21, 2, 16) and why == "GPU, no mask; dropout 0.1 drawn in the kernel"
  odd = [x[..., :12] for x in (q, k, v)]
  assert "power of two" in run("pallas", q=odd[0], k=odd[1], v=odd[2])[1]
  out, why = run("pallas")
  assert out.shape == q.shape and why == "GPU, segment ids; dropout 0.1 drawn in the kernel"


def test_bf16_inputs_stay_within_bf16_rounding_of_the_float32_reference():
  """In bf16 (the configs' GPU dtype) the kernel's output and gradients are within bf16 rounding
  of the float32 reference dropping the same scores (the kernel keeps its softmax statistics and
  accumulators in float32)."""
  rng = np.random.default_rng(9)
  seg = jnp.asarray(random_packed(rng, 2, 64, max_docs=3, pad=8)[0])
  q, k, v = _qkv(rng, 2, 64, 2, 2, d=32)
  cot = jnp.asarray(rng.normal(size=(2, 64, 2, 32)), jnp.float32)
  seed = jnp.uint32(77)
  kw = dict(causal=False, scale=32**-0.5, rate=0.1, seed=seed)
  grads = lambda fn, *x: jax.jit(jax.value_and_grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * cot),
                                                    argnums=(0, 1, 2)))(*x)
  bf16 = [x.astype(jnp.bfloat16) for x in (q, k, v)]
  _, got = grads(lambda q, k, v: fd.dropout_flash_attention(q, k, v, seg, **kw), *bf16)
  _, want = grads(lambda q, k, v: reference(q, k, v, seg, **kw), *(x.astype(jnp.float32) for x in bf16))
  out = fd.dropout_flash_attention(*bf16, seg, **kw).astype(jnp.float32)
  for g, w in zip([out, *got], [reference(*(x.astype(jnp.float32) for x in bf16), seg, **kw), *want]):
    g = np.asarray(g, np.float32)
    assert np.max(np.abs(g - w)) <= 3e-2 * np.max(np.abs(w)), np.max(np.abs(g - w)) / np.max(np.abs(w))
