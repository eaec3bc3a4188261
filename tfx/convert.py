"""Import and export Hugging Face checkpoints (config.json + safetensors; no torch needed).

    python -m tfx.convert --from-hf DIR --workdir OUT     # HF save_pretrained dir -> tfx run dir
    python -m tfx.convert --to-hf DIR --workdir RUN       # trained tfx run -> HF dir

Supported architectures (both directions):

- `BertForMaskedLM` -> `encoder` family: post-LN, `embed_norm`, token types, MLM head
  (`head_dense` + activation + `head_norm` + tied projection + `output_bias`). BERT's `gelu` is
  the exact (erf) GELU (`mlp='gelu_exact'`), LayerNorm eps 1e-12.
- `RobertaForMaskedLM` -> `encoder` family. RoBERTa numbers positions from `pad_token_id + 1`
  (= 2): HF position p holds token p - 2 of the sequence. tfx positions start at 0, so the
  imported table is HF's rows 2.. (tfx position i == HF position i + 2), and `data.seq_len` is
  `max_position_embeddings - 2`; export puts the two unused rows back (as zeros).
- A token-type table with a single row (RoBERTa) adds the same vector at every position: it
  is folded into the position table on import (`type_vocab_size=0`); export writes a zero
  one-row table.
- `GPT2LMHeadModel` -> `decoder` family: pre-LN, learned positions, `gelu_new` (= tanh GELU,
  `mlp='gelu'`), eps 1e-5; the fused Conv1D `c_attn` ([in, 3*out]) is split into query / key /
  value.
- `T5ForConditionalGeneration` -> `encoder_decoder` family: rmsnorm, no biases, relative
  position buckets, unscaled attention. v1.0 (`relu`, tied, logits scaled by d_model**-0.5:
  `scale_tied_logits=True`) and v1.1 (`gated-gelu` = `geglu`, untied `lm_head`).
- `XLNetLMHeadModel` -> `xlnet` family (objective `permutation_lm`): two-stream relative
  attention with memory, tied LM head plus bias, per-layer or shared r_*_bias (see the XLNet
  section below).

HF Linear weights are [out, in]; tfx DenseGeneral kernels are [in..., out...] with the heads
split out ([e, h, d] for query/key/value, [h, d, e] for the attention output). Parameters are
stacked along a leading `layers` axis when `model.scan_layers=True` (the default, as native
tfx models), or stored per layer (`<stack>/layer_{i}/...`) otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any, Callable

import ml_collections
import numpy as np

from tfx.errors import UserError

ARCHITECTURES = ("BertForMaskedLM", "RobertaForMaskedLM", "GPT2LMHeadModel", "T5ForConditionalGeneration",
                 "XLNetLMHeadModel")
_MODEL_TYPES = {"bert": "BertForMaskedLM", "roberta": "RobertaForMaskedLM", "gpt2": "GPT2LMHeadModel",
                "t5": "T5ForConditionalGeneration"}
# HF tensors that carry no information tfx needs (tied copies, buffers, unused heads).
_IGNORED_SUFFIXES = (".position_ids", "attn.bias", "attn.masked_bias", "encoder.embed_tokens.weight",
                     "decoder.embed_tokens.weight", "cls.predictions.decoder.bias", "lm_head.decoder.bias")
_IGNORED_PREFIXES = ("bert.pooler.", "roberta.pooler.")
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
  """All rules of one architecture: global ones and per-layer ones of each stack."""

  globals: list[_Rule]
  stacks: list[tuple[str, int, list[_Rule]]]  # (tfx stack name, number of layers, rules)


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
  return tensors


def _bert_layout(m, prefix: str, head: str, pos_offset: int) -> _Layout:
  h, d = m.num_heads, _head_dim(m)
  p = f"{prefix}.embeddings"
  g = [_rule(f"{p}.word_embeddings.weight", "token_embed/embedding"),
       _rule(f"{p}.position_embeddings.weight", "position_embed/embedding",
             _one(lambda w: w[pos_offset:]),
             _one(lambda k: np.concatenate([np.zeros((pos_offset, k.shape[1]), k.dtype), k]))),
       *_norm(f"{p}.LayerNorm", "embed_norm")]
  if m.type_vocab_size:
    g.append(_rule(f"{p}.token_type_embeddings.weight", "type_embed/embedding"))
  if head == "cls":
    g += [_linear("cls.predictions.transform.dense.weight", "head_dense/kernel"),
          _rule("cls.predictions.transform.dense.bias", "head_dense/bias"),
          *_norm("cls.predictions.transform.LayerNorm", "head_norm"),
          _rule("cls.predictions.bias", "output_bias")]
    if not m.tie_embeddings:
      g.append(_linear("cls.predictions.decoder.weight", "lm_head/kernel"))
  else:
    g += [_linear("lm_head.dense.weight", "head_dense/kernel"), _rule("lm_head.dense.bias", "head_dense/bias"),
          *_norm("lm_head.layer_norm", "head_norm"), _rule("lm_head.bias", "output_bias")]
    if not m.tie_embeddings:
      g.append(_linear("lm_head.decoder.weight", "lm_head/kernel"))
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
  return _Layout(g, [("encoder", m.num_layers, layer)])


def _gpt2_layout(m) -> _Layout:
  h, d, e = m.num_heads, _head_dim(m), m.d_model
  g = [_rule("transformer.wte.weight", "token_embed/embedding"),
       _rule("transformer.wpe.weight", "position_embed/embedding"),
       *_norm("transformer.ln_f", "final_norm")]
  if not m.tie_embeddings:
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
  return _Layout(g, [("decoder", m.num_layers, layer)])


def _t5_layout(m, lm_head_scale: float = 1.0) -> _Layout:
  h, d = m.num_heads, _head_dim(m)
  g = [_rule("shared.weight", "token_embed/embedding"),
       _rule("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight", "encoder_relative_bias/embedding"),
       _rule("decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight", "decoder_relative_bias/embedding"),
       *_norm("encoder.final_layer_norm", "encoder_final_norm", bias=False),
       *_norm("decoder.final_layer_norm", "decoder_final_norm", bias=False)]
  if not m.tie_embeddings:
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
  return _Layout(g, [("encoder", m.num_layers, enc), ("decoder", m.num_decoder_layers or m.num_layers, dec)])


def _layout(arch: str, m, hf_cfg: dict) -> _Layout:
  if arch == XLNET:
    return _xlnet_layout(m)
  if arch == "BertForMaskedLM":
    return _bert_layout(m, "bert", "cls", 0)
  if arch == "RobertaForMaskedLM":
    return _bert_layout(m, "roberta", "lm_head", _roberta_offset(hf_cfg))
  if arch == "GPT2LMHeadModel":
    return _gpt2_layout(m)
  scale = m.d_model**-0.5 if hf_cfg.get("scale_decoder_outputs", False) and not m.tie_embeddings else 1.0
  return _t5_layout(m, scale)


def _roberta_offset(hf_cfg: dict) -> int:
  """Rows of RoBERTa's position table before position 0 (padding_idx + 1)."""
  pad = hf_cfg.get("pad_token_id")
  return (1 if pad is None else int(pad)) + 1


# ============================================================================ configs


def _base_config() -> ml_collections.ConfigDict:
  """configs/base.py's get_config() (the repository's configs folder sits beside tfx/)."""
  try:
    from configs import base  # noqa: PLC0415
    return base.get_config()
  except ImportError:
    from tfx.config import load_config_file  # noqa: PLC0415
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return load_config_file(os.path.join(root, "configs", "base.py"))


_HF_ACT = {"gelu": "gelu_exact", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu_fast": "gelu",
           "relu": "relu"}
_TFX_ACT = {"gelu_exact": "gelu", "gelu": "gelu_new", "relu": "relu"}


def _architecture(hf_cfg: dict) -> str:
  archs = hf_cfg.get("architectures") or []
  for a in archs:
    if a in ARCHITECTURES:
      return a
  if not archs and hf_cfg.get("model_type") in _MODEL_TYPES:
    return _MODEL_TYPES[hf_cfg["model_type"]]
  got = ", ".join(archs) or f"model_type {hf_cfg.get('model_type')!r}"
  raise ConvertError(f"unsupported architecture {got}; tfx converts {', '.join(ARCHITECTURES)}")


def _activation(name: str, arch: str) -> str:
  if name not in _HF_ACT:
    raise ConvertError(f"{arch}: activation {name!r} is not supported; tfx has {', '.join(_HF_ACT)}")
  return _HF_ACT[name]


def _tfx_config(arch: str, hf: dict) -> ml_collections.ConfigDict:
  """The tfx config (configs/base.py + the HF architecture) of an HF config.json."""
  c = _base_config()
  m = c.model
  m.dropout = 0.0
  m.attention_dropout = 0.0
  m.scan_layers = True
  if arch in ("BertForMaskedLM", "RobertaForMaskedLM"):
    if hf.get("position_embedding_type", "absolute") != "absolute":
      raise ConvertError(f"{arch}: position_embedding_type {hf['position_embedding_type']!r} is not supported")
    if hf.get("is_decoder") or hf.get("add_cross_attention"):
      raise ConvertError(f"{arch}: decoder / cross-attention variants are not supported")
    act = _activation(hf.get("hidden_act", "gelu"), arch)
    if arch == "RobertaForMaskedLM" and act != "gelu_exact":
      raise ConvertError("RobertaForMaskedLM: its MLM head always uses the exact GELU; hidden_act "
                         f"{hf.get('hidden_act')!r} would need a different head activation")
    m.family = "encoder"
    m.num_layers = hf["num_hidden_layers"]
    m.d_model = hf["hidden_size"]
    m.num_heads = hf["num_attention_heads"]
    m.d_ff = hf["intermediate_size"]
    m.position, m.norm, m.norm_type, m.embed_norm = "learned", "post", "layernorm", True
    m.norm_eps = float(hf.get("layer_norm_eps", 1e-12))
    m.mlp, m.use_bias = act, True
    m.type_vocab_size = int(hf.get("type_vocab_size", 2))
    m.tie_embeddings = bool(hf.get("tie_word_embeddings", True))
    m.dropout = float(hf.get("hidden_dropout_prob", 0.1))
    m.attention_dropout = float(hf.get("attention_probs_dropout_prob", 0.1))
    offset = _roberta_offset(hf) if arch == "RobertaForMaskedLM" else 0
    c.data.seq_len = int(hf.get("max_position_embeddings", 512)) - offset
    c.objective.name = "masked_lm"
  elif arch == "GPT2LMHeadModel":
    if not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx", False):
      raise ConvertError("GPT2LMHeadModel: only scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False "
                         "(standard GPT-2 attention) is supported")
    if hf.get("add_cross_attention"):
      raise ConvertError("GPT2LMHeadModel: cross-attention is not supported")
    m.family = "decoder"
    m.num_layers = hf["n_layer"]
    m.d_model = hf["n_embd"]
    m.num_heads = hf["n_head"]
    m.d_ff = hf.get("n_inner") or 4 * hf["n_embd"]
    m.position, m.norm, m.norm_type, m.embed_norm = "learned", "pre", "layernorm", False
    m.norm_eps = float(hf.get("layer_norm_epsilon", 1e-5))
    m.mlp, m.use_bias = _activation(hf.get("activation_function", "gelu_new"), arch), True
    m.type_vocab_size = 0
    m.tie_embeddings = bool(hf.get("tie_word_embeddings", True))
    m.dropout = float(hf.get("resid_pdrop", 0.1))
    m.attention_dropout = float(hf.get("attn_pdrop", 0.1))
    c.data.seq_len = int(hf.get("n_positions", 1024))
    c.objective.name = "causal_lm"
  else:  # T5
    proj = hf.get("feed_forward_proj", "relu")
    parts = proj.split("-")
    gated = parts[0] == "gated" and len(parts) == 2
    act = parts[-1]
    if gated and act in ("gelu", "gelu_new"):
      mlp = "geglu"
    elif gated and act == "silu":
      mlp = "swiglu"
    elif not gated and len(parts) == 1 and act in _HF_ACT:
      mlp = _HF_ACT[act]
    else:
      raise ConvertError(f"T5ForConditionalGeneration: feed_forward_proj {proj!r} is not supported "
                         "(relu, gelu, gelu_new, gated-gelu, gated-silu are)")
    m.family = "encoder_decoder"
    m.num_layers = hf["num_layers"]
    ndec = hf.get("num_decoder_layers") or hf["num_layers"]
    m.num_decoder_layers = 0 if ndec == hf["num_layers"] else ndec
    m.d_model = hf["d_model"]
    m.num_heads = hf["num_heads"]
    m.head_dim = 0 if hf["d_kv"] * hf["num_heads"] == hf["d_model"] else hf["d_kv"]  # t5-v1_1-small: 6 x 64 on 512
    m.d_ff = hf["d_ff"]
    m.position, m.norm, m.norm_type, m.embed_norm = "relative", "pre", "rmsnorm", False
    m.relative_buckets = int(hf.get("relative_attention_num_buckets", 32))
    m.relative_max_distance = int(hf.get("relative_attention_max_distance", 128))
    m.norm_eps = float(hf.get("layer_norm_epsilon", 1e-6))
    m.mlp, m.use_bias, m.scale_attention, m.type_vocab_size = mlp, False, False, 0
    m.dropout = float(hf.get("dropout_rate", 0.1))
    m.attention_dropout = m.dropout
    # Whether the decoder output is scaled by d_model**-0.5: transformers >= 5 stores it as
    # `scale_decoder_outputs`; older versions derive it from `tie_word_embeddings`.
    scale = hf.get("scale_decoder_outputs", hf.get("tie_word_embeddings", True))
    m.tie_embeddings = bool(scale)  # refined by _resolve_t5_tying once the tensors are read
    m.scale_tied_logits = bool(scale)
    c.data.seq_len = 512
    c.objective.name = "span_corruption"
  c.data.vocab_size = int(hf["vocab_size"])
  return c


def _resolve_t5_tying(c, hf_cfg: dict, tensors: dict[str, np.ndarray]) -> None:
  """T5: untied iff the checkpoint holds an `lm_head.weight` different from `shared.weight`."""
  scale = bool(hf_cfg.get("scale_decoder_outputs", hf_cfg.get("tie_word_embeddings", True)))
  head = tensors.get("lm_head.weight")
  untied = head is not None and not np.array_equal(head, tensors.get("shared.weight"))
  c.model.tie_embeddings = not untied
  c.model.scale_tied_logits = scale and not untied


# ============================================================================ tensors on disk


def _read_safetensors(path: str) -> dict[str, np.ndarray]:
  """All tensors of a safetensors file as numpy arrays (bf16/fp16 cast to float32)."""
  try:
    from safetensors.numpy import load_file  # noqa: PLC0415
  except ImportError as e:
    raise ConvertError("reading HF checkpoints needs the `safetensors` package: pip install safetensors") from e
  try:
    tensors = load_file(path)
  except (TypeError, ValueError, KeyError):  # dtypes numpy lacks (bfloat16): parse the file ourselves
    tensors = _read_safetensors_raw(path)
  return {k: (v.astype(np.float32) if v.dtype.kind == "f" or v.dtype.name == "bfloat16" else v)
          for k, v in tensors.items()}


def _read_safetensors_raw(path: str) -> dict[str, np.ndarray]:
  import ml_dtypes  # noqa: PLC0415  (a jax dependency)

  dtypes = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64,
            "I64": np.int64, "I32": np.int32, "U8": np.uint8, "BOOL": np.bool_}
  with open(path, "rb") as f:
    n = int.from_bytes(f.read(8), "little")
    header = json.loads(f.read(n))
    data = f.read()
  out = {}
  for name, info in header.items():
    if name == "__metadata__":
      continue
    start, end = info["data_offsets"]
    out[name] = np.frombuffer(data[start:end], dtype=dtypes[info["dtype"]]).reshape(info["shape"])
  return out


def _load_tensors(path: str) -> dict[str, np.ndarray]:
  single = os.path.join(path, "model.safetensors")
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.isfile(single):
    return _read_safetensors(single)
  if os.path.isfile(index):
    with open(index) as f:
      files = sorted(set(json.load(f)["weight_map"].values()))
    tensors = {}
    for name in files:
      tensors.update(_read_safetensors(os.path.join(path, name)))
    return tensors
  extra = " (it has pytorch_model.bin: re-save it with save_pretrained(..., safe_serialization=True))" \
      if os.path.isfile(os.path.join(path, "pytorch_model.bin")) else ""
  raise ConvertError(f"{path} has no model.safetensors{extra}")


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


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(_flatten(v, f"{prefix}{k}/"))
    else:
      out[f"{prefix}{k}"] = v
  return out


def _model_config(config):
  from tfx.nn.layers import ModelConfig  # noqa: PLC0415
  return ModelConfig.from_config(config.model, vocab_size=config.data.vocab_size, max_length=config.data.seq_len)


def _expected_shapes(config) -> dict[str, tuple[int, ...]]:
  """Shapes of every parameter of the tfx model of `config` (computed abstractly)."""
  import flax.linen as nn  # noqa: PLC0415
  import jax  # noqa: PLC0415

  from tfx.models import build_model  # noqa: PLC0415

  model = build_model(config.model, vocab_size=config.data.vocab_size, max_length=config.data.seq_len)
  inputs = type(model).init_inputs(1, 8)
  shapes = jax.eval_shape(lambda: nn.unbox(model.init(jax.random.key(0), **inputs))["params"])
  return {k: tuple(v.shape) for k, v in _flatten(shapes).items()}


# ============================================================================ import


def from_hf(path: str, *, scan_layers: bool = True) -> tuple[ml_collections.ConfigDict, dict]:
  """Reads an HF `save_pretrained` directory (config.json + model.safetensors).

  Returns (config, params): a full tfx config (configs/base.py with the model fields, the
  objective name, data.seq_len = the HF maximum positions and data.vocab_size = the HF
  vocabulary; dropout as in the HF config) and the `params` tree of that model (numpy float32,
  stacked along a leading layers axis as `model.scan_layers=True` expects; with
  `scan_layers=False`, per layer as `<stack>/layer_{i}/...`). Raises
  ConvertError (a UserError) for missing files or unsupported architectures.
  """
  cfg_path = os.path.join(path, "config.json")
  if not os.path.isdir(path):
    raise ConvertError(f"{path} is not a directory (expected an HF save_pretrained directory)")
  if not os.path.isfile(cfg_path):
    raise ConvertError(f"{path} has no config.json (expected an HF save_pretrained directory)")
  with open(cfg_path) as f:
    hf_cfg = json.load(f)
  if _is_xlnet(hf_cfg):
    return _xlnet_from_hf(path, hf_cfg, scan_layers)
  arch = _architecture(hf_cfg)
  config = _tfx_config(arch, hf_cfg)
  config.model.scan_layers = scan_layers
  tensors = _load_tensors(path)
  if arch == "T5ForConditionalGeneration":
    _resolve_t5_tying(config, hf_cfg, tensors)
  # A one-row token-type table is a constant vector: fold it into the position table.
  fold_types = config.model.type_vocab_size == 1
  if fold_types:
    config.model.type_vocab_size = 0
  m = config.model
  layout = _layout(arch, m, hf_cfg)

  used: set[str] = set()

  def fetch(names: tuple[str, ...]) -> Arrays:
    missing = [n for n in names if n not in tensors]
    if missing:
      raise ConvertError(f"{path}: the {arch} checkpoint lacks tensor(s) {', '.join(missing)}")
    used.update(names)
    return [tensors[n] for n in names]

  params = _layout_params(layout, fetch, m.scan_layers)
  if fold_types:
    types = fetch((f"{'roberta' if arch == 'RobertaForMaskedLM' else 'bert'}.embeddings.token_type_embeddings.weight",))
    params["position_embed"]["embedding"] = params["position_embed"]["embedding"] + types[0][0]

  leftover = [k for k in tensors if k not in used and not k.endswith(_IGNORED_SUFFIXES)
              and not k.startswith(_IGNORED_PREFIXES) and not (k == "lm_head.weight" and m.tie_embeddings)]
  if leftover:
    raise ConvertError(f"{path}: tensors tfx has no place for (an unsupported variant of {arch}?): "
                       f"{', '.join(sorted(leftover)[:8])}{' ...' if len(leftover) > 8 else ''}")
  if m.family == "encoder":  # Encoder.two_stream's query-stream input: no HF tensor, starts at zero (not exported)
    params["mask_emb"] = np.zeros((m.d_model,), np.float32)
  _check_shapes(config, params, path)
  return config, params


# ============================================================================ XLNet
#
# `XLNetLMHeadModel` <-> `xlnet` family (tfx/models/xlnet.py), objective `permutation_lm`.
# HF stores rel_attn.{q,k,v,r} as [d_model, n_head, d_head] (= the tfx kernels) and o as
# [d_model, n_head, d_head] (tfx out kernel [h, d, e]: transposed). HF keeps r_*_bias per layer
# whatever `untie_r` says; identical biases in every layer import as shared (`untie_r=False`,
# top-level `r_*_bias`), otherwise per layer; export writes shared biases into every layer.
# Layers are stacked under `layers` (scan_layers=True, the default) or unrolled as `layer_{i}`,
# as for the other architectures; the untied r_*_bias and seg_embed are per-layer parameters
# like any other. HF's `reuse_len` / `mem_len` None mean "cache every row" / "no memory": they
# import as 0 and 0 exports as None. The LM head is tied (lm_loss.weight is not written).

XLNET = "XLNetLMHeadModel"
_XLNET_BIASES = ("r_w_bias", "r_r_bias", "r_s_bias")


def _is_xlnet(hf_cfg: dict) -> bool:
  archs = hf_cfg.get("architectures") or []
  return XLNET in archs or (not archs and hf_cfg.get("model_type") == "xlnet")


def _xlnet_config(hf: dict, untie_r: bool, scan_layers: bool) -> ml_collections.ConfigDict:
  if hf.get("attn_type", "bi") != "bi":
    raise ConvertError(f"{XLNET}: attn_type {hf.get('attn_type')!r} is not supported (only 'bi')")
  if hf.get("same_length", False):
    raise ConvertError(f"{XLNET}: same_length=True is not supported")
  if hf["d_head"] * hf["n_head"] != hf["d_model"]:
    raise ConvertError(f"{XLNET}: d_head * n_head ({hf['d_head']} * {hf['n_head']}) must equal d_model "
                       f"({hf['d_model']})")
  c = _base_config()
  m = c.model
  m.family = "xlnet"
  m.num_layers, m.d_model, m.num_heads, m.d_ff = hf["n_layer"], hf["d_model"], hf["n_head"], hf["d_inner"]
  m.position, m.norm, m.norm_type, m.embed_norm = "relative", "post", "layernorm", False
  m.norm_eps = float(hf.get("layer_norm_eps", 1e-12))
  m.mlp, m.use_bias, m.type_vocab_size, m.tie_embeddings = _activation(hf.get("ff_activation", "gelu"), XLNET), \
      True, 0, True
  m.dropout = m.attention_dropout = float(hf.get("dropout", 0.1))
  m.scan_layers = scan_layers
  extra = {"mem_len": int(hf.get("mem_len") or 0), "reuse_len": int(hf.get("reuse_len") or 0),
           "clamp_len": int(hf.get("clamp_len", -1)), "untie_r": bool(untie_r)}
  with c.unlocked():  # the xlnet fields may not be in configs/base.py yet
    for k, v in extra.items():
      m[k] = v
    c.objective.name = "permutation_lm"
    c.objective.bi_data = bool(hf.get("bi_data", False))
  c.data.seq_len = 512
  c.data.vocab_size = int(hf["vocab_size"])
  return c


def _xlnet_layout(m) -> _Layout:
  """Global tensors, then the per-layer ones (`{i}`) of the single top-level stack ("")."""
  n, t = m.num_layers, "transformer"
  g = [_rule(f"{t}.word_embedding.weight", "token_embed/embedding"),
       _rule(f"{t}.mask_emb", "mask_emb", _one(lambda w: w.reshape(-1)), _one(lambda k: k.reshape(1, 1, -1))),
       _rule("lm_loss.bias", "output_bias")]
  if not m.untie_r:  # one shared bias <-> a copy in every HF layer (import reads layer 0)
    g += [_rule(tuple(f"{t}.layer.{i}.rel_attn.{b}" for i in range(n)), b, lambda xs: [xs[0]],
                lambda ks: [ks[0]] * n) for b in _XLNET_BIASES]
  L = f"{t}.layer.{{i}}"
  layer = [_rule(f"{L}.rel_attn.{hf}", f"attention/{name}/kernel")
           for hf, name in (("q", "query"), ("k", "key"), ("v", "value"), ("r", "relative"))]
  layer += [_rule(f"{L}.rel_attn.o", "attention/out/kernel", _one(lambda w: np.ascontiguousarray(w.transpose(1, 2, 0))),
                  _one(lambda k: np.ascontiguousarray(k.transpose(2, 0, 1)))),  # [e, h, d] <-> [h, d, e]
            _rule(f"{L}.rel_attn.seg_embed", "attention/seg_embed"),
            *_norm(f"{L}.rel_attn.layer_norm", "attention/attention_norm"),
            _linear(f"{L}.ff.layer_1.weight", "mlp/wi_0/kernel"), _rule(f"{L}.ff.layer_1.bias", "mlp/wi_0/bias"),
            _linear(f"{L}.ff.layer_2.weight", "mlp/wo/kernel"), _rule(f"{L}.ff.layer_2.bias", "mlp/wo/bias"),
            *_norm(f"{L}.ff.layer_norm", "mlp_norm")]
  if m.untie_r:
    layer += [_rule(f"{L}.rel_attn.{b}", f"attention/{b}") for b in _XLNET_BIASES]
  return _Layout(g, [("", n, layer)])


def _xlnet_hf_config(config, ids: dict) -> dict:
  """The HF XLNetConfig (as config.json) of a tfx xlnet config; bi_data comes from the objective."""
  m = config.model
  _require(m.family == "xlnet", XLNET, f"model.family is {m.family!r}, not 'xlnet'")
  _require(m.position == "relative" and m.norm == "post" and m.norm_type == "layernorm" and m.use_bias
           and m.tie_embeddings and not m.embed_norm and not m.embed_scale, XLNET,
           "it needs position=relative, norm=post, norm_type=layernorm, use_bias, tie_embeddings and no "
           "embed_norm / embed_scale")
  _require(m.mlp in _TFX_ACT, XLNET, f"mlp {m.mlp!r} has no HF equivalent (gelu, gelu_exact, relu do)")
  _require(m.d_model % m.num_heads == 0, XLNET, f"d_model {m.d_model} is not a multiple of num_heads {m.num_heads}")
  mem_len = int(m.get("mem_len", 0))
  out = {"architectures": [XLNET], "model_type": "xlnet", "vocab_size": config.data.vocab_size, "d_model": m.d_model,
         "n_layer": m.num_layers, "n_head": m.num_heads, "d_head": m.d_model // m.num_heads, "d_inner": m.d_ff,
         "ff_activation": _TFX_ACT[m.mlp], "untie_r": bool(m.get("untie_r", True)), "attn_type": "bi",
         "initializer_range": m.init_std, "layer_norm_eps": m.norm_eps,
         "dropout": m.dropout,  # HF has one rate (import sets attention_dropout to it too)
         "mem_len": mem_len or None, "reuse_len": int(m.get("reuse_len", 0)) or None,
         "clamp_len": int(m.get("clamp_len", -1)), "bi_data": bool(config.objective.get("bi_data", False)),
         "same_length": False, "use_mems_eval": True, "use_mems_train": mem_len > 0, "tie_word_embeddings": True}
  out.update({f"{k}_token_id": v for k, v in ids.items() if k in ("pad", "bos", "eos")})
  return out


def _xlnet_from_hf(path: str, hf_cfg: dict, scan_layers: bool) -> tuple[ml_collections.ConfigDict, dict]:
  """`from_hf` for an `XLNetLMHeadModel` directory (see the section comment)."""
  tensors = _load_tensors(path)
  n = int(hf_cfg["n_layer"])
  tied_biases = all(np.array_equal(tensors.get(f"transformer.layer.{i}.rel_attn.{b}"),
                                   tensors.get(f"transformer.layer.0.rel_attn.{b}"))
                    for i in range(n) for b in _XLNET_BIASES)
  config = _xlnet_config(hf_cfg, not tied_biases, scan_layers)
  used: set[str] = set()

  def fetch(names: tuple[str, ...]) -> Arrays:
    missing = [k for k in names if k not in tensors]
    if missing:
      raise ConvertError(f"{path}: the {XLNET} checkpoint lacks tensor(s) {', '.join(missing)}")
    used.update(names)
    return [tensors[k] for k in names]

  params = _layout_params(_xlnet_layout(config.model), fetch, scan_layers)
  head = tensors.get("lm_loss.weight")
  if head is not None and not np.array_equal(head, tensors["transformer.word_embedding.weight"]):
    raise ConvertError(f"{path}: lm_loss.weight differs from the word embedding; tfx's xlnet head is tied")
  used.add("lm_loss.weight")
  leftover = sorted(k for k in tensors if k not in used)
  if leftover:
    raise ConvertError(f"{path}: tensors tfx has no place for: {', '.join(leftover[:8])}")
  _check_shapes(config, params, path)
  return config, params


def _check_shapes(config, params: dict, where: str) -> None:
  want = _expected_shapes(config)
  got = {k: tuple(np.shape(v)) for k, v in _flatten(params).items()}
  if want != got:
    diff = sorted(set(want) ^ set(got)) or [k for k in want if want[k] != got[k]]
    details = "; ".join(f"{k}: tfx {want.get(k)} vs converted {got.get(k)}" for k in diff[:6])
    raise ConvertError(f"{where}: the converted parameters do not match the tfx model ({details})")


# ============================================================================ export


def _default_architecture(config) -> str:
  fam = config.model.family
  if fam == "decoder":
    return "GPT2LMHeadModel"
  if fam == "encoder_decoder":
    return "T5ForConditionalGeneration"
  if fam == "encoder":
    return "BertForMaskedLM" if config.model.type_vocab_size >= 2 else "RobertaForMaskedLM"
  if fam == "xlnet":
    return XLNET
  raise ConvertError(f"model.family {fam!r} has no HF export; tfx exports encoder (BERT/RoBERTa), "
                     "decoder (GPT-2), encoder_decoder (T5) and xlnet (XLNet)")


def _head_dim(m) -> int:
  """model.head_dim of a config (0 or absent = d_model // num_heads)."""
  return int(m.get("head_dim", 0)) or m.d_model // m.num_heads


def _require(cond: bool, arch: str, what: str) -> None:
  if not cond:
    raise ConvertError(f"cannot export as {arch}: {what}")


def _hf_config(arch: str, config, special_ids: dict | None) -> dict:
  m, ids = config.model, dict(special_ids or {})
  d_ff = m.d_ff
  if arch == XLNET:
    return _xlnet_hf_config(config, ids)
  if arch != "T5ForConditionalGeneration":
    _require(_head_dim(m) * m.num_heads == m.d_model, arch, f"HF {arch} derives its head width from hidden size / "
             f"heads, but model.head_dim={_head_dim(m)} x {m.num_heads} heads != d_model {m.d_model}")
  if arch in ("BertForMaskedLM", "RobertaForMaskedLM"):
    _require(m.family == "encoder", arch, f"model.family is {m.family!r}, not 'encoder'")
    _require(m.position == "learned" and m.norm == "post" and m.norm_type == "layernorm" and m.embed_norm
             and m.use_bias and not m.embed_scale and m.scale_attention, arch,
             "it needs position=learned, norm=post, norm_type=layernorm, embed_norm, use_bias, "
             "scale_attention and no embed_scale")
    _require(m.mlp in _TFX_ACT, arch, f"mlp {m.mlp!r} has no HF equivalent (gelu, gelu_exact, relu do)")
    if arch == "RobertaForMaskedLM":
      _require(m.mlp == "gelu_exact", arch, "RoBERTa's MLM head always uses the exact GELU: mlp must be gelu_exact")
      pad = ids.get("pad", 1)
      offset = pad + 1
      out = {"architectures": [arch], "model_type": "roberta", "pad_token_id": pad,
             "bos_token_id": ids.get("bos", 0), "eos_token_id": ids.get("eos", 2)}
    else:
      offset = 0
      out = {"architectures": [arch], "model_type": "bert", "pad_token_id": ids.get("pad", 0)}
    out.update(vocab_size=config.data.vocab_size, hidden_size=m.d_model, num_hidden_layers=m.num_layers,
               num_attention_heads=m.num_heads, intermediate_size=d_ff, hidden_act=_TFX_ACT[m.mlp],
               max_position_embeddings=config.data.seq_len + offset, type_vocab_size=max(m.type_vocab_size, 1),
               layer_norm_eps=m.norm_eps, hidden_dropout_prob=m.dropout,
               attention_probs_dropout_prob=m.attention_dropout, tie_word_embeddings=m.tie_embeddings,
               position_embedding_type="absolute", initializer_range=m.init_std)
    return out
  if arch == "GPT2LMHeadModel":
    _require(m.family == "decoder", arch, f"model.family is {m.family!r}, not 'decoder'")
    _require(m.position == "learned" and m.norm == "pre" and m.norm_type == "layernorm" and m.use_bias
             and not m.embed_norm and not m.embed_scale and m.scale_attention and not m.type_vocab_size, arch,
             "it needs position=learned, norm=pre, norm_type=layernorm, use_bias, scale_attention, "
             "no embed_norm / embed_scale / token types")
    _require(m.mlp in _TFX_ACT, arch, f"mlp {m.mlp!r} has no GPT-2 equivalent (gelu, gelu_exact, relu do)")
    return {"architectures": [arch], "model_type": "gpt2", "vocab_size": config.data.vocab_size,
            "n_positions": config.data.seq_len, "n_embd": m.d_model, "n_layer": m.num_layers, "n_head": m.num_heads,
            "n_inner": d_ff, "activation_function": _TFX_ACT[m.mlp], "layer_norm_epsilon": m.norm_eps,
            "resid_pdrop": m.dropout, "embd_pdrop": m.dropout, "attn_pdrop": m.attention_dropout,
            "tie_word_embeddings": m.tie_embeddings, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "initializer_range": m.init_std,
            "bos_token_id": ids.get("bos", ids.get("eos")), "eos_token_id": ids.get("eos"),
            "pad_token_id": ids.get("pad")}
  _require(m.family == "encoder_decoder", arch, f"model.family is {m.family!r}, not 'encoder_decoder'")
  _require(m.position == "relative" and m.norm == "pre" and m.norm_type == "rmsnorm" and not m.use_bias
           and not m.embed_norm and not m.embed_scale and not m.scale_attention and not m.type_vocab_size, arch,
           "it needs position=relative, norm=pre, norm_type=rmsnorm, no biases, scale_attention=False, "
           "no embed_norm / embed_scale / token types")
  proj = {"relu": "relu", "gelu": "gelu_new", "gelu_exact": "gelu", "geglu": "gated-gelu", "swiglu": "gated-silu"}
  _require(m.mlp in proj, arch, f"mlp {m.mlp!r} has no T5 equivalent")
  scale = bool(m.tie_embeddings and m.scale_tied_logits)
  return {"architectures": [arch], "model_type": "t5", "vocab_size": config.data.vocab_size, "d_model": m.d_model,
          "d_kv": _head_dim(m), "d_ff": d_ff, "num_layers": m.num_layers,
          "num_decoder_layers": m.num_decoder_layers or m.num_layers, "num_heads": m.num_heads,
          "relative_attention_num_buckets": m.relative_buckets,
          "relative_attention_max_distance": m.relative_max_distance, "dropout_rate": m.dropout,
          "layer_norm_epsilon": m.norm_eps, "feed_forward_proj": proj[m.mlp], "is_encoder_decoder": True,
          "tie_word_embeddings": m.tie_embeddings, "scale_decoder_outputs": scale,
          "pad_token_id": ids.get("pad", 0), "eos_token_id": ids.get("eos", 1), "decoder_start_token_id": 0,
          "initializer_factor": 1.0}


def to_hf(config, params: dict, path: str, *, architecture: str | None = None,
          special_ids: dict | None = None) -> str:
  """Writes `params` of a tfx model as an HF checkpoint directory (config.json + model.safetensors).

  Args:
    config: the tfx config (its `model` and `data.seq_len` / `data.vocab_size` are used;
      `data.vocab_size` must equal the embedding rows).
    params: the model's `params` tree (jax or numpy arrays; scanned or unrolled layers).
    path: output directory (created).
    architecture: one of ARCHITECTURES; default from the family (encoder: BERT with token
      types, RoBERTa without).
    special_ids: optional {'pad', 'eos', 'bos'} ids written to the HF config.
  Returns:
    The architecture written. `from_pretrained(path)` of that class loads it.
  """
  from safetensors.numpy import save_file  # noqa: PLC0415

  if "params" in params and "token_embed" not in params:  # a full variables dict
    params = params["params"]
  params = _to_numpy(params)
  vocab = np.shape(_get(params, "token_embed/embedding"))[0]
  config = ml_collections.ConfigDict(config.to_dict())
  config.data.vocab_size = int(vocab)
  arch = architecture or _default_architecture(config)
  if arch not in ARCHITECTURES:
    raise ConvertError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
  hf_cfg = _hf_config(arch, config, special_ids)
  m = config.model
  layout = _layout(arch, m, hf_cfg)
  tensors = _layout_tensors(layout, params)
  if arch in ("BertForMaskedLM", "RobertaForMaskedLM") and not m.type_vocab_size:
    prefix = "roberta" if arch == "RobertaForMaskedLM" else "bert"
    tensors[f"{prefix}.embeddings.token_type_embeddings.weight"] = np.zeros((1, m.d_model), np.float32)

  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf_cfg, f, indent=2, sort_keys=True)
  save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
  return arch


def _to_numpy(tree):
  if isinstance(tree, dict) or hasattr(tree, "items"):
    return {k: _to_numpy(v) for k, v in tree.items()}
  value = getattr(tree, "value", tree)  # flax boxes (LogicallyPartitioned)
  return np.asarray(value, dtype=np.float32)


# ============================================================================ T5 tokenizer


def t5_tokenizer_proto(spiece_path: str, vocab_size: int) -> bytes:
  """T5's spiece.model extended to the model's vocabulary, as HF's T5 tokenizer numbers it.

  HF adds `<extra_id_99>` ... `<extra_id_0>` after the sentencepiece pieces (so extra_id_0 is
  id vocab - 1 of the 32100 = 32000 + 100 tokenizer); the embedding table (32128) has further
  unused rows. tfx's tokenizer vocabulary must equal the embedding rows, so the sentinels are
  appended as user-defined pieces (tfx finds them by name) and the remaining rows as control
  pieces `<unused_k>` that encoding never produces.
  """
  from sentencepiece import sentencepiece_model_pb2  # noqa: PLC0415

  proto = sentencepiece_model_pb2.ModelProto()
  with open(spiece_path, "rb") as f:
    proto.ParseFromString(f.read())
  n = len(proto.pieces)
  if n > vocab_size:
    raise ConvertError(f"{spiece_path} has {n} pieces, more than the model's {vocab_size} embedding rows")
  existing = {p.piece for p in proto.pieces}
  extra = [f"<extra_id_{k}>" for k in reversed(range(min(100, vocab_size - n)))]
  for piece in extra:
    if piece not in existing:
      proto.pieces.add(piece=piece, score=0.0, type=sentencepiece_model_pb2.ModelProto.SentencePiece.USER_DEFINED)
  k = 0
  while len(proto.pieces) < vocab_size:
    proto.pieces.add(piece=f"<unused_{k}>", score=0.0, type=sentencepiece_model_pb2.ModelProto.SentencePiece.CONTROL)
    k += 1
  return proto.SerializeToString()


# ============================================================================ command line


def import_run(hf_dir: str, workdir: str) -> dict[str, Any]:
  """`--from-hf`: writes WORKDIR/config.json, config.py, checkpoints/0 (and tokenizer.model)."""
  import jax  # noqa: PLC0415

  from tfx import checkpoint, config as config_lib, parallel  # noqa: PLC0415
  from tfx.models import build_model  # noqa: PLC0415
  from tfx.train import make_optimizer, state_shardings, TrainState  # noqa: PLC0415

  config, params = from_hf(hf_dir)
  os.makedirs(workdir, exist_ok=True)
  if os.path.isdir(os.path.join(workdir, "checkpoints")) and os.listdir(os.path.join(workdir, "checkpoints")):
    raise ConvertError(f"{workdir}/checkpoints already has checkpoints; import into a new --workdir")
  notes = []
  spiece = os.path.join(hf_dir, "spiece.model")
  if os.path.isfile(spiece):
    tok_path = os.path.abspath(os.path.join(workdir, "tokenizer.model"))
    with open(tok_path, "wb") as f:
      f.write(t5_tokenizer_proto(spiece, config.data.vocab_size))
    config.data.tokenizer = tok_path
    notes.append(f"tokenizer: {spiece} -> {tok_path} (sentinels <extra_id_k> at HF's ids)")
  else:
    config.data.tokenizer = os.path.join(os.path.abspath(workdir), "SET-data.tokenizer-TO-A-SENTENCEPIECE-MODEL")
    notes.append(
        f"tokenizer: {hf_dir} has no sentencepiece model (BERT/RoBERTa/GPT-2 use WordPiece/BPE tokenizers, which "
        f"tfx does not read). Before training, set --config.data.tokenizer=PATH to a sentencepiece model whose ids "
        f"match the checkpoint's {config.data.vocab_size} embedding rows.")

  model = build_model(config.model, vocab_size=config.data.vocab_size, max_length=config.data.seq_len)
  tx, _ = make_optimizer(config)
  mesh = parallel.make_mesh(config.mesh)
  abstract, shardings = state_shardings(model, tx, mesh, config.data.seq_len)
  params_dev = jax.tree.map(lambda a, s: jax.device_put(np.asarray(a, np.float32), s), params, shardings.params)
  with parallel.context(mesh):
    opt_state = jax.jit(tx.init, out_shardings=shardings.opt_state)(params_dev)
  rng = jax.random.key_data(jax.random.split(jax.random.key(config.train.seed))[1])
  state = TrainState(step=jax.numpy.zeros((), jax.numpy.int32), params=params_dev, opt_state=opt_state,
                     rng=jax.device_put(rng, shardings.rng))
  mngr = checkpoint.manager(workdir, keep=config.train.keep_checkpoints, async_save=False)
  checkpoint.save(mngr, 0, state, {"epoch": 0, "row": 0})
  mngr.wait_until_finished()
  mngr.close()
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(config_lib.to_json(config))
  with open(os.path.join(workdir, "config.py"), "w") as f:
    f.write(_CONFIG_PY.format(source=os.path.abspath(hf_dir)))
  return {"config": config, "notes": notes, "num_params": sum(int(np.prod(np.shape(x))) for x in
                                                             _flatten(params).values())}


_CONFIG_PY = '''"""A model imported from {source} by `python -m tfx.convert --from-hf`.

Fine-tune it by training in this directory (tfx.train resumes from its checkpoints/0):

    python -m tfx.train --config THIS_DIR/config.py --workdir THIS_DIR --config.train.steps=N
"""

import os

from tfx.config import from_json


def get_config():
  with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "config.json")) as f:
    return from_json(f.read())
'''


def _load_params(workdir: str, step: int | None):
  """(config, params, special ids) of a run; works without a tokenizer (imported runs)."""
  from tfx import train  # noqa: PLC0415
  from tfx import checkpoint, config as config_lib, parallel  # noqa: PLC0415
  from tfx.models import build_model  # noqa: PLC0415
  from tfx.registry import load_builtins  # noqa: PLC0415

  path = os.path.join(workdir, "config.json")
  if not os.path.isfile(path):
    raise ConvertError(f"{workdir} is not a tfx run: it has no config.json")
  with open(path) as f:
    config = config_lib.from_json(f.read())
  tok = config.data.tokenizer or os.path.join(workdir, "tokenizer.model")
  if os.path.isfile(tok):
    config, tokenizer, _, params = train.load_trained(workdir, step)
    ids = {k: getattr(tokenizer, f"{k}_id") for k in ("pad", "eos", "bos")}
    return config, params, {k: v for k, v in ids.items() if v is not None}
  load_builtins()
  model = build_model(config.model, vocab_size=config.data.vocab_size, max_length=config.data.seq_len)
  tx, _ = train.make_optimizer(config)
  with config.unlocked():
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = -1, 1, 1
  mesh = parallel.make_mesh(config.mesh)
  abstract, shardings = train.state_shardings(model, tx, mesh, config.data.seq_len)
  mngr = checkpoint.manager(workdir, keep=config.train.keep_checkpoints, async_save=False)
  step = mngr.latest_step() if step is None else step
  if step is None:
    raise ConvertError(f"{workdir}/checkpoints has no checkpoint")
  state, _ = checkpoint.restore(mngr, step, checkpoint.abstract_like(abstract, shardings))
  mngr.close()
  return config, state.params, None


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m tfx.convert", description=__doc__.split("\n")[0])
  group = parser.add_mutually_exclusive_group(required=True)
  group.add_argument("--from-hf", metavar="DIR", help="HF save_pretrained directory to import")
  group.add_argument("--to-hf", metavar="DIR", help="directory to write the HF checkpoint to")
  parser.add_argument("--workdir", required=True, help="tfx run directory (written by --from-hf, read by --to-hf)")
  parser.add_argument("--architecture", choices=ARCHITECTURES, help="--to-hf: HF class (default: from the family)")
  parser.add_argument("--step", type=int, help="--to-hf: checkpoint step (default: the latest)")
  args = parser.parse_args(argv)
  try:
    if args.from_hf:
      out = import_run(args.from_hf, args.workdir)
      c = out["config"]
      print(f"tfx.convert: {args.from_hf} -> {args.workdir}: {c.model.family} ({out['num_params']:,} parameters), "
            f"checkpoint at step 0, config.json + config.py")
      for note in out["notes"]:
        print(f"  {note}")
      print(f"  fine-tune: python -m tfx.train --config {os.path.join(args.workdir, 'config.py')} "
            f"--workdir {args.workdir} --config.objective.name={c.objective.name} --config.train.steps=N")
    else:
      config, params, ids = _load_params(args.workdir, args.step)
      arch = to_hf(config, params, args.to_hf, architecture=args.architecture, special_ids=ids)
      print(f"tfx.convert: {args.workdir} -> {args.to_hf} ({arch}); load it with "
            f"transformers.{arch}.from_pretrained({args.to_hf!r})")
  except UserError as e:
    sys.exit(f"tfx.convert: {e}")


if __name__ == "__main__":
  main()
