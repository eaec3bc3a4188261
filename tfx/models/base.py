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
from tfx.nn.attention import RelativePositionBias
from tfx.nn.layers import DenseGeneral, Embed, ModelConfig, make_norm

POSITIONS = ("learned", "sinusoidal", "rotary", "relative")


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

  def absolute_positions(self, positions: jax.Array, name: str = "position_embed") -> jax.Array | float:
    """[b, t] -> [b, t, e] absolute position embedding; 0.0 for rotary / relative positions
    (applied inside attention)."""
    cfg = self.cfg
    if cfg.position == "learned":
      table = Embed(cfg.max_length, cfg.d_model, axes=("position", "embed"), init_std=cfg.init_std,
                    dtype=cfg.compute_dtype, name=name)
      return table(positions)
    if cfg.position == "sinusoidal":
      return ops.sinusoidal(positions, cfg.d_model).astype(cfg.compute_dtype)
    if cfg.position in ("rotary", "relative"):
      return 0.0
    raise ValueError(f"unknown model.position {cfg.position!r}; choose one of {POSITIONS}")

  def embed_inputs(self, embed: Embed, tokens, positions, *, train: bool, token_types=None,
                   prefix: str = "") -> jax.Array:
    """Token (+ position, + token type) embeddings, optional norm, dropout: [b, t] -> [b, t, e].

    `prefix` names the position/type tables of one stack when a model has two.
    """
    cfg = self.cfg
    x = embed(tokens)  # [b, t, e]
    if cfg.embed_scale:
      x = x * jnp.asarray(cfg.d_model**0.5, x.dtype)
    x = x + self.absolute_positions(positions, name=prefix + "position_embed")
    if cfg.type_vocab_size:
      types = jnp.zeros_like(tokens) if token_types is None else token_types
      x = x + Embed(cfg.type_vocab_size, cfg.d_model, axes=("token_type", "embed"), init_std=cfg.init_std,
                    dtype=cfg.compute_dtype, name=prefix + "type_embed")(types)
    if cfg.embed_norm:
      x = make_norm(cfg, prefix + "embed_norm")(x)
    # Zero unless a 'perturbations' collection is passed: lets tests take gradients with
    # respect to the input embeddings (information-flow checks).
    x = self.perturb(prefix + "embeddings", x)
    x = nn.with_logical_constraint(x, ("act_batch", "act_length", "act_embed"))
    return nn.Dropout(cfg.dropout)(x, deterministic=not train)

  def relative_bias(self, q_positions, k_positions, *, bidirectional: bool, name: str):
    """[b, h, t, s] T5 relative-position bias of a stack, or None for other position kinds."""
    if self.cfg.position != "relative":
      return None
    return RelativePositionBias(self.cfg, bidirectional, name=name)(q_positions, k_positions)

  def lm_head(self, embed: Embed, x: jax.Array, *, bias: bool = False) -> jax.Array:
    """[b, t, e] -> [b, t, v] logits (float32), tied to `embed` or a separate projection."""
    cfg = self.cfg
    if cfg.tie_embeddings:
      if cfg.scale_tied_logits:
        x = x * jnp.asarray(cfg.d_model**-0.5, x.dtype)
      logits = embed.attend(x)
    else:
      logits = DenseGeneral((cfg.d_model,), (cfg.vocab_size,), ("embed", "vocab"), use_bias=False,
                            init_std=cfg.init_std, dtype=cfg.compute_dtype, name="lm_head")(x)
    if bias:
      logits = logits + self.param("output_bias", nn.with_logical_partitioning(nn.initializers.zeros, ("vocab",)),
                                   (cfg.vocab_size,), jnp.float32).astype(logits.dtype)
    return nn.with_logical_constraint(logits, ("act_batch", "act_length", "act_vocab")).astype(jnp.float32)
