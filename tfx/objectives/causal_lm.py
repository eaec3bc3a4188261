"""Causal language modelling (GPT), OBJECTIVES.md §1.

Target convention (B), input shift, as in seqio/T5X/MaxText: the targets are the packed
tokens themselves and the model input is the same row shifted right by one **within each
document**, with BOS at every document start:

    tokens      a  b  c  EOS | d  e  EOS      (segment 1 | segment 2)
    inputs     BOS a  b  c   | BOS d  e
    targets     a  b  c  EOS | d  e  EOS
    weights     1  1  1  1   | 1  1  1        (0 only on padding, segment 0)

So every real token, the first of each document and its EOS included, is predicted exactly
once, and nothing is predicted across a document boundary. The loss is the mean
cross-entropy over predicted tokens. Generation starts from [BOS] + prompt.
"""

import dataclasses

import jax
import jax.numpy as jnp

from tfx.objectives.base import Objective, Predictions, causal_visible, flat_positions
from tfx.registry import OBJECTIVES


def shift_right_by_segment(tokens: jax.Array, segment_ids: jax.Array, bos_id: int) -> jax.Array:
  """[b, t] -> [b, t]: out[i] = tokens[i-1] within a segment, `bos_id` at each segment start."""
  prev = jnp.pad(tokens[:, :-1], ((0, 0), (1, 0)), constant_values=bos_id)
  prev_segment = jnp.pad(segment_ids[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
  return jnp.where(segment_ids == prev_segment, prev, bos_id)


def causal_lm_inputs(batch: dict[str, jax.Array], bos_id: int) -> dict[str, jax.Array]:
  """The model inputs, targets and weights of convention (B)."""
  tokens, segment_ids = batch["tokens"], batch["segment_ids"]
  return {
      "inputs": shift_right_by_segment(tokens, segment_ids, bos_id),  # [b, t]
      "targets": tokens,  # [b, t]
      "weights": (segment_ids > 0).astype(jnp.float32),  # [b, t]
  }


@OBJECTIVES.register("causal_lm")
@dataclasses.dataclass(frozen=True)
class CausalLM(Objective):
  """Next-token prediction with a causal, document-isolated mask."""

  families = ("decoder",)
  uses_rng = False

  @property
  def bos_id(self) -> int:
    return self.ids.bos if self.ids.bos is not None else self.ids.eos

  def _forward(self, model, params, batch, rng, *, train, loss=False):
    """(logits [b, t, v], or with `loss` the token loss and its metrics; the model inputs)."""
    x = causal_lm_inputs(batch, self.bos_id)
    out = model.apply(
        {"params": params}, x["inputs"], batch["segment_ids"], batch["positions"],
        train=train, rngs={"dropout": rng}, loss=self.token_targets(x["targets"], x["weights"]) if loss else None)
    return out, x

  def loss(self, model, params, batch, rng, *, train):
    return self._forward(model, params, batch, rng, train=train, loss=True)[0]

  def predictions(self, model, params, batch, rng):
    """Position i predicts raw token i from the tokens before it in its document."""
    logits, x = self._forward(model, params, batch, rng, train=False)
    return Predictions(logits, x["targets"], x["weights"], flat_positions(batch["segment_ids"]),
                       visible=causal_visible(batch["segment_ids"]))
