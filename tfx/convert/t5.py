"""T5 (`T5ForConditionalGeneration`) <-> the encoder_decoder family; T5's tokenizer.

rmsnorm, no biases, relative position buckets, unscaled attention. v1.0 (`relu`, tied, logits
scaled by d_model**-0.5: `scale_tied_logits=True`) and v1.1 (`gated-gelu` = `geglu`, untied
`lm_head`); `num_heads * d_kv` may differ from `d_model` (t5-v1_1-small).
"""

from __future__ import annotations

import numpy as np

from tfx.convert.layouts import _TIED, ConvertError, _Layout, _Rule, _head_dim, _heads_in, _heads_out, _linear, \
    _norm, _one, _require, _rule
from tfx.convert.configs import _HF_ACT


def _t5_layout(m, lm_head_scale: float = 1.0) -> _Layout:
  h, d = m.num_heads, _head_dim(m)
  g = [_rule("shared.weight", "token_embed/embedding"),
       _rule("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight", "encoder_relative_bias/embedding"),
       _rule("decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight", "decoder_relative_bias/embedding"),
       *_norm("encoder.final_layer_norm", "encoder_final_norm", bias=False),
       *_norm("decoder.final_layer_norm", "decoder_final_norm", bias=False)]
  unused = [(f"{stack}.embed_tokens.weight", _TIED.format("shared.weight")) for stack in ("encoder", "decoder")]
  if m.tie_embeddings:
    unused.append(("lm_head.weight", _TIED.format("shared.weight")))
  else:
    s = lm_head_scale  # an untied head with scaled inputs (unusual): folded into the kernel
    g.append(_rule("lm_head.weight", "lm_head/kernel", _one(lambda w: np.ascontiguousarray(w.T) * np.float32(s)),
                   _one(lambda k: np.ascontiguousarray(k.T) / np.float32(s))))

  def attention(hf: str, tfx: str) -> list[_Rule]:
    return [_heads_in(f"{hf}.q.weight", f"{tfx}/query/kernel", h, d),
            _heads_in(f"{hf}.k.weight", f"{tfx}/key/kernel", h, d),
            _heads_in(f"{hf}.v.weight", f"{tfx}/value/kernel", h, d),
            _heads_out(f"{hf}.o.weight", f"{tfx}/out/kernel", h, d)]

  def mlp(hf: str) -> list[_Rule]:
    if m.mlp in ("geglu", "swiglu"):
      rules = [_linear(f"{hf}.DenseReluDense.wi_0.weight", "mlp/wi_0/kernel"),
               _linear(f"{hf}.DenseReluDense.wi_1.weight", "mlp/wi_1/kernel")]
    else:
      rules = [_linear(f"{hf}.DenseReluDense.wi.weight", "mlp/wi_0/kernel")]
    return rules + [_linear(f"{hf}.DenseReluDense.wo.weight", "mlp/wo/kernel"),
                    *_norm(f"{hf}.layer_norm", "mlp_norm", bias=False)]

  E, D = "encoder.block.{i}.layer", "decoder.block.{i}.layer"
  enc = [*attention(f"{E}.0.SelfAttention", "attention"), *_norm(f"{E}.0.layer_norm", "attention_norm", bias=False),
         *mlp(f"{E}.1")]
  dec = [*attention(f"{D}.0.SelfAttention", "attention"), *_norm(f"{D}.0.layer_norm", "attention_norm", bias=False),
         *attention(f"{D}.1.EncDecAttention", "cross_attention"),
         *_norm(f"{D}.1.layer_norm", "cross_attention_norm", bias=False), *mlp(f"{D}.2")]
  return _Layout(g, [("encoder", m.num_layers, enc), ("decoder", m.num_decoder_layers or m.num_layers, dec)],
                 unused)


def config_from_hf(c, arch: str, hf: dict) -> None:
  """Sets the model / data / objective fields of tfx config `c` from a T5 config.json."""
  m = c.model
  proj = hf.get("feed_forward_proj", "relu")
  parts = proj.split("-")
  gated = parts[0] == "gated" and len(parts) == 2
  act = parts[-1]
  if gated and act in ("gelu", "gelu_new"):
    mlp = "geglu"
  elif gated and act == "silu":
    mlp = "swiglu"
  elif not gated and len(parts) == 1 and act in _HF_ACT:
    mlp = _HF_ACT[act]
  else:
    raise ConvertError(f"T5ForConditionalGeneration: feed_forward_proj {proj!r} is not supported "
                       "(relu, gelu, gelu_new, gated-gelu, gated-silu are)")
  m.family = "encoder_decoder"
  m.num_layers = hf["num_layers"]
  ndec = hf.get("num_decoder_layers") or hf["num_layers"]
  m.num_decoder_layers = 0 if ndec == hf["num_layers"] else ndec
  m.d_model = hf["d_model"]
  m.num_heads = hf["num_heads"]
  m.head_dim = 0 if hf["d_kv"] * hf["num_heads"] == hf["d_model"] else hf["d_kv"]  # t5-v1_1-small: 6 x 64 on 512
  m.d_ff = hf["d_ff"]
  m.position, m.norm, m.norm_type, m.embed_norm = "relative", "pre", "rmsnorm", False
  m.relative_buckets = int(hf.get("relative_attention_num_buckets", 32))
  m.relative_max_distance = int(hf.get("relative_attention_max_distance", 128))
  m.norm_eps = float(hf.get("layer_norm_epsilon", 1e-6))
  m.mlp, m.use_bias, m.scale_attention, m.type_vocab_size = mlp, False, False, 0
  m.dropout = float(hf.get("dropout_rate", 0.1))
  m.attention_dropout = m.dropout
  scale = scales_decoder_outputs(hf)
  m.tie_embeddings = scale  # refined by _resolve_t5_tying once the tensors are read
  m.scale_tied_logits = scale
  c.data.seq_len = 512
  c.objective.name = "span_corruption"


def scales_decoder_outputs(hf_cfg: dict) -> bool:
  """Whether HF's T5 scales the decoder output by d_model**-0.5 before the head: transformers >= 5
  stores it as `scale_decoder_outputs`; older versions derive it from `tie_word_embeddings`."""
  return bool(hf_cfg.get("scale_decoder_outputs", hf_cfg.get("tie_word_embeddings", True)))


def _resolve_t5_tying(c, hf_cfg: dict, tensors: dict[str, np.ndarray]) -> None:
  """T5: untied iff the checkpoint holds an `lm_head.weight` different from `shared.weight`."""
  scale = scales_decoder_outputs(hf_cfg)
  head = tensors.get("lm_head.weight")
  untied = head is not None and not np.array_equal(head, tensors.get("shared.weight"))
  c.model.tie_embeddings = not untied
  c.model.scale_tied_logits = scale and not untied


def config_to_hf(arch: str, config, ids: dict) -> dict:
  """The T5 config.json of a tfx encoder_decoder config (ids: special token ids, maybe empty)."""
  m, d_ff = config.model, config.model.d_ff
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


