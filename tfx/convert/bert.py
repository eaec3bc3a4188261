"""BERT (`BertForMaskedLM`) and RoBERTa (`RobertaForMaskedLM`) <-> the encoder family.

Post-LN, `embed_norm`, token types, and the MLM head (`head_dense` + activation + `head_norm` +
projection + `output_bias`). BERT's `gelu` is the exact (erf) GELU (`mlp='gelu_exact'`). RoBERTa
numbers positions from `pad_token_id + 1`: its table is imported from that row on, and a
one-row token-type table (RoBERTa) is folded into the position table by the import.
"""

from __future__ import annotations

import numpy as np

from tfx.convert.layouts import _BUFFER, _TIED, ConvertError, _Layout, _head_dim, _heads_bias, _heads_in, \
    _heads_out, _linear, _norm, _one, _require, _rule
from tfx.convert.configs import _TFX_ACT, _activation


def _bert_layout(m, prefix: str, head: str, pos_offset: int) -> _Layout:
  """BERT (`head="cls"`) or RoBERTa (`head="lm_head"`). With tied embeddings the output bias is
  the head's `bias` (HF ties `decoder.bias` to it); untied (transformers >= 5) the decoder is a
  Linear with its own bias and `bias` is unused: import reads `decoder.bias`, export writes both
  (older transformers tie the two even when untied)."""
  h, d = m.num_heads, _head_dim(m)
  p = f"{prefix}.embeddings"
  words = f"{p}.word_embeddings.weight"
  g = [_rule(words, "token_embed/embedding"),
       _rule(f"{p}.position_embeddings.weight", "position_embed/embedding",
             _one(lambda w: w[pos_offset:]),
             _one(lambda k: np.concatenate([np.zeros((pos_offset, k.shape[1]), k.dtype), k]))),
       *_norm(f"{p}.LayerNorm", "embed_norm")]
  if m.type_vocab_size:
    g.append(_rule(f"{p}.token_type_embeddings.weight", "type_embed/embedding"))
  if head == "cls":
    mlm = "cls.predictions"
    g += [_linear(f"{mlm}.transform.dense.weight", "head_dense/kernel"),
          _rule(f"{mlm}.transform.dense.bias", "head_dense/bias"),
          *_norm(f"{mlm}.transform.LayerNorm", "head_norm")]
  else:
    mlm = "lm_head"
    g += [_linear("lm_head.dense.weight", "head_dense/kernel"), _rule("lm_head.dense.bias", "head_dense/bias"),
          *_norm("lm_head.layer_norm", "head_norm")]
  unused = [(f"{p}.position_ids", _BUFFER), (f"{p}.token_type_ids", _BUFFER),
            (f"{prefix}.pooler.*", "the pooler (input of the next-sentence head), not part of the MLM model"),
            ("cls.seq_relationship.*", "the next-sentence-prediction head, not part of the MLM model")]
  copies = {}
  if m.tie_embeddings:
    g.append(_rule(f"{mlm}.bias", "output_bias"))
    unused += [(f"{mlm}.decoder.weight", _TIED.format(words)), (f"{mlm}.decoder.bias", _TIED.format(f"{mlm}.bias"))]
  else:
    g += [_linear(f"{mlm}.decoder.weight", "lm_head/kernel"), _rule(f"{mlm}.decoder.bias", "output_bias")]
    unused.append((f"{mlm}.bias", f"unused by HF when tie_word_embeddings=False ({mlm}.decoder.bias is the "
                                  "output bias); export writes a copy for older transformers"))
    copies[f"{mlm}.bias"] = f"{mlm}.decoder.bias"
  L = f"{prefix}.encoder.layer.{{i}}"
  layer = []
  for name in ("query", "key", "value"):
    layer += [_heads_in(f"{L}.attention.self.{name}.weight", f"attention/{name}/kernel", h, d),
              _heads_bias(f"{L}.attention.self.{name}.bias", f"attention/{name}/bias", h, d)]
  layer += [_heads_out(f"{L}.attention.output.dense.weight", "attention/out/kernel", h, d),
            _rule(f"{L}.attention.output.dense.bias", "attention/out/bias"),
            *_norm(f"{L}.attention.output.LayerNorm", "attention_norm"),
            _linear(f"{L}.intermediate.dense.weight", "mlp/wi_0/kernel"),
            _rule(f"{L}.intermediate.dense.bias", "mlp/wi_0/bias"),
            _linear(f"{L}.output.dense.weight", "mlp/wo/kernel"),
            _rule(f"{L}.output.dense.bias", "mlp/wo/bias"),
            *_norm(f"{L}.output.LayerNorm", "mlp_norm")]
  return _Layout(g, [("encoder", m.num_layers, layer)], unused, copies)


def _roberta_offset(hf_cfg: dict) -> int:
  """Rows of RoBERTa's position table before position 0 (padding_idx + 1)."""
  pad = hf_cfg.get("pad_token_id")
  return (1 if pad is None else int(pad)) + 1


def config_from_hf(c, arch: str, hf: dict) -> None:
  """Sets the model / data / objective fields of tfx config `c` from a BERT or RoBERTa config.json."""
  m = c.model
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
  m.mlp_dropout = 0.0  # BERT's intermediate layer has no dropout
  offset = _roberta_offset(hf) if arch == "RobertaForMaskedLM" else 0
  c.data.seq_len = int(hf.get("max_position_embeddings", 512)) - offset
  c.objective.name = "masked_lm"


def config_to_hf(arch: str, config, ids: dict) -> dict:
  """The config.json of `arch` for a tfx encoder config (ids: special token ids, maybe empty)."""
  m, d_ff = config.model, config.model.d_ff
  _require(m.family == "encoder", arch, f"model.family is {m.family!r}, not 'encoder'")
  _require(m.position == "learned" and m.norm == "post" and m.norm_type == "layernorm" and m.embed_norm
           and m.use_bias and not m.embed_scale and m.scale_attention, arch,
           "it needs position=learned, norm=post, norm_type=layernorm, embed_norm, use_bias, "
           "scale_attention and no embed_scale")
  _require(m.mlp in _TFX_ACT, arch, f"mlp {m.mlp!r} has no HF equivalent (gelu, gelu_exact, relu do)")
  if arch == "RobertaForMaskedLM":
    _require(m.mlp == "gelu_exact", arch, "RoBERTa's MLM head always uses the exact GELU: mlp must be gelu_exact")
    # RoBERTa's positions count the tokens that are not the pad id: a tokenizer without a pad token
    # leaves no id that is safe to name (the default 1 is a real token in most vocabularies).
    _require("pad" in ids or not ids, arch, "the tokenizer has no pad token, and RoBERTa computes positions "
             "from it (input_ids != pad_token_id); give the tokenizer one, or export as BertForMaskedLM")
    pad = ids.get("pad", 1)
    _require(pad not in (ids.get("eos"), ids.get("bos")), arch,
             f"the pad id {pad} is also the tokenizer's eos or bos id, and RoBERTa computes positions from it")
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
