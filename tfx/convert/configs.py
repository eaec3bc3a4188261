"""Hugging Face config.json <-> tfx model config (BERT, RoBERTa, GPT-2, T5)."""

from __future__ import annotations

import os

import ml_collections
import numpy as np

from tfx.convert.layouts import ARCHITECTURES, ConvertError, _MODEL_TYPES, _roberta_offset


# ============================================================================ configs


def _base_config() -> ml_collections.ConfigDict:
  """configs/base.py's get_config() (the repository's configs folder sits beside tfx/)."""
  try:
    from configs import base  # noqa: PLC0415
    return base.get_config()
  except ImportError:
    from tfx.config import load_config_file  # noqa: PLC0415
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
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
  """The tfx config (configs/base.py + the HF architecture) of an HF config.json whose fields
  `audit.audit` has checked (the values it refuses are not looked at here)."""
  c = _base_config()
  m = c.model
  m.dropout = 0.0
  m.attention_dropout = 0.0
  m.scan_layers = True
  if arch in ("BertForMaskedLM", "RobertaForMaskedLM"):
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


