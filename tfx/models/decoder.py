"""The decoder family (GPT): token + position embeddings, a causal block stack, an LM head."""

import flax.linen as nn
from tfx import ops
from tfx.models.base import Family
from tfx.nn import Embed, Stack, make_norm
from tfx.registry import FAMILIES


@FAMILIES.register("decoder")
class Decoder(Family):
  """Decoder-only language model.

  `__call__(tokens, segment_ids, positions, *, train, decode, mask, return_hidden) -> logits [b, t, v]`
  (or the final hidden states [b, t, e] with `return_hidden=True`, for classification heads; or the
  token loss and its metrics with `loss`, see `Family.lm_head`). `rows` [b, n] int: the output at
  those positions only, [b, n, .], the last layer computing nothing else (`Stack.last_layer_queries`).
  tokens, segment_ids (0 = padding, 1..k = packed documents), positions: [b, t] int.
  mask: optional [b, 1|h, t, t] bool replacing the default causal-and-same-document mask
  (prefix-LM objectives pass theirs). With decode=True the block attention reads and
  extends the KV cache ("cache" collection) and the mask is built from the cache.
  """

  INPUTS = ("tokens", "segment_ids", "positions")
  POOLING = "last"  # causal: only the last real token has seen the whole text

  @nn.compact
  def __call__(self, tokens, segment_ids, positions, *, train: bool = False, decode: bool = False, mask=None,
               return_hidden: bool = False, loss: ops.TokenTargets | None = None, rows=None):
    cfg = self.cfg
    embed = Embed(cfg.vocab_size, cfg.d_model, init_std=cfg.init_std, dtype=cfg.compute_dtype, name="token_embed")
    x = self.embed_inputs(embed, tokens, positions, train=train)  # [b, t, e]
    if mask is None and not decode:
      mask = ops.self_attention_mask(segment_ids, causal=True, implementation=cfg.attention,
                                     packed_runs=cfg.packed_runs)  # ids (+ [b, 1, t, t])
    stack = Stack(cfg, cfg.num_layers, deterministic=not train, decode=decode, name="decoder")
    x = stack(x, mask, positions, segment_ids, rows=rows)  # [b, t, e], or [b, n, e] at `rows`
    if cfg.norm == "pre":
      x = make_norm(cfg, "final_norm")(x)
    if return_hidden:
      return x  # [b, t, e]
    return self.lm_head(embed, x, loss=loss)

  def sequence_hidden(self, tokens, segment_ids, positions, token_types=None, *, train: bool = False, rows=None):
    """[b, t, e] final hidden states under the causal, same-document mask (token types unused);
    [b, n, e] at `rows`, the last layer computed at those rows alone."""
    return self(tokens, segment_ids, positions, train=train, return_hidden=True, rows=rows)

  def rows_alone(self) -> bool:
    return True

