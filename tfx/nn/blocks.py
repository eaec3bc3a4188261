"""Transformer blocks (pre-LN or post-LN) and the layer stack (nn.scan, nn.remat).

A block is self-attention + MLP with residuals; an optional cross-attention sits between
them for encoder-decoder models. Which tokens see which is decided by the masks passed in.
"""

from typing import Callable

import flax.linen as nn
import jax

from tfx.nn.attention import Attention
from tfx.nn.layers import Mlp, ModelConfig, constrain, make_norm

# Rematerialisation policies by name (config `model.remat`).
REMAT_POLICIES: dict[str, Callable | None] = {
    "full": None,  # save nothing, recompute the whole block in the backward pass
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
REMAT_NAMES = ("none",) + tuple(REMAT_POLICIES)


class Block(nn.Module):
  """One transformer layer.

  `__call__(x, mask, positions, segment_ids) -> (x, None)` so that it can be scanned.
  x: [b, t, e]; mask: [b, 1|h, t, t] bool; positions, segment_ids: [b, t] int.
  """

  cfg: ModelConfig
  deterministic: bool = True
  decode: bool = False

  @nn.compact
  def __call__(self, x, mask, positions, segment_ids):
    cfg = self.cfg
    drop = lambda y: nn.Dropout(cfg.dropout)(y, deterministic=self.deterministic)
    attn = Attention(cfg, self.deterministic, self.decode, use_rotary=cfg.position == "rotary", name="attention")
    mlp = Mlp(cfg, self.deterministic, name="mlp")

    def self_attention(y):
      return attn(y, y, mask, q_positions=positions, kv_positions=positions, q_segment_ids=segment_ids)

    if cfg.norm == "pre":
      x = x + drop(self_attention(make_norm(cfg, "attention_norm")(x)))
      x = x + drop(mlp(make_norm(cfg, "mlp_norm")(x)))
    else:  # post-LN
      x = make_norm(cfg, "attention_norm")(x + drop(self_attention(x)))
      x = make_norm(cfg, "mlp_norm")(x + drop(mlp(x)))
    x = constrain(x, ("act_batch", "act_length", "act_embed"))
    return x, None


class Stack(nn.Module):
  """`num_layers` blocks, scanned (stacked parameters with a `layers` axis) or unrolled.

  Attributes:
    block: the block class (called as block(cfg, deterministic, decode)).
  """

  cfg: ModelConfig
  block: type = Block
  deterministic: bool = True
  decode: bool = False

  @nn.compact
  def __call__(self, x, mask, positions, segment_ids):
    cfg = self.cfg
    block = self.block
    if cfg.remat != "none":
      block = nn.remat(block, policy=REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan_layers)
    if cfg.scan_layers:
      scanned = nn.scan(
          block,
          variable_axes={"params": 0, "cache": 0},
          split_rngs={"params": True, "dropout": True},
          in_axes=(nn.broadcast, nn.broadcast, nn.broadcast),
          length=cfg.num_layers,
          metadata_params={nn.PARTITION_NAME: "layers"},
      )
      x, _ = scanned(cfg, self.deterministic, self.decode, name="layers")(x, mask, positions, segment_ids)
    else:
      for i in range(cfg.num_layers):
        x, _ = block(cfg, self.deterministic, self.decode, name=f"layer_{i}")(x, mask, positions, segment_ids)
    return x
