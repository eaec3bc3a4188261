"""XLNetLMHeadModel <-> the xlnet family (objective permutation_lm)."""

from __future__ import annotations

import ml_collections
import numpy as np

from tfx.convert.layouts import Arrays, ConvertError, _Layout, _layout_params, _linear, _norm, _one, _require, _rule
from tfx.convert.configs import _TFX_ACT, _activation, _base_config
from tfx.convert.tensors import _expected_shapes, _flatten


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


def _xlnet_from_hf(path: str, hf_cfg: dict, scan_layers: bool, tensors: dict[str, np.ndarray]):
  """`import_hf` for an `XLNetLMHeadModel` directory (see the section comment): (config, params,
  the HF tensors used, the known-unused patterns)."""
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
  _check_shapes(config, params, path)
  return config, params, used, [("lm_loss.weight", "a tied copy of transformer.word_embedding.weight")]


def _check_shapes(config, params: dict, where: str) -> None:
  want = _expected_shapes(config)
  got = {k: tuple(np.shape(v)) for k, v in _flatten(params).items()}
  if want != got:
    diff = sorted(set(want) ^ set(got)) or [k for k in want if want[k] != got[k]]
    details = "; ".join(f"{k}: tfx {want.get(k)} vs converted {got.get(k)}" for k in diff[:6])
    raise ConvertError(f"{where}: the converted parameters do not match the tfx model ({details})")


