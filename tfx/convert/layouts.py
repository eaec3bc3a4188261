"""What every family's tensor map is made of: rules (HF tensors <-> tfx parameters), layouts (the rules of
one architecture, per layer and global, with its known-unused tensors), and tree helpers. The layouts
themselves live in the family modules (bert, gpt2, t5, xlnet)."""

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
