"""Export: (tfx config, parameters) -> a Hugging Face directory; the T5 tokenizer."""

from __future__ import annotations

import json
import os

import ml_collections
import numpy as np

from tfx.convert.layouts import ARCHITECTURES, ConvertError, _get, _head_dim, _layout_tensors, _require
from tfx.convert.configs import _TFX_ACT
from tfx.convert.xlnet import XLNET, _xlnet_hf_config
from tfx.convert.hf_import import _layout


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


