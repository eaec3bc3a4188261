"""What every model family shares: construction from the config, positions, the LM head.

A family is a linen Module registered by name in `tfx.registry.FAMILIES`, with one field,
`cfg: ModelConfig`. The training loop only needs `Family.init_inputs` (dummy inputs of the
right shapes for `init`); objectives call the module itself.
"""

from typing import Callable, ClassVar, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from tfx import ops
from tfx.nn.attention import RelativePositionBias
from tfx.nn.layers import DenseGeneral, Dropout, Embed, ModelConfig, add_bias, broadcast_param, make_norm

POSITIONS = ("learned", "sinusoidal", "rotary", "relative")


class Slots(NamedTuple):
  """The inputs of a two-stream model's query stream at its n prediction slots.

  vectors: [e] or [b, n, e], what stands in for the (unknown) token embedding.
  positions: [b, n] int, the position of each slot's target.
  token_types: [b, n] int or None (type 0), the target's token type.
  """

  vectors: jax.Array
  positions: jax.Array
  token_types: jax.Array | None = None


class Family(nn.Module):
  """Base class of model families."""

  cfg: ModelConfig

  # Names of the int32 [b, t] inputs `init` needs.
  INPUTS: ClassVar[tuple[str, ...]] = ()
  # Which position a sequence classifier pools (ClassifierHead.pooling): 'first', 'mean' or 'last'.
  POOLING: ClassVar[str] = "mean"

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

  def sequence_hidden(self, tokens, segment_ids, positions, token_types=None, *, train: bool = False,
                      rows=None) -> jax.Array:
    """Final hidden states [b, t, e] of one (right-padded) text per row, for sequence classification.

    tokens, segment_ids (1 = real, 0 = padding), positions, token_types: [b, t] int. Attention
    never reaches padding, so whatever follows a row's last real token changes nothing before
    it. The parameters it uses are a subset of those of the family's pretraining call.
    `rows` [b, n] int: the hidden states at those positions only, [b, n, e] (a classifier's pooled
    token); families that can (`rows_alone`) compute their last layer at those rows alone.
    """
    raise NotImplementedError(f"model family {self.cfg.family!r} has no sequence classification features")

  def rows_alone(self) -> bool:
    """Whether `sequence_hidden(rows=)` runs its last layer at the rows alone (else it gathers
    them from the full output): what a FLOP count of a pooled classifier needs."""
    return False

  def absolute_positions(self, positions: jax.Array, name: str = "position_embed") -> jax.Array | float:
    """[b, t] -> [b, t, e] absolute position embedding; 0.0 for rotary / relative positions
    (applied inside attention)."""
    return self._position_encoder(name)(positions)

  def _position_encoder(self, name: str) -> Callable[[jax.Array], jax.Array | float]:
    """The absolute position embedding as a function [b, t] -> [b, t, e] (0.0 for rotary /
    relative positions). The learned table is built here once, so it can be called twice."""
    cfg = self.cfg
    if cfg.position == "learned":
      return Embed(cfg.max_length, cfg.d_model, axes=("position", "embed"), init_std=cfg.init_std,
                   dtype=cfg.compute_dtype, name=name)
    if cfg.position == "sinusoidal":
      return lambda positions: ops.sinusoidal(positions, cfg.d_model).astype(cfg.compute_dtype)
    if cfg.position in ("rotary", "relative"):
      return lambda positions: 0.0
    raise ValueError(f"unknown model.position {cfg.position!r}; choose one of {POSITIONS}")

  def embed_inputs(self, embed: Embed, tokens, positions, *, train: bool, token_types=None,
                   prefix: str = "", slots: Slots | None = None):
    """Token (+ position, + token type) embeddings, optional norm, dropout: [b, t] -> [b, t, e].

    `prefix` names the position/type tables of one stack when a model has two. With `slots`
    (a two-stream model's query stream) it returns (x [b, t, e], g [b, n, e]): g is
    `slots.vectors` in place of the token embeddings, with the same position / type tables,
    embedding scale and norm, and its own dropout.
    """
    cfg = self.cfg
    position_embed = self._position_encoder(prefix + "position_embed")
    type_embed = norm = None
    if cfg.type_vocab_size:
      type_embed = Embed(cfg.type_vocab_size, cfg.d_model, axes=("token_type", "embed"), init_std=cfg.init_std,
                         dtype=cfg.compute_dtype, name=prefix + "type_embed")
    if cfg.embed_norm:
      norm = make_norm(cfg, prefix + "embed_norm")

    def combine(x, positions, types):  # [b, t, e] token vectors -> [b, t, e] before dropout
      if cfg.embed_scale:
        x = x * jnp.asarray(cfg.d_model**0.5, x.dtype)
      x = x + position_embed(positions)
      if type_embed is not None:
        x = x + type_embed(jnp.zeros_like(positions) if types is None else types)
      return x if norm is None else norm(x)

    drop = lambda y: Dropout(cfg.dropout)(y, deterministic=not train)
    x = combine(embed(tokens), positions, token_types)  # [b, t, e]
    # Zero unless a 'perturbations' collection is passed: lets tests take gradients with
    # respect to the input embeddings (information-flow checks).
    x = self.perturb(prefix + "embeddings", x)
    x = nn.with_logical_constraint(x, ("act_batch", "act_length", "act_embed"))
    x = drop(x)
    if slots is None:
      return x
    vectors = broadcast_param(slots.vectors, slots.positions.shape + (cfg.d_model,), x.dtype)  # [b, n, e]
    g = combine(vectors, slots.positions, slots.token_types)  # [b, n, e]
    g = nn.with_logical_constraint(g, ("act_batch", "act_length", "act_embed"))
    return x, drop(g)

  def relative_bias(self, q_positions, k_positions, *, bidirectional: bool, name: str, decode: bool = False):
    """T5 relative-position bias of a stack, or None for other position kinds: [1, h, t, s] from
    column offsets (model.relative_distance='columns', not while decoding with a KV cache), else
    [b, h, t, s] from the position ids [b, t] / [b, s]."""
    if self.cfg.position != "relative":
      return None
    if self.cfg.relative_distance == "columns" and not decode:
      q_positions = jnp.arange(q_positions.shape[1], dtype=jnp.int32)[None, :]  # [1, t]
      k_positions = jnp.arange(k_positions.shape[1], dtype=jnp.int32)[None, :]  # [1, s]
    return RelativePositionBias(self.cfg, bidirectional, name=name)(q_positions, k_positions)

  def lm_head(self, embed: Embed, x: jax.Array, *, bias: bool = False, loss: ops.TokenTargets | None = None,
              float32_logits: bool = True):
    """[b, t, e] -> [b, t, v] logits (float32; in the compute dtype without `float32_logits`, for a
    loss that reads them in float32 itself), tied to `embed` or a separate projection.

    With `loss` (the targets, weights and z-loss of a token loss) and `model.loss_chunk` > 0, the
    projection is fused with the loss (`ops.linear_cross_entropy`) and (loss, metrics) is returned
    instead of the logits; with `loss` and loss_chunk 0, the same from the materialised logits."""
    cfg = self.cfg
    if cfg.tie_embeddings:
      if cfg.scale_tied_logits:
        x = x * jnp.asarray(cfg.d_model**-0.5, x.dtype)
      kernel = embed.table()  # [v, e]
    else:
      projection = DenseGeneral((cfg.d_model,), (cfg.vocab_size,), ("embed", "vocab"), use_bias=False,
                                init_std=cfg.init_std, dtype=cfg.compute_dtype, name="lm_head")
      kernel = projection(None, weights_only=True)[0]  # [e, v]
    output_bias = None
    if bias:
      output_bias = self.param("output_bias", nn.with_logical_partitioning(nn.initializers.zeros, ("vocab",)),
                               (cfg.vocab_size,), jnp.float32)
    if loss is not None and cfg.loss_chunk:
      head = ops.HeadWeights(kernel, output_bias, vocab_major=cfg.tie_embeddings)
      return ops.linear_cross_entropy(x.astype(cfg.compute_dtype), head, loss.targets, loss.weights,
                                      z_loss=loss.z_loss, chunk=cfg.loss_chunk)
    logits = embed.attend(x) if cfg.tie_embeddings else projection(x)
    if output_bias is not None:
      logits = add_bias(logits, output_bias, True)  # its gradient summed in float32 (`wide`)
    logits = nn.with_logical_constraint(logits, ("act_batch", "act_length", "act_vocab"))
    if loss is None:
      return logits.astype(jnp.float32) if float32_logits else logits
    # In the compute dtype: the loss reads them in float32 itself, and bf16 logits get its
    # one-pass gradient, without a float32 copy of [b, t, v] (`ops.log_z_and_target`).
    return ops.weighted_cross_entropy(logits, loss.targets, loss.weights, z_loss=loss.z_loss)
