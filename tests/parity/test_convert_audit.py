"""The config audit against transformers' own config classes, and `--verify` against HF models.

A transformers release that adds a config field to one of the imported architectures fails
`test_audit_covers_every_hf_config_field` until the field is classified in tfx/convert/audit.py
(mapped, refused, or known not to change the model).
"""

import inspect
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tfx import convert  # noqa: E402
from tfx.convert import audit  # noqa: E402
from tfx.convert.verify import LIMIT  # noqa: E402

CONFIG_CLASSES = {
    "BertForMaskedLM": "BertConfig", "RobertaForMaskedLM": "RobertaConfig", "GPT2LMHeadModel": "GPT2Config",
    "T5ForConditionalGeneration": "T5Config", "XLNetLMHeadModel": "XLNetConfig",
}


def _hf_fields(cls) -> set[str]:
  """Every field an HF config class writes or accepts: its to_dict() (with the generic
  PretrainedConfig ones), its constructor's parameters and its attribute aliases."""
  fields = set(cls().to_dict()) | set(transformers.PretrainedConfig().to_dict())
  fields |= {p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "kwargs")}
  return fields | set(getattr(cls, "attribute_map", {}))


@pytest.mark.parametrize("arch", list(CONFIG_CLASSES))
def test_audit_covers_every_hf_config_field(arch):
  cls = getattr(transformers, CONFIG_CLASSES[arch])
  known = audit.known_fields(arch)
  aliases = set(getattr(cls, "attribute_map", {}))  # hidden_size -> n_embd: never written to config.json
  missing = sorted(_hf_fields(cls) - set(known) - aliases)
  assert not missing, f"transformers {transformers.__version__} {cls.__name__} has unaudited fields {missing}"


@pytest.mark.parametrize("arch", list(CONFIG_CLASSES))
def test_default_hf_configs_pass_the_audit(arch):
  """HF's own defaults (what save_pretrained writes for a default model) are all accepted."""
  cls = getattr(transformers, CONFIG_CLASSES[arch])
  fields = audit.audit(arch, cls().to_dict())
  assert fields["vocab_size"] == audit.MAPPED


def _perturbed(model, seed: int = 1):
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for p in model.parameters():
      p.add_(torch.randn(p.shape, generator=g) * 0.05)
  return model


def test_verify_passes_on_a_good_import_and_fails_on_a_wrong_one(tmp_path):
  torch.manual_seed(0)
  hf = _perturbed(transformers.BertForMaskedLM(transformers.BertConfig(
      vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
      max_position_embeddings=32, tie_word_embeddings=False)).eval())
  src = os.path.join(str(tmp_path), "bert")
  hf.save_pretrained(src)
  imported = convert.import_hf(src)
  assert convert.verify(src, imported.architecture, imported.config, imported.params) < 1e-5
  wrong = imported.config.copy_and_resolve_references()
  wrong.model.mlp = "gelu"  # the tanh GELU instead of BERT's exact one
  assert convert.verify(src, imported.architecture, wrong, imported.params) > LIMIT


def test_cli_verify_fails_before_writing_anything(tmp_path, monkeypatch, capsys):
  torch.manual_seed(0)
  hf = _perturbed(transformers.GPT2LMHeadModel(transformers.GPT2Config(
      vocab_size=60, n_embd=32, n_layer=2, n_head=4, n_positions=32)).eval())
  src = os.path.join(str(tmp_path), "gpt2")
  hf.save_pretrained(src)
  convert.main(["--from-hf", src, "--workdir", str(tmp_path / "good"), "--verify"])
  out = capsys.readouterr().out
  assert "verify: max relative logit error" in out and "tensors: 28 mapped, 0 ignored" in out

  from tfx.convert import configs  # a converter bug: GPT-2's tanh GELU read as the exact one
  monkeypatch.setitem(configs._HF_ACT, "gelu_new", "gelu_exact")
  with pytest.raises(SystemExit, match="--verify: .* differ"):
    convert.main(["--from-hf", src, "--workdir", str(tmp_path / "bad"), "--verify"])
  assert not (tmp_path / "bad" / "checkpoints").exists()
  assert not (tmp_path / "bad" / "config.json").exists()


def test_untied_xlnet_is_refused_not_imported_wrong(tmp_path):
  """tfx's xlnet head is tied; an XLNet saved with its own lm_loss.weight fails by name."""
  torch.manual_seed(0)
  hf = _perturbed(transformers.XLNetLMHeadModel(transformers.XLNetConfig(
      vocab_size=60, d_model=32, n_layer=1, n_head=4, d_inner=64, tie_word_embeddings=False)).eval())
  src = os.path.join(str(tmp_path), "xlnet")
  hf.save_pretrained(src)
  with pytest.raises(convert.ConvertError, match="lm_loss.weight"):
    convert.from_hf(src)
