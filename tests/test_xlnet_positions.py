"""XLNet's relative positions (tfx/nn/xlnet.py): the score-by-distance table and its per-block and
per-row windows against the gather by distance index and against Transformer-XL's rel-shift, with
their gradients; the sinusoid's layout. Small dims, float32."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfx.nn import xlnet as X

E, H = 16, 2  # d_model and heads of tests/test_xlnet_model.py's small XLNet

# ============================================================================ positions


@pytest.mark.parametrize("t, mlen, batched, block", [
    (5, 0, False, None), (5, 3, True, None), (1, 4, False, None), (7, 16, True, None),  # one block
    (8, 3, False, 2), (8, 0, True, 4), (6, 5, False, 3), (6, 2, True, 1), (128, 0, False, None),
    (128, 5, True, None), (8, 3, 2, 2), (128, 5, 2, None)])
def test_positional_scores_are_the_gather_by_distance_index_with_its_gradients(t, mlen, batched, block):
  """The blocked pad-and-reshape shift reads what a gather by `distance_table`'s index reads, and
  its gradients (a pad and slices, where the gather's is a scatter-add) are the gather's, for one
  block of queries and for several (each against its own window of distances); k_r shared by the
  batch, one per row (batched) or one per half of the batch (2: bi_data's)."""
  b, d = 4, 4
  p = mlen + 2 * t - 1
  groups = {False: 1, True: b}.get(batched, batched)
  kq, kr, kc = jax.random.split(jax.random.key(1), 3)
  q_r = jax.random.normal(kq, (b, t, H, d))
  k_r = jax.random.normal(kr, (groups, p, H, d))
  cot = jax.random.normal(kc, (b, H, t, mlen + t))
  _, index = X.distance_table(t, mlen)

  def gathered(q_r, k_r):
    table = jnp.einsum("bthd,bphd->bhtp", q_r, jnp.repeat(k_r, b // groups, axis=0))  # [b, h, t, p]
    return jnp.take_along_axis(table, jnp.broadcast_to(index, (b, H) + index.shape), axis=-1)

  blocked = lambda q, k: X.positional_scores(q, k, block)
  np.testing.assert_allclose(blocked(q_r, k_r), gathered(q_r, k_r), rtol=1e-6, atol=1e-6)
  grads = [jax.grad(lambda q, k: jnp.sum(f(q, k) * cot), argnums=(0, 1))(q_r, k_r) for f in (blocked, gathered)]
  for ours, want in zip(*grads):  # sums in another order: within a few ulps of the largest entry
    np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(want).max())))
  scatter = jax.jit(jax.grad(lambda q: jnp.sum(blocked(q, k_r)))).lower(q_r).as_text()
  assert "scatter" not in scatter and "gather" not in scatter


@pytest.mark.parametrize("t, mlen, batched, n", [(5, 0, False, 2), (5, 3, True, 3), (1, 4, False, 1),
                                                (9, 6, True, 4), (9, 0, False, 9), (9, 6, 2, 4)])
def test_scores_at_rows_are_the_whole_tables_rows_with_its_gradients(t, mlen, batched, n):
  """`row_positional_scores` at any positions (the first and last among them) reads the rows of the whole
  sequence's `positional_scores` there, with the same gradients (k_r shared, per row, per half); its
  window's gradient is a gather, not a scatter-add."""
  b, d = 4, 4
  p, s = mlen + 2 * t - 1, mlen + t
  kq, kr, kc, kp = jax.random.split(jax.random.key(2), 4)
  q_r = jax.random.normal(kq, (b, n, H, d))
  k_r = jax.random.normal(kr, ({False: 1, True: b}.get(batched, batched), p, H, d))
  cot = jax.random.normal(kc, (b, H, n, s))
  rng = np.random.default_rng(t + n)
  rows = jnp.asarray(np.stack([rng.permutation(t)[:n] for _ in range(b)]))  # [b, n], distinct in a row
  rows = rows.at[0, 0].set(t - 1) if t - 1 not in np.asarray(rows[0]) else rows

  def whole(q_r, k_r):  # the slots' queries put at their positions, the full table's rows read back
    placed = jnp.zeros((b, t, H, d)).at[jnp.arange(b)[:, None], rows].set(q_r)
    table = X.positional_scores(placed, k_r, t)  # [b, h, t, s]
    return jnp.take_along_axis(table, rows[:, None, :, None], axis=2)

  at_rows = lambda q, k: X.row_positional_scores(q, k, rows, s)
  np.testing.assert_allclose(at_rows(q_r, k_r), whole(q_r, k_r), rtol=1e-6, atol=1e-6)
  grads = [jax.grad(lambda q, k: jnp.sum(f(q, k) * cot), argnums=(0, 1))(q_r, k_r) for f in (at_rows, whole)]
  for ours, want in zip(*grads):  # sums in another order: within a few ulps of the largest entry
    np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(want).max())))
  window_grad = jax.jit(jax.grad(lambda q: jnp.sum(at_rows(q, k_r) * cot))).lower(q_r).as_text()
  assert "scatter" not in window_grad


def test_row_windows_index_by_row_start_alone():
  """`row_windows` cuts each row's window out, and its gradient puts it back (zeros elsewhere), with
  gathers whose indices are the rows' starts alone: one index per row, not per window entry, and
  none for the head axis the starts are broadcast over (XLA reads every index a gather has, for
  each window: take_along_axis's full index tuples were 17 GB of XLNet-base's step)."""
  g, h, r, n, p, width = 2, 3, 4, 5, 40, 17
  table = jax.random.normal(jax.random.key(3), (g, h, r, n, p))
  start = jnp.asarray(np.random.default_rng(0).integers(0, p - width + 1, (g, 1, r, n)))
  at = np.asarray(start)[..., None] + np.arange(width)  # [g, 1, r, n, width]
  want = np.take_along_axis(np.asarray(table), np.broadcast_to(at, (g, h, r, n, width)), axis=-1)
  np.testing.assert_array_equal(X.row_windows(table, start, width), want)
  np.testing.assert_array_equal(X.row_windows(table[:1], start[0], width), want[:1])  # start [1, r, n], as numpy
  cot = jax.random.normal(jax.random.key(4), (g, h, r, n, width))
  grad = jax.grad(lambda t: jnp.sum(X.row_windows(t, start, width) * cot))(table)
  expected = np.zeros(table.shape, np.float32)
  np.put_along_axis(expected, np.broadcast_to(at, cot.shape), np.asarray(cot), axis=-1)
  np.testing.assert_array_equal(grad, expected)

  hlo = jax.jit(jax.value_and_grad(lambda t: jnp.sum(X.row_windows(t, start, width) * cot))).lower(table).as_text()
  gathers = re.findall(r'"stablehlo.gather"\(%\S+, %\S+\).*: \(tensor<[^>]+>, tensor<([0-9x]+)xi(?:32|64)>\)', hlo)
  assert len(gathers) == 2, hlo  # the window and its gradient
  for index_shape in gathers:
    assert np.prod([int(x) for x in index_shape.split("x")]) == g * r * n, index_shape
  assert "scatter" not in hlo


def test_query_blocks_divide_the_queries():
  assert [X.query_block(t) for t in (1, 7, 64, 100, 128, 512, 97, 192)] == [1, 7, 64, 50, 64, 64, 97, 64]
  with pytest.raises(ValueError, match="block 3 does not divide the 8 queries"):
    X.positional_scores(jnp.zeros((1, 8, H, 4)), jnp.zeros((1, 15, H, 4)), 3)


@pytest.mark.parametrize("mlen,clamp,sign", [(0, -1, None), (3, -1, None), (3, 2, None), (4, -1, (1.0, -1.0))])
def test_positional_term_matches_rel_shift(mlen, clamp, sign):
  b, t, d = 2, 5, 4
  s = mlen + t
  kq, kw = jax.random.split(jax.random.key(0))
  q_r = jax.random.normal(kq, (b, t, H, d))
  w_r = jax.random.normal(kw, (E, H, d))
  sign = None if sign is None else jnp.asarray(sign)
  distances, index = X.distance_table(t, mlen)
  assert distances.shape == (s + t - 1,) and int(index.min()) == 0 and int(index.max()) == s + t - 2  # all read
  k_r = jnp.einsum("bpe,ehd->bphd", X.relative_encoding(distances, E, clamp_len=clamp, sign=sign), w_r)
  ours = X.positional_scores(q_r, k_r)
  # Transformer-XL: encodings of pos = s, s-1, ..., -t+1, then the shift.
  pos = jnp.arange(s, -t, -1, dtype=jnp.float32)
  k_shift = jnp.einsum("bpe,ehd->bphd", X.relative_encoding(pos, E, clamp_len=clamp, sign=sign), w_r)
  ref = X.rel_shift_scores(q_r, k_shift, mlen)
  np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5)
  # Explicitly: entry (i, j) scores the distance i + mlen - j (clamped, signed).
  sgn = np.ones(b) if sign is None else np.asarray(sign)
  for i, j in [(0, 0), (t - 1, 0), (0, s - 1), (2, 1)]:
    dist = np.clip(i + mlen - j, -clamp, clamp) if clamp > 0 else i + mlen - j
    r = X.sinusoid(jnp.asarray(sgn * dist, jnp.float32), E)  # [b, e]
    want = jnp.einsum("bhd,be,ehd->bh", q_r[:, i], r, w_r)
    np.testing.assert_allclose(ours[:, :, i, j], want, rtol=1e-5, atol=1e-5)


def test_sinusoid_layout():
  r = X.sinusoid(jnp.asarray([0.0, 2.0]), 8)
  f = 10000.0 ** (-np.arange(0, 8, 2) / 8)
  np.testing.assert_allclose(r[1], np.concatenate([np.sin(2 * f), np.cos(2 * f)]), rtol=1e-6)
  np.testing.assert_allclose(r[0], [0, 0, 0, 0, 1, 1, 1, 1])
