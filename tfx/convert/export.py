"""Export: (tfx config, parameters) -> a Hugging Face directory."""

from __future__ import annotations

import json
import os

import ml_collections
import numpy as np

from tfx.convert import bert, gpt2, t5
from tfx.convert.layouts import ARCHITECTURES, ConvertError, _get, _head_dim, _layout_tensors, _require
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
  if arch != "T5ForConditionalGeneration":  # only HF's T5 scales the decoder output before a tied head
    _require(not (m.tie_embeddings and m.scale_tied_logits), arch, "HF's head does not scale the hidden state "
             "by d_model**-0.5 before the tied embedding: model.scale_tied_logits must be off")
  if arch == XLNET:
    return _xlnet_hf_config(config, ids)
  if arch != "T5ForConditionalGeneration":
    _require(_head_dim(m) * m.num_heads == m.d_model, arch, f"HF {arch} derives its head width from hidden size / "
             f"heads, but model.head_dim={_head_dim(m)} x {m.num_heads} heads != d_model {m.d_model}")
  family = {"BertForMaskedLM": bert, "RobertaForMaskedLM": bert, "GPT2LMHeadModel": gpt2}.get(arch, t5)
  return family.config_to_hf(arch, config, ids)


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
    special_ids: optional {'pad', 'eos', 'bos'} ids written to the HF config. RoBERTa computes
      positions from its pad id (tokens != pad), so pass the tokenizer's ids for a model trained
      by tfx: without any, RoBERTa's own pad id 1 is written (right for an imported RoBERTa,
      wrong where 1 is a real token, as tfx's EOS is).
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




def save_hf_tokenizer(tokenizer, path: str, max_length: int) -> bool:
  """Writes an HF tokenizer (tfx.data.HFTokenizer) as transformers reads it: tokenizer.json,
  special_tokens_map.json and tokenizer_config.json. Returns False (writes nothing) for a
  SentencePiece tokenizer, which has no such form."""
  from tfx.data.hf_tokenizer import HFTokenizer  # noqa: PLC0415

  if not isinstance(tokenizer, HFTokenizer):
    return False
  roles = {f"{role}_token": token for role, token in tokenizer.special_tokens.items()}
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "tokenizer.json"), "w", encoding="utf-8") as f:
    f.write(tokenizer.tokenizer.to_str())
  with open(os.path.join(path, "special_tokens_map.json"), "w", encoding="utf-8") as f:
    json.dump(roles, f, indent=2, ensure_ascii=False)
  with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": int(max_length), **roles}, f,
              indent=2, ensure_ascii=False)
  return True
