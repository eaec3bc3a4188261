"""Model families, registered by name in tfx.registry.FAMILIES."""

from tfx.models.base import POSITIONS, Family
from tfx.models import decoder, encoder, encoder_decoder, xlnet  # noqa: F401  (register the families)
from tfx.models.encoder import ClassifierHead
from tfx.models.classifier import POOLINGS, Classifier, build_classifier


def build_model(model_cfg, *, vocab_size: int, max_length: int) -> Family:
  """The registered family of `model_cfg.family`, configured."""
  from tfx.nn.layers import ModelConfig
  from tfx.registry import FAMILIES

  cls = FAMILIES.get(model_cfg.family)
  return cls(ModelConfig.from_config(model_cfg, vocab_size=vocab_size, max_length=max_length))
