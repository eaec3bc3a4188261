"""cuDNN's fused attention as tfx calls it: which of a mask's forms the kernel gets (sequence
lengths, a dense mask whose empty rows are given every key, or a packed row's runs in cuDNN's
packed layout), and the even lengths its backward pass needs beside a mask or bias.

`tfx.ops.attention.dot_product_attention` picks this kernel (`choose_implementation`) and falls back
to XLA's attention when `attention` here reports that cuDNN refused.
"""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp

from tfx.ops import hoisting, target
from tfx.ops.masks import LengthMask, SegmentMask, SegmentRuns, dense_mask, rows_attend


def kernel_mask(mask: jax.Array | None) -> jax.Array | None:
  """[b, h|1, t, s]: `mask` with every row that has no allowed key given all of them.

  JAX passes a boolean mask to cuDNN as a bias of a large negative number, so the scores of such
  a row are all that one number; cuDNN's backward pass then gives NaN in dq (seen on an H200 with
  jax 0.11.2, cross attention of 128 queries over 64 keys; benchmarks/gpu/cudnn_empty_rows.py).
  The row's output is zeroed afterwards (the guard), which also zeroes its gradient.
  """
  if mask is None:
    return None
  return mask | ~rows_attend(mask)[..., None]


def padding_attends_padding(v: jax.Array, mask: SegmentMask) -> tuple[jax.Array, jax.Array]:
  """(v, mask [b, 1, t, t]) for a kernel that takes a dense mask, such that the kernel itself gives
  the guard's zeros for a packed row's padding queries (segment 0, the only queries of a
  `SegmentMask` with no allowed key).

  Each padding query attends the padding keys (itself included, so no row is empty, causal or
  not), whose values are zeroed: its output is a mean of zero vectors, exactly 0, and so are its
  gradients (dq = dk = 0 where the output and the values it read are 0; dv at a padding key is
  taken by the zeroing). The real queries' keys are unchanged. Where the guard was a select over
  the [b, t, h, d] output and another over its gradient, the zeroing of v fuses into the kernels
  that write v and read dv (GPT-2-small's step compiled for an H100: 102.7 -> 100.3 GB).
  """
  pad = mask.segment_ids == 0  # [b, t]
  v = hoisting.where(~pad[:, :, None, None], v, 0.0)  # [b, t, k, d]
  return v, mask.dense() | (pad[:, None, :, None] & pad[:, None, None, :])


@jax.custom_vjp
def _real_only_gradient(x: jax.Array, valid: jax.Array) -> jax.Array:
  """x [b, t, ...] unchanged; its cotangent zeroed where `valid` [b, t] is False."""
  return x


def _real_only_gradient_fwd(x, valid):
  return x, valid


def _real_only_gradient_bwd(valid, g):
  valid = valid.reshape(valid.shape + (1,) * (g.ndim - valid.ndim))
  return jnp.where(valid, g, jnp.zeros((), g.dtype)), None


_real_only_gradient.defvjp(_real_only_gradient_fwd, _real_only_gradient_bwd)


def even_lengths(q, k, v, mask, bias):
  """(q, k, v, mask, bias) at even lengths: an odd t gets one more query row (zeros; its output is
  to be dropped, so it sends no gradient anywhere), an odd s one more key (zeros) that no query
  may attend. For cuDNN's backward pass, which refuses odd lengths beside a mask or bias: XLNet's
  query stream attends from 85 prediction slots, T5's decoder from an odd number of targets, a
  packed row of odd length. The mask is a dense [b|1, h|1, t, s], a `LengthMask` (its lengths
  leave the new row and key out), a `SegmentMask` (the new position is padding, segment 0: no
  real query attends it, and a padding query's output stays 0 under `padding_attends_padding`)
  or None."""
  t, s = q.shape[1], k.shape[1]
  pt, ps = t % 2, s % 2
  q = jnp.pad(q, ((0, 0), (0, pt), (0, 0), (0, 0)))  # [b, t + pt, h, d]
  k, v = (jnp.pad(x, ((0, 0), (0, ps), (0, 0), (0, 0))) for x in (k, v))  # [b, s + ps, k, d]
  bias = None if bias is None else jnp.pad(bias, ((0, 0), (0, 0), (0, pt), (0, ps)))
  if isinstance(mask, LengthMask):
    return q, k, v, dataclasses.replace(mask, shape=(t + pt, s + ps)), bias
  if isinstance(mask, SegmentMask):  # self-attention: t == s
    ids = jnp.pad(mask.segment_ids, ((0, 0), (0, pt)))  # [b, t + pt], the new position segment 0
    array = None if mask.array is None else jnp.pad(mask.array, ((0, 0), (0, 0), (0, pt), (0, ps)))
    return q, k, v, SegmentMask(ids, mask.causal, array), bias  # its runs left out: the mask
  if mask is None and ps:
    mask = jnp.ones((1, 1, t, s), bool)
  mask = None if mask is None else jnp.pad(mask, ((0, 0), (0, 0), (0, pt), (0, ps)))  # the new key: False
  return q, k, v, mask, bias


def attention(q, k, v, mask, bias, scale: float, causal: bool
                     ) -> tuple[jax.Array | None, str | None, str | None]:
  """(cuDNN's fused attention, None, how the mask went if not as usual), or (None, why cuDNN
  refused, None). A `LengthMask` goes to cuDNN as sequence lengths (its padding mask: a bias
  beside it is not widened to [b, h, t, s]); a `SegmentMask` as its array with the padding
  queries attending the zeroed padding values (`padding_attends_padding`), or with its `runs` as
  cuDNN's packed layout (`packed_attention`); any other mask as the [b, 1|h, t, s] array with empty
  rows given every key (`kernel_mask`). JAX folds an array mask into a bias. An odd length beside
  a mask or a bias is padded to even (`even_lengths`)."""
  t, s = q.shape[1], k.shape[1]
  if (mask is not None or bias is not None) and (t % 2 or s % 2):
    # JAX's cuDNN wrapper checks this only when it builds the backward pass, after it has
    # accepted the forward call: were it not padded here, the train step would not trace.
    kept = mask if isinstance(mask, (LengthMask, SegmentMask)) else dense_mask(mask, (t, s))
    out, refused, how = attention(*even_lengths(q, k, v, kept, bias), scale, causal)
    return (None if out is None else out[:, :t]), refused, how
  kwargs, packed_refused = {}, None
  if isinstance(mask, LengthMask):
    # At least one of each: a row without real tokens attends its first key instead of nothing
    # (its queries are zeroed by the guard). cuDNN leaves the gradients of the padding positions
    # to its own devices: they are zeroed, so that nothing but the real tokens reaches a weight.
    q_valid, k_valid = mask.valid()  # [b, t], [b, s]
    q = _real_only_gradient(q, q_valid)
    k, v = _real_only_gradient(k, k_valid), _real_only_gradient(v, k_valid)
    kwargs = {"query_seq_lengths": jnp.maximum(mask.q_lengths, 1).astype(jnp.int32),
              "key_value_seq_lengths": jnp.maximum(mask.k_lengths, 1).astype(jnp.int32)}
  elif isinstance(mask, SegmentMask):  # its padding queries get their zeros from the kernel itself
    v, kwargs["mask"] = padding_attends_padding(v, mask)
  elif mask is not None:
    kwargs["mask"] = kernel_mask(dense_mask(mask, (t, s)))
  # A mask alone (no bias of the model's) needs no gradient of the bias JAX folds it into.
  no_bias_gradient = bias is None and "mask" in kwargs

  def masked(q, k, v):
    # A mask stays exact for every row with a key; `is_causal` lets cuDNN skip the key blocks
    # above the diagonal (with lengths, it is the causal half of cuDNN's PADDING_CAUSAL mask).
    with target.cudnn_without_bias_gradient() if no_bias_gradient else contextlib.nullcontext():
      return jax.nn.dot_product_attention(q, k, v, bias=bias, scale=scale, is_causal=causal and t == s,
                                          implementation="cudnn", **kwargs)

  if isinstance(mask, SegmentMask) and mask.runs is not None and bias is None and t == s:
    try:
      return packed_attention(q, k, v, mask.runs, masked, scale, mask.causal), None, (
          f"packed rows: at most {mask.runs.lengths.shape[1]} runs a row, else the mask")
    except Exception as e:  # noqa: BLE001  (a JAX without the packed layout, a GPU before Hopper)
      packed_refused = f"packed rows refused ({str(e).splitlines()[0][:100]}): the mask"
  try:
    return masked(q, k, v), None, packed_refused
  except Exception as e:  # noqa: BLE001  (cuDNN refuses a shape / layout / version at trace time)
    return None, str(e).splitlines()[0][:120], None


def packed_attention(q, k, v, runs: SegmentRuns, masked, scale: float, causal: bool) -> jax.Array:
  """Self-attention of packed rows [b, t, h, d] in cuDNN's packed layout: each run of one segment
  id (`runs`, `SegmentRuns`) a sequence of its own, causal within it or not, so that the kernel
  reads no mask and skips every key block outside a query's run (documents of 100 tokens in a
  row of 1024 leave about a tenth of the blocks). A padding run attends itself, its values zeroed
  (`padding_attends_padding`): its output is 0, as the mask's. A batch whose runs do not fit
  (`runs.fits` false: more runs than the layout holds, or a document split over two runs)
  attends with the mask instead (`masked(q, k, v)`, cuDNN's call with the [b, 1, t, t] mask;
  `lax.cond`: one of the two kernels runs). JAX's
  private cuDNN module (its public `dot_product_attention` has no offsets); Hopper or later.
  """
  from jax._src.cudnn import fused_attention_stablehlo as fused  # noqa: PLC0415

  mask_type = fused.MaskType.PADDING_CAUSAL if causal else fused.MaskType.PADDING

  def packed(q, k, v):
    return fused.dot_product_attention(q, k, v, q_seqlen=runs.lengths, kv_seqlen=runs.lengths,
                                       q_offsets=runs.offsets, kv_offsets=runs.offsets, scale=scale,
                                       mask_type=mask_type)

  return jax.lax.cond(runs.fits, packed, masked, q, k, v)
