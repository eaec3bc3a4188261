"""tfx's Pallas flash-attention kernels with dropout and their VJP (`tfx.ops.flash_dropout` is
what calls them: its docstring says what they compute and why).

Kernels (each program one (block, row, head)): the forward pass keeps an online softmax over
key blocks and returns the output and each query's log-sum-exp; the backward pass runs one
kernel over key blocks (dK, dV, looping over the queries) and one over query blocks (dQ,
looping over the keys), recomputing the probabilities from the log-sum-exp, with
delta = rowsum(dO * O) (which dropout leaves valid: rowsum(dP * P) over the dropped matrix is
rowsum(dO * (P_dropped V))). Each draws the keep bits of its block pairs from the program's
stream (`program_stream`: the step's seed, the global row and head). Optional operands: a
self-attention's stacked projection (`STACKED` slots) and its bias, and a bias on the scores
[b, h, t, s], whose gradient the dQ kernel writes. Off a GPU they run in Pallas' interpreter
(slow, exact): the tests.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl

from tfx.ops import dropout
from tfx.ops.dropout import keep_probability

# Large finite negative for masked scores (as `tfx.ops.attention.MASK_VALUE`: a block whose keys
# are all masked gives weights that the next block's correction then zeroes).
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True)
class Static:
  """The kernels' compile-time parameters."""

  scale: float
  causal: bool
  rate: float
  block_q: int  # the forward kernel's query blocks
  block_k: int  # and key blocks (a self-attention's: the same)
  back_q: int  # the backward kernels' query blocks
  back_k: int  # and key blocks
  interpret: bool
  stacked: bool = False  # q, k and v are slots of one [b, t, h, 3, d] array (`STACKED`)
  biased: bool = False  # and (stacked) their projection's bias [h, 3, d] is added as they are read
  score_bias: bool = False  # a [b, h, t, s] bias is added to the scaled scores (its gradient returned)
  dense_mask: bool = False  # a [b, t, s] int8 mask (nonzero = may attend) beside the ids

  @property
  def threshold(self) -> int:
    return dropout.threshold(self.rate)

  @property
  def keep_scale(self) -> float:  # 1 / P(keep)
    return 1.0 / keep_probability(self.rate)


def program_stream(seeds_ref) -> jax.Array:
  """This program's stream key: seeds_ref holds (seed, first row, first head, 0) of the shard."""
  seed = lax.convert_element_type(seeds_ref[0], jnp.uint32)
  return dropout.stream(seed, seeds_ref[1] + pl.program_id(1), seeds_ref[2] + pl.program_id(2))


def _block(ref, rows, columns):
  """The [bq, bk] block of a score bias or a dense mask this block pair reads, or None (none)."""
  return None if ref is None else ref[rows, columns]


def _scores(q, k, q_ids, k_ids, q0, k0, static: Static, bias=None, mask=None):
  """f32 [bq, bk] masked scores of a query block starting at q0 over a key block starting at k0
  (plus their `bias` block [bq, bk], and masked where their `mask` block is 0, if any), and the
  positions (query [bq, 1], key [1, bk]) the keep bits are drawn at."""
  s = _dot(q, k, transpose_b=True) * static.scale  # [bq, bk]
  if bias is not None:
    s = s + bias.astype(jnp.float32)
  query = q0 + lax.broadcasted_iota(jnp.int32, (q.shape[0], 1), 0)  # [bq, 1]
  key_pos = k0 + lax.broadcasted_iota(jnp.int32, (1, k.shape[0]), 1)  # [1, bk]
  allowed = q_ids[:, None] == k_ids[None, :]  # [bq, bk]
  if static.causal:
    allowed = allowed & (query >= key_pos)
  if mask is not None:
    allowed = allowed & (mask != 0)
  return jnp.where(allowed, s, MASK_VALUE), query, key_pos


def _dot(a, b, *, transpose_a=False, transpose_b=False):
  """a @ b (either transposed) accumulated in float32."""
  dims = (((0,) if transpose_a else (1,), (1,) if transpose_b else (0,)), ((), ()))
  return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _key_blocks(q0, block_q: int, block_k: int, keys: int, causal: bool):
  """How many key blocks of `block_k` the queries q0..q0 + block_q - 1 attend: all, or (causal)
  those holding a key at or before the last of them."""
  return (q0 + block_q + block_k - 1) // block_k if causal else keys // block_k


def _forward_kernel(seeds_ref, q_ref, k_ref, v_ref, q_ids_ref, k_ids_ref, sb_ref, mask_ref, o_ref, lse_ref, *,
                    static: Static):
  block_q, block_k, s = static.block_q, static.block_k, k_ref.shape[0]
  key = program_stream(seeds_ref)
  q0 = pl.program_id(0) * block_q
  q = q_ref[...]  # [bq, d]
  q_ids = q_ids_ref[pl.ds(q0, block_q)]  # [bq]

  def body(j, carry):
    acc, m, l = carry  # [bq, d], [bq], [bq]
    k0 = j * block_k
    k = k_ref[pl.ds(k0, block_k), :]  # [bk, d]
    columns = pl.ds(k0, block_k)
    scores, query, key_pos = _scores(q, k, q_ids, k_ids_ref[columns], q0, k0, static,
                                     _block(sb_ref, slice(None), columns), _block(mask_ref, slice(None), columns))
    m_new = jnp.maximum(m, jnp.max(scores, axis=1))
    correction = jnp.exp(m - m_new)  # [bq]
    w = jnp.exp(scores - m_new[:, None])  # [bq, bk] unnormalised probabilities
    l = correction * l + jnp.sum(w, axis=1)
    w = jnp.where(dropout.kept(key, query, key_pos, s, static.threshold), w, 0.0)
    v = v_ref[pl.ds(k0, block_k), :]  # [bk, d]
    acc = correction[:, None] * acc + _dot(w.astype(v.dtype), v)
    return acc, m_new, l

  blocks = _key_blocks(q0, block_q, block_k, s, static.causal)
  init = (jnp.zeros(q.shape, jnp.float32), jnp.full((block_q,), -jnp.inf, jnp.float32),
          jnp.zeros((block_q,), jnp.float32))
  acc, m, l = lax.fori_loop(0, blocks, body, init)
  # A padding query, and one with no key to attend (a cross attention's document without keys,
  # which saw only masked scores): its output is 0 and its log-sum-exp +inf, so that the backward
  # kernels give it p = 0 (no gradient reaches q, k or v through it; nothing outside the kernel
  # zeroes the output or its gradient).
  attends = (m > 0.5 * MASK_VALUE) & (q_ids > 0)  # [bq]
  o_ref[...] = jnp.where(attends[:, None], acc * (static.keep_scale / l)[:, None], 0.0).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(attends, m + jnp.log(l), jnp.inf)


def _recomputed(key, q, k, q_ids, k_ids, lse, q0, k0, keys: int, static: Static, bias=None, mask=None):
  """(probabilities p [bq, bk], keep bits) of one block pair, from the forward pass' log-sum-exp;
  `keys`: the row's key count (the keep bits count query * keys + key)."""
  scores, query, key_pos = _scores(q, k, q_ids, k_ids, q0, k0, static, bias, mask)
  return jnp.exp(scores - lse[:, None]), dropout.kept(key, query, key_pos, keys, static.threshold)


def _grad_scores(p, kept, do, v, delta, static: Static):
  """(dropped probabilities, d scores) of one block pair: [bq, bk] each."""
  dropped = jnp.where(kept, p * static.keep_scale, 0.0)
  dp = jnp.where(kept, _dot(do, v, transpose_b=True) * static.keep_scale, 0.0)  # [bq, bk]
  return dropped, p * (dp - delta[:, None])


def _dkv_kernel(seeds_ref, q_ref, k_ref, v_ref, q_ids_ref, k_ids_ref, sb_ref, mask_ref, do_ref, lse_ref, delta_ref,
                *out_refs, static: Static):
  """dK and dV of a key block: into dk_ref and dv_ref, or (stacked) into the k and v slots of one
  [block, 2, d] block of the stacked gradient."""
  block_q, block_k, t, s = static.back_q, static.back_k, q_ref.shape[0], k_ids_ref.shape[0]
  key = program_stream(seeds_ref)
  k0 = pl.program_id(0) * block_k
  k, v = k_ref[...], v_ref[...]  # [bk, d] each
  k_ids = k_ids_ref[pl.ds(k0, block_k)]

  def body(i, carry):
    dk, dv = carry  # [bk, d] f32 each
    q0 = i * block_q
    q, do = q_ref[pl.ds(q0, block_q), :], do_ref[pl.ds(q0, block_q), :]  # [bq, d] each
    rows = pl.ds(q0, block_q)
    p, kept = _recomputed(key, q, k, q_ids_ref[rows], k_ids, lse_ref[rows], q0, k0, s, static,
                          _block(sb_ref, rows, slice(None)), _block(mask_ref, rows, slice(None)))
    dropped, ds = _grad_scores(p, kept, do, v, delta_ref[pl.ds(q0, block_q)], static)
    dv = dv + _dot(dropped.astype(do.dtype), do, transpose_a=True)
    dk = dk + _dot(ds.astype(q.dtype), q, transpose_a=True)
    return dk, dv

  first = k0 // block_q if static.causal else 0  # causal: no earlier query sees this key block
  zeros = jnp.zeros(k.shape, jnp.float32)
  dk, dv = lax.fori_loop(first, t // block_q, body, (zeros, zeros))
  dk = (dk * static.scale).astype(out_refs[0].dtype)
  if static.stacked:
    out_refs[0][:, STACKED.index("k"), :] = dk
    out_refs[0][:, STACKED.index("v"), :] = dv.astype(out_refs[0].dtype)
  else:
    out_refs[0][...] = dk
    out_refs[1][...] = dv.astype(out_refs[1].dtype)


def _dq_kernel(seeds_ref, q_ref, k_ref, v_ref, q_ids_ref, k_ids_ref, sb_ref, mask_ref, do_ref, lse_ref, delta_ref,
               *refs, static: Static):
  """dQ of a query block into its output ref (the last; stacked, a buffer aliased to the stacked
  gradient comes before it and is not read), or with a score bias dQ and the bias's gradient, the
  scores' (the outputs in that order)."""
  dq_ref, dsb_ref = refs if static.score_bias else (refs[-1], None)
  block_q, block_k, s = static.back_q, static.back_k, k_ref.shape[0]
  key = program_stream(seeds_ref)
  q0 = pl.program_id(0) * block_q
  q, do = q_ref[...], do_ref[...]  # [bq, d] each
  q_ids, lse, delta = q_ids_ref[pl.ds(q0, block_q)], lse_ref[...], delta_ref[...]

  def body(j, dq):
    k0 = j * block_k
    columns = pl.ds(k0, block_k)
    k, v = k_ref[columns, :], v_ref[columns, :]  # [bk, d] each
    p, kept = _recomputed(key, q, k, q_ids, k_ids_ref[columns], lse, q0, k0, s, static,
                          _block(sb_ref, slice(None), columns), _block(mask_ref, slice(None), columns))
    _, ds = _grad_scores(p, kept, do, v, delta, static)
    if dsb_ref is not None:  # the scores' gradient is the bias's
      dsb_ref[:, columns] = ds.astype(dsb_ref.dtype)
    return dq + _dot(ds.astype(k.dtype), k)

  def masked(j, carry):  # causal: the key blocks after the queries' get no gradient
    dsb_ref[:, pl.ds(j * block_k, block_k)] = jnp.zeros((block_q, block_k), dsb_ref.dtype)
    return carry

  blocks = _key_blocks(q0, block_q, block_k, s, static.causal)
  dq = lax.fori_loop(0, blocks, body, jnp.zeros(q.shape, jnp.float32))
  if dsb_ref is not None and static.causal:
    lax.fori_loop(blocks, s // block_k, masked, 0)
  dq_ref[...] = (dq * static.scale).astype(dq_ref.dtype)


class _Biased:
  """A q, k or v block ref whose reads add the projection's bias for this program's head ([d],
  float32, rounded to the block's dtype first, as `tfx.nn.layers.add_bias` adds it)."""

  def __init__(self, ref, bias_ref):
    self.ref, self.bias_ref = ref, bias_ref

  @property
  def shape(self):
    return self.ref.shape

  def __getitem__(self, index):
    block = self.ref[index]  # [n, d]
    return block + self.bias_ref[...].astype(block.dtype)[None, :]


def _with_biases(kernel, static: Static):
  """`kernel(*refs, static=static)`, its q, k and v refs reading their biases (`static.biased`:
  the three bias refs come right after them, and the kernel does not see them), and None for the
  score bias' and the dense mask's refs after the ids where there are none."""
  def call(seeds_ref, q_ref, k_ref, v_ref, *refs):
    if static.biased:
      (bq, bk, bv), refs = refs[:3], refs[3:]
      q_ref, k_ref, v_ref = _Biased(q_ref, bq), _Biased(k_ref, bk), _Biased(v_ref, bv)
    ids, refs = refs[:2], refs[2:]
    optional = []
    for present in (static.score_bias, static.dense_mask):
      optional.append(refs[0] if present else None)
      refs = refs[1:] if present else refs
    return kernel(seeds_ref, q_ref, k_ref, v_ref, *ids, *optional, *refs, static=static)
  call.__name__ = kernel.__name__
  return call


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5, 6))
def call(kernel, static: Static, block: int, out_shape: tuple, blocked: tuple[bool, ...], slots: tuple,
          aliases: tuple, seeds, *operands):
  """pallas_call of `kernel` over (n // block, b, h), n the length of its first output (queries
  or keys). Each of the outputs, then of the operands, is either `blocked` (program i gets
  positions i * block..) or whole along its length (t queries or s keys), per (row, head):
  [b, t|s, h, d] activations, [b, t|s] segment ids, [b, h, t] softmax statistics. `slots` (None
  each, or for a stacked [b, t, h, 3, d] array (first slot, slots)) picks an array's slots: one is
  a [.., d] block, two a [.., 2, d] one; `SCORE_ROWS` / `SCORE_COLUMNS` mark a [b, h, t, s] array
  blocked over its queries / its keys, `MASK_ROWS` / `MASK_COLUMNS` a [b, t, s] one. `aliases`:
  pallas_call's input_output_aliases, as pairs (operand index, the seeds not counted; output
  index).

  Under jit, as a call JAX can drop: a bare pallas_call survives dead-code elimination, and under
  a remat policy that keeps the forward kernel's named outputs the forward kernel then ran twice
  (BERT-base's step for an H100: four Triton kernels a layer where three do)."""
  b, _, h = operands[0].shape[:3]
  d = operands[0].shape[-1]

  def spec(shape: tuple[int, ...], blocked: bool, slot) -> pl.BlockSpec:
    if slot in (SCORE_ROWS, SCORE_COLUMNS):  # [b, h, t, s] scores, blocked over the queries or the keys
      rows = slot == SCORE_ROWS
      return pl.BlockSpec((None, None, block if rows else shape[2], shape[3] if rows else block),
                          lambda i, j, k: (j, k, i if rows else 0, 0 if rows else i))
    if slot in (MASK_ROWS, MASK_COLUMNS):  # a [b, t, s] mask, every head's, blocked likewise
      rows = slot == MASK_ROWS
      return pl.BlockSpec((None, block if rows else shape[1], shape[2] if rows else block),
                          lambda i, j, k: (j, i if rows else 0, 0 if rows else i))
    length = block if blocked else shape[2 if len(shape) == 3 else 1]
    if slot is not None and len(shape) == 3:  # a stacked projection's bias [h, 3, d]: this head's slot
      return pl.BlockSpec((None, None, d), lambda i, j, k: (k, slot[0], 0))
    if slot is not None:  # [b, t, h, 3, d]: one slot, or two from an even one
      start, width = slot
      if width == 1:
        return pl.BlockSpec((None, length, None, None, d), lambda i, j, k: (j, i if blocked else 0, k, start, 0))
      return pl.BlockSpec((None, length, None, width, d),
                          lambda i, j, k: (j, i if blocked else 0, k, start // width, 0))
    if len(shape) == 4:  # [b, t, h, d]
      return pl.BlockSpec((None, length, None, d), lambda i, j, k: (j, i if blocked else 0, k, 0))
    if len(shape) == 3:  # [b, h, t]
      return pl.BlockSpec((None, None, length), lambda i, j, k: (j, k, i if blocked else 0))
    return pl.BlockSpec((None, length), lambda i, j, k: (j, i if blocked else 0))  # [b, t]

  outputs = len(out_shape)
  in_specs = [pl.BlockSpec((4,), lambda i, j, k: (0,))]  # the seeds, whole
  in_specs += [spec(x.shape, flag, slot) for x, flag, slot in zip(operands, blocked[outputs:], slots[outputs:])]
  out_specs = [spec(x.shape, flag, slot) for x, flag, slot in zip(out_shape, blocked[:outputs], slots[:outputs])]
  from jax.experimental.pallas import triton as plgpu  # noqa: PLC0415  (compiler parameters only)

  return pl.pallas_call(
      _with_biases(kernel, static), grid=(out_shape[0].shape[1] // block, b, h), in_specs=in_specs,
      out_specs=out_specs, out_shape=out_shape, interpret=static.interpret,
      input_output_aliases={operand + 1: output for operand, output in aliases},
      name=f"tfx_{kernel.__name__.strip('_')}",
      compiler_params=plgpu.CompilerParams(num_warps=4 if d <= 64 else 8, num_stages=2),
  )(seeds, *operands)


# The slots of a stacked self-attention projection [b, t, h, 3, d] (`tfx.nn.attention`'s order):
# k and v first, so that the dK / dV kernel writes them as one [.., 2, d] block.
STACKED = ("k", "v", "q")


def _slot(name: str, width: int = 1) -> tuple[int, int]:
  return STACKED.index(name), width


# `call`'s slots of a [b, h, t, s] score bias (or its gradient): blocked over the queries or the keys.
SCORE_ROWS, SCORE_COLUMNS = ("scores", 2), ("scores", 3)
# and of a dense [b, t, s] mask.
MASK_ROWS, MASK_COLUMNS = ("mask", 1), ("mask", 2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def attend(q, k, v, q_ids, k_ids, score_bias, mask, seeds, static: Static):
  """Stacked (`static.stacked`): q is the [b, t, h, 3, d] array, k its bias [h, 3, d] float32
  (`static.biased`) or None, and v None. `score_bias`: [b, h, t, s] or None; `mask`: [b, t, s]
  int8 or None."""
  return _attend_fwd(q, k, v, q_ids, k_ids, score_bias, mask, seeds, static)[0]


def _activations(q, k, v, static: Static):
  """(q, k, v operands, their slots): the three arrays, or the stacked one three times, then
  (biased) its bias [h, 3, d] three times."""
  if not static.stacked:
    return (q, k, v), (None, None, None)
  slots = (_slot("q"), _slot("k"), _slot("v"))
  if static.biased:
    return (q, q, q, k, k, k), slots * 2
  return (q, q, q), slots


def _optional(score_bias, mask, *, rows: bool) -> tuple[tuple, tuple]:
  """(operands, their slots): the score bias and the dense mask there are, blocked over the
  queries (`rows`) or over the keys."""
  present = [(x, slot) for x, slot in ((score_bias, SCORE_ROWS if rows else SCORE_COLUMNS),
                                       (mask, MASK_ROWS if rows else MASK_COLUMNS)) if x is not None]
  return tuple(x for x, _ in present), tuple(slot for _, slot in present)


def _attend_fwd(q, k, v, q_ids, k_ids, score_bias, mask, seeds, static: Static):
  b, t, h = q.shape[:3]
  d = q.shape[-1]
  stats = jax.ShapeDtypeStruct((b, h, t), jnp.float32)
  qkv, slots = _activations(q, k, v, static)
  extra, extra_slots = _optional(score_bias, mask, rows=True)
  # blocked: outputs (o, lse), then inputs (q, k, v[, their biases], q_ids, k_ids[, score bias][, mask])
  out, lse = call(_forward_kernel, static, static.block_q, (jax.ShapeDtypeStruct((b, t, h, d), q.dtype), stats),
                  (True, True, True, False, False, *(False,) * (len(qkv) - 3), False, False, *(True,) * len(extra)),
                  (None, None, *slots, None, None, *extra_slots), (), seeds, *qkv, q_ids, k_ids,
                  *extra)  # [b, t, h, d], [b, h, t]
  out, lse = checkpoint_name(out, "attention_out"), checkpoint_name(lse, "attention_out")
  return out, (q, k, v, q_ids, k_ids, score_bias, mask, seeds, out, lse)


def _attend_bwd(static: Static, residuals, d_out):
  q, k, v, q_ids, k_ids, score_bias, mask, seeds, out, lse = residuals
  delta = jnp.einsum("bthd,bthd->bht", d_out.astype(jnp.float32), out.astype(jnp.float32))  # [b, h, t]
  d_out = d_out.astype(q.dtype)
  qkv, slots = _activations(q, k, v, static)
  extra, row_slots = _optional(score_bias, mask, rows=True)
  _, column_slots = _optional(score_bias, mask, rows=False)
  n = len(extra)
  operands = (*qkv, q_ids, k_ids, *extra, d_out, lse, delta)
  biases = (False,) * (len(qkv) - 3)  # never blocked
  like = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
  # dK, dV: blocked over keys; every query read. dQ (and d score bias): blocked over queries; every key read.
  dkv_in = (False, True, True, *biases, False, False, *(True,) * n, False, False, False)
  dq_in = (True, False, False, *biases, False, False, *(True,) * n, True, True, True)
  dkv_slots = (*slots, None, None, *column_slots, None, None, None)
  dq_slots = (*slots, None, None, *row_slots, None, None, None)
  scores = () if score_bias is None else (score_bias,)  # its gradient: the dQ kernel's second output
  if not static.stacked:
    d_k, d_v = call(_dkv_kernel, static, static.back_k, (like(k), like(v)), (True, True, *dkv_in),
                    (None, None, *dkv_slots), (), seeds, *operands)
    d_q, *d_scores = call(_dq_kernel, static, static.back_q, (like(q), *map(like, scores)),
                          (True, *(True,) * len(scores), *dq_in), (None, *(SCORE_ROWS,) * len(scores), *dq_slots),
                          (), seeds, *operands)
    return d_q, d_k, d_v, None, None, (d_scores[0] if scores else None), None, None
  # Stacked: the dK / dV kernel writes the k and v slots of the [b, t, h, 3, d] gradient, and the dQ
  # kernel its q slot in the same buffer (aliased), so that no copy stacks the three gradients.
  (d_kv,) = call(_dkv_kernel, static, static.back_k, (like(q),), (True, *dkv_in), (_slot("k", 2), *dkv_slots), (),
                 seeds, *operands)
  (d_qkv,) = call(_dq_kernel, static, static.back_q, (like(q),), (True, *dq_in, True),
                  (_slot("q"), *dq_slots, _slot("q")), ((len(operands), 0),), seeds, *operands, d_kv)
  # the bias's gradient: the projection's summed over the rows, in float32 (as `add_bias`'s)
  d_bias = jnp.sum(d_qkv.astype(jnp.float32), axis=(0, 1)).astype(k.dtype) if static.biased else None
  return d_qkv, d_bias, None, None, None, None, None, None


attend.defvjp(_attend_fwd, _attend_bwd)
