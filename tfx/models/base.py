"""What every model family shares: construction from the config, positions, the LM head.

A family is a linen Module registered by name in `tfx.registry.FAMILIES`, with one field,
`cfg: ModelConfig`. The training loop only needs `Family.init_inputs` (dummy inputs of the
right shapes for `init`); objectives call the module itself.
"""

from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from tfx import ops
from tfx.nn.layers import DenseGeneral, Embed, ModelConfig

POSITIONS = ("learned", "sinusoidal", "rotary")


class Family(nn.Module):
  """Base class of model families."""

  cfg: ModelConfig

  # Names of the int32 [b, t] inputs `init` needs.
  INPUTS: ClassVar[tuple[str, ...]] = ()

  @classmethod
  def init_inputs(cls, batch: int, length: int) -> dict[str, jax.Array]:
    """Dummy inputs for `model.init`: [batch, length] int32 each (one document per row)."""
    out = {}
    for name in cls.INPUTS:
      if name == "segment_ids":
        out[name] = jnp.ones((batch, length), jnp.int32)
      elif name == "positions":
        out[name] = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
      else:
        out[name] = jnp.zeros((batch, length), jnp.int32)
    return out

  def absolute_positions(self, positions: jax.Array) -> jax.Array | float:
    """[b, t] -> [b, t, e] absolute position embedding, or 0.0 for rotary (applied in attention)."""
    cfg = self.cfg
    if cfg.position == "learned":
      table = Embed(cfg.max_length, cfg.d_model, axes=("position", "embed"), init_std=cfg.init_std,
                    dtype=cfg.compute_dtype, name="position_embed")
      return table(positions)
    if cfg.position == "sinusoidal":
      return ops.sinusoidal(positions, cfg.d_model).astype(cfg.compute_dtype)
    if cfg.position == "rotary":
      return 0.0
    raise ValueError(f"unknown model.position {cfg.position!r}; choose one of {POSITIONS}")

  def lm_head(self, embed: Embed, x: jax.Array) -> jax.Array:
    """[b, t, e] -> [b, t, v] logits (float32), tied to `embed` or a separate projection."""
    cfg = self.cfg
    if cfg.tie_embeddings:
      logits = embed.attend(x)
    else:
      logits = DenseGeneral((cfg.d_model,), (cfg.vocab_size,), ("embed", "vocab"), use_bias=False,
                            init_std=cfg.init_std, dtype=cfg.compute_dtype, name="lm_head")(x)
    return nn.with_logical_constraint(logits, ("act_batch", "act_length", "act_vocab")).astype(jnp.float32)
