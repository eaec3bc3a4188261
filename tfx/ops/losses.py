"""Weighted cross-entropy and accuracy: the only loss arithmetic objectives need, from logits or
fused with the output projection (`linear_cross_entropy`)."""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tfx.ops import target


def log_z_and_target(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """log Z, the target's logit and the largest logit of each row, float32 [b, t] each.

  Args:
    logits: [b, t, v] in any float dtype (read in float32).
    targets: [b, t] int.

  The largest logit carries no gradient (its share of log Z's cancels; callers use it only as
  `stop_gradient`, for the accuracy). Narrower logits than float32 (bf16 training) get a
  gradient written by hand, g_z softmax + g_t onehot(target), in one elementwise pass over the
  logits in their own dtype: autodiff of the same formulas keeps a float32 exp(x - max) of the
  [b, t, v] logits and scatters the target's gradient into a zeroed [b, t, v] buffer, each a
  pass over the largest tensor of the step (on an H200, GPT-2-small's loss took 11% of its step;
  compiled for an H100 at 16 rows the step's temporaries fall from 7.56 to 4.51 GiB). Float32
  logits keep autodiff's gradient: there the kept exp costs no more than the logits, and with
  the hand-written pass XLA:CPU computed the gradient twice, once transposed for the head's
  weight gradient, keeping exp alive longer (GPT-2 with 4 layers, d_model 256, 8 x 256 tokens:
  62 MiB more temporaries, the step time within this machine's noise). Where
  `target.one_pass_reductions()` (a GPU), the narrow path's forward pass also reads the logits
  once, not twice (the max, then the sum of exp(x - max)): one reduction yields both
  (`_max_and_total`; GPT-2-small compiled for an H100 at 32 rows: 3.3 GB a step less).
  """
  if logits.dtype == jnp.float32:
    return _log_z_and_target_fwd(logits, targets)[0]
  return _narrow_log_z_and_target(logits, targets, target.one_pass_reductions())


def _softmax_parts(logits, targets):
  """(top, exp, total, log Z, target logit) of [b, t, v] logits: the row max (no gradient),
  exp(x - max) [b, t, v], its row sum, and three [b, t] float32 arrays."""
  x = logits.astype(jnp.float32)  # [b, t, v]; fused into the reductions: no float32 copy is kept
  # logsumexp written out so that its max serves the accuracy too: one pass over [b, t, v] for
  # both, where an argmax would be a second (variadic) reduction over the vocabulary.
  top = jax.lax.stop_gradient(jnp.max(x, axis=-1))  # [b, t]
  exp = jnp.exp(x - top[..., None])  # [b, t, v]
  total = jnp.sum(exp, axis=-1)  # [b, t]
  log_z = top + jnp.log(total)
  target_logit = jnp.take_along_axis(x, targets[..., None], axis=-1)[..., 0]  # [b, t]
  return top, exp, total, log_z, target_logit


def _d_logits(exp, total, targets, g_z, g_t):
  """[b, t, v] float32: g_z softmax + g_t onehot(target), the logits' gradient of g_z log Z + g_t
  target logit, from `_softmax_parts`' exp and total."""
  # a [v] iota: a [b, t, v] one is loop-invariant in `linear_cross_entropy`'s scan over chunks, and
  # XLA:CPU hoisted it out of the loop as a [b, chunk, v] buffer
  onehot = targets[..., None] == jnp.arange(exp.shape[-1], dtype=targets.dtype)  # [b, t, v]
  return exp * (g_z / total)[..., None] + jnp.where(onehot, g_t[..., None], 0.0)


def _log_z_and_target_fwd(logits, targets):
  top, _, total, log_z, target_logit = _softmax_parts(logits, targets)
  return (log_z, target_logit, top), (logits, targets, top, total)


def _log_z_and_target_bwd(residuals, cotangents):
  logits, targets, top, total = residuals
  g_z, g_t, _ = cotangents  # [b, t] each; the largest logit's is dropped (see the docstring)
  exp = jnp.exp(logits.astype(jnp.float32) - top[..., None])  # [b, t, v], computed again
  return _d_logits(exp, total, targets, g_z, g_t).astype(logits.dtype), np.zeros(targets.shape, jax.dtypes.float0)


def _max_and_total(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """x float32 [..., v] -> (max, sum of exp(x - max)), [...] each, in one reduction over v.

  Each partial result is a pair (m, s) of a running max and the sum of exp(x - m) so far; two
  pairs combine as (max(m1, m2), s1 exp(m1 - max) + s2 exp(m2 - max)), an associative rule, so
  XLA may split and order the reduction as it likes. One of the two exponents is 0: one exp per
  combination, exp(-|m1 - m2|), as many as the two-pass logsumexp computes. Equal maxima (-inf
  and -inf included, where m1 - m2 is NaN) combine with exp(0); the start value is float32's
  most negative finite number, so a row's max is finite and its -inf logits add exp(-inf) = 0.
  """

  def combine(a, b):
    (m1, s1), (m2, s2) = a, b
    e = jnp.exp(jnp.where(m1 == m2, 0.0, -jnp.abs(m1 - m2)))  # exp(smaller - larger)
    return jnp.maximum(m1, m2), jnp.where(m1 >= m2, s1 + s2 * e, s1 * e + s2)

  start = (np.float32(np.finfo(np.float32).min), np.float32(0.0))
  return jax.lax.reduce((x, jnp.ones_like(x)), start, combine, (x.ndim - 1,))


def _narrow_fwd(logits, targets, one_pass):
  if not one_pass:
    return _log_z_and_target_fwd(logits, targets)
  x = logits.astype(jnp.float32)  # [b, t, v]; fused into the reduction
  top, total = _max_and_total(x)  # [b, t] each
  log_z = top + jnp.log(total)
  target_logit = jnp.take_along_axis(x, targets[..., None], axis=-1)[..., 0]  # [b, t]
  return (log_z, target_logit, top), (logits, targets, top, total)


_narrow_log_z_and_target = jax.custom_vjp(lambda logits, targets, one_pass: _narrow_fwd(logits, targets, one_pass)[0],
                                          nondiff_argnums=(2,))
_narrow_log_z_and_target.defvjp(_narrow_fwd, lambda one_pass, residuals, cotangents:
                                _log_z_and_target_bwd(residuals, cotangents))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def soft_cross_entropy(logits: jax.Array, teacher_logits: jax.Array, temperature: float) -> jax.Array:
  """-sum_v softmax(teacher / T)_v log softmax(logits / T)_v of each row, float32 [b, t]
  (DistilBERT's soft targets); logits, teacher_logits: [b, t, v] in any float dtype, read in
  float32. The teacher's logits get no gradient.

  Written as log Z_s - sum_v p_t(v) s_v / T with p_t = softmax(t / T), and the logits' gradient by
  hand, g / T (softmax(s / T) - p_t), in one elementwise pass in the logits' dtype: autodiff of the
  log-softmax form keeps float32 [b, t, v] softmaxes for the backward pass and sums two products
  (DistilBERT-base's own step compiled for an H100 at 32 rows: 55.4 -> 43.4 GB, 7.41 -> 5.60 GiB;
  docs/performance/4-compile-only.md)."""
  return _soft_fwd(logits, teacher_logits, temperature)[0]


def _soft_stats(x: jax.Array, temperature: float) -> tuple[jax.Array, jax.Array]:
  """(x / T in float32 [b, t, v], its row log-sum-exp [b, t]: one pass over x where
  `target.one_pass_reductions()`)."""
  x = x.astype(jnp.float32) / temperature
  if not target.one_pass_reductions():
    return x, jax.nn.logsumexp(x, axis=-1)
  top, total = _max_and_total(x)
  return x, top + jnp.log(total)


def _soft_fwd(logits, teacher_logits, temperature):
  s, lse_s = _soft_stats(logits, temperature)
  t, lse_t = _soft_stats(jax.lax.stop_gradient(teacher_logits), temperature)
  ce = lse_s - jnp.sum(jnp.exp(t - lse_t[..., None]) * s, axis=-1)  # [b, t]
  return ce, (logits, teacher_logits, lse_s, lse_t)


def _soft_bwd(temperature, residuals, g):
  logits, teacher_logits, lse_s, lse_t = residuals
  s, t = (x.astype(jnp.float32) / temperature for x in (logits, teacher_logits))
  d = (g / temperature)[..., None] * (jnp.exp(s - lse_s[..., None]) - jnp.exp(t - lse_t[..., None]))
  return d.astype(logits.dtype), None


soft_cross_entropy.defvjp(_soft_fwd, _soft_bwd)


def weighted_cross_entropy(
    logits: jax.Array, targets: jax.Array, weights: jax.Array, *, z_loss: float = 0.0
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Mean cross-entropy over the predicted tokens (those with weight > 0).

  Args:
    logits: [b, t, v] (any float dtype; computed in float32).
    targets: [b, t] int.
    weights: [b, t] float, 0 for tokens that are not predicted.
    z_loss: coefficient of log(Z)^2 (PaLM/T5X stabiliser), 0 = off.
  Returns:
    (loss, metrics): loss is sum(w * ce) / sum(w) (0 when nothing is predicted); metrics has
    `loss`, `accuracy` (weighted; correct = the target has the largest logit, ties included) and
    `num_tokens` (sum of weights).
  """
  log_z, target_logit, top = log_z_and_target(logits, targets)  # [b, t] float32 each; top has no gradient
  ce = log_z - target_logit
  weights = weights.astype(jnp.float32)
  total = jnp.sum(weights)
  denom = jnp.maximum(total, 1.0)
  loss = jnp.sum(ce * weights) / denom
  # Correct when the target's logit is the largest (a tie for the largest counts as correct).
  correct = (target_logit >= top).astype(jnp.float32)
  metrics = {
      "loss": loss,
      "accuracy": jnp.sum(correct * weights) / denom,
      "num_tokens": total,
  }
  if z_loss:
    zl = z_loss * jnp.sum(jnp.square(log_z) * weights) / denom
    metrics["z_loss"] = zl
    loss = loss + zl
  return loss, metrics


class TokenTargets(NamedTuple):
  """What a token loss needs besides the logits: targets [b, t] int, weights [b, t] float (0 = not
  predicted), the z-loss coefficient."""

  targets: jax.Array
  weights: jax.Array
  z_loss: float = 0.0


class HeadWeights(NamedTuple):
  """The output projection the fused loss applies: logits = x . kernel (+ bias).

  kernel: [v, e] (a tied embedding table, `vocab_major=True`) or [e, v] (a separate projection).
  bias: [v] or None.
  """

  kernel: jax.Array
  bias: jax.Array | None
  vocab_major: bool


def _project(x: jax.Array, kernel: jax.Array, bias: jax.Array | None, vocab_major: bool) -> jax.Array:
  """[b, c, e] -> [b, c, v] float32 logits."""
  dims = ((2,), (1,)) if vocab_major else ((2,), (0,))
  logits = jax.lax.dot_general(x, kernel.astype(x.dtype), (dims, ((), ())), preferred_element_type=jnp.float32)
  return logits if bias is None else logits + bias.astype(jnp.float32)


def _chunked(a: jax.Array, chunk: int) -> jax.Array:
  """[b, t, ...] -> [t / chunk, b, chunk, ...] (t a multiple of chunk)."""
  b, t = a.shape[:2]
  return jnp.moveaxis(a.reshape((b, t // chunk, chunk) + a.shape[2:]), 1, 0)


def _unchunked(a: jax.Array) -> jax.Array:
  """[n, b, chunk, ...] -> [b, n * chunk, ...]."""
  a = jnp.moveaxis(a, 0, 1)
  return a.reshape((a.shape[0], a.shape[1] * a.shape[2]) + a.shape[3:])


def sum_rows(g: jax.Array, lead: int, wide: bool = True) -> jax.Array:
  """g [*rows, *s] (`lead` row dims) summed over its rows in float32 -> [*s]: the gradient of a bias
  added to every row. For a `wide` bias (the vocabulary's), where `target.row_sums_as_products()`
  (a CPU), as ones [n] . g [n, prod(s)], the products exact and their sum float32 (the same sum in
  another order); otherwise as a reduce."""
  if not (wide and target.row_sums_as_products()):
    return jnp.sum(g.astype(jnp.float32), axis=tuple(range(lead)))
  n = math.prod(g.shape[:lead])
  ones = jnp.ones((n,), g.dtype)
  total = jax.lax.dot_general(ones, g.reshape(n, -1), (((0,), (0,)), ((), ())),
                              precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
  return total.reshape(g.shape[lead:])  # [*s]


def _chunk_sums(x, kernel, bias, targets, weights, z_loss, vocab_major, grads):
  """One chunk: x [b, c, e], targets / weights [b, c] -> the chunk's weighted sums of ce, log(Z)^2 and
  correct, and with `grads` the gradients of sum(w (ce + z_loss log(Z)^2)) for x, kernel and bias."""
  logits = _project(x, kernel, bias, vocab_major)  # [b, c, v]
  top, exp, total, log_z, target_logit = _softmax_parts(logits, targets)  # exp [b, c, v], the rest [b, c]
  ce = log_z - target_logit  # [b, c]
  sums = (jnp.sum(weights * ce), jnp.sum(weights * jnp.square(log_z)), jnp.sum(weights * (target_logit >= top)))
  if not grads:
    return sums, None
  # d/dlogits of w (log Z - logit[target] + z log(Z)^2) = w ((1 + 2 z log Z) softmax - onehot)
  d_logits = _d_logits(exp, total, targets, weights * (1.0 + 2.0 * z_loss * log_z), -weights).astype(x.dtype)
  k = kernel.astype(x.dtype)
  if vocab_major:  # kernel [v, e]
    d_x = jnp.einsum("bcv,ve->bce", d_logits, k, preferred_element_type=jnp.float32)
    d_kernel = jnp.einsum("bcv,bce->ve", d_logits, x, preferred_element_type=jnp.float32)
  else:  # kernel [e, v]
    d_x = jnp.einsum("bcv,ev->bce", d_logits, k, preferred_element_type=jnp.float32)
    d_kernel = jnp.einsum("bce,bcv->ev", x, d_logits, preferred_element_type=jnp.float32)
  d_bias = None if bias is None else sum_rows(d_logits, 2)
  d_weights = ce + z_loss * jnp.square(log_z)  # [b, c]: the loss is linear in the weights
  return sums, (d_x.astype(x.dtype), d_kernel, d_bias, d_weights)


def _fused_sums(x, kernel, bias, targets, weights, z_loss, chunk, vocab_major, grads):
  """Scan `_chunk_sums` over the row's chunks; the head's gradients accumulate in float32."""
  zeros = lambda a: None if a is None else jnp.zeros(a.shape, jnp.float32)

  def body(carry, inputs):
    sums, d_kernel, d_bias = carry
    chunk_sums, chunk_grads = _chunk_sums(inputs[0], kernel, bias, inputs[1], inputs[2], z_loss, vocab_major, grads)
    sums = tuple(a + b for a, b in zip(sums, chunk_sums))
    if not grads:
      return (sums, d_kernel, d_bias), None
    d_x, chunk_d_kernel, chunk_d_bias, d_weights = chunk_grads
    d_bias = None if bias is None else d_bias + chunk_d_bias
    return (sums, d_kernel + chunk_d_kernel, d_bias), (d_x, d_weights)

  init = ((jnp.zeros((), jnp.float32),) * 3, zeros(kernel) if grads else None, zeros(bias) if grads else None)
  (sums, d_kernel, d_bias), per_chunk = jax.lax.scan(body, init, (_chunked(x, chunk), _chunked(targets, chunk),
                                                            _chunked(weights, chunk)))
  if not grads:
    return sums, None
  d_bias = None if bias is None else d_bias.astype(bias.dtype)
  d_x, d_weights = (_unchunked(a) for a in per_chunk)
  return sums, (d_x, d_kernel.astype(kernel.dtype), d_bias, d_weights)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _fused_loss(x, kernel, bias, targets, weights, z_loss, chunk, vocab_major):
  sums, _ = _fused_sums(x, kernel, bias, targets, weights, z_loss, chunk, vocab_major, grads=False)
  return sums[0] + z_loss * sums[1], sums


def _fused_loss_fwd(x, kernel, bias, targets, weights, z_loss, chunk, vocab_major):
  sums, grads = _fused_sums(x, kernel, bias, targets, weights, z_loss, chunk, vocab_major, grads=True)
  return (sums[0] + z_loss * sums[1], sums), (grads, targets)


def _fused_loss_bwd(z_loss, chunk, vocab_major, residuals, cotangents):
  # The gradients were taken in the forward pass: the loss is a sum, its cotangent only scales them.
  # The sums in the second output are metrics, stop_gradient'ed by the caller.
  (d_x, d_kernel, d_bias, d_weights), targets = residuals
  g = cotangents[0]
  scale = lambda a: None if a is None else a * g.astype(a.dtype)
  return (scale(d_x), scale(d_kernel), scale(d_bias), np.zeros(targets.shape, jax.dtypes.float0), scale(d_weights))


_fused_loss.defvjp(_fused_loss_fwd, _fused_loss_bwd)


def linear_cross_entropy(
    x: jax.Array, head: HeadWeights, targets: jax.Array, weights: jax.Array, *, z_loss: float = 0.0,
    chunk: int = 128,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """`weighted_cross_entropy` of the logits x . head, without materialising them.

  The row is cut into chunks of `chunk` tokens; for each chunk the [b, chunk, v] logits, their
  loss and (under differentiation) their gradient with respect to x and the head are computed and
  dropped, the head's gradient summed over the chunks in float32. The full [b, t, v] logits and
  their gradient never exist: their memory becomes [b, chunk, v], and no matmul is repeated (the
  gradients are taken in the forward pass, as the loss is a weighted sum whose cotangent only
  scales them). Every input but the targets gets the gradient autodiff would give it.

  Args:
    x: [b, t, e] final hidden states (the compute dtype; logits and loss are float32).
    head: the projection (kernel [v, e] or [e, v], optional bias [v]).
    targets: [b, t] int; weights: [b, t] float, 0 for tokens not predicted.
    z_loss: coefficient of log(Z)^2, as in `weighted_cross_entropy`.
    chunk: tokens per row per chunk; t is padded (with weight 0) to a multiple of it.
  Returns:
    (loss, metrics) exactly as `weighted_cross_entropy` (to float32 rounding).
  """
  t = x.shape[1]
  chunk = max(1, min(chunk, t))
  pad = -t % chunk
  weights = weights.astype(jnp.float32)
  if pad:
    x = jnp.pad(x, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    weights = jnp.pad(weights, ((0, 0), (0, pad)))
  objective, sums = _fused_loss(x, head.kernel, head.bias, targets, weights, float(z_loss), chunk,
                                bool(head.vocab_major))
  ce_sum, log_z_sq_sum, correct_sum = jax.lax.stop_gradient(sums)
  total = jnp.sum(weights)
  denom = jnp.maximum(total, 1.0)
  metrics = {"loss": ce_sum / denom, "accuracy": correct_sum / denom, "num_tokens": total}
  if z_loss:
    metrics["z_loss"] = z_loss * log_z_sq_sum / denom
  return objective / denom, metrics
