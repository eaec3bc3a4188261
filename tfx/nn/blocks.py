"""Transformer blocks (pre-LN or post-LN) and the layer stack (nn.scan, nn.remat).

A block is self-attention + MLP with residuals; an optional cross-attention sits between
them for encoder-decoder models. Which tokens see which is decided by the masks passed in.
A block can also run two streams with shared parameters (XLNet's content and query streams,
`QueryStream`).
"""

from typing import Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from tfx import ops
from tfx.nn.attention import Attention
from tfx.nn.layers import Dropout, Mlp, ModelConfig, constrain, make_norm, rows_together

# Rematerialisation policies by name (config `model.remat`; tfx.bench --sweep-remat compares them).
# JAX's own policy names are accepted beside the short ones.
_cp = jax.checkpoint_policies
REMAT_POLICIES: dict[str, Callable | None] = {
    "full": None,  # save nothing, recompute the whole block in the backward pass
    "nothing_saveable": _cp.nothing_saveable,  # the same as 'full'
    "dots": _cp.checkpoint_dots,  # save every matmul output, recompute the elementwise ops
    "dots_saveable": _cp.dots_saveable,
    "dots_no_batch": _cp.dots_with_no_batch_dims_saveable,  # save the weight matmuls, not q.k / p.v
    "dots_with_no_batch_dims_saveable": _cp.dots_with_no_batch_dims_saveable,
    "everything_saveable": _cp.everything_saveable,  # save all (remat as a no-op, for comparison)
    # The weight matmuls and the attention's own residuals (tfx.ops.softmax_attention's unnormalised
    # probabilities, inverse row sums and output, XLNet's included; the fused kernels' output and
    # softmax statistics: cuDNN's, Pallas', splash's), not the q.k scores: the
    # backward pass recomputes neither the mask nor the softmax, nor runs a forward kernel again
    # (the default).
    "dots_attention": _cp.save_from_both_policies(
        _cp.dots_with_no_batch_dims_saveable,
        _cp.save_from_both_policies(_cp.save_only_these_names(*ops.attention.RESIDUAL_NAMES),
                                    ops.attention.saves_kernel_residuals)),
}
REMAT_NAMES = ("none",) + tuple(REMAT_POLICIES)


class QueryStream(NamedTuple):
  """What a two-stream layer needs for its query stream besides g (the same for every layer).

  mask: [b, 1|h, n, t] bool, slot m may attend content position j (True = may attend).
  positions: [b, n] int, each slot's position (the rotary query position).
  """

  mask: jax.Array
  positions: jax.Array


class Block(nn.Module):
  """One transformer layer: self-attention, optional cross-attention, MLP.

  `__call__(x, mask, positions, segment_ids, bias, encoded, cross_mask, query) -> (x, None)`, so
  it can be scanned. x: [b, t, e]; mask: [b, 1|h, t, t] bool; positions, segment_ids: [b, t]
  int; bias: optional [b|1, h, t, t] added to the self-attention scores (T5 relative
  positions); encoded: [b, s, e] encoder output and cross_mask [b, 1, t, s] when `cross`.

  Two streams (XLNet): with `query` (a `QueryStream`), x is the pair (h [b, t, e], g [b, n, e])
  and so is the result. h is the content stream, computed exactly as x without `query`; g is
  the query stream of n prediction slots. Every sublayer (its norm, attention, MLP) is the same
  module for both streams; g's attention takes its keys / values from h's input to the same
  sublayer (so g is never a key) under `query.mask`. With `content=False` the block computes the
  query stream alone and returns (None, g): h enters only as the keys and values (a stack's last
  layer, whose content stream nothing reads).
  """

  cfg: ModelConfig
  deterministic: bool = True
  decode: bool = False
  cross: bool = False
  content: bool = True

  @nn.compact
  def __call__(self, x, mask, positions, segment_ids, bias=None, encoded=None, cross_mask=None, query=None):
    cfg = self.cfg
    if query is not None and (self.cross or self.decode or bias is not None):
      raise ValueError("two-stream blocks have no cross-attention, KV cache or attention bias")
    if query is None and not self.content:
      raise ValueError("Block(content=False) runs the query stream alone: it needs `query`")
    drop = lambda y: Dropout(cfg.dropout)(y, deterministic=self.deterministic)
    attn = Attention(cfg, self.deterministic, self.decode, use_rotary=cfg.position == "rotary", name="attention")

    # Two streams: each projection on its own, so that XLA merges the query stream's k and v with
    # the content stream's (`Attention`'s `fuse`).
    fuse = query is None

    # A sublayer maps (y: its stream's input, kv: the content stream's input, q: None for the
    # content stream or the QueryStream) to the residual update.
    def self_attention(y, kv, q):
      if q is None:
        return attn(y, kv, mask, q_positions=positions, kv_positions=positions, q_segment_ids=segment_ids, bias=bias,
                    fuse=fuse)
      return attn(y, kv, q.mask, q_positions=q.positions, kv_positions=positions, fuse=fuse)

    sublayers = [self_attention]
    names = ["attention_norm"]
    if self.cross:
      cross = Attention(cfg, self.deterministic, decode=False, name="cross_attention")
      sublayers.append(lambda y, kv, q: cross(y, encoded, cross_mask))
      names.append("cross_attention_norm")
    mlp = Mlp(cfg, self.deterministic, name="mlp")
    feed_forward = lambda y, kv, q: mlp(y)  # row by row
    sublayers.append(feed_forward)
    names.append("mlp_norm")

    h, g = (x, None) if query is None else x
    for sublayer, name in zip(sublayers, names):
      norm = make_norm(cfg, name)
      if sublayer is feed_forward and h is not None and g is not None and self.content:
        def row_wise(y, norm=norm):  # [b, ., e]: this sublayer's residual step
          return _residual(cfg.norm, norm, y, drop(feed_forward(norm(y) if cfg.norm == "pre" else y, None, None)))

        h, g = rows_together(row_wise, h, g)  # both streams' rows in one pass
        continue
      h_in = None if h is None else norm(h) if cfg.norm == "pre" else h  # [b, t, e]
      # Without the content stream, h is read once: the self-attention's keys and values.
      new_h = _residual(cfg.norm, norm, h, drop(sublayer(h_in, h_in, None))) if self.content else None
      if g is not None:
        g_in = norm(g) if cfg.norm == "pre" else g  # [b, n, e]
        g = _residual(cfg.norm, norm, g, drop(sublayer(g_in, h_in, query)))
      h = new_h
    h = None if h is None else constrain(h, ("act_batch", "act_length", "act_embed"))
    if g is None:
      return h, None
    return (h, constrain(g, ("act_batch", "act_length", "act_embed"))), None


def _residual(kind: str, norm: nn.Module, x: jax.Array, update: jax.Array) -> jax.Array:
  """x + update (pre-LN: the norm was applied to the sublayer's input), or norm(x + update)."""
  return x + update if kind == "pre" else norm(x + update)


class Stack(nn.Module):
  """`num_layers` blocks, scanned (stacked parameters with a `layers` axis) or unrolled.

  Attributes:
    num_layers: blocks in this stack.
    cross: blocks have cross-attention over an encoder output.

  With `query` (a `QueryStream`), x is the pair (h [b, t, e], g [b, n, e]) of a two-stream
  model and the result is (None, g): nothing reads the last layer's content stream, so it is not
  computed (see `Block`, `last_layer_queries`).
  """

  cfg: ModelConfig
  num_layers: int
  deterministic: bool = True
  decode: bool = False
  cross: bool = False

  @nn.compact
  def __call__(self, x, mask, positions, segment_ids, bias=None, encoded=None, cross_mask=None, query=None,
               rows=None):
    """x [b, t, e] -> [b, t, e]. With `query`: the two-stream pair (h, g) -> (None, g [b, n, e]),
    the query stream (the last layer's content stream feeds nothing, so it is not computed). With
    `rows` [b, n] int (and neither `query`, `bias` nor `cross`): [b, n, e], the last layer's
    output at those positions only. See `last_layer_queries`."""
    cfg = self.cfg
    block = rematted(Block, cfg, in_scan=cfg.scan_layers)
    args = (x, mask, positions, segment_ids, bias, encoded, cross_mask)
    if query is not None:
      args += (query,)
    if rows is not None and (query is not None or bias is not None or self.cross or self.decode):
      raise ValueError("Stack(rows=...) runs a plain self-attention stack: no query stream, bias, "
                       "cross-attention or KV cache")
    if (query is not None or rows is not None) and not self.is_initializing():
      return self.last_layer_queries(block, args, rows)
    if cfg.scan_layers:
      x, _ = self._scanned(block, len(args), self.num_layers)(*args)
    else:
      for i in range(self.num_layers):
        x, _ = block(cfg, self.deterministic, self.decode, self.cross, name=f"layer_{i}")(x, *args[1:])
    if rows is not None:  # initialisation: the parameters are the full stack's
      return jnp.take_along_axis(x, rows[..., None], axis=1)  # [b, n, e]
    return x if query is None else (None, x[1])

  def last_layer_queries(self, block, args, rows=None):
    """The stack's last layer without the work nothing reads. The layers before the last run in
    full (every position is a key or value of the next); the last runs as a two-stream block
    without its content stream (`Block(content=False)`): keys and values from every position,
    queries, attention output, norms and MLP at the query stream's slots alone.

    Two streams (`args` end with a `QueryStream`): returns (None, g [b, n, e]). With `rows`
    [b, n] int: the one-stream stack's output at those positions, [b, n, e], the query stream
    being the gathered rows (masked LM's selected tokens, whose loss reads nothing else). Exact:
    the same function as the full stack followed by the gather.

    Scanned, the stacked parameters are cut into the first num_layers - 1 (scanned as before) and
    the last with `nn.map_variables` (`stacked_layers`), so the parameter tree is the full
    stack's."""
    cfg, n_layers = self.cfg, self.num_layers
    x, mask, positions, segment_ids = args[:4]
    new = lambda b, name, **kw: b(cfg, self.deterministic, self.decode, self.cross, name=name, **kw)
    if not cfg.scan_layers:
      for i in range(n_layers - 1):
        x, _ = new(block, f"layer_{i}")(x, *args[1:])
      last = new(block, f"layer_{n_layers - 1}", content=False)
    else:  # the last layer outside the scan: remat's prevent_cse on (`rematted`)
      if n_layers > 1:
        def first_layers(mdl, *a):  # (a named function: it names the ops in profiles)
          return mdl._scanned(block, len(a), n_layers - 1)(*a)

        x, _ = with_layers_cut(first_layers, slice(None, n_layers - 1))(self, *args)
      last = new(stacked_layers(rematted(Block, cfg, in_scan=False), n_layers - 1), "layers", content=False)
    if rows is None:
      query = args[-1]
    else:
      take = lambda a: jnp.take_along_axis(a, rows, axis=1)  # [b, t] -> [b, n]
      query = QueryStream(ops.mask_rows(mask, rows), take(positions))
      x = (x, jnp.take_along_axis(x, rows[..., None], axis=1))  # g: [b, n, e]
    (_, g), _ = last(x, mask, positions, segment_ids, None, None, None, query)
    return g if rows is not None else (None, g)

  def _scanned(self, block, n_args: int, length: int):
    """`length` blocks scanned over stacked parameters (a `layers` axis), the first argument the
    carry, the other `n_args - 1` the same for every layer."""
    cfg = self.cfg
    scanned = nn.scan(
        block,
        variable_axes={"params": 0, "cache": 0},
        split_rngs={"params": True, "dropout": True},
        in_axes=(nn.broadcast,) * (n_args - 1),
        length=length,
        unroll=cfg.layers_per_iteration(length),
        metadata_params={nn.PARTITION_NAME: "layers"},
    )
    return scanned(cfg, self.deterministic, self.decode, self.cross, name="layers")


def rematted(module: type[nn.Module], cfg, *, in_scan: bool) -> type[nn.Module]:
  """`module` under `cfg.remat`'s policy (itself for 'none'). Outside a scanned loop remat's
  prevent_cse must be on, or XLA merges the recomputation with the forward pass and the layer keeps
  everything; inside one the loop already keeps them apart (and prevent_cse would cost speed). A
  fully unrolled scan (`model.scan_unroll=0`, the accelerator suite's layout) keeps it off too,
  knowingly: there XLA does merge, and keeps forward values it would otherwise recompute, which on
  an H100 moves fewer bytes for more memory (prevent_cse on: GPT-2-small 99.7 -> 113.1 GB a step,
  12.60 -> 9.35 GiB of temporaries; docs/performance/4-compile-only.md, stop 59). Where a kept value
  costs more than recomputing it, the op says so itself (`tfx.ops.activations.geglu`)."""
  if cfg.remat == "none":
    return module
  return nn.remat(module, policy=REMAT_POLICIES[cfg.remat], prevent_cse=not in_scan)


def _cut(index: int | slice):
  return lambda tree: jax.tree_util.tree_map(lambda a: a[index], tree)


def stacked_layers(module: type[nn.Module], index: int | slice) -> type[nn.Module]:
  """`module` reading its parameters from a stack of layers (a leading `layers` axis) at `index`:
  an int for one layer's, a slice for a shorter stack. The stored tree stays the whole stack's,
  so checkpoints and converters see no difference (gradients land in the stacked leaves)."""
  return nn.map_variables(module, "params", _cut(index))


def with_layers_cut(fn: Callable, index: int | slice) -> Callable:
  """`fn(module, *args)` run with `module`'s child `layers` (a stack of layers) cut at `index`, as
  `stacked_layers`. For a scan over the first layers beside the last layer's own module: a module
  cannot create two children named `layers`, but `fn` creates its one in map_variables' scope."""
  def cut(tree):  # {collection: {child name: variables}}
    return {c: {**v, "layers": _cut(index)(v["layers"])} for c, v in tree.items()}

  return nn.map_variables(fn, "params", cut)
