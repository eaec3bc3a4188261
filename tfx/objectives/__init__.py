"""Objectives, one file each, registered by name in tfx.registry.OBJECTIVES."""

from tfx.objectives.base import Objective, SpecialIds
from tfx.objectives import causal_lm  # noqa: F401  (registers 'causal_lm')
