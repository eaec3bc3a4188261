"""The encoder family (BERT / RoBERTa): bidirectional attention within each packed document,
and the masked-LM head (dense + activation + norm + tied output embedding + bias).

Post-LN with a norm on the embeddings is BERT (`model.norm=post`, `model.embed_norm=True`);
pre-LN adds a final norm instead. Token types (segment A/B) when `model.type_vocab_size` > 0.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from tfx import ops
from tfx.models.base import Family
from tfx.nn import DenseGeneral, Embed, Stack, make_norm
from tfx.nn.layers import GATED, activation
from tfx.registry import FAMILIES


@FAMILIES.register("encoder")
class Encoder(Family):
  """Bidirectional encoder with an MLM head.

  `__call__(tokens, segment_ids, positions, *, token_types, train, mask, return_hidden)`:
  tokens, segment_ids (0 = padding), positions, token_types: [b, t] int. Returns logits
  [b, t, v], or the final hidden states [b, t, e] with `return_hidden=True` (for heads such
  as `ClassifierHead`). `mask` [b, 1|h, t, t] replaces the default same-document mask.
  """

  INPUTS = ("tokens", "segment_ids", "positions")

  @nn.compact
  def __call__(self, tokens, segment_ids, positions, *, token_types=None, train: bool = False, mask=None,
               return_hidden: bool = False):
    cfg = self.cfg
    embed = Embed(cfg.vocab_size, cfg.d_model, init_std=cfg.init_std, dtype=cfg.compute_dtype, name="token_embed")
    x = self.embed_inputs(embed, tokens, positions, train=train, token_types=token_types)  # [b, t, e]
    if mask is None:
      mask = ops.segment_mask(segment_ids)  # [b, 1, t, t]
    bias = self.relative_bias(positions, positions, bidirectional=True, name="relative_bias")
    x = Stack(cfg, cfg.num_layers, deterministic=not train, name="encoder")(x, mask, positions, segment_ids, bias)
    if cfg.norm == "pre":
      x = make_norm(cfg, "final_norm")(x)
    if return_hidden:
      return x
    # MLM head: transform, then the (tied) output projection with a bias.
    act = activation("gelu" if cfg.mlp in GATED else cfg.mlp)
    h = DenseGeneral((cfg.d_model,), (cfg.d_model,), ("embed", "mlp"), use_bias=True, init_std=cfg.init_std,
                     dtype=cfg.compute_dtype, name="head_dense")(x)
    h = make_norm(cfg, "head_norm")(act(h))
    return self.lm_head(embed, h, bias=True)


class ClassifierHead(nn.Module):
  """Sequence classification on encoder hidden states, for fine-tuning.

  Attributes:
    num_classes: output classes.
    pooling: 'first' (the first token of each row, BERT's [CLS]) or 'mean' (mean over the
      tokens of the row's first document, segment 1).
  """

  num_classes: int
  pooling: str = "first"
  dropout: float = 0.0
  init_std: float = 0.02

  @nn.compact
  def __call__(self, hidden: jax.Array, segment_ids: jax.Array, *, train: bool = False) -> jax.Array:
    """hidden [b, t, e], segment_ids [b, t] -> logits [b, num_classes] float32."""
    if self.pooling == "first":
      pooled = hidden[:, 0]  # [b, e]
    elif self.pooling == "mean":
      w = (segment_ids == 1).astype(jnp.float32)[..., None]  # [b, t, 1]
      pooled = jnp.sum(hidden.astype(jnp.float32) * w, axis=1) / jnp.maximum(jnp.sum(w, axis=1), 1.0)
    else:
      raise ValueError(f"unknown pooling {self.pooling!r}; choose 'first' or 'mean'")
    e = hidden.shape[-1]
    pooled = jnp.tanh(DenseGeneral((e,), (e,), ("embed", "mlp"), init_std=self.init_std, name="pooler")(pooled))
    pooled = nn.Dropout(self.dropout)(pooled, deterministic=not train)
    return DenseGeneral((e,), (self.num_classes,), ("embed", None), init_std=self.init_std,
                        name="classifier")(pooled).astype(jnp.float32)
