"""Multi-head attention as a linen module: self or cross attention, with an optional KV cache.

The module projects, applies rotary positions if asked, and calls the pure
`tfx.ops.dot_product_attention` with the mask it is given. It knows nothing about causality,
packing or objectives: those are in the mask. The projections of one input run as one matmul
(`tfx.nn.layers.fused_projections`): q, k and v of a self-attention, k and v of a cross-attention.

KV cache (decode=True): the cache holds `cached_key`/`cached_value` [b, s, k, d] for the
maximum length s, `cached_segment` [b, s] (the segment id of each cached token, 0 = empty or
padding) and `cache_index` (how many tokens are cached). Each decode call appends the new
tokens and attends over the cache with mask: key j <= own index, same segment, key not
padding. The shapes never change, so one compiled step serves every decoding position.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from tfx import ops
from tfx.ops import dropout as dropout_ops
from tfx.ops import hoisting, target
from tfx.ops.flash_dropout import STACKED, fused_dropout_attention
from tfx.nn.layers import DenseGeneral, ModelConfig, add_bias, constrain, fused_projections


class Attention(nn.Module):
  """Multi-head attention.

  Attributes:
    cfg: model hyper-parameters.
    deterministic: disables dropout.
    decode: use and update the KV cache (self-attention only).
    use_rotary: apply RoPE to queries and keys with the given positions.
  """

  cfg: ModelConfig
  deterministic: bool = True
  decode: bool = False
  use_rotary: bool = False

  @nn.compact
  def __call__(
      self,
      x_q: jax.Array,
      x_kv: jax.Array,
      mask: jax.Array | None,
      *,
      q_positions: jax.Array | None = None,
      kv_positions: jax.Array | None = None,
      q_segment_ids: jax.Array | None = None,
      bias: jax.Array | None = None,
      fuse: bool = True,
  ) -> jax.Array:
    """Attends x_q [b, t, e] over x_kv [b, s, e] with mask [b, 1|h, t, s] (or an
    `ops.SegmentMask`); returns [b, t, e]. `fuse=False` runs every projection on its own: a
    two-stream block's query stream projects k and v of the content stream's input again, and XLA
    merges those (forward and backward) with the content stream's only when both are unfused."""
    cfg = self.cfg
    h, d, e = cfg.num_heads, cfg.head_dim, cfg.d_model
    proj = lambda name: DenseGeneral(
        (e,), (h, d), ("embed", "heads", "kv"), use_bias=cfg.use_bias, init_std=cfg.init_std, dtype=cfg.compute_dtype,
        name=name)
    projections = [proj(name) for name in ("query", "key", "value")]
    qkv = None  # a self-attention's stacked projection, for the Pallas dropout kernel
    if not fuse:
      q, k, v = (p(x) for p, x in zip(projections, (x_q, x_kv, x_kv)))  # [b, t|s, h, d] each
    elif x_q is x_kv:  # self-attention: one matmul for the three projections, else for k and v
      # stacked in the Pallas dropout kernel's order, which reads q, k and v (and adds their bias)
      # out of the matmul's output itself: `qkv`; every other path reads the slices
      by_name = dict(zip(("q", "k", "v"), projections))
      qkv = fused_projections([by_name[n] for n in STACKED], x_q, cfg.compute_dtype, stacked=True,
                              bias_apart=True)  # ([b, t, h, 3, d], [h, 3, d] or None)
      y = qkv[0] if qkv[1] is None else add_bias(*qkv)
      k, v, q = (y[:, :, :, STACKED.index(n)] for n in ("k", "v", "q"))  # [b, t, h, d] each
    else:
      q = projections[0](x_q)  # [b, t, h, d]
      k, v = fused_projections(projections[1:], x_kv, cfg.compute_dtype)  # [b, s, h, d] each
    if self.use_rotary:
      q = ops.rotary(q, q_positions, cfg.rope_base)
      k = ops.rotary(k, kv_positions, cfg.rope_base)
      qkv = None  # q and k are no longer its slots
    q = constrain(q, ("act_batch", "act_length", "act_heads", "act_kv"))
    k = constrain(k, ("act_batch", "act_length", "act_heads", "act_kv"))
    v = constrain(v, ("act_batch", "act_length", "act_heads", "act_kv"))

    if self.decode:  # the cache's own causal mask unless the caller gives one (a bidirectional prompt)
      k, v, cache_mask = self._update_cache(k, v, q_segment_ids)
      mask = cache_mask if mask is None else mask

    scale = d**-0.5 if cfg.scale_attention else 1.0
    dropout = cfg.attention_dropout if not self.deterministic else 0.0
    if dropout > 0.0:  # the Pallas kernel draws the dropout in itself; XLA's attention otherwise
      rng = self.make_rng("dropout")
      out, _ = fused_dropout_attention(q, k, v, mask, bias, scale, dropout, rng, cfg.attention,
                                       qkv=None if self.decode else qkv)  # logs its choice
      if out is None:
        out = xla_dropout_attention(q, k, v, ops.dense_mask(mask), bias, scale, dropout, rng,
                                    causal_blocks=ops.attention.causal_blocks_for(mask, cfg.causal_blocks))
    else:
      out = ops.dot_product_attention(q, k, v, mask=mask, bias=bias, scale=scale, implementation=cfg.attention,
                                      causal_blocks=cfg.causal_blocks)
    out = constrain(out, ("act_batch", "act_length", "act_heads", "act_kv"))  # [b, t, h, d]
    return DenseGeneral(
        (h, d), (e,), ("heads", "kv", "embed"),
        use_bias=cfg.use_bias, init_std=cfg.init_std, dtype=cfg.compute_dtype, name="out")(out)

  def _update_cache(self, k, v, q_segment_ids):
    """Appends k, v [b, t, h, d] to the cache; returns the full cache and the decode mask."""
    is_initialized = self.has_variable("cache", "cached_key")
    b, t, h, d = k.shape
    cached_k = self.variable("cache", "cached_key", jnp.zeros, k.shape, k.dtype)
    cached_v = self.variable("cache", "cached_value", jnp.zeros, v.shape, v.dtype)
    cached_seg = self.variable("cache", "cached_segment", jnp.zeros, (b, t), jnp.int32)
    index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
    if not is_initialized:
      # Initialisation call with a full-length dummy input: it only sizes the cache.
      return k, v, ops.decoder_mask(q_segment_ids)
    i = index.value
    s = cached_k.value.shape[1]
    cached_k.value = jax.lax.dynamic_update_slice(cached_k.value, k, (0, i, 0, 0))
    cached_v.value = jax.lax.dynamic_update_slice(cached_v.value, v, (0, i, 0, 0))
    cached_seg.value = jax.lax.dynamic_update_slice(cached_seg.value, q_segment_ids.astype(jnp.int32), (0, i))
    index.value = i + t
    q_index = i + jnp.arange(t)  # [t]
    causal = jnp.arange(s)[None, :] <= q_index[:, None]  # [t, s]
    mask = causal[None, None] & ops.segment_mask(q_segment_ids, cached_seg.value)  # [b, 1, t, s]
    return cached_k.value, cached_v.value, mask


def xla_dropout_attention(q, k, v, mask, bias, scale, rate, rng, *, causal_blocks: int = 1):
  """XLA's attention with dropout (where the Pallas kernel does not run): `_reference_with_dropout`,
  or on a TPU `ops.attention.softmax_attention` (`tfx.ops.target.autodiff_attention_dropout`), either
  in query blocks for a causal mask (`causal_blocks`, 1 for any other:
  `ops.attention.in_causal_blocks`); the same function and keep bits either way. mask [b|1, 1|h, t,
  s] bool or None."""
  seed = dropout_ops.seed(rng)
  if target.autodiff_attention_dropout():
    attend = lambda q, k, v, mask, bias, block: _reference_with_dropout(q, k, v, mask, bias, scale, rate, seed, block)
    return ops.attention.in_causal_blocks(attend, q, k, v, mask, bias, causal_blocks)
  return ops.attention.softmax_attention(q, k, v, mask, bias, scale, dropout_rate=rate, seed=seed,
                                         causal_blocks=causal_blocks)


def _reference_with_dropout(q, k, v, mask, bias, scale, rate, seed, block):
  """Einsum attention with dropout on the probabilities (where the Pallas dropout kernel cannot
  run: `tfx.ops.flash_dropout`), dropping the scores the kernel would (`tfx.ops.dropout.keep_bits`
  of [b, h, t, s] under `seed`, at `block` (first query, columns) of the whole array for a query
  block: `tfx.ops.dropout.dropout`; drawn again in the backward pass, not stored). Autodiff's backward pass: for
  BART's cross attention compiled for an H100 it moves 6.6 GB a step less than
  `ops.attention.softmax_attention`'s own (BERT-base's and BART-base's own steps at 32 rows: 79.6
  and 123.2 GB against 91.6 and 142.3). Not on a TPU, whose compiler crashes on it
  (`xla_dropout_attention`)."""
  scores = jnp.einsum("bthd,bshd->bhts", q, k).astype(jnp.float32) * scale
  if bias is not None:
    scores = scores + bias
  if mask is not None:
    scores = hoisting.where(mask, scores, ops.MASK_VALUE)
  # The softmax over [b h, t, s]: with one head (ELECTRA-small's generator) XLA:CPU reduces the
  # [b, 1, t, s] gradient's rows at a fraction of its speed (2.0 against 0.44 ms at [8, 1, 256, 256]).
  probs = jax.nn.softmax(scores.reshape(-1, *scores.shape[2:]), axis=-1).reshape(scores.shape)  # [b, h, t, s]
  probs = dropout_ops.dropout(probs, seed, rate, block).astype(v.dtype)
  out = jnp.einsum("bhts,bshd->bthd", probs, v)
  if mask is not None:
    ok = jnp.moveaxis(ops.rows_attend(mask), 1, 2)[..., None]
    out = hoisting.where(ok, out, 0.0)
  return out


class RelativePositionBias(nn.Module):
  """T5 relative-position bias: a learned scalar per (bucket, head), added to the scores.

  One instance per stack; its output is passed to every layer of the stack.
  """

  cfg: ModelConfig
  bidirectional: bool = True

  @nn.compact
  def __call__(self, q_positions: jax.Array, k_positions: jax.Array) -> jax.Array:
    """q_positions [b, t], k_positions [b, s] int -> bias [b, h, t, s] float32 (b may be 1)."""
    cfg = self.cfg
    table = self.param(
        "embedding",
        nn.with_logical_partitioning(nn.initializers.normal(stddev=cfg.init_std), ("relpos", "heads")),
        (cfg.relative_buckets, cfg.num_heads),
        jnp.float32,
    )
    relative = k_positions[:, None, :] - q_positions[:, :, None]  # [b, t, s]
    buckets = ops.t5_relative_buckets(relative, bidirectional=self.bidirectional, num_buckets=cfg.relative_buckets,
                                      max_distance=cfg.relative_max_distance)
    return jnp.moveaxis(jnp.take(table, buckets, axis=0), -1, 1)  # [b, h, t, s]
