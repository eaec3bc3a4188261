"""What the family modules share about configs: configs/base.py, activations, the architecture of a config.json."""

from __future__ import annotations

import os

import ml_collections

from tfx.convert.layouts import ARCHITECTURES, ConvertError, _MODEL_TYPES


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


