"""GPT-2 (`GPT2LMHeadModel`) <-> the decoder family.

Pre-LN, learned positions, `gelu_new` (= tanh GELU, `mlp='gelu'`), eps 1e-5; the fused Conv1D
`c_attn` ([in, 3*out]) is split into query / key / value.
"""

from __future__ import annotations

import numpy as np

from tfx.convert.layouts import _BUFFER, _TIED, _Layout, _head_dim, _linear, _norm, _one, _require, _rule
from tfx.convert.configs import _TFX_ACT, _activation


def _gpt2_layout(m) -> _Layout:
  h, d, e = m.num_heads, _head_dim(m), m.d_model
  g = [_rule("transformer.wte.weight", "token_embed/embedding"),
       _rule("transformer.wpe.weight", "position_embed/embedding"),
       *_norm("transformer.ln_f", "final_norm")]
  unused = [("transformer.h.*.attn.bias", _BUFFER), ("transformer.h.*.attn.masked_bias", _BUFFER)]
  if m.tie_embeddings:
    unused.append(("lm_head.weight", _TIED.format("transformer.wte.weight")))
  else:
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
  return _Layout(g, [("decoder", m.num_layers, layer)], unused)


def config_from_hf(c, arch: str, hf: dict) -> None:
  """Sets the model / data / objective fields of tfx config `c` from a GPT-2 config.json."""
  m = c.model
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
  m.mlp_dropout = 0.0  # GPT-2 drops the MLP's output (resid_pdrop), not its hidden layer
  c.data.seq_len = int(hf.get("n_positions", 1024))
  c.objective.name = "causal_lm"


def config_to_hf(arch: str, config, ids: dict) -> dict:
  """The GPT-2 config.json of a tfx decoder config (ids: special token ids, maybe empty)."""
  m, d_ff = config.model, config.model.d_ff
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
