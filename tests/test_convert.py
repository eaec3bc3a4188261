"""tfx.convert without torch: export -> import is exact, and nothing imports silently wrong.

Checkpoints are written by `to_hf` from randomly initialised tfx models (the parity suite,
tests/parity, checks the same layouts against transformers itself).
"""

import json
import os
import sys

import flax.linen as nn
import jax
import numpy as np
import pytest

from tfx import convert
from tfx.convert import audit
from tfx.convert.hf_import import _tfx_config
from tfx.convert.tensors import _flatten, _load_tensors
from tfx.models import build_model

SMALL = {
    "BertForMaskedLM": dict(architectures=["BertForMaskedLM"], model_type="bert", vocab_size=40, hidden_size=16,
                            num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                            max_position_embeddings=16, type_vocab_size=2),
    "RobertaForMaskedLM": dict(architectures=["RobertaForMaskedLM"], model_type="roberta", vocab_size=40,
                               hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                               max_position_embeddings=18, type_vocab_size=1, pad_token_id=1),
    "GPT2LMHeadModel": dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", vocab_size=40, n_embd=16,
                            n_layer=2, n_head=2, n_positions=16),
    "T5ForConditionalGeneration": dict(architectures=["T5ForConditionalGeneration"], model_type="t5",
                                       vocab_size=40, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
                                       feed_forward_proj="gated-gelu"),
}


def _random_params(config, seed: int) -> dict:
  """The tfx model's params with every leaf random (norm scales and biases included)."""
  model = build_model(config.model, vocab_size=config.data.vocab_size, max_length=config.data.seq_len)
  shapes = jax.eval_shape(lambda: nn.unbox(model.init(jax.random.key(0), **type(model).init_inputs(1, 4))))
  leaves, tree = jax.tree.flatten(shapes["params"])
  rng = np.random.default_rng(seed)
  return jax.tree.unflatten(tree, [rng.normal(size=x.shape).astype(np.float32) for x in leaves])


def _checkpoint(tmp_path, arch: str, tied: bool = True, name: str = "hf"):
  """An HF directory written by `to_hf` from random tfx params; (dir, config, params)."""
  hf = dict(SMALL[arch], tie_word_embeddings=tied)
  config = _tfx_config(arch, hf)
  if config.model.type_vocab_size == 1:
    config.model.type_vocab_size = 0
  params = _random_params(config, seed=len(arch) + tied)
  if config.model.family == "encoder":
    params["mask_emb"] = np.zeros_like(params["mask_emb"])  # not part of an HF checkpoint
  out = str(tmp_path / name)
  convert.to_hf(config, params, out, architecture=arch)
  return out, config, params


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("arch", list(SMALL))
def test_export_then_import_is_exact(tmp_path, arch, tied):
  src, config, params = _checkpoint(tmp_path, arch, tied)
  imported = convert.import_hf(src)
  assert imported.architecture == arch and imported.config.model.tie_embeddings == tied
  for field in convert.MODEL_FIELDS:
    assert imported.config.model[field] == config.model[field], field
  want, got = _flatten(params), _flatten(imported.params)
  assert want.keys() == got.keys()
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  assert set(imported.mapped) | set(imported.ignored) == set(_load_tensors(src))


def test_untied_bert_export_writes_the_decoder_bias(tmp_path):
  """transformers >= 5 reads the untied output bias from cls.predictions.decoder.bias; older
  releases from cls.predictions.bias: export writes both, import reads the decoder's."""
  src, _, params = _checkpoint(tmp_path, "BertForMaskedLM", tied=False)
  tensors = _load_tensors(src)
  np.testing.assert_array_equal(tensors["cls.predictions.decoder.bias"], params["output_bias"])
  np.testing.assert_array_equal(tensors["cls.predictions.bias"], params["output_bias"])
  imported = convert.import_hf(src)
  assert "cls.predictions.bias" in imported.ignored and "cls.predictions.decoder.bias" in imported.mapped


def _rewrite(src: str, extra: dict | None = None, drop: str | None = None) -> None:
  from safetensors.numpy import save_file

  tensors = _load_tensors(src)
  tensors.update(extra or {})
  tensors.pop(drop, None)
  save_file(tensors, os.path.join(src, "model.safetensors"))


def test_a_stray_tensor_fails_the_import_by_name(tmp_path):
  src, _, _ = _checkpoint(tmp_path, "BertForMaskedLM")
  _rewrite(src, {"bert.encoder.layer.1.attention.self.gate.weight": np.ones((16, 16), np.float32)})
  with pytest.raises(convert.ConvertError, match=r"bert\.encoder\.layer\.1\.attention\.self\.gate\.weight"):
    convert.from_hf(src)


def test_known_unused_tensors_are_reported_with_the_reason(tmp_path):
  src, _, params = _checkpoint(tmp_path, "BertForMaskedLM")
  _rewrite(src, {"bert.pooler.dense.weight": np.ones((16, 16), np.float32),
                 "cls.seq_relationship.bias": np.ones((2,), np.float32),
                 "cls.predictions.decoder.weight": np.asarray(params["token_embed"]["embedding"])})
  imported = convert.import_hf(src)
  assert "pooler" in imported.ignored["bert.pooler.dense.weight"]
  assert "next-sentence" in imported.ignored["cls.seq_relationship.bias"]
  assert "tied copy" in imported.ignored["cls.predictions.decoder.weight"]
  summary = "\n".join(imported.summary())
  assert "3 ignored" in summary and "bert.pooler.dense.weight" in summary


def test_a_missing_tensor_fails_by_name(tmp_path):
  src, _, _ = _checkpoint(tmp_path, "GPT2LMHeadModel")
  _rewrite(src, drop="transformer.h.1.mlp.c_fc.bias")
  with pytest.raises(convert.ConvertError, match=r"transformer\.h\.1\.mlp\.c_fc\.bias"):
    convert.from_hf(src)


def _edit_config(src: str, **fields) -> None:
  path = os.path.join(src, "config.json")
  with open(path) as f:
    cfg = json.load(f)
  cfg.update(fields)
  with open(path, "w") as f:
    json.dump(cfg, f)


def test_an_unaudited_config_field_fails_unless_trusted(tmp_path):
  src, _, _ = _checkpoint(tmp_path, "GPT2LMHeadModel")
  _edit_config(src, attention_sink_size=4)
  with pytest.raises(convert.ConvertError, match="attention_sink_size.*--trust-field attention_sink_size"):
    convert.from_hf(src)
  imported = convert.import_hf(src, trust_fields=("attention_sink_size",))
  assert "trusted" in imported.fields["attention_sink_size"]


@pytest.mark.parametrize("arch,field,value", [
    ("BertForMaskedLM", "position_embedding_type", "relative_key"),
    ("BertForMaskedLM", "is_decoder", True),
    ("BertForMaskedLM", "pruned_heads", {"0": [1]}),
    ("GPT2LMHeadModel", "scale_attn_by_inverse_layer_idx", True),
    ("T5ForConditionalGeneration", "is_gated_act", False),
])
def test_a_config_value_that_changes_the_model_is_refused(tmp_path, arch, field, value):
  src, _, _ = _checkpoint(tmp_path, arch)
  _edit_config(src, **{field: value})
  with pytest.raises(convert.ConvertError, match=f"{field}=.*not supported"):
    convert.from_hf(src)


def test_every_audited_field_is_classified():
  for arch in audit.FIELDS:
    for field, entry in audit.known_fields(arch).items():
      assert entry == audit.MAPPED or isinstance(entry, (audit._Require, audit._Ignore)), (arch, field)


def test_pickle_checkpoints_are_refused_with_how_to_convert(tmp_path):
  src, _, _ = _checkpoint(tmp_path, "GPT2LMHeadModel")
  os.rename(os.path.join(src, "model.safetensors"), os.path.join(src, "pytorch_model.bin"))
  with pytest.raises(convert.ConvertError, match="pytorch_model.bin.*safe_serialization"):
    convert.from_hf(src)


def test_verify_without_torch_says_what_to_install(tmp_path, monkeypatch):
  src, config, params = _checkpoint(tmp_path, "GPT2LMHeadModel")
  monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
  with pytest.raises(convert.ConvertError, match="pip install torch"):
    convert.verify(src, "GPT2LMHeadModel", config, params)


def test_sharded_safetensors_import_like_one_file(tmp_path):
  from safetensors.numpy import save_file

  src, _, params = _checkpoint(tmp_path, "T5ForConditionalGeneration", tied=False)
  tensors = _load_tensors(src)
  names = sorted(tensors)
  shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
  for file, keys in shards.items():
    save_file({k: tensors[k] for k in keys}, os.path.join(src, file))
  with open(os.path.join(src, "model.safetensors.index.json"), "w") as f:
    json.dump({"weight_map": {k: file for file, keys in shards.items() for k in keys}}, f)
  os.remove(os.path.join(src, "model.safetensors"))
  got = _flatten(convert.from_hf(src)[1])
  for k, v in _flatten(params).items():
    np.testing.assert_array_equal(got[k], v, err_msg=k)


@pytest.mark.parametrize("arch", ["GPT2LMHeadModel", "BertForMaskedLM", "RobertaForMaskedLM"])
def test_export_refuses_logits_scaled_before_a_tied_head(tmp_path, arch):
  """tfx can scale the hidden state by d_model**-0.5 before any tied head; of HF's classes only T5 does."""
  _, config, params = _checkpoint(tmp_path, arch)
  config.model.scale_tied_logits = True
  with pytest.raises(convert.ConvertError, match="scale_tied_logits must be off"):
    convert.to_hf(config, params, str(tmp_path / "scaled"), architecture=arch)
  assert not os.path.exists(tmp_path / "scaled")  # refused before anything is written


def test_roberta_export_needs_a_pad_id_that_is_no_real_token(tmp_path):
  """RoBERTa's positions count the tokens that are not its pad id."""
  _, config, params = _checkpoint(tmp_path, "RobertaForMaskedLM")
  with pytest.raises(convert.ConvertError, match="the tokenizer has no pad token"):
    convert.to_hf(config, params, str(tmp_path / "a"), special_ids={"eos": 1})
  with pytest.raises(convert.ConvertError, match="the pad id 1 is also the tokenizer's eos or bos id"):
    convert.to_hf(config, params, str(tmp_path / "b"), special_ids={"pad": 1, "eos": 1})
  convert.to_hf(config, params, str(tmp_path / "c"), special_ids={"pad": 0, "eos": 1})
  hf = json.load(open(tmp_path / "c" / "config.json"))
  assert hf["pad_token_id"] == 0 and hf["max_position_embeddings"] == config.data.seq_len + 1


def test_t5_untied_head_of_a_legacy_config_is_scaled(tmp_path):
  """A config.json without `scale_decoder_outputs` (transformers 4 wrote none) scales the decoder
  output iff `tie_word_embeddings`; with a separate lm_head.weight the scale is folded into tfx's
  untied kernel, as the tying itself is read off the tensors."""
  src, config, params = _checkpoint(tmp_path, "T5ForConditionalGeneration", tied=False)
  hf = json.load(open(os.path.join(src, "config.json")))
  assert hf.pop("scale_decoder_outputs") is False
  hf["tie_word_embeddings"] = True
  json.dump(hf, open(os.path.join(src, "config.json"), "w"))
  imported = convert.import_hf(src)
  assert not imported.config.model.tie_embeddings
  np.testing.assert_allclose(imported.params["lm_head"]["kernel"],
                             params["lm_head"]["kernel"] * np.float32(config.model.d_model**-0.5), rtol=1e-6)
