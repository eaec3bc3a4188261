"""Weighted cross-entropy and accuracy: the only loss arithmetic objectives need."""

import jax
import jax.numpy as jnp


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
  logits = logits.astype(jnp.float32)
  # logsumexp written out so that its max serves the accuracy too: one pass over [b, t, v] for
  # both, where an argmax would be a second (variadic) reduction over the vocabulary.
  top = jax.lax.stop_gradient(jnp.max(logits, axis=-1))  # [b, t]
  log_z = top + jnp.log(jnp.sum(jnp.exp(logits - top[..., None]), axis=-1))  # [b, t]
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]  # [b, t]
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
