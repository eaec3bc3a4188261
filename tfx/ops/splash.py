"""Splash attention over packed rows on TPU, from their segment ids (`model.attention=splash`).

The kernel is JAX's own Pallas kernel for TPUs (`jax.experimental.pallas.ops.tpu.
splash_attention`, lowered through Mosaic), the one MaxText uses there: a block-sparse flash
attention whose static mask (causal or full) skips the key blocks above the diagonal, with its
own dQ and dK/dV kernels, reading one [b, t] segment-id array for packing instead of a
[b, 1, t, t] mask, and keeping no [b, h, t, t] probabilities. Like `model.attention=pallas` on
GPUs it covers a family's self-attention over packed rows (`SegmentMask`); what it cannot take
goes to XLA's attention (`tfx.ops.dot_product_attention` decides and logs why).

Grouped-query heads run as splash's multi-query kernel once per key/value head, without repeating
K and V (except on a mesh that cuts the heads more ways than there are key/value heads: each
device then gets a copy per query head). The kernel has no score scale: q is multiplied by it
first, in q's dtype (exact for head_dim 64, whose scale is a power of two). Its forward residuals
(output and log-sum-exp) are named `attention_out`, so `model.remat=dots_attention` keeps them,
as it keeps XLA attention's.

Off a TPU the same kernel runs in Pallas' interpreter (slow, exact): that is how the tests check
it against the reference attention on CPU. It has not yet run on a TPU here.
"""

import jax
import jax.numpy as jnp

from tfx.ops import flash, target

# Query / key block lengths tried, largest first (MaxText's default block is 512); a row length
# must be a multiple of one. 128 is the TPU's lane width, the smallest block Mosaic tiles well.
BLOCKS = (512, 256, 128)
NAME = "Splash attention"


def unsupported(q: jax.Array, k: jax.Array, mask, bias) -> str | None:
  """Why the splash kernel cannot compute this attention (a short reason), or None if it can."""
  return flash.unsupported(q, k, mask, bias, blocks=BLOCKS)


def _kernel(t: int, groups: int, causal: bool, interpret: bool):
  """Splash's multi-query kernel for rows of t tokens and `groups` query heads per key/value head:
  q [groups, t, d], k and v [t, d], segment ids [t] each."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel  # noqa: PLC0415
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks  # noqa: PLC0415

  block = flash.block_length(t, BLOCKS)
  head = masks.CausalMask((t, t)) if causal else masks.FullMask((t, t))
  sizes = kernel.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                            block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
  splash = kernel.make_splash_mqa(masks.MultiHeadMask([head] * groups), block_sizes=sizes, head_shards=1,
                                  q_seq_shards=1, residual_checkpoint_name="attention_out", interpret=interpret)
  return lambda q, k, v, ids: splash(q, k, v, segment_ids=kernel.SegmentIds(q=ids, kv=ids))


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *, causal: bool,
                     scale: float, interpret: bool | None = None) -> jax.Array:
  """Attention of each token over the tokens of its own segment (and, when `causal`, at or before
  it); padding (segment 0) queries give zeros.

  Args:
    q: [b, t, h, d]; k, v: [b, t, k, d] (k divides h: grouped-query heads).
    segment_ids: [b, t] int, 0 = padding.
    causal: whether key j > query i is masked.
    scale: the score scale.
    interpret: run Pallas' interpreter instead of compiling the kernel; default: off a TPU (`tfx.ops.target.backend()`).

  Returns:
    [b, t, h, d] in q's dtype, equal to `softmax_attention` with `SegmentMask(segment_ids,
    causal).dense()`.
  """
  t = q.shape[1]
  if flash.block_length(t, BLOCKS) is None:
    raise ValueError(f"splash attention needs a row length that is a multiple of {BLOCKS[-1]}, got {t}")
  if interpret is None:
    interpret = target.backend() != "tpu"
  h, kh = q.shape[2], k.shape[2]
  if kh % flash.shards()[1]:  # fewer key/value heads than head shards: each device needs its own copy
    k, v = (jnp.repeat(x, h // kh, axis=2) for x in (k, v))  # [b, t, h, d]

  def kernel(q, k, v, ids):  # one device's rows and heads: [b', t, h', d], [b', t, k', d], ids [b', t]
    b, _, h, d = q.shape
    kh = k.shape[2]
    splash = _kernel(t, h // kh, causal, interpret)
    qg = jnp.transpose(q.reshape(b, t, kh, h // kh, d), (0, 2, 3, 1, 4)) * jnp.asarray(scale, q.dtype)  # [b', k', g, t, d]
    kt, vt = (jnp.transpose(x, (0, 2, 1, 3)) for x in (k, v))  # [b', k', t, d]
    per_head = jax.vmap(splash, in_axes=(0, 0, 0, None))  # over key/value heads
    out = jax.vmap(per_head)(qg, kt, vt, ids)  # [b', k', g, t, d]
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, h, d)  # [b', t, h', d]

  return flash.per_device(kernel, q, k, v, segment_ids)
