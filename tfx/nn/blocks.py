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
  """One transformer layer: self-attention, optional cross-attention, MLP.

  `__call__(x, mask, positions, segment_ids, bias, encoded, cross_mask) -> (x, None)`, so it
  can be scanned. x: [b, t, e]; mask: [b, 1|h, t, t] bool; positions, segment_ids: [b, t]
  int; bias: optional [b|1, h, t, t] added to the self-attention scores (T5 relative
  positions); encoded: [b, s, e] encoder output and cross_mask [b, 1, t, s] when `cross`.
  """

  cfg: ModelConfig
  deterministic: bool = True
  decode: bool = False
  cross: bool = False

  @nn.compact
  def __call__(self, x, mask, positions, segment_ids, bias=None, encoded=None, cross_mask=None):
    cfg = self.cfg
    drop = lambda y: nn.Dropout(cfg.dropout)(y, deterministic=self.deterministic)
    attn = Attention(cfg, self.deterministic, self.decode, use_rotary=cfg.position == "rotary", name="attention")
    sublayers = [lambda y: attn(y, y, mask, q_positions=positions, kv_positions=positions, q_segment_ids=segment_ids,
                                bias=bias)]
    names = ["attention_norm"]
    if self.cross:
      cross = Attention(cfg, self.deterministic, decode=False, name="cross_attention")
      sublayers.append(lambda y: cross(y, encoded, cross_mask))
      names.append("cross_attention_norm")
    sublayers.append(Mlp(cfg, self.deterministic, name="mlp"))
    names.append("mlp_norm")
    for sublayer, name in zip(sublayers, names):
      if cfg.norm == "pre":
        x = x + drop(sublayer(make_norm(cfg, name)(x)))
      else:  # post-LN
        x = make_norm(cfg, name)(x + drop(sublayer(x)))
    x = constrain(x, ("act_batch", "act_length", "act_embed"))
    return x, None


class Stack(nn.Module):
  """`num_layers` blocks, scanned (stacked parameters with a `layers` axis) or unrolled.

  Attributes:
    num_layers: blocks in this stack.
    cross: blocks have cross-attention over an encoder output.
  """

  cfg: ModelConfig
  num_layers: int
  deterministic: bool = True
  decode: bool = False
  cross: bool = False

  @nn.compact
  def __call__(self, x, mask, positions, segment_ids, bias=None, encoded=None, cross_mask=None):
    cfg = self.cfg
    block = Block
    if cfg.remat != "none":
      block = nn.remat(block, policy=REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan_layers)
    args = (x, mask, positions, segment_ids, bias, encoded, cross_mask)
    if cfg.scan_layers:
      scanned = nn.scan(
          block,
          variable_axes={"params": 0, "cache": 0},
          split_rngs={"params": True, "dropout": True},
          in_axes=(nn.broadcast,) * 6,
          length=self.num_layers,
          metadata_params={nn.PARTITION_NAME: "layers"},
      )
      x, _ = scanned(cfg, self.deterministic, self.decode, self.cross, name="layers")(*args)
    else:
      for i in range(self.num_layers):
        x, _ = block(cfg, self.deterministic, self.decode, self.cross, name=f"layer_{i}")(x, *args[1:])
    return x
