"""Decoder-only prefix LM, OBJECTIVES.md §3.3 (seqio `PrefixLMFeatureConverter`, per document).

Each packed document of length n is split at a point P drawn uniformly from {1, ..., n-1}
(documents of one token: P = 0, all target). Its first P tokens are the prefix (context,
no loss), the rest the suffix (predicted). As in causal LM (convention B), the model input
is the row shifted right by one within each document, with BOS at each document start:

    tokens    x0  x1  x2 | x3  x4  EOS          (P = 3)
    inputs   BOS  x0  x1 | x2  x3  x4
    targets   x0  x1  x2 | x3  x4  EOS
    weights    0   0   0 |  1   1   1
    bidirectional: input positions 0..P (BOS, x0 .. x_{P-1}); causal after.

The bidirectional block is the first **P + 1** input positions, i.e. `prefix_lm_mask` gets
prefix length P + 1 per token (seqio: "causal_attention = 1 for positions < len(inputs) + 1").
These positions hold only prefix tokens, so a suffix target x_i (i >= P), which sits at input
position i + 1 > P, is visible only causally, to positions >= i + 1: never to its own
prediction (position i) nor to an earlier one. Prefix positions do see their own next token
(x_{P-1} is at input P), but they carry no loss.
"""

import dataclasses

import jax
import jax.numpy as jnp

from tfx import ops
from tfx.objectives.base import Objective, Predictions, causal_visible, flat_positions
from tfx.objectives.causal_lm import shift_right_by_segment
from tfx.registry import OBJECTIVES


def document_lengths(segment_ids: jax.Array) -> jax.Array:
  """[b, t] -> [b, t] int32: the length of each token's document (its count of tokens)."""
  b, t = segment_ids.shape
  rows = jnp.arange(b)[:, None]
  counts = jnp.zeros((b, t + 1), jnp.int32).at[rows, segment_ids].add(1)  # [b, t + 1], by segment id
  return jnp.take_along_axis(counts, segment_ids, axis=1)


def random_prefix_lengths(segment_ids: jax.Array, rng: jax.Array) -> jax.Array:
  """[b, t] -> [b, t] int32: per token, the prefix length P of its document.

  P ~ U{1, ..., n-1} for a document of n >= 2 tokens, 0 for n = 1; one draw per (row,
  segment id), row r from split(rng, b)[r]. Padding gets 0.
  """
  b, t = segment_ids.shape
  keys = jax.random.split(rng, b)
  u = jax.vmap(lambda k: jax.random.uniform(k, (t + 1,)))(keys)  # [b, t + 1], by segment id
  n = document_lengths(segment_ids)  # [b, t]
  draw = jnp.take_along_axis(u, segment_ids, axis=1)  # [b, t], the same within a document
  prefix = 1 + jnp.floor(draw * (n - 1)).astype(jnp.int32)  # in {1 .. n-1}
  prefix = jnp.minimum(prefix, n - 1)  # guards u -> 1 in float32; n = 1 gives 0
  return jnp.where(segment_ids > 0, prefix, 0)


def prefix_lm_inputs(batch: dict[str, jax.Array], rng: jax.Array, bos_id: int) -> dict[str, jax.Array]:
  """Model inputs, targets, weights, attention mask and per-token prefix lengths.

  Returns:
    dict with `inputs`, `targets`, `weights` (float32, 1 on suffix tokens only), `prefix_length`
    ([b, t] int32, P of each token's document) and `mask` (bool [b, 1, t, t]).
  """
  tokens, segment_ids, positions = batch["tokens"], batch["segment_ids"], batch["positions"]
  prefix = random_prefix_lengths(segment_ids, rng)  # [b, t]
  return {
      "inputs": shift_right_by_segment(tokens, segment_ids, bos_id),  # [b, t]
      "targets": tokens,  # [b, t]
      "weights": ((segment_ids > 0) & (positions >= prefix)).astype(jnp.float32),  # [b, t]
      "prefix_length": prefix,
      "mask": ops.prefix_lm_mask(segment_ids, positions, prefix + 1),  # [b, 1, t, t]
  }


@OBJECTIVES.register("prefix_lm")
@dataclasses.dataclass(frozen=True)
class PrefixLM(Objective):
  """Prefix LM on a decoder: bidirectional over a random prefix of each document, loss on the rest."""

  families = ("decoder",)

  @classmethod
  def bidirectional_prompt(cls, objective_cfg) -> bool:
    return True

  @property
  def bos_id(self) -> int:
    return self.ids.bos if self.ids.bos is not None else self.ids.eos

  def _forward(self, model, params, batch, rng, *, train, loss=False):
    """(logits [b, t, v], or with `loss` the token loss and its metrics; the model inputs)."""
    split_rng, dropout_rng = jax.random.split(rng)
    x = prefix_lm_inputs(batch, split_rng, self.bos_id)
    out = model.apply(
        {"params": params}, x["inputs"], batch["segment_ids"], batch["positions"], mask=x["mask"],
        train=train, rngs={"dropout": dropout_rng},
        loss=self.token_targets(x["targets"], x["weights"]) if loss else None)
    return out, x

  def loss(self, model, params, batch, rng, *, train):
    return self._forward(model, params, batch, rng, train=train, loss=True)[0]

  def predictions(self, model, params, batch, rng):
    """A suffix token is predicted from the tokens before it in its document (the prefix, seen
    bidirectionally, is all before it)."""
    logits, x = self._forward(model, params, batch, rng, train=False)
    return Predictions(logits, x["targets"], x["weights"], flat_positions(batch["segment_ids"]),
                       visible=causal_visible(batch["segment_ids"]))
