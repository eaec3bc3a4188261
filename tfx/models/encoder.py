"""The encoder family (BERT / RoBERTa): bidirectional attention within each packed document,
and the masked-LM head (dense + activation + norm + tied output embedding + bias).

Post-LN with a norm on the embeddings is BERT (`model.norm=post`, `model.embed_norm=True`);
pre-LN adds a final norm instead. Token types (segment A/B) when `model.type_vocab_size` > 0.
`Encoder.two_stream` runs XLNet's content / query streams on the same weights (permutation LM
with absolute or rotary positions and no memory).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from tfx import ops
from tfx.models.base import Family, Slots
from tfx.nn import DenseGeneral, Embed, QueryStream, Stack, make_norm
from tfx.nn.layers import GATED, Dropout, activation, take_rows
from tfx.registry import FAMILIES


# Position kinds `Encoder.two_stream` supports (T5 relative positions would need a [b, h, n, t]
# bias for the query stream).
TWO_STREAM_POSITIONS = ("learned", "sinusoidal", "rotary")


def slot_values(target_mapping: jax.Array, values: jax.Array) -> jax.Array:
  """The value at each prediction slot's target: target_mapping [b, n, t] (one-hot rows, zero
  rows for padded slots), values [b, t] int -> [b, n] int (0 at padded slots)."""
  picked = jnp.einsum("bnt,bt->bn", target_mapping.astype(jnp.float32), values.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)  # exact for |values| < 2**24
  return jnp.round(picked).astype(jnp.int32)


def slot_mask(target_mapping: jax.Array, query_mask: jax.Array) -> jax.Array:
  """Each slot's row of the query mask: target_mapping [b, n, t], query_mask [b, t, t] bool ->
  [b, 1, n, t] bool (a padded slot may attend nothing: the attention guard gives it zeros)."""
  rows = jnp.einsum("bnt,bts->bns", target_mapping.astype(jnp.float32), query_mask.astype(jnp.float32),
                    precision=jax.lax.Precision.HIGHEST)  # [b, n, t]
  return (rows > 0)[:, None]


@FAMILIES.register("encoder")
class Encoder(Family):
  """Bidirectional encoder with an MLM head.

  `__call__(tokens, segment_ids, positions, *, token_types, train, mask, return_hidden)`:
  tokens, segment_ids (0 = padding), positions, token_types: [b, t] int. Returns logits
  [b, t, v], or the final hidden states [b, t, e] with `return_hidden=True` (for heads such
  as `ClassifierHead`), or the embedding layer's output [b, t, e] (token + position + type
  embeddings, norm, dropout) with `return_embeddings=True` (ELECTRA's generator shares it).
  `mask` [b, 1|h, t, t] replaces the default same-document mask. `rows` [b, n] int: the output
  (logits or hidden states) at those positions only, [b, n, .]; the last layer then computes
  nothing else (`Stack.last_layer_queries`: masked LM's selected tokens).

  `two_stream(...)`: XLNet's two-stream attention on this encoder, for permutation LM (see
  its docstring). Its only parameter beyond `__call__`'s is `mask_emb` [e], which `__call__`
  also creates (unused there), so `init` through `__call__` gives the parameters of both.
  """

  INPUTS = ("tokens", "segment_ids", "positions")
  POOLING = "first"  # BERT's [CLS]

  def sequence_hidden(self, tokens, segment_ids, positions, token_types=None, *, train: bool = False, rows=None):
    """[b, t, e] final hidden states ([b, n, e] at `rows`, the last layer at those rows alone),
    bidirectional within the row's real tokens; token types (segment A / B) when the model has a
    type embedding (`type_vocab_size` > 0)."""
    token_types = token_types if self.cfg.type_vocab_size else None
    return self(tokens, segment_ids, positions, token_types=token_types, train=train, return_hidden=True, rows=rows)

  def rows_alone(self) -> bool:
    return self.cfg.position != "relative"  # a relative-position bias keeps the last layer whole (`_hidden`)

  def __call__(self, tokens, segment_ids, positions, *, token_types=None, train: bool = False, mask=None,
               return_hidden: bool = False, return_embeddings: bool = False, rows=None, float32_logits: bool = True):
    if mask is None:
      mask = ops.self_attention_mask(segment_ids, causal=False, implementation=self.cfg.attention,
                                     packed_runs=self.cfg.packed_runs)  # ids (+ [b, 1, t, t])
    return self._encode(tokens, positions, mask, segment_ids, token_types=token_types, train=train,
                        return_hidden=return_hidden, return_embeddings=return_embeddings, rows=rows,
                        float32_logits=float32_logits)

  def mlm_head(self, hidden, loss: ops.TokenTargets | None = None):
    """The MLM head alone on final hidden states (`return_hidden=True`'s output): [b, n, e] ->
    logits [b, n, v] for any n, e.g. the masked positions gathered out of [b, t, e]; with `loss`
    (the slots' `ops.TokenTargets`) the token loss and its metrics instead, computed by the head
    (`Family.lm_head`: from logits in the compute dtype, or fused with the output projection).
    Same parameters and computation as the head at the end of `__call__`."""
    return self._encode(None, None, None, None, token_types=None, train=False, head_input=hidden, loss=loss)

  def two_stream(self, tokens, positions, content_mask, query_mask, target_mapping, *, token_types=None,
                 train: bool = False, loss: ops.TokenTargets | None = None):
    """XLNet's content and query streams with shared weights; the query stream's MLM logits.

    Args:
      tokens, positions: [b, t] int; token_types: [b, t] int or None (type 0).
      content_mask, query_mask: [b, t, t] bool, True = position i may attend j (the content
        mask is the query mask with the diagonal set).
      target_mapping: [b, n, t] float32; row m is one-hot at the m-th prediction target's
        position, or all zero for a padded slot.

    Returns:
      [b, n, v] float32 logits of the query stream (the `__call__` MLM head); with `loss` (the
      slots' `ops.TokenTargets`) the head's token loss and its metrics instead (`mlm_head`).

    The content stream is exactly `__call__`'s computation with mask = content_mask. The query
    stream lives in slot space: g⁰[m] = mask_emb in place of a token embedding, plus slot m's
    position embedding (learned / sinusoidal) and token type, with the same embedding scale,
    norm and dropout as the content stream. Each layer runs the same block on g with keys /
    values from the content stream's layer input, under query_mask's row of slot m's target
    (rotary: query position = the target's). Padded slots attend nothing (exact zeros from the
    attention guard), give finite logits and affect nothing else.
    """
    cfg = self.cfg
    if cfg.position not in TWO_STREAM_POSITIONS:
      raise ValueError(f"two-stream attention (Encoder.two_stream) needs model.position learned, sinusoidal or "
                       f"rotary, got {cfg.position!r}; the xlnet family has relative positions")
    query = QueryStream(slot_mask(target_mapping, query_mask), slot_values(target_mapping, positions))
    slot_types = None if token_types is None else slot_values(target_mapping, token_types)  # [b, n]
    return self._encode(tokens, positions, content_mask[:, None], None, token_types=token_types, train=train,
                        query=query, slot_types=slot_types, loss=loss)

  @nn.compact
  def _encode(self, tokens, positions, mask, segment_ids, *, token_types, train: bool, return_hidden: bool = False,
              return_embeddings: bool = False, query: QueryStream | None = None, slot_types=None,
              head_input=None, rows=None, loss: ops.TokenTargets | None = None, float32_logits: bool = True):
    """One stream (query None): [b, t] -> logits [b, t, v] or hidden [b, t, e]. Two streams:
    the query stream's logits [b, n, v]. mask: [b, 1|h, t, t] bool for the content stream.
    head_input [b, n, e]: skip the embeddings and the stack, only the MLM head on it.
    float32_logits=False: the logits in the compute dtype (`Family.lm_head`)."""
    cfg = self.cfg
    embed = Embed(cfg.vocab_size, cfg.d_model, init_std=cfg.init_std, dtype=cfg.compute_dtype, name="token_embed")
    mask_emb = self.param("mask_emb", nn.with_logical_partitioning(nn.initializers.normal(cfg.init_std), ("embed",)),
                          (cfg.d_model,), jnp.float32)  # [e], the query stream's input (two_stream only)
    if head_input is None:
      x = self._hidden(embed, mask_emb, tokens, positions, mask, segment_ids, token_types=token_types, train=train,
                       return_embeddings=return_embeddings, query=query, slot_types=slot_types, rows=rows)
      if return_hidden or return_embeddings:
        return x
    else:
      x = head_input  # [b, n, e]
    # MLM head: transform, then the (tied) output projection with a bias.
    act = activation("gelu" if cfg.mlp in GATED else cfg.mlp)
    h = DenseGeneral((cfg.d_model,), (cfg.d_model,), ("embed", "mlp"), use_bias=True, init_std=cfg.init_std,
                     dtype=cfg.compute_dtype, name="head_dense")(x)
    h = make_norm(cfg, "head_norm")(act(h))
    return self.lm_head(embed, h, bias=True, loss=loss, float32_logits=float32_logits)

  def _hidden(self, embed, mask_emb, tokens, positions, mask, segment_ids, *, token_types, train: bool,
              return_embeddings: bool, query: QueryStream | None, slot_types, rows=None):
    """`_encode` up to the MLM head (its submodules are named in `_encode`'s scope)."""
    cfg = self.cfg
    slots = None if query is None else Slots(mask_emb, query.positions, slot_types)
    x = self.embed_inputs(embed, tokens, positions, train=train, token_types=token_types, slots=slots)
    if return_embeddings:
      return x  # [b, t, e]
    stack = Stack(cfg, cfg.num_layers, deterministic=not train, name="encoder")
    if query is None:
      bias = self.relative_bias(positions, positions, bidirectional=True, name="relative_bias")
      if rows is None:
        x = stack(x, mask, positions, segment_ids, bias)  # [b, t, e]
      elif self.rows_alone():
        x = stack(x, mask, positions, segment_ids, rows=rows)  # [b, n, e]
      else:  # a relative-position bias: the last layer runs in full (a two-stream layer takes no bias)
        x = take_rows(stack(x, mask, positions, segment_ids, bias), rows)  # [b, n, e]
    else:
      _, x = stack(x, mask, positions, segment_ids, query=query)  # the query stream, [b, n, e]
    if cfg.norm == "pre":
      x = make_norm(cfg, "final_norm")(x)
    return x


def last_real_index(segment_ids: jax.Array) -> jax.Array:
  """[b, t] -> [b] int32: the position of each row's last real token (segment > 0; 0 if none)."""
  t = segment_ids.shape[-1]
  return jnp.max(jnp.where(segment_ids > 0, jnp.arange(t, dtype=jnp.int32), 0), axis=-1)


def pooled_rows(pooling: str, segment_ids: jax.Array) -> jax.Array | None:
  """The one position a pooling reads, [b, 1] int32 ('first': 0, 'last': the last real token);
  None for 'mean', which reads every position."""
  if pooling == "first":
    return jnp.zeros((segment_ids.shape[0], 1), jnp.int32)
  if pooling == "last":
    return last_real_index(segment_ids)[:, None]
  if pooling == "mean":
    return None
  raise ValueError(f"unknown pooling {pooling!r}; choose 'first', 'mean' or 'last'")


class ClassifierHead(nn.Module):
  """Sequence classification on encoder hidden states, for fine-tuning.

  Attributes:
    num_classes: output classes.
    pooling: 'first' (the first token of each row, BERT's [CLS]), 'mean' (mean over the
      tokens of the row's first document, segment 1) or 'last' (the row's last real token,
      segment > 0: a causal decoder's or XLNet's summary position; rows are right-padded).
    gathered: `hidden` is [b, 1, e], already the pooled position's (`pooled_rows`: a stack whose
      last layer computed that row alone); the parameters are the same either way.
  """

  num_classes: int
  pooling: str = "first"
  dropout: float = 0.0
  init_std: float = 0.02
  gathered: bool = False

  @nn.compact
  def __call__(self, hidden: jax.Array, segment_ids: jax.Array, *, train: bool = False) -> jax.Array:
    """hidden [b, t, e] ([b, 1, e] when `gathered`), segment_ids [b, t] -> logits [b, num_classes] float32."""
    rows = pooled_rows(self.pooling, segment_ids)  # [b, 1] or None
    if self.gathered:
      if rows is None or hidden.shape[1] != 1:
        raise ValueError(f"ClassifierHead(gathered=True) takes the pooled position's [b, 1, e] hidden states "
                         f"('first' or 'last' pooling), got pooling {self.pooling!r} and {hidden.shape}")
      pooled = hidden[:, 0]  # [b, e]
    elif rows is None:  # mean
      w = (segment_ids == 1).astype(jnp.float32)[..., None]  # [b, t, 1]
      pooled = jnp.sum(hidden.astype(jnp.float32) * w, axis=1) / jnp.maximum(jnp.sum(w, axis=1), 1.0)
    else:
      pooled = take_rows(hidden, rows)[:, 0]  # [b, e]
    e = hidden.shape[-1]
    pooled = jnp.tanh(DenseGeneral((e,), (e,), ("embed", "mlp"), init_std=self.init_std, name="pooler")(pooled))
    pooled = Dropout(self.dropout)(pooled, deterministic=not train)
    return DenseGeneral((e,), (self.num_classes,), ("embed", None), init_std=self.init_std,
                        name="classifier")(pooled).astype(jnp.float32)
