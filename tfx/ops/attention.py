"""Attention as pure functions: the reference, XLA's einsum attention with its own backward pass,
and the one entry point that picks a fused kernel (cuDNN, Pallas, splash) or falls back to it.

Dimension letters used in shapes and einsums throughout tfx:
  b batch, t query length, s key length, h query heads, k key/value heads, d head dim,
  e embed (d_model), f MLP hidden, v vocab, l layers.

The masks (who may attend to whom) are in `tfx.ops.masks` (and `tfx.ops`); how cuDNN is called,
in `tfx.ops.cudnn`.
"""

import contextlib
import functools
import logging
from typing import Literal

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from tfx.ops import cudnn, dropout, flash, hoisting, splash, target
from tfx.ops.masks import SEGMENT_ID_KERNELS, LengthMask, SegmentMask, dense_mask, rows_attend

Implementation = Literal["auto", "xla", "cudnn", "pallas", "splash", "reference"]
# The kernels that read a packed row's segment ids (`SegmentMask`) instead of a dense mask:
# implementation -> (why it cannot run on these inputs, the kernel, its name in a refusal).
SEGMENT_KERNELS = {
    "pallas": (flash.unsupported, flash.flash_attention, "Pallas flash attention"),
    "splash": (splash.unsupported, splash.splash_attention, splash.NAME),
}
assert tuple(SEGMENT_KERNELS) == SEGMENT_ID_KERNELS

# Large finite negative for masked scores (not -inf, so fully masked rows do not give NaN).
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


# ----------------------------------------------------------------------------- attention


def reference_attention(q, k, v, *, mask=None, bias=None, scale=None):
  """Plain einsum attention, the reference the fast paths are tested against.

  Args:
    q: [b, t, h, d]; k, v: [b, s, k, d] with h a multiple of k (grouped-query heads).
    mask: optional bool [b|1, h|1, t, s]; bias: optional float [b|1, h|1, t, s].
  Returns:
    [b, t, h, d]
  """
  b, t, h, d = q.shape
  kh = k.shape[2]
  scale = d**-0.5 if scale is None else scale
  qg = q.reshape(b, t, kh, h // kh, d)  # [b, t, k, g, d]
  scores = jnp.einsum("btkgd,bskd->bkgts", qg, k).astype(jnp.float32) * scale
  scores = scores.reshape(b, h, t, -1)  # [b, h, t, s]
  if bias is not None:
    scores = scores + bias.astype(jnp.float32)
  if mask is not None:
    scores = jnp.where(mask, scores, MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  probs = probs.reshape(b, kh, h // kh, t, -1)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
  return out.reshape(b, t, h, d)


def _grouped(x: jax.Array | None, kv_heads: int) -> jax.Array | None:
  """A mask or bias [b|1, h|1, t, s] as [b|1, k|1, g|1, t, s] for grouped-query heads."""
  if x is None:
    return None
  if x.shape[1] == 1:
    return x[:, :, None]
  return x.reshape(x.shape[0], kv_heads, x.shape[1] // kv_heads, *x.shape[2:])


# The names of the attention's residuals (unnormalised probabilities, inverse row sums, output),
# for rematerialisation policies that keep them (tfx/nn/blocks.py). The Pallas and splash kernels
# name their output and log-sum-exp `attention_out` too.
RESIDUAL_NAMES = ("attention_probs", "attention_inv_sum", "attention_out")
# cuDNN's fused attention (jax.nn.dot_product_attention(implementation='cudnn')) cannot name its
# residuals: its forward kernel is this JAX primitive, whose outputs (output and softmax
# statistics) are the residuals of its backward kernel.
CUDNN_FORWARD_PRIMITIVES = ("dot_product_attention_fwd_wrapper",)


def saves_kernel_residuals(prim, *_, **__) -> bool:
  """A rematerialisation policy (jax.checkpoint's signature) that keeps the outputs of cuDNN's
  forward attention kernel, so that the backward pass does not run that kernel again."""
  return prim.name in CUDNN_FORWARD_PRIMITIVES


# The attention's matmuls as batched dot_generals over (batch, kv head) with the output in the
# layout its consumer reads: jnp.einsum may order the operands so that the [b, k, g, t, s] scores
# come out key-major and are then transposed in a copy of the whole tensor (on XLA:CPU, a copy
# fused into the mask select of every layer, forward and backward).
_F32 = jnp.float32


def _qk(x: jax.Array, y: jax.Array) -> jax.Array:
  """x [b, t, k, g, d] . y [b, s, k, d] over d -> [b, k, g, t, s] float32 (scores, dP)."""
  b, t, kh, g, d = x.shape
  x = jnp.transpose(x, (0, 2, 3, 1, 4)).reshape(b, kh, g * t, d)  # [b, k, g*t, d]
  out = jax.lax.dot_general(x, y, (((3,), (3,)), ((0, 1), (0, 2))), preferred_element_type=_F32)  # [b, k, g*t, s]
  return out.reshape(b, kh, g, t, -1)


def _pv(p: jax.Array, y: jax.Array) -> jax.Array:
  """p [b, k, g, t, s] . y [b, s, k, d] over s -> [b, t, k, g, d] float32 (output, dQ)."""
  b, kh, g, t, s = p.shape
  out = jax.lax.dot_general(p.reshape(b, kh, g * t, s), y, (((3,), (1,)), ((0, 1), (0, 2))),
                            preferred_element_type=_F32)  # [b, k, g*t, d]
  return jnp.transpose(out.reshape(b, kh, g, t, -1), (0, 3, 1, 2, 4))


def _ptx(p: jax.Array, x: jax.Array) -> jax.Array:
  """p [b, k, g, t, s] . x [b, t, k, g, d] over (g, t) -> [b, s, k, d] float32 (dV, dK), computed
  as x^T . p, [b, k, d, g*t] . [b, k, g*t, s]: the small operand is the transposed one."""
  b, kh, g, t, s = p.shape
  x = jnp.transpose(x, (0, 2, 4, 3, 1)).reshape(b, kh, -1, g * t)  # [b, k, d, g*t]
  out = jax.lax.dot_general(x, p.reshape(b, kh, g * t, s), (((3,), (2,)), ((0, 1), (0, 1))),
                            preferred_element_type=_F32)  # [b, k, d, s]
  return jnp.transpose(out, (0, 3, 1, 2))


def _scores(q, k, mask, bias, scale):
  """Masked scores [b, k, g, t, s] (float32), the scale applied to q in float32 (t*d products,
  not t*s) and in float32 after the matmul otherwise."""
  b, t, h, d = q.shape
  kh = k.shape[2]
  if q.dtype == jnp.float32:
    q = q * jnp.float32(scale)
  qg = q.reshape(b, t, kh, h // kh, d)  # [b, t, k, g, d]
  s = _qk(qg, k)  # [b, k, g, t, s]
  if q.dtype != jnp.float32:
    s = s * jnp.float32(scale)
  if bias is not None:
    s = s + _grouped(bias, kh).astype(jnp.float32)
  if mask is not None:
    s = hoisting.where(_grouped(mask, kh), s, MASK_VALUE)
  return s


def _dropped(p: jax.Array, seed: jax.Array | None, rate: float, block: tuple[int, int]) -> jax.Array:
  """p [b, k, g, t, s] with attention dropout: the entries `tfx.ops.dropout.keep_bits` keeps for
  the [b, h, t, s] probabilities under `seed` scaled by 1 / P(keep), the rest 0 (p itself for no
  seed); `block` (first query, columns): p is the block of queries first.. over the first s of
  `columns` keys (0 columns: p is the whole array). The bits are drawn where they are used, never
  stored."""
  if seed is None:
    return p
  b, kh, g, t, s = p.shape
  first, columns = block
  keep = dropout.keep_bits(seed, (b, kh * g, t, s), rate, first_query=first,
                           columns=columns or None).reshape(p.shape)  # [b, k, g, t, s]
  return hoisting.where(keep, p * jnp.float32(1.0 / dropout.keep_probability(rate)), 0.0)


def _attention_fwd(q, k, v, mask, bias, seed, scale, rate, block):
  """Returns (out [b, t, h, d], residuals). The softmax is left unnormalised, [b, k, g, t, s], and
  its row sums divide the output [b, t, h, d] instead (d values per row rather than s)."""
  b, t, h, d = q.shape
  s = _scores(q, k, mask, bias, scale)  # [b, k, g, t, s]
  top = jnp.max(s, axis=-1, keepdims=True)  # [b, k, g, t, 1]
  # Unnormalised probabilities; a row with no allowed key (its max is the mask value) gets none,
  # so its output and every gradient through it are exactly zero (no mean of V).
  p = hoisting.where(top > 0.5 * MASK_VALUE, jnp.exp(s - top), 0.0)
  total = jnp.sum(p, axis=-1)  # [b, k, g, t]: 0 for such a row, else >= 1 (the max gives exp(0))
  inv_l = hoisting.where(total > 0.0, 1.0 / jnp.maximum(total, 1.0), 0.0)
  out = _pv(_dropped(p, seed, rate, block).astype(v.dtype), v)  # [b, t, k, g, d]
  out = out * jnp.moveaxis(inv_l, 3, 1)[..., None]  # [b, t, k, g, d]
  # The residual in the compute dtype: the backward pass rounds dS to it before its matmuls anyway,
  # and in bf16 it halves the largest array a layer keeps (and the scan stacks).
  p = p.astype(q.dtype)
  p, inv_l, out = (checkpoint_name(x, n) for x, n in zip((p, inv_l, out), RESIDUAL_NAMES))
  return out.reshape(b, t, h, d).astype(q.dtype), (q, k, v, bias, seed, p, inv_l, out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _attention(q, k, v, mask, bias, seed, scale, rate, block):
  return _attention_fwd(q, k, v, mask, bias, seed, scale, rate, block)[0]


def _sum_to_bias(d_s: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """d_s [b, h, t, s] summed over the batch and head axes a bias of `shape` [b|1, h|1, t, s] is
  broadcast over (T5's relative positions: one bias for the batch), as a contraction with ones.
  XLA:CPU hands a reduce over a short major axis to its YNNPACK library, which takes about 40x
  the time of a dot for [8, 4 * 256 * 256] (22 ms against 0.6 ms; T5's step on a CPU is 3-5%
  faster). The same bytes move either way on a GPU or TPU. HIGHEST keeps it float32 where matmuls
  round. The dot's accumulation order depends on the number of rows: rows of zeros added to the
  batch change the sum by float32 rounding, not bitwise."""
  axes = [i for i in (0, 1) if shape[i] == 1 and d_s.shape[i] > 1]
  if not axes:
    return d_s
  ones = [jnp.ones((d_s.shape[i],), d_s.dtype) for i in axes]
  kept = "".join(c for i, c in enumerate("bhts") if i not in axes)
  spec = ",".join("bhts"[i] for i in axes) + ",bhts->" + kept
  return jnp.einsum(spec, *ones, d_s, precision=jax.lax.Precision.HIGHEST).reshape(shape)  # [b|1, h|1, t, s]


def _attention_bwd(scale, rate, block, residuals, d_out):
  q, k, v, bias, seed, p, inv_l, out = residuals  # no mask: p is exactly 0 wherever it is False
  if seed is not None:  # the keep bits drawn again: XLA may not merge them with the forward pass's
    seed = jax.lax.optimization_barrier(seed)
  p = p.astype(jnp.float32)  # [b, k, g, t, s]
  b, t, h, d = q.shape
  kh = k.shape[2]
  # dS = P * (dP - rowsum(dO * O)) with P = p / l: fold 1/l into dO once ([b, t, k, g, d]). With
  # dropout, dP is dO . V^T where kept (scaled), and rowsum(P * dP) is still rowsum(dO * O).
  d_out = d_out.reshape(b, t, kh, h // kh, d).astype(jnp.float32) * jnp.moveaxis(inv_l, 3, 1)[..., None]
  d_v = _ptx(_dropped(p, seed, rate, block).astype(v.dtype), d_out.astype(v.dtype))  # [b, s, k, d]
  d_p = _dropped(_qk(d_out.astype(v.dtype), v), seed, rate, block)  # [b, k, g, t, s]
  # Summed as [b, t, h, d] over d: XLA:CPU hands this reduce to YNNPACK, which took 7-22x as long
  # with the size-1 g axis of ungrouped heads kept (GPT-2 medium 1.2 against 0.16 ms a layer).
  row = jnp.sum((d_out * out).reshape(b, t, h, d), axis=-1).reshape(b, t, kh, h // kh)  # [b, t, k, g]
  row = jnp.moveaxis(row, 1, 3)  # [b, k, g, t]
  d_s = p * (d_p - row[..., None])  # [b, k, g, t, s]; 0 wherever the mask is False (p is 0 there)
  d_bias = None
  if bias is not None:
    d_bias = _sum_to_bias(d_s.reshape(b, h, t, -1), bias.shape).astype(bias.dtype)
  d_s = d_s.astype(q.dtype)  # the dQ / dK matmuls in the compute dtype
  d_q = _pv(d_s, k).reshape(b, t, h, d) * scale
  d_k = _ptx(d_s, q.reshape(b, t, kh, h // kh, d)) * scale
  return d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), None, d_bias, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def causal_block_bounds(t: int, blocks: int) -> tuple[tuple[int, int], ...]:
  """The (first, end) query rows of the blocks a causal self-attention of length t is cut into:
  `blocks` of them (their ends rounded up to a multiple of 8, so fewer where t is short), or for 0
  four from 256 tokens and one below (`model.causal_blocks`' default). Block i's queries attend the
  keys [0, end_i) only. Each block is a kernel of its own shape, forward and backward: on this
  project's 2-core CPU GPT-2 at 256 tokens took 0.91-0.94x of one block's train step with 4
  blocks, 0.97x with 8, 0.99x with 2, and compiled 0.6-0.7 s longer; at 128 tokens 2 blocks left
  the step as it was (docs/performance/1-peer-cpu.md)."""
  if blocks < 0:
    raise ValueError(f"causal blocks must be >= 0 (0 = automatic), got {blocks}")
  n = (4 if t >= 256 else 1) if blocks == 0 else blocks
  ends = sorted({min(t, 8 * -(-(i + 1) * t // (8 * n))) for i in range(n)})  # ceil((i + 1) t / n) to 8s
  return tuple(zip([0] + ends[:-1], ends))


def known_causal(mask) -> bool:
  """Whether a mask is known to be causal: a `SegmentMask` or `LengthMask` with `causal` (a dense
  array is not inspected)."""
  return isinstance(mask, (SegmentMask, LengthMask)) and mask.causal


def causal_blocks_for(mask, blocks: int) -> int:
  """`blocks` (`model.causal_blocks`) for a mask `known_causal`, 1 for any other: the query blocks
  `softmax_attention` and `in_causal_blocks` take."""
  return blocks if known_causal(mask) else 1


def _query_block(x: jax.Array | None, first: int, end: int) -> jax.Array | None:
  """A mask or bias [b|1, h|1, t|1, s] at the queries first..end and the keys ..end."""
  if x is None:
    return None
  return (x[:, :, first:end] if x.shape[2] > 1 else x)[..., :end]


def softmax_attention(q, k, v, mask, bias, scale, *, dropout_rate: float = 0.0, seed: jax.Array | None = None,
                      causal_blocks: int = 1):
  """Einsum attention for XLA (CPU, TPU, and GPU when cuDNN does not apply), with a hand-written
  backward pass. The same function as `reference_attention` (tests compare values and gradients)
  with fewer passes over the [b, k, g, t, s] scores and one [b, k, g, t, s] residual (the
  unnormalised probabilities, kept in the compute dtype: in bf16 the gradients stay as close to
  float32's as autodiff's bf16 ones, whose softmax keeps float32 probabilities; a test checks)
  instead of autodiff's several: the forward pass divides the output by the row sums instead of
  normalising the probabilities; the backward pass takes the softmax term from rowsum(dO * O) over
  d (as flash attention does) instead of rowsum(dP * P) over s, and folds 1 / rowsum into dO once.
  A query row with no allowed key gets exact zeros (output and gradients), never the mean of V.

  Args: as `reference_attention` (mask bool, bias float, both [b|1, h|1, t, s] or None); scale a
  Python float; attention dropout at `dropout_rate` with `seed` (uint32 scalar, `tfx.ops.dropout.seed`
  of the layer's key): the [b, h, t, s] probabilities `tfx.ops.dropout.keep_bits` keeps (the bits
  the Pallas kernel draws too), scaled by 1 / P(keep); drawn in the forward and again in the
  backward pass, never stored. With dropout the identity the backward pass uses still holds:
  rowsum(P * dP) = rowsum(dO * O) with O the dropped output. Returns [b, t, h, d] in q's dtype.

  causal_blocks: for a mask that is causal (self-attention, t == s, no key after its query
  attended; the caller knows it: `dot_product_attention`), the queries are cut into blocks
  (`causal_block_bounds(t, causal_blocks)`) and block i attends the keys [0, end_i) alone, so the
  scores above the diagonal blocks are never computed (4 blocks: 5/8 of them computed, and kept
  as the residual). The same function up to float32 rounding (each row's sums run over fewer exact
  zeros), with the same keep bits; 1 = one block.
  """
  if seed is None or not dropout_rate:
    seed, dropout_rate = None, 0.0
  attend = lambda q, k, v, mask, bias, block: _attention(q, k, v, mask, bias, seed, float(scale),
                                                         float(dropout_rate), block)
  return in_causal_blocks(attend, q, k, v, mask, bias, causal_blocks)


def in_causal_blocks(attend, q, k, v, mask, bias, blocks: int) -> jax.Array:
  """`attend(q, k, v, mask, bias, block)` [b, t, h, d] of a causal self-attention run on each of its
  query blocks (`causal_block_bounds(t, blocks)`; one for blocks=1 or t != s) over the keys up to
  the block's last row, the outputs concatenated. `block` is (first query, s) for the dropout's
  keep bits (`tfx.ops.dropout.keep_bits`), (0, 0) for a single block."""
  t, s = q.shape[1], k.shape[1]
  bounds = causal_block_bounds(t, blocks) if blocks != 1 and t == s else ((0, t),)
  if len(bounds) == 1:
    return attend(q, k, v, mask, bias, (0, 0))
  outs = [attend(q[:, first:end], k[:, :end], v[:, :end], _query_block(mask, first, end),
                 _query_block(bias, first, end), (first, s))
          for first, end in bounds]  # [b, end - first, h, d] each
  return jnp.concatenate(outs, axis=1)


def _on_gpu() -> bool:
  return target.backend() == "gpu"


def _on_tpu() -> bool:
  return target.backend() == "tpu"


_LOGGED: set[tuple[str, str]] = set()
_RECORDERS: list[list[tuple[str, str]]] = []


@contextlib.contextmanager
def recorded_choices():
  """Collects the (kernel, reason) of every attention traced inside the block, in trace order
  (repeats included; the log prints each distinct pair once per process): what a benchmark
  reports as the kernel that ran.

      with recorded_choices() as chosen:
        jitted.lower(...)
  """
  chosen: list[tuple[str, str]] = []
  _RECORDERS.append(chosen)
  try:
    yield chosen
  finally:
    _RECORDERS.remove(chosen)


def log_choice(impl: str, why: str) -> None:
  """Logs which attention kernel a call site runs and why: one line per distinct (kernel,
  reason), at trace time (so once per compiled step); every call reaches `recorded_choices`.
  Attention that does not go through `dot_product_attention` (the attention-dropout paths of
  `tfx.nn.Attention` and of XLNet) reports itself here too."""
  for chosen in _RECORDERS:
    chosen.append((impl, why))
  if (impl, why) not in _LOGGED:
    _LOGGED.add((impl, why))
    logging.getLogger("tfx.attention").info("attention: %s (%s)", impl, why)


def choose_implementation(implementation: Implementation, dtype, head_dim: int) -> tuple[str, str]:
  """(kernel, reason): which attention kernel runs and why, from the config and the inputs' dtype.

  'auto' is cuDNN's fused kernel on a GPU for bf16/fp16 inputs with a head dim it supports
  (<= 128, a multiple of 8), XLA's einsum attention otherwise. An explicit 'cudnn' that cannot
  run here (no GPU, fp32 inputs, head dim) falls back to XLA instead of failing, and so do an
  explicit 'pallas' off a GPU and 'splash' off a TPU (`dot_product_attention` also sends them to
  XLA for a mask or bias their kernel cannot take: `tfx.ops.flash.unsupported`).
  """
  if implementation in ("xla", "reference"):
    return implementation, "model.attention"
  if implementation not in ("auto", "cudnn", "pallas", "splash"):
    raise ValueError(f"unknown model.attention {implementation!r}; choose auto, xla, cudnn, pallas, splash or reference")
  if implementation == "splash":
    return ("splash", "TPU, segment ids") if _on_tpu() else ("xla", f"no TPU (backend {target.backend()})")
  if not _on_gpu():
    return "xla", f"no GPU (backend {target.backend()})"
  if implementation == "pallas":
    return "pallas", "GPU, segment ids"
  if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
    return "xla", f"cuDNN needs bf16/fp16 inputs, got {jnp.dtype(dtype).name} (model.dtype)"
  if head_dim > 128 or head_dim % 8:
    return "xla", f"cuDNN needs head_dim <= 128 and a multiple of 8, got {head_dim}"
  return "cudnn", "GPU, " + jnp.dtype(dtype).name


def dot_product_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mask: "jax.Array | SegmentMask | LengthMask | None" = None,
    bias: jax.Array | None = None,
    scale: float | None = None,
    implementation: Implementation = "auto",
    guard: bool = True,
    causal_blocks: int = 0,
) -> jax.Array:
  """The one attention entry point of tfx.

  Args:
    q: [b, t, h, d]; k, v: [b, s, k, d].
    mask: bool [b|1, h|1, t, s], True = may attend, or a `SegmentMask` (a packed row's
      self-attention: the 'pallas' and 'splash' kernels read its ids, every other path its
      `dense()` array; 'cudnn' also skips the blocks above the diagonal of a causal one), or a
      `LengthMask` (rows of one segment each: 'cudnn' reads the lengths, every other path its
      `dense()` array).
    bias: float [b|1, h|1, t, s] added to the scores (relative positions, ...).
    scale: score scale, default 1/sqrt(d).
    implementation: 'auto' | 'xla' | 'cudnn' | 'pallas' | 'splash' | 'reference' (see
      `choose_implementation`; the kernel chosen is logged once, on the `tfx.attention` logger,
      with the reason).
    guard: zero the output of query rows that have no allowed key, instead of the mean of V
      that the softmax over a fully masked row would give. Such rows are padding queries
      (their loss weight is 0); the guard makes sure nothing leaks through them. The XLA path
      (`softmax_attention`) always gives them zeros, and so does cuDNN for a `SegmentMask`
      (`padding_attends_padding`): neither needs a select after the kernel.
    causal_blocks: for a causal `SegmentMask` or `LengthMask` on XLA's path, the query blocks of
      `softmax_attention` (0 = automatic, 1 = none: `model.causal_blocks`).
  Returns:
    [b, t, h, d] in q's dtype.
  """
  impl, why = choose_implementation(implementation, q.dtype, q.shape[-1])
  if impl in SEGMENT_KERNELS:
    unsupported, kernel, name = SEGMENT_KERNELS[impl]
    refused = unsupported(q, k, mask, bias)
    if refused is None:
      log_choice(impl, why)
      scale = q.shape[-1] ** -0.5 if scale is None else scale
      return kernel(q, k, v, mask.segment_ids, causal=mask.causal, scale=scale)
    impl, why = "xla", f"{name} refused: {refused}"
  causal = known_causal(mask)
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  out = None
  if impl == "cudnn":
    out, refused, how = cudnn.attention(q, k, v, mask, bias, float(scale), causal)
    if refused is not None:
      impl, why = "xla", f"cuDNN refused: {refused}"
    elif how:
      why = f"{why}; {how}"
  log_choice(impl, why)
  dense = lambda: dense_mask(mask, (q.shape[1], k.shape[1]))  # [b|1, h|1, t, s] bool or None
  if out is None:
    if impl == "reference":
      out = reference_attention(q, k, v, mask=dense(), bias=bias, scale=scale)
    else:  # XLA's attention zeroes the rows without a key itself
      blocks = causal_blocks_for(mask, causal_blocks)
      return softmax_attention(q, k, v, dense(), bias, float(scale), causal_blocks=blocks)
  if guard and mask is not None and not (impl == "cudnn" and isinstance(mask, SegmentMask)):
    if isinstance(mask, LengthMask):
      ok = mask.attending_rows()[:, :, None, None]  # [b, t, 1, 1]
    else:
      ok = jnp.moveaxis(rows_attend(dense()), 1, 2)[..., None]  # [b|1, t, h|1, 1]
    out = hoisting.where(ok, out, 0.0)
  return out
