"""XLNet building blocks: Transformer-XL relative attention with two streams and memory.

Shape letters as in tfx/nn/__init__.py, plus: m memory length, s = m + t key length,
n prediction slots, p relative distances (s + t - 1 of them).

- Relative positions: query i in [0, t) and key j in [0, s) are at distance
  d_ij = i + m - j. R(d) = concat[sin(d f), cos(d f)], f_k = 10000^(-2k/e). The positional
  score (q_i + r_r_bias) . W_r R(d_ij) is computed once per distance that a block of queries reads
  and each query's keys cut out of that table (`positional_scores`, a pad-and-reshape shift);
  `rel_shift_scores` is the Transformer-XL shift formulation over all of them, a test reference.
- Segments: s_ij = [type_i != type_j]; memory positions have type 0.
- Attention (`relative_attention`): the content term (q + r_w_bias) . k is a fused kernel's own
  q . k and the position and segment terms (`relative_bias`) its bias, through
  `tfx.ops.dot_product_attention` (cuDNN on a GPU); `relative_scores` writes the three terms out,
  the reference it is tested against.
- Two streams share every weight: the content stream h attends [mem; h] under `content_mask`;
  the query stream g attends the same keys / values under `query_mask` and is never a key. Its
  prediction slots (`target_mapping`) attend from their own positions alone: the slot's mask and
  segment rows, and its positional scores against every distance with its window cut out
  (`row_positional_scores`). XLNet scatters the slots to all t positions and attends there;
  the slots' rows of that are the same numbers at n / t of the work.
- Masks are inputs (True = may attend); nothing here knows about permutations.
"""

import functools
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from tfx import ops
from tfx.ops import dropout as dropout_ops
from tfx.ops import hoisting
from tfx.ops.flash_dropout import fused_dropout_attention
from tfx.ops.target import whole_positional_table
from tfx.nn.layers import (DenseGeneral, Dropout, Mlp, ModelConfig, Norm, add_bias, constrain, rows_together,
                           take_rows)


class RelBiases(NamedTuple):
  """The per-head biases of relative attention, [h, d] each."""

  r_w: jax.Array  # content (query . key)
  r_r: jax.Array  # position (query . W_r R)
  r_s: jax.Array  # segment (query . seg_embed)


# ============================================================================ positions


def distance_table(length: int, mem_length: int) -> tuple[jax.Array, jax.Array]:
  """The distinct relative distances and, per (query, key), the index of its distance.

  Args:
    length: t, the number of queries.
    mem_length: m, memory positions before the queries (keys are [mem; current], s = m + t).

  Returns:
    distances: [s + t - 1] float32, s - 1 down to -(t - 1): the distances i + m - j that occur
      (the rest of -(s - 1)..(s - 1) never does: with memory, building them would only add rows
      to the W_r projection and the positional score tables).
    index: [t, s] int32 with distances[index[i, j]] == i + m - j.
  """
  s = mem_length + length
  distances = jnp.arange(s - 1, -length, -1, dtype=jnp.float32)  # [p]
  i = jnp.arange(length)[:, None]
  j = jnp.arange(s)[None, :]
  index = (length - 1 - i + j).astype(jnp.int32)  # [t, s]; = (s - 1) - (i + m - j)
  return distances, index


def sinusoid(distances: jax.Array, d_model: int) -> jax.Array:
  """R(d) = concat[sin(d f), cos(d f)], f_k = 10000^(-2k/d_model): [...] -> [..., d_model]."""
  inv_freq = 1.0 / (10000.0 ** (jnp.arange(0, d_model, 2, dtype=jnp.float32) / d_model))  # [e/2]
  angles = distances[..., None].astype(jnp.float32) * inv_freq  # [..., e/2]
  return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


def relative_encoding(distances: jax.Array, d_model: int, *, clamp_len: int = -1,
                      sign: jax.Array | None = None) -> jax.Array:
  """Sinusoidal encodings of (clamped, signed) distances.

  Args:
    distances: [p] float.
    d_model: e.
    clamp_len: > 0 clips distances to [-clamp_len, clamp_len]; otherwise unused.
    sign: optional [g] of +1 / -1 (bi_data: the backward rows use -d), one per group of rows: g = b
      (each row its own), or a divisor of b (the batch's rows in g contiguous groups, `encoding_signs`).

  Returns:
    [1, p, e] without `sign`, else [g, p, e] (float32).
  """
  d = distances
  if clamp_len is not None and clamp_len > 0:
    d = jnp.clip(d, -clamp_len, clamp_len)
  d = d[None, :] if sign is None else sign.astype(jnp.float32)[:, None] * d[None, :]  # [g|1, p]
  return sinusoid(d, d_model)


HALVES = "halves"  # bi_sign for XLNet's bi_data layout: rows [0, b/2) forward, [b/2, b) reversed


def encoding_signs(bi_sign, batch: int, *, per_row: bool = False) -> jax.Array | None:
  """The `sign` of `relative_encoding` for the model's `bi_sign`: None (every row forward), a [b]
  array (a sign per row), or `HALVES`, XLNet's bi_data layout, which is (+1, -1): one encoding per
  half of the batch, shared by its rows, so that W_r projects 2 x p distances instead of b x p (and
  the positional scores read two windows of k_r, not b), unless `per_row` (dropout on the encodings
  draws a mask per row, XLNet's own): then [b] of +1 then -1."""
  if not isinstance(bi_sign, str):
    return bi_sign
  if bi_sign != HALVES:
    raise ValueError(f"bi_sign must be a [b] array, None or {HALVES!r}, got {bi_sign!r}")
  if batch % 2:
    raise ValueError(f"bi_sign={HALVES!r} reads the batch's second half reversed and needs an even batch, got {batch}")
  signs = jnp.asarray([1.0, -1.0], jnp.float32)  # [2]
  return jnp.repeat(signs, batch // 2) if per_row else signs


# Queries per block of `positional_scores`, whose table is s + block - 1 distances wide. Against k_r
# shared by the batch the windows are small (nb x w x h x d); per row (the encodings dropped per row
# in training) they are nb copies of the rows' k_r, so there the table is halves or (on a GPU:
# `tfx.ops.target.whole_positional_table`) one block. Measured by the
# bytes of XLNet-base's step compiled for an H100 (32 x 512, memory 384): shared, blocks of 16 / 32 /
# 64 / 128 / 512 move 208.3 / 207.0 / 207.9 / 211.5 / 257.3 GB; per row, 64 / 128 / 256 / 512: 238.7 /
# 220.6 / 216.1 / 222.9 GB (2026-11-29, XLA's attention then), and since the Pallas kernel takes the
# bias (stop 66) 128 / 256 / 512: 182.9 / 174.0 / 169.2 GB on it, 252.2 (256) / 247.4 (512) on XLA's
# attention. One k_r per half of the batch (bi_data, `HALVES`; the suite's step, cuDNN's attention):
# blocks of 64 / 256 moved 156.3 / 158.9 GB (2026-11-29), and 64 / 128 / 512 136.8 / 137.2 / 144.6
# (stop 66): a few k_r are small windows, as one is.
QUERY_BLOCK = 64


def query_block(length: int, target: int = QUERY_BLOCK) -> int:
  """The largest divisor of `length` that is at most `target`; `length` itself (one block) when that
  divisor is below target / 8 (blocks that small would make poor matmuls)."""
  block = max(b for b in range(1, min(length, target) + 1) if length % b == 0)
  return block if block * 8 >= min(length, target) else length


def positional_scores(q_r: jax.Array, k_r: jax.Array, block: int | None = None) -> jax.Array:
  """(q_i + r_r_bias) . W_r R(d_ij), scored once per distance, then each query row's keys cut out.

  Row i needs the distances at `distance_table`'s index, (t - 1 - i) + j for key j: a window of s
  consecutive distances that starts one place earlier for each later query. The queries go in
  blocks of `block` (nb = t / block of them): block c's rows need only the s + block - 1 distances
  from (nb - 1 - c) * block on, so each block is scored against its own window of k_r (a static
  slice; the table is [b, h, t, s + block - 1], not [b, h, t, s + t - 1]: XLNet-base's 512 queries
  over 896 keys score 959 distances per row instead of 1407). Within a block, padded with one column
  and read flat, the table gives every row's window at one stride (Transformer-XL's shift): a pad,
  a reshape and two slices, whose gradient is the same slices and pad backwards. A gather by
  `index` would be the same numbers, but its gradient is a scatter-add over [b, h, t, s], which took
  15% of XLNet-base's step on an H200.

  Args:
    q_r: [b, t, h, d] queries plus r_r_bias.
    k_r: [g, p, h, d] projected encodings W_r R(d) of `distance_table`'s distances (p = s + t - 1),
      shared by the rows of each of g contiguous groups (g = 1: the whole batch; g = b: a k_r per
      row; g = 2: bi_data's halves).
    block: queries per block, a divisor of t (default: `query_block` of t, for QUERY_BLOCK; for a
      k_r per row (g = b > 1) t, one block, on a GPU (`whole_positional_table`), else halves).

  Returns:
    [b, h, t, s] float32: entry (i, j) scores the distance i + m - j.
  """
  b, t, h, d = q_r.shape
  g, p = k_r.shape[:2]
  s = p - t + 1
  if block is None:
    if g < b or b == 1:
      block = query_block(t)
    else:  # a k_r per row
      block = t if whole_positional_table() else query_block(t, max(QUERY_BLOCK, t // 2))
  if t % block:
    raise ValueError(f"positional_scores: block {block} does not divide the {t} queries")
  nb, w = t // block, s + block - 1
  windows = jnp.stack(  # [g, nb, w, h, d]
      [k_r[:, (nb - 1 - c) * block:(nb - 1 - c) * block + w] for c in range(nb)], axis=1)
  q_blocks = q_r.reshape(b, nb, block, h, d)  # [b, nb, block, h, d]
  if g == 1:
    table = jnp.einsum("bnqhd,nwhd->bhnqw", q_blocks, windows[0])  # [b, h, nb, block, w]
  elif g == b:
    table = jnp.einsum("bnqhd,bnwhd->bhnqw", q_blocks, windows)
  else:  # rows in g groups (a batch-sharded mesh splits them so), in the matmul's own order until the end
    table = jnp.einsum("gbnqhd,gnwhd->gnhbqw", q_blocks.reshape((g, b // g) + q_blocks.shape[1:]), windows)
  lead = table.shape[:-2]  # (b, h, nb) or (g, nb, h, b / g)
  flat = jnp.pad(table, ((0, 0),) * (table.ndim - 1) + ((0, 1),)).reshape(lead + (block * (w + 1),))
  # flat[block - 1 + r * w + j] = table[r, block - 1 - r + j]: row r at r * (w + 1)
  rows = flat[..., block - 1:block - 1 + block * w].reshape(lead + (block, w))[..., :s]
  if 1 < g < b:
    rows = jnp.transpose(rows, (0, 3, 2, 1, 4, 5))  # [g, b / g, h, nb, block, s]
  return rows.reshape(b, h, t, s).astype(jnp.float32)  # [b, h, t, s]


def _windows(table: jax.Array, start: jax.Array, width: int) -> jax.Array:
  """table [..., p], start [...] (each dim 1 or the table's, missing leading dims as 1s, as numpy
  broadcasts) -> [..., width]: a dynamic slice per row, vmapped over the leading axes, which XLA
  compiles to one gather whose indices are the starts alone (a dim where start is 1 is sliced
  whole, not indexed)."""
  if table.ndim == 1:
    return jax.lax.dynamic_slice_in_dim(table, start, width)
  start = jnp.reshape(start, (1,) * (table.ndim - 1 - jnp.ndim(start)) + jnp.shape(start))
  if start.shape[0] == 1:
    return jax.vmap(lambda t: _windows(t, start[0], width))(table)
  return jax.vmap(lambda t, s: _windows(t, s, width))(table, start)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def row_windows(table: jax.Array, start: jax.Array, width: int) -> jax.Array:
  """Each row's `width` consecutive entries from its own start: [..., p] at start [...] (each dim 1,
  broadcast, or the table's; e.g. [b, 1, n] for a [b, h, n, p] table) -> [..., width] (every window
  inside its row). The gradient is a window too, of the gradient padded on both sides (each table
  entry reads the window place it went to, or a pad's 0): a gather's own transpose would be a
  scatter-add.

  Not `jnp.take_along_axis` with the window's indices: XLA reads a full index tuple per output
  entry there, and the indices broadcast over the heads were 5 x 4 bytes for each 2-byte score
  (XLNet-base's query stream at 32 x 512 for an H100: 0.6 GB of indices read by each layer's
  forward pass, 0.9 GB by its backward pass)."""
  return _windows(table, start, width)


def _row_windows_fwd(table, start, width):
  return row_windows(table, start, width), (start, table.shape[-1])


def _row_windows_bwd(width, residuals, g):
  start, p = residuals  # g [..., width]
  # table entry c went to place c - start: in g padded by p - width on both sides, entry c reads
  # place c + (p - width - start), a window of p from p - width - start (in [0, p - width])
  padded = jnp.pad(g, ((0, 0),) * (g.ndim - 1) + ((p - width, p - width),))  # [..., 2p - width]
  return row_windows(padded, p - width - start, p), None


row_windows.defvjp(_row_windows_fwd, _row_windows_bwd)


def row_positional_scores(q_r: jax.Array, k_r: jax.Array, rows: jax.Array, keys: int) -> jax.Array:
  """`positional_scores` for queries at any positions: query slot k at position rows[b, k] scores
  every distance, then its window of `keys` distances is cut out (from t - 1 - rows[b, k], see
  `distance_table`). For a few rows (the query stream's prediction slots, a pooled token) this is
  n x p entries where the whole sequence's table would be t x (s + block - 1).

  Args:
    q_r: [b, n, h, d] queries plus r_r_bias; k_r: [g, p, h, d] as `positional_scores`.
    rows: [b, n] int positions in [0, t); keys: s.

  Returns:
    [b, h, n, s] float32.
  """
  b, n, h, _ = q_r.shape
  g, p = k_r.shape[:2]
  start = p - keys - rows  # [b, n]: t - 1 - rows
  if g == 1:
    table = jnp.einsum("bnhd,phd->bhnp", q_r, k_r[0])  # [b, h, n, p]
  elif g == b:
    table = jnp.einsum("bnhd,bphd->bhnp", q_r, k_r)
  else:  # rows in g groups, each sharing its k_r; the matmul's own order [g, h, b / g, n, p] until the end
    table = jnp.einsum("gbnhd,gphd->ghbnp", q_r.reshape((g, b // g) + q_r.shape[1:]), k_r)
    scores = row_windows(table, start.reshape(g, 1, b // g, n), keys)  # [g, h, b / g, n, s]
    return jnp.swapaxes(scores, 1, 2).reshape(b, h, n, keys).astype(jnp.float32)
  return row_windows(table, start[:, None], keys).astype(jnp.float32)  # [b, h, n, s]


def rel_shift_scores(q_r: jax.Array, k_r_shift: jax.Array, mem_length: int) -> jax.Array:
  """Transformer-XL's formulation (a test reference for `positional_scores`).

  Args:
    q_r: [b, t, h, d] queries plus r_r_bias.
    k_r_shift: [b|1, s + t, h, d] W_r R(pos) for pos = s, s - 1, ..., -t + 1 (HF / original "bi").
    mem_length: m.

  Returns:
    [b, h, t, s]: score against every position, then the reshape-and-drop-a-row shift.
  """
  b, t = q_r.shape[:2]
  s = mem_length + t
  k = jnp.broadcast_to(k_r_shift, (b,) + k_r_shift.shape[1:])
  x = jnp.einsum("bthd,bphd->bhtp", q_r, k)  # [b, h, t, s + t]
  h = x.shape[1]
  x = x.reshape(b, h, s + t, t)[:, :, 1:, :]  # [b, h, s + t - 1, t]
  x = x.reshape(b, h, t, s + t - 1)
  return x[..., :s].astype(jnp.float32)


# ============================================================================ attention core


def segment_difference(token_types: jax.Array, mem_length: int) -> jax.Array:
  """[b, t] int -> [b, t, s] bool: type_i != type_j, memory positions having type 0."""
  b = token_types.shape[0]
  keys = jnp.concatenate([jnp.zeros((b, mem_length), token_types.dtype), token_types], axis=1)  # [b, s]
  return token_types[:, :, None] != keys[:, None, :]


@jax.custom_vjp
def segment_scores(q: jax.Array, seg_embed: jax.Array) -> jax.Array:
  """q [b, t, h, d] . seg_embed [k, h, d] -> [b, h, t, k] in q's dtype (seg_embed cast to it); the
  gradient of seg_embed (a float32 parameter) is the float32 product, as `tfx.nn.layers.project`
  gives every weight's."""
  return jnp.einsum("bthd,khd->bhtk", q, seg_embed.astype(q.dtype))


def _segment_scores_fwd(q, seg_embed):
  return segment_scores(q, seg_embed), (q, seg_embed)


def _segment_scores_bwd(residuals, g):
  q, seg_embed = residuals  # g [b, h, t, k]
  w = seg_embed.astype(q.dtype)
  d_q = jax.vjp(lambda q: jnp.einsum("bthd,khd->bhtk", q, w), q)[1](g)[0]  # autodiff's, [b, t, h, d]
  d_seg = jnp.einsum("bhtk,bthd->khd", g, q, preferred_element_type=seg_embed.dtype)
  return d_q, d_seg


segment_scores.defvjp(_segment_scores_fwd, _segment_scores_bwd)


def relative_bias(q: jax.Array, k_r: jax.Array, biases: RelBiases, seg_embed: jax.Array,
                  seg_diff: jax.Array | None, rows: jax.Array | None = None, keys: int = 0) -> jax.Array:
  """The position and segment terms of the unscaled scores, which attention adds to the content
  term (q + r_w_bias) . k as a bias.

  Args:
    q: [b, t, h, d] (or [b, n, h, d] at `rows`); k_r: [g, p, h, d] (`distance_table`'s distances, g
      contiguous groups of rows: `positional_scores`).
    biases: r_r / r_s, [h, d] each (r_w belongs to the content term).
    seg_embed: [2, h, d] (same-segment, different-segment).
    seg_diff: [b, t|n, s] bool, or None for no segment term.
    rows: [b, n] int, the queries' positions (`row_positional_scores`), or None: q is every position
      in order. keys: s (needed with rows).

  Returns:
    [b, h, t|n, s] float32.
  """
  q_r = add_bias(q, biases.r_r)
  bd = positional_scores(q_r, k_r) if rows is None else row_positional_scores(q_r, k_r, rows, keys)
  if seg_diff is None:
    return bd
  ef = segment_scores(add_bias(q, biases.r_s), seg_embed)  # [b, h, t, 2]
  ef = ef.astype(jnp.float32)
  # (seg_diff tied to ef: a scanned stack's gradient would store its head broadcast; ops.hoisting)
  return bd + jnp.where(hoisting.tied(seg_diff[:, None], ef), ef[..., 1:], ef[..., :1])


def relative_scores(q: jax.Array, k: jax.Array, k_r: jax.Array, biases: RelBiases, seg_embed: jax.Array,
                    seg_diff: jax.Array | None) -> jax.Array:
  """Unscaled scores: content + position + segment terms.

  Args:
    q: [b, t, h, d]; k: [b, s, h, d]; k_r: [g, p, h, d] (`distance_table`'s distances, `positional_scores`).
    biases: r_w / r_r / r_s, [h, d] each.
    seg_embed: [2, h, d] (same-segment, different-segment).
    seg_diff: [b, t, s] bool, or None for no segment term.

  Returns:
    [b, h, t, s] float32.
  """
  ac = jnp.einsum("bthd,bshd->bhts", add_bias(q, biases.r_w), k).astype(jnp.float32)
  return ac + relative_bias(q, k_r, biases, seg_embed, seg_diff)


def relative_attention(q: jax.Array, k: jax.Array, v: jax.Array, k_r: jax.Array, biases: RelBiases,
                       seg_embed: jax.Array, seg_diff: jax.Array | None, mask: jax.Array | None, *, scale: float,
                       implementation: str = "auto", dropout_rate: float = 0.0,
                       dropout_rng: jax.Array | None = None, rows: jax.Array | None = None) -> jax.Array:
  """softmax(where(mask, `relative_scores` * scale, -inf)) . v, as a fused attention computes it.

  The content term (q + r_w_bias) . k is the attention's own q . k; the position and segment terms
  (`relative_bias`) are its bias, [b, h, t, s] in the compute dtype (cuDNN's fused attention on a
  GPU reads it and writes its gradient at half the bytes of float32; the softmax stays float32),
  else XLA's attention with its own backward pass. Attention dropout runs in tfx's Pallas kernel
  with `model.attention=pallas` (`tfx.ops.flash_dropout`: it reads the bias, the mask folded into
  it, and writes the bias's gradient blockwise; no [b, h, t, s] probabilities), else in XLA's
  attention, which draws the same keep bits. A row with no allowed key (the query stream's first
  token in the factorisation order, before any memory) gets the mean of V, as XLNet's own softmax
  over all-masked scores gives it: never predicted by tfx's objective, but the model's function is
  XLNet's.

  Args:
    q: [b, t, h, d]; k, v: [b, s, h, d]; k_r, biases, seg_embed, seg_diff: as `relative_scores`.
    mask: [b, t, s] bool (True = may attend) or None.
    scale: the scores' scale; implementation: `model.attention`.
    dropout_rate, dropout_rng: attention dropout on the probabilities ([b, h, t, s] drawn from the key).
    rows: [b, n] int: q, seg_diff and mask are n queries at these positions ([b, n, ...] for t), or
      None: every position in order.

  Returns:
    [b, t|n, h, d] in q's dtype.
  """
  bias = relative_bias(q, k_r, biases, seg_embed, seg_diff, rows, k.shape[1])  # [b, h, t, s]
  bias = (bias * scale).astype(q.dtype)
  q_w = add_bias(q, biases.r_w)
  mask4 = None if mask is None else mask[:, None]  # [b, 1, t, s]
  if dropout_rate > 0.0:  # tfx's Pallas kernel (`model.attention=pallas`, the bias carrying the mask), else XLA's
    out, _ = fused_dropout_attention(q_w, k, v, mask4, bias, scale, dropout_rate, dropout_rng, implementation)
    if out is None:
      out = ops.attention.softmax_attention(q_w, k, v, mask4, bias, scale, dropout_rate=dropout_rate,
                                            seed=dropout_ops.seed(dropout_rng))  # bits of [b, h, t, s]
  else:
    out = ops.dot_product_attention(q_w, k, v, bias=bias, scale=scale, mask=mask4, implementation=implementation)
  if mask is None:
    return out
  keyless = ~jnp.any(mask, axis=-1)[:, :, None, None]  # [b, t, 1, 1]
  mean_v = jnp.mean(v.astype(jnp.float32), axis=1, keepdims=True).astype(out.dtype)  # [b, 1, h, d]
  return jnp.where(hoisting.tied(keyless, out), mean_v, out)


def slot_rows(target_mapping: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(position [b, n] int, filled [b, n] float) of each prediction slot: target_mapping's rows are
  one-hot (the slot predicts that position) or zero (an empty slot: its output is 0, as XLNet's
  scatter to the positions and gather back gives it)."""
  return jnp.argmax(target_mapping, axis=-1), jnp.sum(target_mapping, axis=-1)


# ============================================================================ modules


def _bias_param(module: nn.Module, name: str, cfg: ModelConfig) -> jax.Array:
  return module.param(name, nn.with_logical_partitioning(nn.initializers.normal(cfg.init_std), ("heads", "kv")),
                      (cfg.num_heads, cfg.head_dim), jnp.float32)


def shared_biases(module: nn.Module, cfg: ModelConfig) -> RelBiases:
  """r_w / r_r / r_s biases as parameters of `module` (one set per layer, or one for all when
  untie_r is False)."""
  return RelBiases(*(_bias_param(module, f"r_{k}_bias", cfg) for k in ("w", "r", "s")))


class TwoStreamAttention(nn.Module):
  """Relative multi-head attention over [mem; h] for the content and (optional) query streams.

  Post-LN: each stream's output is LayerNorm(x + dropout(o(attention))), with one norm shared by
  both streams. Parameters: query / key / value / relative [e, h, d], out [h, d, e], seg_embed
  [2, h, d], r_*_bias [h, d] (unless given), attention_norm. With `content=False` only the query
  stream is computed (h gives the keys and values) and the content stream's output is None.
  """

  cfg: ModelConfig
  deterministic: bool = True
  content: bool = True

  @nn.compact
  def __call__(self, h: jax.Array, g: jax.Array | None, mem: jax.Array | None, r: jax.Array,
               seg_diff: jax.Array | None, content_mask: jax.Array | None, query_mask: jax.Array | None,
               target_mapping: jax.Array | None, biases: RelBiases | None = None):
    """Runs both streams.

    Args:
      h: [b, t, e] content stream.
      g: [b, n, e] query stream (n = t without target_mapping), or None.
      mem: [b, m, e] memory (keys / values only), or None.
      r: [g, p, e] encodings of `distance_table`'s distances, shared by g contiguous groups of rows
        (1: the batch, b: each row its own, 2: bi_data's halves).
      seg_diff: [b, t, s] bool or None.
      content_mask, query_mask: [b, t, s] bool (True = may attend), or None (attend all).
      target_mapping: [b, n, t] float, rows one-hot (the position a slot predicts) or zero (an empty
        slot, whose attention output is 0), or None: g is every position, in order.
      biases: shared relative biases, or None for this layer's own.

    Returns:
      (h [b, t, e], g [b, n, e] or None).
    """
    cfg = self.cfg
    e, nh, hd = cfg.d_model, cfg.num_heads, cfg.head_dim
    dt = cfg.compute_dtype

    def proj(name: str) -> DenseGeneral:
      return DenseGeneral((e,), (nh, hd), ("embed", "heads", "kv"), use_bias=False, init_std=cfg.init_std,
                          dtype=dt, name=name)

    if biases is None:
      biases = shared_biases(self, cfg)
    seg_embed = self.param("seg_embed", nn.with_logical_partitioning(nn.initializers.normal(cfg.init_std),
                                                                     (None, "heads", "kv")),
                           (2, nh, hd), jnp.float32)
    query = proj("query")
    out = DenseGeneral((nh, hd), (e,), ("heads", "kv", "embed"), use_bias=False, init_std=cfg.init_std, dtype=dt,
                       name="out")
    norm = Norm("layernorm", cfg.norm_eps, use_bias=True, dtype=dt, name="attention_norm")
    drop = lambda x: Dropout(cfg.dropout)(x, deterministic=self.deterministic)

    cat = h if mem is None else jnp.concatenate([mem.astype(h.dtype), h], axis=1)  # [b, s, e]
    k = proj("key")(cat)  # [b, s, h, d]
    v = proj("value")(cat)  # [b, s, h, d]
    k_r = proj("relative")(r.astype(dt))  # [g, p, h, d]
    scale = hd**-0.5

    dropout = cfg.attention_dropout if not self.deterministic else 0.0

    def attend(q: jax.Array, mask: jax.Array | None, rows: jax.Array | None = None) -> jax.Array:
      # [b, t|n, h, d] -> [b, t|n, h, d]: every position, or n queries at `rows` [b, n]
      return relative_attention(q, k, v, k_r, biases, seg_embed, take_rows(seg_diff, rows),
                                mask, scale=scale, implementation=cfg.attention, dropout_rate=dropout,
                                dropout_rng=self.make_rng("dropout") if dropout else None, rows=rows)

    def post(x: jax.Array, vec: jax.Array) -> jax.Array:
      return norm(x + drop(out(vec)))

    h_out = None
    if self.content:
      h_out = post(h, attend(query(h), content_mask))
      h_out = constrain(h_out, ("act_batch", "act_length", "act_embed"))
    elif g is None:
      raise ValueError("TwoStreamAttention(content=False) computes the query stream alone: it needs g")
    if g is None:
      return h_out, None
    q_g = query(g)  # [b, n, h, d]
    if target_mapping is None:  # n = t, in order
      vec = attend(q_g, query_mask)
    else:  # each slot attends from its position alone (XLNet scatters it there, attends at all t)
      rows, filled = slot_rows(target_mapping)  # [b, n]
      vec = attend(q_g, take_rows(query_mask, rows), rows) * filled[:, :, None, None].astype(q_g.dtype)
    return h_out, post(g, vec)


class XLNetLayer(nn.Module):
  """Two-stream relative attention then a post-LN FFN (shared by both streams), and this
  layer's new memory.

  The call has nn.scan's form `(carry, per-layer input, broadcast inputs...) -> (carry,
  per-layer output)`, so the same module runs unrolled (`layer_{i}`) or scanned over a stacked
  `layers` axis, with the memory scanned in and the new memory scanned out. `content=False`: the
  query stream alone (the last layer, whose content stream nothing reads); h comes out None.
  """

  cfg: ModelConfig
  deterministic: bool = True
  content: bool = True

  @nn.compact
  def __call__(self, carry, mem, r, seg_diff, content_mask, query_mask, target_mapping, biases=None):
    """Runs one layer.

    Args:
      carry: (h [b, t, e], g [b, n, e] or None), the streams entering the layer.
      mem: [b, m, e] this layer's memory, or None.
      r, seg_diff, content_mask, query_mask, target_mapping, biases: as
        `TwoStreamAttention` (the same for every layer).

    Returns:
      ((h [b, t, e], g [b, n, e] or None), new_mem): new_mem is `cache_memory` of this layer's
      memory and input h, [b, mem_len, e], or None when cfg.mem_len == 0.
    """
    cfg = self.cfg
    h, g = carry
    new_mem = cache_memory(mem, h, cfg.mem_len, cfg.reuse_len) if cfg.mem_len > 0 else None
    h, g = TwoStreamAttention(cfg, self.deterministic, self.content, name="attention")(
        h, g, mem, r, seg_diff, content_mask, query_mask, target_mapping, biases)
    mlp = Mlp(cfg, self.deterministic, name="mlp")
    norm = Norm("layernorm", cfg.norm_eps, use_bias=True, dtype=cfg.compute_dtype, name="mlp_norm")
    drop = lambda x: Dropout(cfg.dropout)(x, deterministic=self.deterministic)
    ffn = lambda x: norm(x + drop(mlp(x)))
    if h is None or g is None:
      return (None if h is None else ffn(h), None if g is None else ffn(g)), new_mem
    return rows_together(ffn, h, g), new_mem


def cache_memory(prev: jax.Array | None, h: jax.Array, mem_len: int, reuse_len: int = 0) -> jax.Array:
  """new_mem = stop_gradient(concat(prev, h[:reuse_len])[-mem_len:]) along time.

  Args:
    prev: [b, m, e] or None (treated as zeros, as the original's initial memory).
    h: [b, t, e] this layer's input.
    mem_len: rows kept (> 0).
    reuse_len: leading rows of h that may be cached (<= 0: all).

  Returns:
    [b, mem_len, e]; left-padded with zeros if fewer rows exist.
  """
  cur = h[:, :reuse_len] if reuse_len and reuse_len > 0 else h
  x = cur if prev is None else jnp.concatenate([prev.astype(cur.dtype), cur], axis=1)
  if x.shape[1] < mem_len:
    x = jnp.concatenate([jnp.zeros((x.shape[0], mem_len - x.shape[1], x.shape[2]), x.dtype), x], axis=1)
  return jax.lax.stop_gradient(x[:, -mem_len:])
