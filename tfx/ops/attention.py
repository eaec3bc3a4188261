"""Attention as pure functions, and the masks that say who may attend to whom.

Dimension letters used in shapes and einsums throughout tfx:
  b batch, t query length, s key length, h query heads, k key/value heads, d head dim,
  e embed (d_model), f MLP hidden, v vocab, l layers.

A mask is boolean, `True` = the query may attend to the key, shaped [b, 1|h, t, s]
(the head axis broadcasts). `jax.nn.dot_product_attention` has no segment-id argument, so
packing, padding, causality and prefix-LM are all expressed as such a mask. A query row with
no allowed key would silently softmax to the mean of V (a leak); `assert_rows_attend` and
the `guard` of `dot_product_attention` make that an error or exact zeros.
"""

import logging
from typing import Literal

import jax
import jax.numpy as jnp

Implementation = Literal["auto", "xla", "cudnn", "reference"]

# Large finite negative for masked scores (not -inf, so fully masked rows do not give NaN).
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


# ----------------------------------------------------------------------------- masks


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


def _on_gpu() -> bool:
  return jax.default_backend() == "gpu"


_LOGGED: set[tuple[str, str]] = set()


def _log_choice(impl: str, why: str) -> None:
  """One line per distinct (kernel, reason), at trace time (so once per compiled step)."""
  if (impl, why) not in _LOGGED:
    _LOGGED.add((impl, why))
    logging.getLogger("tfx.attention").info("attention: %s (%s)", impl, why)


def choose_implementation(implementation: Implementation, dtype, head_dim: int) -> tuple[str, str]:
  """(kernel, reason): which attention kernel runs and why.

  'auto' is cuDNN's fused kernel on a GPU for bf16/fp16 inputs with a head dim it supports
  (<= 128, a multiple of 8), XLA's einsum attention otherwise. An explicit 'cudnn' that cannot
  run here (no GPU, fp32 inputs, head dim) falls back to XLA instead of failing.
  """
  if implementation in ("xla", "reference"):
    return implementation, "model.attention"
  if implementation not in ("auto", "cudnn"):
    raise ValueError(f"unknown model.attention {implementation!r}; choose auto, xla, cudnn or reference")
  if not _on_gpu():
    return "xla", f"no GPU (backend {jax.default_backend()})"
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
    mask: jax.Array | None = None,
    bias: jax.Array | None = None,
    scale: float | None = None,
    implementation: Implementation = "auto",
    guard: bool = True,
) -> jax.Array:
  """The one attention entry point of tfx.

  Args:
    q: [b, t, h, d]; k, v: [b, s, k, d].
    mask: bool [b|1, h|1, t, s], True = may attend.
    bias: float [b|1, h|1, t, s] added to the scores (relative positions, ...).
    scale: score scale, default 1/sqrt(d).
    implementation: 'auto' | 'xla' | 'cudnn' | 'reference' (see `choose_implementation`; the
      kernel chosen is logged once, on the `tfx.attention` logger, with the reason).
    guard: zero the output of query rows that have no allowed key, instead of the mean of V
      that the softmax over a fully masked row would give. Such rows are padding queries
      (their loss weight is 0); the guard makes sure nothing leaks through them.
  Returns:
    [b, t, h, d] in q's dtype.
  """
  impl, why = choose_implementation(implementation, q.dtype, q.shape[-1])
  if impl == "reference":
    out = reference_attention(q, k, v, mask=mask, bias=bias, scale=scale)
  else:
    b, t, h, _ = q.shape
    s = k.shape[1]
    if mask is not None:
      mask = jnp.broadcast_to(mask, (mask.shape[0], mask.shape[1], t, s))
    try:
      out = jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, scale=scale, implementation=impl)
    except Exception as e:  # noqa: BLE001  (cuDNN refuses a shape / layout / version at trace time)
      if impl != "cudnn":
        raise
      impl, why = "xla", f"cuDNN refused: {str(e).splitlines()[0][:120]}"
      out = jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, scale=scale, implementation="xla")
  _log_choice(impl, why)
  if guard and mask is not None:
    ok = rows_attend(mask)  # [b|1, h|1, t]
    ok = jnp.moveaxis(ok, 1, 2)[..., None]  # [b|1, t, h|1, 1]
    out = jnp.where(ok, out, jnp.zeros((), out.dtype))
  return out
