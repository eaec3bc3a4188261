"""Reading safetensors (no torch) and the flat views of parameter trees."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from tfx.convert.layouts import ConvertError


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
  others = [f for f in ("pytorch_model.bin", "pytorch_model.bin.index.json", "tf_model.h5", "flax_model.msgpack")
            if os.path.isfile(os.path.join(path, f))]
  if others:
    raise ConvertError(
        f"{path} has {others[0]} but no model.safetensors. tfx reads only safetensors (a .bin is a pickle, which "
        "can run code when loaded). If you trust the checkpoint, convert it once with transformers: "
        f"AutoModelForMaskedLM / AutoModelForCausalLM / AutoModelForSeq2SeqLM .from_pretrained({path!r})"
        ".save_pretrained(NEW_DIR) writes model.safetensors (safe_serialization is the default)")
  raise ConvertError(f"{path} has no model.safetensors (nor model.safetensors.index.json)")


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


