"""Tensor maps between Hugging Face checkpoints and tfx parameters: rules, layouts (BERT, RoBERTa, GPT-2, T5), tree helpers."""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from tfx.errors import UserError


ARCHITECTURES = ("BertForMaskedLM", "RobertaForMaskedLM", "GPT2LMHeadModel", "T5ForConditionalGeneration",
                 "XLNetLMHeadModel")
_MODEL_TYPES = {"bert": "BertForMaskedLM", "roberta": "RobertaForMaskedLM", "gpt2": "GPT2LMHeadModel",
                "t5": "T5ForConditionalGeneration"}
# Model fields that define the architecture (what export + import must preserve).
MODEL_FIELDS = ("family", "num_layers", "num_decoder_layers", "d_model", "num_heads", "d_ff", "position",
                "relative_buckets", "relative_max_distance", "type_vocab_size", "embed_norm", "embed_scale",
                "scale_attention", "scale_tied_logits", "norm", "norm_type", "norm_eps", "mlp", "use_bias",
                "tie_embeddings")


class ConvertError(UserError):
  """A checkpoint or config that cannot be converted; the message says why."""


# ============================================================================ tensor maps

Arrays = list[np.ndarray]


@dataclasses.dataclass(frozen=True)
class _Rule:
  """HF tensors <-> tfx parameters. `load` maps the HF arrays (in `hf` order) to the tfx ones
  (in `tfx` order); `save` is its inverse. Names may hold `{i}` (the layer index)."""

  hf: tuple[str, ...]
  tfx: tuple[str, ...]
  load: Callable[[Arrays], Arrays]
  save: Callable[[Arrays], Arrays]


def _rule(hf: str | tuple[str, ...], tfx: str | tuple[str, ...], load=None, save=None) -> _Rule:
  same = lambda xs: list(xs)
  return _Rule((hf,) if isinstance(hf, str) else hf, (tfx,) if isinstance(tfx, str) else tfx,
               load or same, save or same)


def _one(f: Callable[[np.ndarray], np.ndarray]) -> Callable[[Arrays], Arrays]:
  return lambda xs: [f(xs[0])]


_T = _one(lambda w: np.ascontiguousarray(w.T))  # Linear [out, in] <-> kernel [in, out]; self-inverse


def _linear(hf: str, tfx: str) -> _Rule:
  return _rule(hf, tfx, _T, _T)


def _heads_in(hf: str, tfx: str, h: int, d: int) -> _Rule:
  """Linear [h*d, e] <-> kernel [e, h, d] (query / key / value)."""
  return _rule(hf, tfx, _one(lambda w: np.ascontiguousarray(w.T).reshape(-1, h, d)),
               _one(lambda k: np.ascontiguousarray(k.reshape(k.shape[0], h * d).T)))


def _heads_out(hf: str, tfx: str, h: int, d: int) -> _Rule:
  """Linear [e, h*d] <-> kernel [h, d, e] (attention output)."""
  return _rule(hf, tfx, _one(lambda w: np.ascontiguousarray(w.T).reshape(h, d, -1)),
               _one(lambda k: np.ascontiguousarray(k.reshape(h * d, -1).T)))


def _heads_bias(hf: str, tfx: str, h: int, d: int) -> _Rule:
  return _rule(hf, tfx, _one(lambda b: b.reshape(h, d)), _one(lambda b: b.reshape(h * d)))


def _norm(hf: str, tfx: str, bias: bool = True) -> list[_Rule]:
  rules = [_rule(f"{hf}.weight", f"{tfx}/scale")]
  if bias:
    rules.append(_rule(f"{hf}.bias", f"{tfx}/bias"))
  return rules


@dataclasses.dataclass
class _Layout:
  """All rules of one architecture: global ones and per-layer ones of each stack.

  `unused`: (fnmatch pattern, reason) for the HF tensors that the HF model of this config does
  not use or that repeat a mapped one (buffers, tied copies, heads of other tasks); an import
  fails on any tensor that is neither mapped nor matched here. `copies`: HF tensors export
  writes as copies of another one (HF name -> source HF name)."""

  globals: list[_Rule]
  stacks: list[tuple[str, int, list[_Rule]]]  # (tfx stack name, number of layers, rules)
  unused: list[tuple[str, str]] = dataclasses.field(default_factory=list)
  copies: dict[str, str] = dataclasses.field(default_factory=dict)


def _layer_path(stack: str, name: str, layer: int | None = None) -> str:
  """Where a per-layer parameter lives: `<stack>/layers/<name>` (scanned, stacked on axis 0) or
  `<stack>/layer_{i}/<name>` (unrolled). A stack named "" is the top of the tree (XLNet)."""
  where = "layers" if layer is None else f"layer_{layer}"
  return f"{stack}/{where}/{name}" if stack else f"{where}/{name}"


def _layout_params(layout: _Layout, fetch: Callable[[tuple[str, ...]], Arrays], scanned: bool) -> dict:
  """The tfx params tree of `layout`; `fetch(hf names)` returns those HF tensors. Per-layer
  parameters are stacked on a leading layers axis when `scanned`."""
  params: dict = {}
  for rule in layout.globals:
    for name, value in zip(rule.tfx, rule.load(fetch(rule.hf))):
      _set(params, name, value)
  for stack, n, rules in layout.stacks:
    per_layer: dict[str, list[np.ndarray]] = {}
    for i in range(n):
      for rule in rules:
        values = rule.load(fetch(tuple(s.format(i=i) for s in rule.hf)))
        for name, value in zip(rule.tfx, values):
          per_layer.setdefault(name, []).append(value)
    for name, values in per_layer.items():
      if scanned:
        _set(params, _layer_path(stack, name), np.stack(values))
      else:
        for i, value in enumerate(values):
          _set(params, _layer_path(stack, name, i), value)
  return params


def _layout_scanned(layout: _Layout, params: dict) -> bool:
  """Whether `params` holds the layers of `layout` stacked (`layers`) rather than unrolled."""
  return any("layers" in (params.get(stack, {}) if stack else params) for stack, _, _ in layout.stacks)


def _layout_tensors(layout: _Layout, params: dict) -> dict[str, np.ndarray]:
  """The HF tensors (float32) of a tfx params tree, scanned or unrolled: `_layout_params`'s
  inverse."""
  scanned = _layout_scanned(layout, params)
  tensors: dict[str, np.ndarray] = {}

  def put(names: tuple[str, ...], values: Arrays) -> None:
    for n, v in zip(names, values):
      tensors[n] = np.ascontiguousarray(np.asarray(v, np.float32))

  for rule in layout.globals:
    put(rule.hf, rule.save([_get(params, p) for p in rule.tfx]))
  for stack, n, rules in layout.stacks:
    for i in range(n):
      for rule in rules:
        if scanned:
          values = [_get(params, _layer_path(stack, p))[i] for p in rule.tfx]
        else:
          values = [_get(params, _layer_path(stack, p, i)) for p in rule.tfx]
        put(tuple(s.format(i=i) for s in rule.hf), rule.save(values))
  for name, source in layout.copies.items():
    tensors[name] = tensors[source].copy()
  return tensors


_TIED = "a tied copy of {}: HF ties it on load"
_BUFFER = "a buffer (constant indices or a causal mask), not a parameter"


def _bert_layout(m, prefix: str, head: str, pos_offset: int) -> _Layout:
  """BERT (`head="cls"`) or RoBERTa (`head="lm_head"`). With tied embeddings the output bias is
  the head's `bias` (HF ties `decoder.bias` to it); untied (transformers >= 5) the decoder is a
  Linear with its own bias and `bias` is unused: import reads `decoder.bias`, export writes both
  (older transformers tie the two even when untied)."""
  h, d = m.num_heads, _head_dim(m)
  p = f"{prefix}.embeddings"
  words = f"{p}.word_embeddings.weight"
  g = [_rule(words, "token_embed/embedding"),
       _rule(f"{p}.position_embeddings.weight", "position_embed/embedding",
             _one(lambda w: w[pos_offset:]),
             _one(lambda k: np.concatenate([np.zeros((pos_offset, k.shape[1]), k.dtype), k]))),
       *_norm(f"{p}.LayerNorm", "embed_norm")]
  if m.type_vocab_size:
    g.append(_rule(f"{p}.token_type_embeddings.weight", "type_embed/embedding"))
  if head == "cls":
    mlm = "cls.predictions"
    g += [_linear(f"{mlm}.transform.dense.weight", "head_dense/kernel"),
          _rule(f"{mlm}.transform.dense.bias", "head_dense/bias"),
          *_norm(f"{mlm}.transform.LayerNorm", "head_norm")]
  else:
    mlm = "lm_head"
    g += [_linear("lm_head.dense.weight", "head_dense/kernel"), _rule("lm_head.dense.bias", "head_dense/bias"),
          *_norm("lm_head.layer_norm", "head_norm")]
  unused = [(f"{p}.position_ids", _BUFFER), (f"{p}.token_type_ids", _BUFFER),
            (f"{prefix}.pooler.*", "the pooler (input of the next-sentence head), not part of the MLM model"),
            ("cls.seq_relationship.*", "the next-sentence-prediction head, not part of the MLM model")]
  copies = {}
  if m.tie_embeddings:
    g.append(_rule(f"{mlm}.bias", "output_bias"))
    unused += [(f"{mlm}.decoder.weight", _TIED.format(words)), (f"{mlm}.decoder.bias", _TIED.format(f"{mlm}.bias"))]
  else:
    g += [_linear(f"{mlm}.decoder.weight", "lm_head/kernel"), _rule(f"{mlm}.decoder.bias", "output_bias")]
    unused.append((f"{mlm}.bias", f"unused by HF when tie_word_embeddings=False ({mlm}.decoder.bias is the "
                                  "output bias); export writes a copy for older transformers"))
    copies[f"{mlm}.bias"] = f"{mlm}.decoder.bias"
  L = f"{prefix}.encoder.layer.{{i}}"
  layer = []
  for name in ("query", "key", "value"):
    layer += [_heads_in(f"{L}.attention.self.{name}.weight", f"attention/{name}/kernel", h, d),
              _heads_bias(f"{L}.attention.self.{name}.bias", f"attention/{name}/bias", h, d)]
  layer += [_heads_out(f"{L}.attention.output.dense.weight", "attention/out/kernel", h, d),
            _rule(f"{L}.attention.output.dense.bias", "attention/out/bias"),
            *_norm(f"{L}.attention.output.LayerNorm", "attention_norm"),
            _linear(f"{L}.intermediate.dense.weight", "mlp/wi_0/kernel"),
            _rule(f"{L}.intermediate.dense.bias", "mlp/wi_0/bias"),
            _linear(f"{L}.output.dense.weight", "mlp/wo/kernel"),
            _rule(f"{L}.output.dense.bias", "mlp/wo/bias"),
            *_norm(f"{L}.output.LayerNorm", "mlp_norm")]
  return _Layout(g, [("encoder", m.num_layers, layer)], unused, copies)


def _gpt2_layout(m) -> _Layout:
  h, d, e = m.num_heads, _head_dim(m), m.d_model
  g = [_rule("transformer.wte.weight", "token_embed/embedding"),
       _rule("transformer.wpe.weight", "position_embed/embedding"),
       *_norm("transformer.ln_f", "final_norm")]
  unused = [("transformer.h.*.attn.bias", _BUFFER), ("transformer.h.*.attn.masked_bias", _BUFFER)]
  if m.tie_embeddings:
    unused.append(("lm_head.weight", _TIED.format("transformer.wte.weight")))
  else:
    g.append(_linear("lm_head.weight", "lm_head/kernel"))
  L = "transformer.h.{i}"
  qkv = tuple(f"attention/{n}/kernel" for n in ("query", "key", "value"))
  qkv_b = tuple(f"attention/{n}/bias" for n in ("query", "key", "value"))
  layer = [
      # Conv1D weights are [in, out]; c_attn's output is [query | key | value].
      _rule(f"{L}.attn.c_attn.weight", qkv, lambda xs: [w.reshape(e, h, d) for w in np.split(xs[0], 3, axis=1)],
            lambda ks: [np.concatenate([k.reshape(e, h * d) for k in ks], axis=1)]),
      _rule(f"{L}.attn.c_attn.bias", qkv_b, lambda xs: [b.reshape(h, d) for b in np.split(xs[0], 3)],
            lambda bs: [np.concatenate([b.reshape(h * d) for b in bs])]),
      _rule(f"{L}.attn.c_proj.weight", "attention/out/kernel", _one(lambda w: w.reshape(h, d, e)),
            _one(lambda k: k.reshape(h * d, e))),
      _rule(f"{L}.attn.c_proj.bias", "attention/out/bias"),
      *_norm(f"{L}.ln_1", "attention_norm"),
      *_norm(f"{L}.ln_2", "mlp_norm"),
      _rule(f"{L}.mlp.c_fc.weight", "mlp/wi_0/kernel"), _rule(f"{L}.mlp.c_fc.bias", "mlp/wi_0/bias"),
      _rule(f"{L}.mlp.c_proj.weight", "mlp/wo/kernel"), _rule(f"{L}.mlp.c_proj.bias", "mlp/wo/bias"),
  ]
  return _Layout(g, [("decoder", m.num_layers, layer)], unused)


def _t5_layout(m, lm_head_scale: float = 1.0) -> _Layout:
  h, d = m.num_heads, _head_dim(m)
  g = [_rule("shared.weight", "token_embed/embedding"),
       _rule("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight", "encoder_relative_bias/embedding"),
       _rule("decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight", "decoder_relative_bias/embedding"),
       *_norm("encoder.final_layer_norm", "encoder_final_norm", bias=False),
       *_norm("decoder.final_layer_norm", "decoder_final_norm", bias=False)]
  unused = [(f"{stack}.embed_tokens.weight", _TIED.format("shared.weight")) for stack in ("encoder", "decoder")]
  if m.tie_embeddings:
    unused.append(("lm_head.weight", _TIED.format("shared.weight")))
  else:
    s = lm_head_scale  # an untied head with scaled inputs (unusual): folded into the kernel
    g.append(_rule("lm_head.weight", "lm_head/kernel", _one(lambda w: np.ascontiguousarray(w.T) * np.float32(s)),
                   _one(lambda k: np.ascontiguousarray(k.T) / np.float32(s))))

  def attention(hf: str, tfx: str) -> list[_Rule]:
    return [_heads_in(f"{hf}.q.weight", f"{tfx}/query/kernel", h, d),
            _heads_in(f"{hf}.k.weight", f"{tfx}/key/kernel", h, d),
            _heads_in(f"{hf}.v.weight", f"{tfx}/value/kernel", h, d),
            _heads_out(f"{hf}.o.weight", f"{tfx}/out/kernel", h, d)]

  def mlp(hf: str) -> list[_Rule]:
    if m.mlp in ("geglu", "swiglu"):
      rules = [_linear(f"{hf}.DenseReluDense.wi_0.weight", "mlp/wi_0/kernel"),
               _linear(f"{hf}.DenseReluDense.wi_1.weight", "mlp/wi_1/kernel")]
    else:
      rules = [_linear(f"{hf}.DenseReluDense.wi.weight", "mlp/wi_0/kernel")]
    return rules + [_linear(f"{hf}.DenseReluDense.wo.weight", "mlp/wo/kernel"),
                    *_norm(f"{hf}.layer_norm", "mlp_norm", bias=False)]

  E, D = "encoder.block.{i}.layer", "decoder.block.{i}.layer"
  enc = [*attention(f"{E}.0.SelfAttention", "attention"), *_norm(f"{E}.0.layer_norm", "attention_norm", bias=False),
         *mlp(f"{E}.1")]
  dec = [*attention(f"{D}.0.SelfAttention", "attention"), *_norm(f"{D}.0.layer_norm", "attention_norm", bias=False),
         *attention(f"{D}.1.EncDecAttention", "cross_attention"),
         *_norm(f"{D}.1.layer_norm", "cross_attention_norm", bias=False), *mlp(f"{D}.2")]
  return _Layout(g, [("encoder", m.num_layers, enc), ("decoder", m.num_decoder_layers or m.num_layers, dec)],
                 unused)


def _roberta_offset(hf_cfg: dict) -> int:
  """Rows of RoBERTa's position table before position 0 (padding_idx + 1)."""
  pad = hf_cfg.get("pad_token_id")
  return (1 if pad is None else int(pad)) + 1


# ============================================================================ tree helpers


def _set(tree: dict, path: str, value) -> None:
  *parents, leaf = path.split("/")
  for p in parents:
    tree = tree.setdefault(p, {})
  tree[leaf] = value


def _get(tree: dict, path: str):
  for p in path.split("/"):
    if not isinstance(tree, dict) or p not in tree:
      raise ConvertError(f"parameter {path!r} is missing from the tfx parameters")
    tree = tree[p]
  return tree


def _head_dim(m) -> int:
  """model.head_dim of a config (0 or absent = d_model // num_heads)."""
  return int(m.get("head_dim", 0)) or m.d_model // m.num_heads


def _require(cond: bool, arch: str, what: str) -> None:
  if not cond:
    raise ConvertError(f"cannot export as {arch}: {what}")
