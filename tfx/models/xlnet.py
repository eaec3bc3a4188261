"""The XLNet family: two-stream Transformer-XL relative attention with memory, post-LN, and an
LM head tied to the input embedding (plus an output bias).

The masks are inputs (True = may attend), so the model knows nothing about permutations; the
permutation-LM objective builds them. Memory: each layer's *input* (layer 0: the word
embeddings) is cached, new_mem_l = stop_gradient(concat(mem_l, h_l[:reuse_len])[-mem_len:]);
incoming memory is also a constant (no gradient flows into it).

Config fields read with defaults (so this runs before configs/base.py has them):
`mem_len` (0 = no memory), `reuse_len` (0 = all t rows), `clamp_len` (-1 = off), `untie_r`
(True: r_*_bias per layer). `type_vocab_size` is unused: XLNet has no type embedding; token
types enter only through s_ij = [type_i != type_j] and the learned seg_embed [2, h, d].

Layers: `scan_layers` runs them as one nn.scan with parameters stacked on a leading `layers`
axis (per-layer r_*_bias and seg_embed included), the memory [l, b, m, e] scanned in and the new
memory scanned out; otherwise they are unrolled as `layer_{i}`. `remat` wraps each layer in
nn.remat with tfx/nn/blocks.py's policies, as `Stack` does. With a query stream, the last layer
computes the query stream alone (nothing reads its content stream; scanned, it runs after a scan
of the others, its parameters cut from the stack by `stacked_layers`).
"""

from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from tfx import ops
from tfx.models.base import Family
from tfx.nn.blocks import rematted, stacked_layers, with_layers_cut
from tfx.nn.layers import Dropout, Embed, broadcast_param, take_rows
from tfx.nn.xlnet import (XLNetLayer, distance_table, encoding_signs, relative_encoding, segment_difference,
                          shared_biases)
from tfx.registry import FAMILIES


@FAMILIES.register("xlnet")
class XLNet(Family):
  """XLNet (two-stream relative attention with memory) and its tied LM head.

  `__call__(tokens, token_types, content_mask, query_mask, target_mapping, mems, bi_sign, *,
  train, return_hidden, rows)` -> `(logits, new_mems)`:
    tokens [b, t] int; token_types [b, t] int or None (no segment term);
    content_mask [b, t, m + t] bool or None (attend all); query_mask [b, t, m + t] bool (needed
    with target_mapping); target_mapping [b, n, t] float (one-hot or zero rows) or None (no query
    stream); mems [l, b, m, e] or None; bi_sign [b] float (+1 / -1 per row), None (all +1) or
    `tfx.nn.xlnet.HALVES` (bi_data: the first half of the batch +1, the second -1, each half sharing
    its encodings' projection unless dropout draws on the encodings per row: `encoding_signs`);
    rows [b, n] int or None: without a query stream, the content stream's output at these
    positions alone (its last layer computed there only).
  logits: the query stream's [b, n, v] with target_mapping, else the content stream's [b, t|n, v]
  (float32); with `return_hidden=True` the final hidden states [b, n|t, e] instead (for
  classification heads); with `loss` (`ops.TokenTargets` of the slots or rows) the token loss
  and its metrics instead, computed by the head (`Family.lm_head`: from logits in the compute
  dtype, or fused with the output projection). new_mems: [l, b, mem_len, e], or None when
  mem_len == 0.
  """

  INPUTS: ClassVar[tuple[str, ...]] = ("tokens", "token_types", "content_mask", "query_mask", "target_mapping")
  POOLING: ClassVar[str] = "last"  # XLNet classifies from the <cls> that ends the row

  def sequence_hidden(self, tokens, segment_ids, positions, token_types=None, *, train: bool = False, rows=None):
    """[b, t, e] content-stream hidden states: every position attends every real token of its
    row (no permutation, no memory; positions are relative, so right padding moves nothing). At
    `rows` [b, n]: [b, n, e], the last layer computed there alone (`__call__`'s rows)."""
    real = segment_ids > 0  # [b, t]
    content_mask = jnp.broadcast_to(real[:, None, :], real.shape + real.shape[-1:])  # [b, t, t]
    hidden, _ = self(tokens, token_types, content_mask, train=train, return_hidden=True, rows=rows)
    return hidden

  def rows_alone(self) -> bool:
    return True

  @classmethod
  def init_inputs(cls, batch: int, length: int) -> dict[str, jax.Array]:
    """Dummy inputs for `model.init` (no memory; every position predicted)."""
    eye = jnp.eye(length, dtype=bool)
    return {
        "tokens": jnp.zeros((batch, length), jnp.int32),
        "token_types": jnp.zeros((batch, length), jnp.int32),
        "content_mask": jnp.ones((batch, length, length), bool),
        "query_mask": jnp.broadcast_to(~eye, (batch, length, length)),
        "target_mapping": jnp.broadcast_to(eye.astype(jnp.float32), (batch, length, length)),
    }

  @nn.compact
  def __call__(self, tokens, token_types=None, content_mask=None, query_mask=None, target_mapping=None, mems=None,
               bi_sign=None, *, train: bool = False, return_hidden: bool = False, rows=None,
               loss: ops.TokenTargets | None = None):
    cfg = self.cfg
    mem_len = cfg.mem_len
    clamp_len = cfg.clamp_len
    untie_r = cfg.untie_r
    if target_mapping is not None and query_mask is None:
      raise ValueError("xlnet: the query stream (target_mapping given) needs a query_mask")
    if rows is not None and target_mapping is not None:
      raise ValueError("xlnet: rows (the content stream at some positions) and a query stream exclude each other")
    b, t = tokens.shape
    m = 0 if mems is None else mems.shape[2]
    drop = lambda x: Dropout(cfg.dropout)(x, deterministic=not train)

    embed = Embed(cfg.vocab_size, cfg.d_model, init_std=cfg.init_std, dtype=cfg.compute_dtype, name="token_embed")
    h = self.perturb("embeddings", embed(tokens))  # [b, t, e]; perturbations: information-flow tests
    h = drop(h)
    g = None
    if target_mapping is not None:
      mask_emb = self.param("mask_emb", nn.with_logical_partitioning(nn.initializers.normal(cfg.init_std),
                                                                     ("embed",)), (cfg.d_model,), jnp.float32)
      g = drop(broadcast_param(mask_emb, (b, target_mapping.shape[1], cfg.d_model), cfg.compute_dtype))

    distances, _ = distance_table(t, m)  # [p]
    signs = encoding_signs(bi_sign, b, per_row=train and cfg.dropout > 0)  # [b], [2] (halves) or None
    r = drop(relative_encoding(distances, cfg.d_model, clamp_len=clamp_len, sign=signs))  # [b|2|1, p, e]
    seg_diff = None if token_types is None else segment_difference(token_types, m)  # [b, t, s]
    biases = None if untie_r else shared_biases(self, cfg)
    if mems is not None:
      mems = jax.lax.stop_gradient(mems)

    layer = rematted(XLNetLayer, cfg, in_scan=cfg.scan_layers)
    shared = (r, seg_diff, content_mask, query_mask, target_mapping, biases)  # the same for every layer
    n_layers = cfg.num_layers
    # With a query stream the loss reads g alone, so the last layer's content stream is dead work
    # (its keys and values, from the layer's input, are not): that layer runs with content=False.
    # Content rows (a classifier's pooled token) are a query stream in the last layer: its slots
    # start from the content stream at the rows and attend as those positions' content queries.
    # Initialisation runs every layer in full (the same parameters).
    split = (g is not None or rows is not None) and not self.is_initializing()
    last_shared = shared
    if rows is not None:
      last_shared = (r, seg_diff, content_mask, content_mask,
                     jax.nn.one_hot(rows, t, dtype=jnp.float32), biases)  # target_mapping [b, n, t]
    mems_of = lambda index: None if mems is None else mems[index]
    in_axes = (nn.broadcast if mems is None else 0,) + (nn.broadcast,) * len(shared)  # scanned: mems, shared
    if cfg.scan_layers:
      # Parameters stacked on a leading `layers` axis; mems [l, b, m, e] scanned in, new_mems out.
      if not split:
        (h, g), new_mems = self._scan(layer, n_layers, in_axes, train)((h, g), mems, *shared)
      else:
        caches = []
        if n_layers > 1:
          def first_layers(mdl, *a):  # (a named function: it names the ops in profiles)
            return mdl._scan(layer, n_layers - 1, in_axes, train)(*a)

          (h, g), cache = with_layers_cut(first_layers, slice(None, n_layers - 1))(
              self, (h, g), mems_of(slice(None, n_layers - 1)), *shared)
          caches.append(cache)  # [l - 1, b, mem_len, e] or None
        last = stacked_layers(rematted(XLNetLayer, cfg, in_scan=False), n_layers - 1)(
            cfg, not train, content=False, name="layers")
        (h, g), cache = last((h, g if rows is None else take_rows(h, rows)), mems_of(n_layers - 1), *last_shared)
        caches.append(None if cache is None else cache[None])
        new_mems = jnp.concatenate(caches) if mem_len > 0 else None  # [l, b, mem_len, e]
    else:
      carry, caches = (h, g), []
      for i in range(n_layers):
        content = not (split and i == n_layers - 1)
        if not content and rows is not None:
          carry = (carry[0], take_rows(carry[0], rows))  # [b, n, e]
        carry, new_mem = layer(cfg, not train, content=content, name=f"layer_{i}")(
            carry, mems_of(i), *(shared if content else last_shared))
        caches.append(new_mem)
      h, g = carry
      new_mems = jnp.stack(caches) if mem_len > 0 else None  # [l, b, mem_len, e]
    out = h if g is None else g
    out = drop(take_rows(out, rows) if rows is not None and not split else out)  # (initialising: all of h)
    if return_hidden:
      return out, new_mems  # [b, n|t, e]
    logits = self.lm_head(embed, out, bias=True, loss=loss)  # [b, n|t, v], or (loss, metrics)
    return logits, new_mems

  def _scan(self, layer, length: int, in_axes: tuple, train: bool) -> nn.Module:
    """`length` layers as one nn.scan over stacked parameters (a leading `layers` axis), the
    memory [length, b, m, e] scanned in (`in_axes[0]` 0) and the new memory scanned out."""
    cfg = self.cfg
    scanned = nn.scan(
        layer,
        variable_axes={"params": 0},
        split_rngs={"params": True, "dropout": True},
        in_axes=in_axes,
        length=length,
        unroll=cfg.layers_per_iteration(length),
        metadata_params={nn.PARTITION_NAME: "layers"},
    )
    return scanned(cfg, not train, name="layers")
