"""Flash attention with dropout on its probabilities, as Pallas kernels of tfx's own
(`model.attention=pallas` with `model.attention_dropout > 0`).

The papers' configs keep attention dropout (BERT, RoBERTa, ELECTRA, BART, XLNet: 0.1). No fused
kernel JAX exposes applies it (cuDNN's fMHA has dropout, but JAX's API takes its seed as a
compile-time constant: the same mask every step), so those configs ran XLA's attention, which
writes and reads [b, h, t, s] scores, probabilities and a keep mask several times a layer
(BERT-base's own step for an H100 at 32 rows: 113.3 GB a step against 43.3 with dropout off).
These kernels draw the keep mask inside the kernel from a counter hash and never write it, nor any
[b, h, t, s] array (but the gradient of a bias given as one).

What they compute (the same as `tfx.nn.attention._reference_with_dropout` over a `SegmentMask`, a
cross attention's `CrossMask` or a dense mask, the same dropped scores): p = softmax(q k^T * scale
[+ bias]) over the keys a query may attend (its own segment; at or before it when causal; for a
cross attention, the keys of its own segment, s of them where there are t queries; where a dense
mask allows), out = (p * keep / P(keep)) v, and 0 for a query with no key to attend. The keep bit
of score (row, head, query, key) is `tfx.ops.dropout.keep_bits` of [b, h, t, s]: a hash of the
step's seed, the *global* row and head (a shard adds its offsets) and the query and key positions,
so that every mesh, block size and kernel draws the same mask, the backward kernels draw it again
bit for bit, and XLA's attention with dropout draws it too (since stop 64; before, XLA's path drew
threefry bits): turning the kernel on changes no dropped score.

The kernels and their VJP are in `tfx.ops.flash_dropout_kernels` (forward, dK/dV and dQ, the
probabilities recomputed from the log-sum-exp); off a GPU they run in Pallas' interpreter (slow,
exact): the tests.

Since stop 65 they also take BART's cross attention (decoder queries over the encoder's keys, each
side's segment ids), which had kept XLA's attention: BART-base's own step compiled for an H100 at 32
rows moves 72.8 GB instead of 91.2 and needs 9.32 instead of 12.07 GiB. And a self-attention's
fused projection [b, t, h, 3, d] comes whole (`STACKED` slots, its bias added as the blocks are
read), its gradient is written as one stacked array, and padding queries get their zeros in the
kernel: BERT-base's step 45.8 -> 43.3 GB, BART-base's 69.2 -> 66.0. Since stop 66 they take a
bias on the scores of every row and head, which also carries a dense mask (XLNet's relative terms
and permutation masks), and a dense mask alone (the two-stream encoder's): XLNet-base's step 252.2
-> 174.0 GB, the two-stream encoder's 137.2 -> 70.9 (docs/performance/6-dropout-and-layout.md).
"""

import jax
import jax.numpy as jnp
from jax import lax

from tfx.ops import dropout, flash, masks, target
from tfx.ops.dropout import keep_probability
from tfx.ops.flash_dropout_kernels import MASK_VALUE, STACKED, Static, attend  # STACKED: tfx.nn.attention's
from tfx.ops.masks import CrossMask, SegmentMask


def reference_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *, causal: bool,
                        scale: float, rate: float, seed: jax.Array,
                        key_segment_ids: jax.Array | None = None) -> jax.Array:
  """What `dropout_flash_attention` computes, as einsums in XLA with [b, h, t, s] arrays: the
  softmax in float32 over the segment mask (`key_segment_ids`: a cross attention's), the scores
  `tfx.ops.dropout.keep_bits` keeps kept and scaled by 1 / P(keep), queries with no key to attend
  (padding) zero ([b, t, h, d] in v's dtype; the tests' and `tfx.check_attention`'s reference)."""
  b, t, h, _ = q.shape
  s = k.shape[1]
  if k.shape[2] != h:
    k, v = (jnp.repeat(x, h // x.shape[2], axis=2) for x in (k, v))  # [b, s, h, d]
  mask = (SegmentMask(segment_ids, causal) if key_segment_ids is None else
          CrossMask(segment_ids, key_segment_ids)).dense()  # [b, 1, t, s]
  scores = jnp.einsum("bthd,bshd->bhts", q, k).astype(jnp.float32) * scale  # [b, h, t, s]
  probs = jax.nn.softmax(jnp.where(mask, scores, MASK_VALUE), axis=-1)
  keep = dropout.keep_bits(seed, (b, h, t, s), rate)
  probs = jnp.where(keep, probs / keep_probability(rate), 0.0).astype(v.dtype)
  out = jnp.einsum("bhts,bshd->bthd", probs, v)
  return jnp.where(jnp.any(mask, axis=-1)[:, 0, :, None, None], out, 0.0)


def unsupported(q: jax.Array, k: jax.Array, mask, bias) -> str | None:
  """Why these kernels cannot compute this attention (a short reason), or None if they can: a
  family's segment-id mask (`SegmentMask`, `CrossMask`), a dense mask [b|1, 1, t, s] (the
  two-stream encoder's) or none, each with or without a bias of every row and head [b, h, t, s]
  (XLNet's relative terms), which carries a dense mask (`score_bias`)."""
  if isinstance(mask, (SegmentMask, CrossMask)):
    refused = flash.unsupported(q, k, mask, None, cross=True) or _bias_unfit(q, k, bias, carries_mask=False)
  else:
    refused = _dense_unfit(q, k, masks.dense_mask(mask)) or _bias_unfit(q, k, bias, carries_mask=mask is not None)
  if refused is not None:
    return refused
  d = q.shape[-1]
  if d < 16 or d & (d - 1):
    return f"its head dim must be a power of two >= 16, got {d}"
  return None


def _bias_unfit(q: jax.Array, k: jax.Array, bias: jax.Array | None, *, carries_mask: bool) -> str | None:
  b, t, h = q.shape[:3]
  s = k.shape[1]
  if bias is not None and tuple(bias.shape) != (b, h, t, s):
    return f"it takes a bias of every row and head [b, h, t, s] = {(b, h, t, s)}, got {tuple(bias.shape)}"
  if bias is not None and carries_mask and jnp.dtype(bias.dtype) == jnp.float16:
    return "a float16 bias cannot carry a mask (it cannot hold a masked score)"
  return None


def _dense_unfit(q: jax.Array, k: jax.Array, mask: jax.Array | None) -> str | None:
  b, t = q.shape[:2]
  s = k.shape[1]
  if mask is not None and (mask.ndim != 4 or mask.shape[1] != 1 or mask.shape[2:] != (t, s)
                           or mask.shape[0] not in (1, b)):
    return f"its dense mask must be [b|1, 1, t, s], got {tuple(mask.shape)}"
  return flash.unfit(q, k, queries=False)


def score_bias(bias: jax.Array, mask: jax.Array | None) -> jax.Array:
  """The bias [b, h, t, s] `dropout_flash_attention` adds to the scores, carrying a dense mask
  [b|1, 1|h, t, s] (True = may attend): where the mask is False, a score no query keeps."""
  if mask is None:
    return bias
  return jnp.where(mask, bias, jnp.asarray(MASK_VALUE, bias.dtype))


def dropout_flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *, causal: bool,
                            scale: float, rate: float, seed: jax.Array, key_segment_ids: jax.Array | None = None,
                            qkv: jax.Array | None = None, qkv_bias: jax.Array | None = None,
                            scores: jax.Array | None = None, mask: jax.Array | None = None,
                            interpret: bool | None = None) -> jax.Array:
  """Attention of each token over its own segment (and, when `causal`, at or before it) with
  dropout at `rate` on the probabilities; padding (segment 0) queries give zeros. With
  `key_segment_ids`, a cross attention: each query over the keys of its own segment.

  Args:
    q: [b, t, h, d]; k, v: [b, s, k, d] (k divides h: grouped-query heads are repeated; s = t
      for a self-attention).
    segment_ids: [b, t] int, 0 = padding: the queries' (and the keys' of a self-attention).
    causal: whether key j > query i is masked (a self-attention's).
    scale: the score scale.
    rate: the dropout rate, in [0, 1).
    seed: uint32 scalar, this call's (a fresh one per step and layer: `tfx.ops.dropout.seed`).
    key_segment_ids: [b, s] int, 0 = padding: a cross attention's keys' (the queries attend the
      keys of their own segment, and a query whose segment has none gives zeros).
    qkv: a self-attention's fused projection [b, t, h, 3, d] (slots `STACKED`: k, v, q) of which
      q, k and v are the slots: the kernels read their blocks out of it, and its gradient is
      written into one [b, t, h, 3, d] array, so that nothing copies q, k and v out of the
      projection or their gradients back in.
    qkv_bias: that projection's bias [h, 3, d] (float32), not yet added to `qkv`: the kernels add
      it as they read q, k and v (so that the projection's matmul writes `qkv` and nothing adds
      the bias in a pass of its own), or None.
    scores: [b, h, t, s] added to the scaled scores (in q's dtype or float32; XLNet's relative
      terms, a dense mask folded in by `score_bias`), its gradient returned; or None.
    mask: [b, t, s] bool (True = may attend), every head's, beside the ids (the two-stream
      encoder's permutation masks), or None. A cross attention takes any number of queries
      (padded to a block here).
    interpret: run Pallas' interpreter; default: off a GPU.

  Returns:
    [b, t, h, d] in q's dtype: `tfx.ops.dropout.keep_bits(seed, ...)` of [b, h, t, s] applied to
    the probabilities, kept ones scaled by 1 / P(keep).
  """
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"attention dropout must be in [0, 1), got {rate}")
  if key_segment_ids is not None and causal:
    raise ValueError("a cross attention (key_segment_ids) is not causal")
  b, t, h, d = q.shape
  s = k.shape[1]
  if scores is not None and (qkv is not None or tuple(scores.shape) != (b, h, t, s)):
    raise ValueError(f"scores must be a bias [b, h, t, s] = {(b, h, t, s)} beside separate q, k and v, got "
                     f"{tuple(scores.shape)}{' and a stacked projection' if qkv is not None else ''}")
  if mask is not None and (qkv is not None or tuple(mask.shape) != (b, t, s)):
    raise ValueError(f"mask must be [b, t, s] = {(b, t, s)} beside separate q, k and v, got {tuple(mask.shape)}"
                     f"{' and a stacked projection' if qkv is not None else ''}")
  mask = None if mask is None else mask.astype(jnp.int8)  # [b, t, s]: nonzero = may attend
  length = t
  if key_segment_ids is not None and flash.block_length(t) is None:
    # a cross attention's queries padded to a block (XLNet's prediction slots): a padding query (id
    # 0) gives zeros and no gradient
    length = -(-t // flash.BLOCKS[-1]) * flash.BLOCKS[-1]
    pad = lambda x, axis: None if x is None else jnp.pad(x, [(0, length - t if i == axis else 0)
                                                            for i in range(x.ndim)])
    q, segment_ids, scores, mask = pad(q, 1), pad(segment_ids, 1), pad(scores, 2), pad(mask, 1)
  block_q, block_k = flash.block_length(length), flash.block_length(s)
  if block_q is None or block_k is None:
    raise ValueError(f"flash attention needs query and key lengths that are multiples of {flash.BLOCKS[-1]}, "
                     f"got {t} and {s}")
  if key_segment_ids is None and s != t:
    raise ValueError(f"a self-attention needs as many keys as queries, got {t} queries over {s} keys")
  if k.shape[2] != h:  # grouped-query heads: each key/value head serves h // k query heads
    k = jnp.repeat(k, h // k.shape[2], axis=2)  # [b, s, h, d]
    v = jnp.repeat(v, h // v.shape[2], axis=2)  # [b, s, h, d]
  stacked = qkv is not None
  if stacked and (key_segment_ids is not None or qkv.shape != (b, t, h, len(STACKED), d)):
    raise ValueError(f"qkv must be a self-attention's stacked [b, t, h, {len(STACKED)}, d] projection, "
                     f"got {qkv.shape} beside q {q.shape}")
  if qkv_bias is not None and (not stacked or qkv_bias.shape != qkv.shape[2:]):
    raise ValueError(f"qkv_bias must be the stacked projection's bias {qkv.shape[2:] if stacked else ''}, "
                     f"got {qkv_bias.shape}")
  static = Static(scale=float(scale), causal=causal, rate=float(rate), block_q=block_q, block_k=block_k,
                   back_q=min(block_q, flash.BACKWARD_BLOCK), back_k=min(block_k, flash.BACKWARD_BLOCK),
                   interpret=target.backend() != "gpu" if interpret is None else interpret, stacked=stacked,
                   biased=qkv_bias is not None, score_bias=scores is not None, dense_mask=mask is not None)
  seed = lax.convert_element_type(seed, jnp.int32)  # the bits travel as int32 (the kernels' scalar operands)

  def kernel(q, k, v, q_ids, k_ids, *rest):  # one device's rows and heads: [b', t, h', (3,) d]
    *extra, seed, first_row, first_head = rest  # the score bias [b', h', t, s] and the mask [b', t, s] there are
    bias = extra.pop(0) if static.score_bias else None
    dense = extra.pop(0) if static.dense_mask else None
    seeds = jnp.stack([seed, first_row, first_head, jnp.zeros((), jnp.int32)])  # [4] int32
    if stacked:  # q is the stacked projection, k its bias or the projection again
      return attend(q, k if static.biased else None, None, q_ids, k_ids, None, None, seeds, static)  # [b', t, h', d]
    return attend(q, k, v, q_ids, k_ids, bias, dense, seeds, static)  # [b', t, h', d]

  key_ids = segment_ids if key_segment_ids is None else key_segment_ids
  arrays = (qkv, qkv if qkv_bias is None else qkv_bias, qkv) if stacked else (q, k, v)
  out = flash.per_device(kernel, *arrays, segment_ids, seed, offsets=True, key_ids=key_ids, zero_padding=False,
                         scores=scores, dense=mask)  # [b, length, h, d]
  return out[:, :t] if length != t else out


def fused_dropout_attention(q, k, v, mask, bias, scale: float, rate: float, rng: jax.Array,
                            implementation: str, qkv: tuple | None = None) -> tuple[jax.Array | None, str]:
  """(output, why): these kernels' attention with dropout when `implementation` picks the Pallas
  kernel here (`tfx.ops.attention.choose_implementation`) and they can take the inputs; else (None,
  why not), and the caller runs XLA's attention with dropout. Either way the choice is logged
  (`tfx.ops.attention.log_choice`: 'pallas' or 'xla', with the reason). The kernels take a
  `SegmentMask` or `CrossMask` (as segment ids), a dense mask [b|1, 1, t, s] (read block by block
  beside the scores: the two-stream encoder's) or none, and a bias of every row and head [b, h,
  t, s] (in the scores' scale; XLNet's relative terms), which then carries a dense mask
  (`score_bias`). `qkv`: (the stacked projection q, k and v are the slots of, its bias or None), a
  self-attention's (`dropout_flash_attention`, without a bias), or None."""
  from tfx.ops import attention  # noqa: PLC0415  (attention imports this module's siblings)

  impl, why = attention.choose_implementation(implementation, q.dtype, q.shape[-1])
  refused = unsupported(q, k, mask, bias) if impl == "pallas" else None
  if impl == "pallas" and refused is None:
    if isinstance(mask, (SegmentMask, CrossMask)):
      ids = ({"segment_ids": mask.q_segment_ids, "causal": False, "key_segment_ids": mask.k_segment_ids}
             if isinstance(mask, CrossMask) else {"segment_ids": mask.segment_ids, "causal": mask.causal})
      if qkv is not None and bias is None and isinstance(mask, SegmentMask):
        ids.update(qkv=qkv[0], qkv_bias=qkv[1])
      why = why if bias is None else f"{why}, a bias of every row and head"
    else:  # a dense mask (the two-stream encoder's) or none: one segment, the mask beside it or in the bias
      ones = lambda x: jnp.ones(x.shape[:2], jnp.int32)  # [b, t] or [b, s]
      ids = {"segment_ids": ones(q), "causal": False, "key_segment_ids": ones(k)}
      dense = masks.dense_mask(mask)  # [b|1, 1, t, s] or None
      if bias is not None:  # XLNet's relative terms, carrying its permutation's mask
        bias = score_bias(bias, dense)
        why = "GPU, a bias of every row and head carrying the mask"
      elif dense is not None:
        ids["mask"] = jnp.broadcast_to(dense[:, 0], (q.shape[0], *dense.shape[2:]))  # [b, t, s]
        why = "GPU, a dense mask"
      else:
        why = "GPU, no mask"
    if bias is not None:
      ids["scores"] = bias
    out = dropout_flash_attention(q, k, v, **ids, scale=scale, rate=rate, seed=dropout.seed(rng))
    why = f"{why}; dropout {rate} drawn in the kernel"
  else:
    out = None
    why = (f"Pallas dropout attention refused: {refused}" if refused is not None else
           f"Pallas dropout attention needs a GPU: {why}" if implementation == "pallas" else
           "of the fused kernels only Pallas' applies dropout (model.attention=pallas)")
    why = f"model.attention_dropout={rate}: {why}"
  attention.log_choice("xla" if out is None else "pallas", why)
  return out, why


