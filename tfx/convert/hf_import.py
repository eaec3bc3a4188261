"""Import: a Hugging Face save_pretrained directory -> (tfx config, parameters)."""

from __future__ import annotations

import json
import os

import ml_collections
import numpy as np

from tfx.convert.layouts import Arrays, ConvertError, _IGNORED_PREFIXES, _IGNORED_SUFFIXES, _Layout, _bert_layout, _gpt2_layout, _layout_params, _roberta_offset, _t5_layout
from tfx.convert.configs import _architecture, _resolve_t5_tying, _tfx_config
from tfx.convert.tensors import _load_tensors
from tfx.convert.xlnet import XLNET, _check_shapes, _is_xlnet, _xlnet_from_hf, _xlnet_layout


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


