"""Flash attention over packed rows from their segment ids (`model.attention=pallas`).

The kernel is JAX's own Pallas flash attention for GPUs (`jax.experimental.pallas.ops.gpu.
attention.mha`, lowered through Triton): a tiled online softmax with its own backward kernels,
which takes the causal flag and one [b, t] segment-id array and so never builds a [b, h, t, t]
mask or keeps [b, h, t, t] probabilities. It covers a family's self-attention over packed rows
(`SegmentMask`: GPT-style causal, BERT-style bidirectional); masks it cannot express (prefix LM,
cross attention, two streams, a bias) go to XLA's attention (`tfx.ops.dot_product_attention`
decides and logs why).

Under `model.remat=dots_attention` the backward pass reads the forward kernel's output and
log-sum-exp, named `attention_out` (one of `tfx.ops.attention.RESIDUAL_NAMES`), instead of running
the forward kernel again: the kernel's own VJP does not name them, so this module wraps the two
kernels in a VJP of its own (`_named_mha`). That calls the backward of JAX's module, a private
function; a JAX whose function differs gets the kernel's own VJP (the same numbers, the forward
kernel run again under remat).

Off a GPU the same kernel runs in Pallas' interpreter (slow, exact): that is how the tests check
it against the reference attention on CPU.
"""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from tfx.ops import target

# Query / key block lengths tried, largest first; a row length must be a multiple of one.
BLOCKS = (128, 64, 32, 16)
# The backward kernels' blocks (Pallas' defaults): smaller, as they hold dK, dV (or dQ) too.
BACKWARD_BLOCK = 32


def block_length(t: int, blocks: tuple[int, ...] = BLOCKS) -> int | None:
  """The largest of `blocks` that divides t, or None (the kernel cannot run on t)."""
  return next((b for b in blocks if t % b == 0), None)


def unsupported(q: jax.Array, k: jax.Array, mask, bias, *, blocks: tuple[int, ...] = BLOCKS,
                cross: bool = False) -> str | None:
  """Why a segment-id kernel with these block lengths (this module's, or splash's on TPU) cannot
  compute this attention (a short reason), or None if it can. With `cross`, the kernel also takes
  a cross-attention's `CrossMask` (its own query and key ids)."""
  from tfx.ops.masks import CrossMask, SegmentMask  # noqa: PLC0415

  if not (isinstance(mask, SegmentMask) or cross and isinstance(mask, CrossMask)):
    kinds = "self- or cross-attention" if cross else "self-attention"
    return f"it needs the segment-id {kinds} mask of a family; this one is a dense mask"
  if bias is not None:
    return "it takes no attention bias"
  if isinstance(mask, SegmentMask) and q.shape[1] != k.shape[1]:
    return f"it needs self-attention, got {q.shape[1]} queries over {k.shape[1]} keys"
  return unfit(q, k, blocks=blocks)


def unfit(q: jax.Array, k: jax.Array, *, blocks: tuple[int, ...] = BLOCKS, queries: bool = True) -> str | None:
  """Why a kernel with these block lengths cannot take q [b, t, h, d] and k [b, s, kv, d] whatever
  their mask (a short reason), or None: lengths a block divides (`queries=False`: the keys' alone,
  the caller pads the queries), heads that group, rows and heads that divide over the mesh."""
  lengths = (("row", q.shape[1]),) if queries else ()
  for what, length in (*lengths, ("key row", k.shape[1])):
    if block_length(length, blocks) is None:
      return f"the {what} length {length} is not a multiple of {blocks[-1]}"
  if q.shape[2] % k.shape[2]:
    return f"{q.shape[2]} query heads do not group over {k.shape[2]} key/value heads"
  rows, heads = shards()
  if q.shape[0] % rows or q.shape[2] % heads:
    return (f"its {q.shape[0]} rows x {q.shape[2]} heads do not divide over the mesh's {rows} row x {heads} head "
            f"shards (it runs on each device's own)")
  return None


# The parameters of `jax.experimental.pallas.ops.gpu.attention._mha_backward` this module passes.
_BACKWARD_PARAMS = ("sm_scale", "causal", "block_sizes", "backward_pass_impl", "num_warps", "num_stages", "grid",
                    "interpret", "debug", "return_residuals", "res", "do")


def _pallas_backward():
  """JAX's backward kernels for its Pallas GPU attention, or None if this JAX's differ."""
  from jax.experimental.pallas.ops.gpu import attention as pallas_attention  # noqa: PLC0415  (only when used)

  backward = getattr(pallas_attention, "_mha_backward", None)
  if backward is None or tuple(inspect.signature(backward).parameters) != _BACKWARD_PARAMS:
    return None
  return backward


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _named_mha(q, k, v, ids, scale, causal, sizes, interpret):
  """JAX's Pallas GPU attention with its residuals named for remat ([b, t, h, d] each)."""
  return _named_mha_fwd(q, k, v, ids, scale, causal, sizes, interpret)[0]


def _named_mha_fwd(q, k, v, ids, scale, causal, sizes, interpret):
  from jax.experimental.pallas.ops.gpu import attention as pallas_attention  # noqa: PLC0415

  out, lse = pallas_attention.mha(q, k, v, ids, sm_scale=scale, causal=causal, block_sizes=sizes,
                                  interpret=interpret, return_residuals=True)  # [b, t, h, d], [b, h, t]
  out, lse = checkpoint_name(out, "attention_out"), checkpoint_name(lse, "attention_out")
  return out, (q, k, v, ids, out, lse)


def _named_mha_bwd(scale, causal, sizes, interpret, residuals, d_out):
  d_q, d_k, d_v, _ = _pallas_backward()(scale, causal, sizes, "triton", None, 2, None, interpret, False, False,
                                        residuals, d_out)
  return d_q, d_k, d_v, None


_named_mha.defvjp(_named_mha_fwd, _named_mha_bwd)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *, causal: bool,
                    scale: float, interpret: bool | None = None) -> jax.Array:
  """Attention of each token over the tokens of its own segment (and, when `causal`, at or before
  it); padding (segment 0) queries give zeros.

  Args:
    q: [b, t, h, d]; k, v: [b, t, k, d] (k divides h: grouped-query heads are repeated).
    segment_ids: [b, t] int, 0 = padding.
    causal: whether key j > query i is masked.
    scale: the score scale.
    interpret: run Pallas' interpreter instead of compiling the kernel; default: off a GPU (`tfx.ops.target.backend()`).

  Returns:
    [b, t, h, d] in q's dtype, equal to `softmax_attention` with `SegmentMask(segment_ids,
    causal).dense()`.
  """
  from jax.experimental.pallas.ops.gpu import attention as pallas_attention  # noqa: PLC0415  (only when used)

  b, t, h, d = q.shape
  block = block_length(t)
  if block is None:
    raise ValueError(f"flash attention needs a row length that is a multiple of {BLOCKS[-1]}, got {t}")
  if k.shape[2] != h:  # grouped-query heads: each key/value head serves h // k query heads
    k = jnp.repeat(k, h // k.shape[2], axis=2)  # [b, t, h, d]
    v = jnp.repeat(v, h // v.shape[2], axis=2)  # [b, t, h, d]
  back = min(block, BACKWARD_BLOCK)
  sizes = pallas_attention.BlockSizes(block_q=block, block_k=block, block_q_dkv=back, block_kv_dkv=back,
                                      block_q_dq=back, block_kv_dq=back)
  if interpret is None:
    interpret = target.backend() != "gpu"

  named = _pallas_backward() is not None

  def kernel(q, k, v, ids):  # one device's rows and heads: [b', t, h', d], ids [b', t]
    if named:
      return _named_mha(q, k, v, ids, float(scale), causal, sizes, interpret)  # [b', t, h', d]
    return pallas_attention.mha(q, k, v, ids, sm_scale=float(scale), causal=causal, block_sizes=sizes,
                                interpret=interpret)  # [b', t, h', d]

  return per_device(kernel, q, k, v, segment_ids)


def _activation_spec():
  """The mesh of the current context and the [b, t, h, d] activations' PartitionSpec on it, or
  None where there is no mesh of several devices."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return None
  import flax.linen as nn  # noqa: PLC0415  (the logical rules of the mesh context, tfx.parallel.context)

  return mesh, nn.logical_to_mesh_axes(("act_batch", "act_length", "act_heads", "act_kv"))


def shards() -> tuple[int, int]:
  """(row shards, head shards): how many ways `per_device` cuts the batch and the heads."""
  found = _activation_spec()
  if found is None:
    return 1, 1
  mesh, spec = found

  def ways(axes) -> int:
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    return int(np.prod([mesh.shape[a] for a in axes]))

  return ways(spec[0]), ways(spec[2])


def per_device(kernel, q: jax.Array, k: jax.Array, v: jax.Array, ids: jax.Array, *replicated: jax.Array,
               offsets: bool = False, key_ids: jax.Array | None = None, zero_padding: bool = True,
               scores: jax.Array | None = None, dense: jax.Array | None = None) -> jax.Array:
  """`kernel(q, k, v, ids, *replicated)` on each device's shard of the rows and heads
  (`jax.shard_map` over the activations' logical sharding: batch over the data axes, heads over
  `tensor`; `replicated` operands whole on every device) when the current mesh has more than one
  device, else on the whole arrays; padding queries (segment 0) give zeros. With `offsets`, the
  kernel also gets the global index of its first row and first head (int32 scalars; 0 and 0
  without a mesh), for what it draws from global positions. With `key_ids` [b, s] (a cross
  attention's keys' segment ids; `ids` are then the queries'), the kernel gets them after `ids`.
  q, k and v may also be a stacked [b, t, h, 3, d] projection, cut over its rows and heads alike,
  or its bias [h, 3, d], cut over the heads (its gradient summed over the row shards).
  `zero_padding=False`: the kernel gives padding queries zeros (and no gradient) itself. With
  `scores` [b, h, t, s] (a bias of every row and head on the scores), the kernel gets it after the
  ids, cut over the rows and heads alike; with `dense` [b, t, s] (a mask, every head's), after
  them, cut over the rows.

  JAX's segment-id kernels let padding queries attend padding keys (both segment 0): their outputs
  are zeroed here, as the mask allows them nothing (their zero cotangent also keeps them out of dK
  and dV); tfx's dropout kernels give them zeros themselves.

  A Pallas call is opaque to XLA's partitioner: left alone under a sharded batch it gathers every
  operand onto every device and runs the whole batch on each (28 all-gathers in one attention
  call on a 2x2x2 mesh). Attention needs no communication across rows or heads, so each device
  runs the kernel on its own.
  """
  found = _activation_spec()
  ids = tuple(x.astype(jnp.int32) for x in (ids, key_ids) if x is not None)  # [b, t] (, [b, s])
  blocks = tuple(x for x in (scores, dense) if x is not None)  # [b, h, t, s], [b, t, s]
  ids += blocks

  def zeroed(q, k, v, *ids_and_replicated):  # [b', t, h', d], ids [b', t]
    extra = ()
    if offsets:
      extra = (jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))
      if found is not None:
        extra = tuple(_shard_index(found[1][dim]) * q.shape[dim] for dim in (0, 2))
    out = kernel(q, k, v, *ids_and_replicated, *extra)  # [b', t, h', d]
    if not zero_padding:
      return out
    return jnp.where((ids_and_replicated[0] > 0)[:, :, None, None], out, jnp.zeros((), out.dtype))

  if found is None:
    return zeroed(q, k, v, *ids, *replicated)
  from jax.sharding import PartitionSpec  # noqa: PLC0415

  _, spec = found  # [b, t, h, d]
  rows = (PartitionSpec(*spec[:2]),) * (len(ids) - len(blocks))  # [b, t] (, [b, s])
  rows += () if scores is None else (PartitionSpec(spec[0], spec[2], None, None),)  # [b, h, t, s]
  rows += () if dense is None else (PartitionSpec(spec[0], None, None),)  # [b, t, s]
  whole = (PartitionSpec(),) * len(replicated)
  # a stacked projection [b, t, h, 3, d] keeps its slots whole; its bias [h, 3, d] goes with the heads
  stacked = {4: spec, 5: PartitionSpec(*spec[:3], None, spec[3]), 3: PartitionSpec(spec[2], None, spec[3])}
  activations = tuple(stacked[x.ndim] for x in (q, k, v))
  return jax.shard_map(zeroed, in_specs=(*activations, *rows, *whole), out_specs=spec,
                       check_vma=False)(q, k, v, *ids, *replicated)


def _shard_index(axes) -> jax.Array:
  """int32: this device's index along mesh axes that shard one dimension (None, a name or a
  tuple of names, major first, as a PartitionSpec entry gives them); 0 for None."""
  if axes is None:
    return jnp.zeros((), jnp.int32)
  return jax.lax.axis_index(axes).astype(jnp.int32)
