"""Import: a Hugging Face save_pretrained directory -> (tfx config, parameters).

Nothing is imported silently wrong: every tensor of the checkpoint is mapped to a tfx parameter
or matched by the layout's `unused` list (with the reason), and every field of config.json is
mapped, refused, or audited as not changing the function (`tfx.convert.audit`); anything else
fails the import with its name.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os

import ml_collections
import numpy as np

from tfx.convert import audit, bert, gpt2, t5
from tfx.convert.configs import _architecture, _base_config
from tfx.convert.layouts import Arrays, ConvertError, _Layout, _layout_params
from tfx.convert.tensors import _load_tensors
from tfx.convert.xlnet import XLNET, _check_shapes, _is_xlnet, _xlnet_from_hf, _xlnet_layout


def _layout(arch: str, m, hf_cfg: dict) -> _Layout:
  if arch == XLNET:
    return _xlnet_layout(m)
  if arch == "BertForMaskedLM":
    return bert._bert_layout(m, "bert", "cls", 0)
  if arch == "RobertaForMaskedLM":
    return bert._bert_layout(m, "roberta", "lm_head", bert._roberta_offset(hf_cfg))
  if arch == "GPT2LMHeadModel":
    return gpt2._gpt2_layout(m)
  scale = m.d_model**-0.5 if t5.scales_decoder_outputs(hf_cfg) and not m.tie_embeddings else 1.0
  return t5._t5_layout(m, scale)


def _tfx_config(arch: str, hf: dict) -> ml_collections.ConfigDict:
  """The tfx config (configs/base.py + the HF architecture) of an HF config.json whose fields
  `audit.audit` has checked (the values it refuses are not looked at here)."""
  c = _base_config()
  m = c.model
  m.dropout = 0.0
  m.attention_dropout = 0.0
  m.scan_layers = True
  family = {"BertForMaskedLM": bert, "RobertaForMaskedLM": bert, "GPT2LMHeadModel": gpt2,
            "T5ForConditionalGeneration": t5}[arch]
  family.config_from_hf(c, arch, hf)
  c.data.vocab_size = int(hf["vocab_size"])
  return c


@dataclasses.dataclass
class Imported:
  """What `import_hf` read: the tfx config and params, and the account of the checkpoint."""

  config: ml_collections.ConfigDict
  params: dict
  architecture: str
  mapped: list[str]  # HF tensors that became tfx parameters
  ignored: dict[str, str]  # HF tensor -> why tfx does not need it
  fields: dict[str, str]  # config.json field -> how it was treated (mapped / why it is irrelevant)

  def summary(self) -> list[str]:
    """Lines for the import's report: counts, then every ignored tensor and why."""
    lines = [f"tensors: {len(self.mapped)} mapped, {len(self.ignored)} ignored"]
    reasons: dict[str, list[str]] = {}
    for name, why in sorted(self.ignored.items()):
      reasons.setdefault(why, []).append(name)
    for why, names in reasons.items():
      shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
      lines.append(f"  ignored {shown}: {why}")
    ignored_fields = sorted(k for k, v in self.fields.items() if v != audit.MAPPED)
    lines.append(f"config.json: {len(self.fields) - len(ignored_fields)} fields mapped, "
                 f"{len(ignored_fields)} audited as not changing the model"
                 + (f" ({', '.join(ignored_fields[:6])}{' ...' if len(ignored_fields) > 6 else ''})"
                    if ignored_fields else ""))
    return lines


def _read_config(path: str) -> dict:
  cfg_path = os.path.join(path, "config.json")
  if not os.path.isdir(path):
    raise ConvertError(f"{path} is not a directory (expected an HF save_pretrained directory)")
  if not os.path.isfile(cfg_path):
    raise ConvertError(f"{path} has no config.json (expected an HF save_pretrained directory)")
  with open(cfg_path) as f:
    return json.load(f)


def _account(path: str, arch: str, tensors: dict, used: set[str], unused: list[tuple[str, str]]) -> dict[str, str]:
  """{ignored tensor: reason}; raises naming every tensor that is neither used nor known-unused."""
  ignored, leftover = {}, []
  for name in sorted(tensors):
    if name in used:
      continue
    why = next((reason for pattern, reason in unused if fnmatch.fnmatchcase(name, pattern)), None)
    if why is None:
      leftover.append(name)
    else:
      ignored[name] = why
  if leftover:
    raise ConvertError(f"{path}: the checkpoint holds tensor(s) that tfx's {arch} does not map: "
                       f"{', '.join(leftover[:8])}{f' and {len(leftover) - 8} more' if len(leftover) > 8 else ''}. "
                       "They would change the model (an unsupported variant or a different head?), so the import "
                       "stops rather than drop them")
  return ignored


def import_hf(path: str, *, scan_layers: bool = True, trust_fields: tuple[str, ...] = ()) -> Imported:
  """Reads an HF `save_pretrained` directory (config.json + safetensors) with its account.

  `trust_fields`: config.json fields that tfx has not audited and that the caller vouches do
  not change the model (otherwise such a field fails the import).
  """
  hf_cfg = _read_config(path)
  arch = XLNET if _is_xlnet(hf_cfg) else _architecture(hf_cfg)
  fields = audit.audit(arch, hf_cfg, path=path, trusted=trust_fields)
  tensors = _load_tensors(path)
  if arch == XLNET:
    config, params, used, unused = _xlnet_from_hf(path, hf_cfg, scan_layers, tensors)
    ignored = _account(path, arch, tensors, used, unused)
    return Imported(config, params, arch, sorted(used), ignored, fields)

  config = _tfx_config(arch, hf_cfg)
  config.model.scan_layers = scan_layers
  if arch == "T5ForConditionalGeneration":
    t5._resolve_t5_tying(config, hf_cfg, tensors)
  # A one-row token-type table is a constant vector: fold it into the position table.
  fold_types = config.model.type_vocab_size == 1
  if fold_types:
    config.model.type_vocab_size = 0
  m = config.model
  layout = _layout(arch, m, hf_cfg)
  for name, source in layout.copies.items():  # e.g. an untied BERT saved by transformers 4 keeps one bias
    if source not in tensors and name in tensors:
      tensors[source] = tensors[name]

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
  ignored = _account(path, arch, tensors, used, layout.unused)
  if m.family == "encoder":  # Encoder.two_stream's query-stream input: no HF tensor, starts at zero (not exported)
    params["mask_emb"] = np.zeros((m.d_model,), np.float32)
  _check_shapes(config, params, path)
  return Imported(config, params, arch, sorted(used), ignored, fields)


def from_hf(path: str, *, scan_layers: bool = True) -> tuple[ml_collections.ConfigDict, dict]:
  """Reads an HF `save_pretrained` directory (config.json + model.safetensors).

  Returns (config, params): a full tfx config (configs/base.py with the model fields, the
  objective name, data.seq_len = the HF maximum positions and data.vocab_size = the HF
  vocabulary; dropout as in the HF config) and the `params` tree of that model (numpy float32,
  stacked along a leading layers axis as `model.scan_layers=True` expects; with
  `scan_layers=False`, per layer as `<stack>/layer_{i}/...`). Raises ConvertError (a
  UserError) for missing files, unsupported architectures or config values, and tensors or
  config fields tfx cannot account for. `import_hf` also returns that account.
  """
  imported = import_hf(path, scan_layers=scan_layers)
  return imported.config, imported.params
