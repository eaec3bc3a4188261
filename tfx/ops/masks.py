"""Attention masks: who may attend to whom.

A mask is boolean, `True` = the query may attend to the key, shaped [b, 1|h, t, s]
(the head axis broadcasts). `jax.nn.dot_product_attention` has no segment-id argument, so
packing, padding, causality and prefix-LM are all expressed as such a mask. Two masks are kept in
a form a kernel reads instead of the array:

- `SegmentMask`: a packed row's self-attention given by its segment ids, which the Pallas flash
  kernel (`model.attention=pallas`, GPU) and splash attention (`model.attention=splash`, TPU)
  read without building the [b, 1, t, t] array (cuDNN gets the array and, for a causal one, its
  `is_causal` hint).
- `LengthMask`: rows of one segment each, real tokens first (span corruption's and UL2's inputs
  and targets): each row's query and key counts, which cuDNN takes as sequence lengths (its
  padding mask), so that the mask is never folded into a [b, h, t, s] bias.

A query row with no allowed key would silently softmax to the mean of V (a leak);
`assert_rows_attend` and the guard of `tfx.ops.dot_product_attention` make that an error or exact
zeros.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

# The kernels that read a `SegmentMask`'s ids themselves (tfx.ops.attention.SEGMENT_KERNELS).
SEGMENT_ID_KERNELS = ("pallas", "splash")


def causal_mask(t: int, s: int | None = None, offset: int = 0) -> jax.Array:
  """[1, 1, t, s]: query i may attend key j iff j <= i + offset."""
  s = t if s is None else s
  q = jnp.arange(t)[:, None] + offset
  k = jnp.arange(s)[None, :]
  return (k <= q)[None, None]


def segment_mask(q_segment_ids: jax.Array, k_segment_ids: jax.Array | None = None) -> jax.Array:
  """[b, 1, t, s]: same packed document and neither side is padding (segment 0)."""
  k_segment_ids = q_segment_ids if k_segment_ids is None else k_segment_ids
  q = q_segment_ids[:, None, :, None]  # [b, 1, t, 1]
  k = k_segment_ids[:, None, None, :]  # [b, 1, 1, s]
  return (q == k) & (q > 0) & (k > 0)


def padding_mask(q_valid: jax.Array, k_valid: jax.Array | None = None) -> jax.Array:
  """[b, 1, t, s]: both the query and the key are real tokens. Inputs are [b, t] / [b, s] bool."""
  k_valid = q_valid if k_valid is None else k_valid
  return q_valid[:, None, :, None] & k_valid[:, None, None, :]


def prefix_lm_mask(segment_ids: jax.Array, positions: jax.Array, prefix_length: jax.Array) -> jax.Array:
  """[b, 1, t, t]: causal within each document, except that the first `prefix_length` tokens
  of each document see each other bidirectionally. `prefix_length` is [b, t] (per token: the
  prefix length of its document) or broadcastable to it."""
  prefix_length = jnp.broadcast_to(prefix_length, segment_ids.shape)
  pos_q = positions[:, None, :, None]
  pos_k = positions[:, None, None, :]
  in_prefix_k = pos_k < prefix_length[:, None, None, :]
  return segment_mask(segment_ids) & ((pos_k <= pos_q) | in_prefix_k)


def decoder_mask(segment_ids: jax.Array) -> jax.Array:
  """[b, 1, t, t]: causal, within the same packed document, never padding."""
  t = segment_ids.shape[-1]
  return causal_mask(t) & segment_mask(segment_ids)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["lengths", "offsets", "fits"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class SegmentRuns:
  """A packed row as at most m runs of one segment id each (documents, and padding runs too):
  cuDNN's packed layout, in which each run is a sequence of its own (`segment_runs`).

  lengths: [b, m] int32, each run's length, -1 after a row's last run.
  offsets: [b, m + 1] int32, each run's first position, -1 after a row's last run.
  fits: [] bool, every row has at most m runs and no document split over two runs (the ids of
    its documents, read along the row, increase: tfx's packing numbers them so); where not, the
    runs are not the mask and the batch attends with the mask instead.
  """

  lengths: jax.Array
  offsets: jax.Array
  fits: jax.Array


def segment_runs(segment_ids: jax.Array, max_runs: int) -> SegmentRuns:
  """The runs of equal ids of segment_ids [b, t] (0 = padding, a run like any other), at most
  `max_runs` a row (`SegmentRuns`)."""
  b, t = segment_ids.shape
  starts = jnp.concatenate([jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)  # [b, t]
  run = jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1  # [b, t]: the run each position is in
  count = run[:, -1] + 1  # [b]
  rows = jnp.arange(b)[:, None]
  kept = jnp.arange(max_runs)[None, :] < count[:, None]  # [b, m]
  lengths = jnp.zeros((b, max_runs), jnp.int32).at[rows, run].add(1, mode="drop")  # runs past m dropped
  lengths = jnp.where(kept, lengths, -1)
  slot = jnp.where(starts & (run < max_runs), run, max_runs + 1)  # [b, t]: out of range = dropped
  offsets = jnp.full((b, max_runs + 1), -1, jnp.int32).at[rows, slot].set(
      jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)), mode="drop")
  # A document's id greater than every id before it wherever one of its runs starts: no document
  # has two runs (padding, id 0, may have several: its queries attend the zeroed padding values).
  before = jnp.concatenate([jnp.zeros((b, 1), segment_ids.dtype), jax.lax.cummax(segment_ids, axis=1)[:, :-1]],
                           axis=1)  # [b, t]: the largest id before each position
  increasing = jnp.all(~starts | (segment_ids == 0) | (segment_ids > before))
  return SegmentRuns(lengths, offsets, jnp.all(count <= max_runs) & increasing)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["segment_ids", "array", "runs"],
                   meta_fields=["causal"])
@dataclasses.dataclass(frozen=True)
class SegmentMask:
  """A packed row's self-attention mask given by its segment ids [b, t] instead of [b, 1, t, t].

  Query i may attend key j when both are in the same segment, neither is padding (segment 0)
  and, when `causal`, j <= i: `dense()` is `decoder_mask` (causal) or `segment_mask`. A kernel
  that takes segment ids (`model.attention=pallas` or `splash`) never builds the array; every
  other path attends with `dense()`, which is `array` when the array was built beforehand (once
  per step, for all layers: `self_attention_mask`). cuDNN also reads `causal`, to skip the key
  blocks above the diagonal. A pytree (the ids and the array are its leaves, `causal` is static),
  so it passes through scan and remat as the dense mask does.
  """

  segment_ids: jax.Array  # [b, t] int
  causal: bool = False
  array: jax.Array | None = None  # [b, 1, t, t] bool, dense() built beforehand
  runs: SegmentRuns | None = None  # for cuDNN's packed layout (`model.packed_runs`), built beforehand

  def dense(self) -> jax.Array:
    """[b, 1, t, t] bool."""
    if self.array is not None:
      return self.array
    return decoder_mask(self.segment_ids) if self.causal else segment_mask(self.segment_ids)

  def prebuilt(self) -> "SegmentMask":
    """The same mask with its array built now, once for all the layers that read it."""
    return dataclasses.replace(self, array=self.dense())


@functools.partial(jax.tree_util.register_dataclass, data_fields=["q_segment_ids", "k_segment_ids", "array"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class CrossMask:
  """A cross-attention's mask given by the queries' segment ids [b, t] and the keys' [b, s]
  instead of [b, 1, t, s]: query i may attend key j when both are in the same document and neither
  is padding (segment 0); `dense()` is `segment_mask(q_segment_ids, k_segment_ids)`.

  The Pallas dropout kernel (`tfx.ops.flash_dropout`: an encoder-decoder's cross attention with
  attention dropout, BART's) reads the ids; every other path attends with `dense()`, which is
  `array` when it was built beforehand (once per step, for all the decoder's layers: `rows_mask`).
  A pytree, as `SegmentMask`."""

  q_segment_ids: jax.Array  # [b, t] int
  k_segment_ids: jax.Array  # [b, s] int
  array: jax.Array | None = None  # [b, 1, t, s] bool, dense() built beforehand

  def dense(self) -> jax.Array:
    """[b, 1, t, s] bool."""
    return self.array if self.array is not None else segment_mask(self.q_segment_ids, self.k_segment_ids)

  def prebuilt(self) -> "CrossMask":
    """The same mask with its array built now, once for all the layers that read it."""
    return dataclasses.replace(self, array=self.dense())


def runs_per_row(segment_ids) -> np.ndarray:
  """[b] int: the runs of one id in each row of host segment ids [b, t] (numpy), what
  `segment_runs` lays out: to size `model.packed_runs` from the data."""
  ids = np.asarray(segment_ids)
  return 1 + np.count_nonzero(ids[:, 1:] != ids[:, :-1], axis=1)


def self_attention_mask(segment_ids: jax.Array, *, causal: bool, implementation: str,
                        packed_runs: int = 0) -> SegmentMask:
  """The mask that every self-attention layer of a family shares: the ids alone for
  `model.attention=pallas` or `splash` (their kernels read them), with the [b, 1, t, t] array
  built once per step for every other kernel (each layer reads it), and with `packed_runs` > 0
  the rows' runs of one id for cuDNN's packed layout too (`segment_runs`)."""
  mask = SegmentMask(segment_ids, causal)
  if implementation in SEGMENT_ID_KERNELS:
    return mask
  runs = segment_runs(segment_ids, packed_runs) if packed_runs > 0 else None
  return dataclasses.replace(mask.prebuilt(), runs=runs)


def rows_attend(mask: jax.Array) -> jax.Array:
  """[b, h|1, t]: whether each query row may attend at least one key."""
  return jnp.any(mask, axis=-1)


def assert_rows_attend(mask: jax.Array, query_valid: jax.Array | None = None) -> None:
  """Raises if a (real) query row of a concrete mask has no allowed key.

  Args:
    mask: [b, h|1, t, s] bool, concrete (not traced).
    query_valid: optional [b, t] bool; rows that are padding are exempt.
  """
  ok = rows_attend(mask)  # [b, h|1, t]
  if query_valid is not None:
    ok = ok | ~query_valid[:, None, :]
  if not bool(jnp.all(ok)):
    bad = jnp.argwhere(~ok)[:5].tolist()
    raise ValueError(f"attention mask has query rows with no allowed key (b, h, t): {bad}")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["q_lengths", "k_lengths"],
                   meta_fields=["shape", "causal"])
@dataclasses.dataclass(frozen=True)
class LengthMask:
  """Rows of one segment each, real tokens first: query i of row r may attend key j when
  i < q_lengths[r], j < k_lengths[r] and, when `causal`, j <= i.

  For a row whose segment ids are 1 on its first n tokens and 0 after (span corruption's and UL2's
  inputs and targets) this is exactly `segment_mask` / `decoder_mask` of those ids; for a packed
  row (several documents) it is not. cuDNN takes the lengths as its padding mask
  (`query_seq_lengths`, `key_value_seq_lengths`), so that a bias beside it stays [1|b, h, t, s]
  instead of the mask being folded into a [b, h, t, s] one; a kernel that cannot (a cuDNN refusal,
  attention dropout) attends with `dense()`. A pytree (the lengths are its leaves, the shape and
  `causal` static), so it passes through scan and remat as a dense mask does.
  """

  q_lengths: jax.Array  # [b] int32
  k_lengths: jax.Array  # [b] int32
  shape: tuple[int, int]  # (t, s): query and key length
  causal: bool = False

  def valid(self) -> tuple[jax.Array, jax.Array]:
    """[b, t], [b, s] bool: the real queries and keys."""
    t, s = self.shape
    return (jnp.arange(t)[None, :] < self.q_lengths[:, None], jnp.arange(s)[None, :] < self.k_lengths[:, None])

  def dense(self) -> jax.Array:
    """[b, 1, t, s] bool."""
    mask = padding_mask(*self.valid())  # [b, 1, t, s]
    return mask & causal_mask(*self.shape) if self.causal else mask

  def attending_rows(self) -> jax.Array:
    """[b, t] bool: the query rows with at least one allowed key (a real query of a row that has
    a real key; causal: key 0 is at or before every query)."""
    return self.valid()[0] & (self.k_lengths[:, None] > 0)


def rows_mask(q_segment_ids: jax.Array, k_segment_ids: jax.Array | None = None, *, causal: bool = False,
              lengths: bool = False) -> "LengthMask | SegmentMask | jax.Array":
  """The mask of rows given by their segment ids [b, t] (queries) and [b, s] (keys; None:
  self-attention): the same document, neither side padding, and (`causal`) key at or before query.

  With `lengths` the rows must hold one segment each, real tokens first (ids positive on a row's
  first tokens, 0 after), and the mask is their `LengthMask` (what cuDNN reads); otherwise the
  [b, 1, t, s] array, built here once for every layer (`segment_mask`): a self-attention's as a
  prebuilt `SegmentMask`, whose flag cuDNN reads and whose ids the Pallas kernels read, a
  cross-attention's as a prebuilt `CrossMask`, whose ids the Pallas dropout kernel reads."""
  if not lengths:
    if k_segment_ids is None:
      return SegmentMask(q_segment_ids, causal=causal).prebuilt()
    if not causal:
      return CrossMask(q_segment_ids, k_segment_ids).prebuilt()
    return segment_mask(q_segment_ids, k_segment_ids) & causal_mask(q_segment_ids.shape[1], k_segment_ids.shape[1])
  k_segment_ids = q_segment_ids if k_segment_ids is None else k_segment_ids
  count = lambda ids: jnp.sum(ids > 0, axis=1, dtype=jnp.int32)  # [b]
  return LengthMask(count(q_segment_ids), count(k_segment_ids), (q_segment_ids.shape[1], k_segment_ids.shape[1]),
                    causal)


def dense_mask(mask: "jax.Array | SegmentMask | CrossMask | LengthMask | None",
               lengths: tuple[int, int] | None = None) -> jax.Array | None:
  """[b, 1|h, t, s] bool, or None: a `SegmentMask`, `CrossMask` or `LengthMask` as its array, any
  other mask unchanged; with `lengths` (t, s) its query and key axes broadcast to them."""
  mask = mask.dense() if isinstance(mask, (SegmentMask, CrossMask, LengthMask)) else mask
  if mask is None or lengths is None:
    return mask
  return jnp.broadcast_to(mask, mask.shape[:2] + tuple(lengths))


def mask_rows(mask: "jax.Array | SegmentMask | CrossMask | LengthMask | None", rows: jax.Array
              ) -> "jax.Array | CrossMask | None":
  """Query rows `rows` [b, n] int of a mask over [b, t] queries: [b, 1|h, n, s] bool (None: None).
  A bidirectional `SegmentMask` gives the `CrossMask` of the rows' ids over the keys' (its
  `dense()` is those rows; the Pallas dropout kernel reads the ids: masked LM's last layer, whose
  queries are the selected tokens alone); a causal one is rebuilt from the rows' ids (without its
  array) or gathered from [b, 1, t, t]."""
  if mask is None:
    return None
  if isinstance(mask, SegmentMask):
    ids = mask.segment_ids  # [b, t]
    if not mask.causal:
      return CrossMask(jnp.take_along_axis(ids, rows, axis=1), ids)
    if mask.array is None:
      out = segment_mask(jnp.take_along_axis(ids, rows, axis=1), ids)  # [b, 1, n, t]
      return out & (jnp.arange(ids.shape[1])[None, None, None, :] <= rows[:, None, :, None])
  return jnp.take_along_axis(dense_mask(mask), rows[:, None, :, None], axis=2)
