"""Objectives, one file each, registered by name in tfx.registry.OBJECTIVES."""

from tfx.objectives.base import Objective, SpecialIds
from tfx.objectives import causal_lm, masked_lm, permutation_lm, prefix_lm, span_corruption  # noqa: F401
