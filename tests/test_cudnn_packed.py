"""cuDNN's packed layout for packed rows (`model.packed_runs`): each run of one segment id a
sequence of its own, read from lengths and offsets instead of a [b, 1, t, t] mask.

cuDNN runs only on a GPU: here its two calls are replaced by float32 functions that compute what
JAX documents them to compute (the packed call from the runs' lengths and offsets alone), and the
step is lowered for a GPU to see the kernels it would call. On a GPU, `python -m
tfx.check_attention` checks the kernels themselves (its `*_runs` cases).
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfx import bench_lower
from tfx.ops import attention, masks, target

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
fused = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")  # JAX's private module


def _runs_by_loop(ids: np.ndarray, max_runs: int):
  """segment_runs' lengths, offsets and fits, one row at a time."""
  b, t = ids.shape
  lengths, offsets = np.full((b, max_runs), -1), np.full((b, max_runs + 1), -1)
  fits = True
  for r in range(b):
    starts = [i for i in range(t) if i == 0 or ids[r, i] != ids[r, i - 1]]
    ends = starts[1:] + [t]
    fits &= len(starts) <= max_runs
    documents = [ids[r, i] for i in starts if ids[r, i] != 0]
    fits &= documents == sorted(set(documents))  # one run per document, numbered along the row
    for m, (start, end) in enumerate(zip(starts[:max_runs], ends)):
      lengths[r, m], offsets[r, m] = end - start, start
  return lengths, offsets, fits


@pytest.mark.parametrize("max_runs", [1, 3, 5])
def test_segment_runs_are_the_rows_runs_of_one_id(max_runs):
  rows = [[1, 1, 1, 2, 2, 0, 0, 0], [1, 0, 2, 2, 2, 2, 3, 3], [4, 4, 4, 4, 4, 4, 4, 4], [0] * 8,
          [1, 2, 3, 4, 5, 0, 6, 0], [1, 1, 2, 1, 1, 0, 0, 0], [2, 2, 1, 1, 0, 0, 0, 0]]
  rng = np.random.default_rng(0)
  for _ in range(20):  # packed rows as tfx's packing makes them: documents numbered 1, 2, ... then padding
    cuts = np.sort(rng.choice(np.arange(1, 8), size=rng.integers(0, 4), replace=False))
    row = np.searchsorted(cuts, np.arange(8), side="right") + 1
    rows.append(np.where(np.arange(8) < rng.integers(1, 9), row, 0).tolist())
  for first in range(0, len(rows), 3):  # batches of three rows: `fits` holds for a whole batch
    ids = np.asarray(rows[first:first + 3], np.int32)
    runs = masks.segment_runs(jnp.asarray(ids), max_runs)
    lengths, offsets, fits = _runs_by_loop(ids, max_runs)
    np.testing.assert_array_equal(runs.lengths, lengths)
    np.testing.assert_array_equal(runs.offsets, offsets)
    assert bool(runs.fits) == fits, ids


def _fake_packed(q, k, v, *, q_seqlen, kv_seqlen, q_offsets, kv_offsets, scale, mask_type, **unused):
  """What cuDNN's packed layout computes, in float32: sequence m of row r is positions offsets[r,
  m] .. offsets[r, m] + seqlen[r, m] - 1 (-1: no sequence); a query attends the keys of its own
  sequence (PADDING_CAUSAL: those at or before it); a query in no sequence gives 0."""
  t = q.shape[1]
  pos = jnp.arange(t)

  def member(offsets, lengths):  # [b, m, t]
    start, n = offsets[:, :-1, None], lengths[:, :, None]
    return (start >= 0) & (n > 0) & (pos >= start) & (pos < start + n)

  same = jnp.einsum("bmt,bms->bts", member(q_offsets, q_seqlen).astype(jnp.float32),
                    member(kv_offsets, kv_seqlen).astype(jnp.float32)) > 0  # [b, t, s]
  if mask_type == fused.MaskType.PADDING_CAUSAL:
    same = same & (pos[:, None] >= pos[None, :])
  out = attention.reference_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                                      mask=same[:, None], scale=scale)
  return jnp.where(jnp.any(same, -1)[:, :, None, None], out, 0.0).astype(q.dtype)


def _fake_masked(q, k, v, *, mask, scale, is_causal=False, **unused):
  """cuDNN with a dense mask, in float32 (`is_causal` on top of the mask)."""
  mask = mask & masks.causal_mask(q.shape[1], k.shape[1]) if is_causal else mask
  f32 = lambda x: x.astype(jnp.float32)
  return attention.reference_attention(f32(q), f32(k), f32(v), mask=mask, scale=scale).astype(q.dtype)


def _poisoned(fake):
  """`fake`'s result made NaN: where it shows up, the branch that calls `fake` ran."""
  return lambda *a, **kw: fake(*a, **kw) * jnp.nan


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("max_runs, packed_runs", [(4, True), (2, False)])
def test_packed_rows_attend_as_their_mask(monkeypatch, causal, max_runs, packed_runs):
  # Rows of at most 4 runs (padding in the middle and at the end, a row of padding alone): with 4
  # the packed kernel runs, with 2 the batch falls back to the mask. The kernel that must not run
  # returns NaN, so the result shows which one did; outputs and q, k, v gradients are the mask's.
  seg = jnp.asarray([[1, 1, 1, 2, 2, 0, 0, 0], [1, 0, 2, 2, 2, 2, 3, 3], [1] * 8, [0] * 8])  # [b, t]
  packed, masked = _fake_packed, _fake_masked
  if packed_runs:
    masked = _poisoned(masked)
  else:
    packed = _poisoned(packed)
  monkeypatch.setattr(fused, "dot_product_attention", packed)
  monkeypatch.setattr(jax.nn, "dot_product_attention", masked)
  mask = masks.self_attention_mask(seg, causal=causal, implementation="auto", packed_runs=max_runs)
  keys = jax.random.split(jax.random.key(1), 4)
  q, k, v = (jax.random.normal(key, (4, 8, 2, 64), jnp.bfloat16) for key in keys[:3])
  cotangent = jax.random.normal(keys[3], (4, 8, 2, 64))

  def loss(q, k, v):
    return jnp.sum(attention.dot_product_attention(q, k, v, mask=mask).astype(jnp.float32) * cotangent)

  with target.lowering_for("gpu"), attention.recorded_choices() as chosen:
    out = attention.dot_product_attention(q, k, v, mask=mask)
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  assert [impl for impl, _ in chosen][0] == "cudnn"
  assert f"packed rows: at most {max_runs} runs a row, else the mask" in chosen[0][1]
  pad = seg == 0

  def reference(q, k, v):  # float32, the padding rows zeroed
    out = attention.reference_attention(q, k, v, mask=masks.SegmentMask(seg, causal).dense(), scale=64 ** -0.5)
    return jnp.where(pad[:, :, None, None], 0.0, out)

  want_out, pull = jax.vjp(reference, *(x.astype(jnp.float32) for x in (q, k, v)))
  for got, want in zip((out, *grads), (want_out, *pull(cotangent))):
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0.05, atol=0.05)
  assert not bool(jnp.any(out[pad])) and not any(bool(jnp.any(g[pad])) for g in grads)


def test_an_odd_length_or_a_bias_attends_with_the_mask(monkeypatch):
  # cuDNN's backward pass wants even lengths beside a mask: an odd packed row is padded by one
  # padding position and goes with the mask (its runs were counted for the odd row); so does a
  # row with a bias of the model's
  calls = []
  monkeypatch.setattr(fused, "dot_product_attention", lambda *a, **kw: calls.append("packed"))
  monkeypatch.setattr(jax.nn, "dot_product_attention", lambda q, k, v, **kw: calls.append("mask") or q)
  q = jnp.zeros((2, 8, 2, 64), jnp.bfloat16)
  for seg, bias in ((jnp.ones((2, 7), jnp.int32), None), (jnp.ones((2, 8), jnp.int32), jnp.zeros((1, 2, 8, 8)))):
    mask = masks.self_attention_mask(seg, causal=True, implementation="auto", packed_runs=2)
    with target.lowering_for("gpu"), attention.recorded_choices() as chosen:
      attention.dot_product_attention(q[:, :seg.shape[1]], q[:, :seg.shape[1]], q[:, :seg.shape[1]], mask=mask,
                                      bias=bias)
    assert chosen == [("cudnn", "GPU, bfloat16")]
  assert calls == ["mask", "mask"]


def test_a_gpt2_step_lowers_both_kernels_with_the_runs():
  (result,) = bench_lower.lower_suite(ROOT, "gpu", tiny=True, batch_per_device=2, only=("gpt2_small",),
                                      overrides=("model.packed_runs=4",))
  assert result["error"] is None, result["error"]
  assert result["attention"] == ["cudnn (GPU, bfloat16; packed rows: at most 4 runs a row, else the mask)"]
  # the packed kernels and, for a batch whose rows do not fit, the masked ones
  assert result["kernel_calls"] == {"cudnn forward": 2, "cudnn backward": 2}
