"""Objectives, one file each, registered by name in tfx.registry.OBJECTIVES (or loaded from
`path/to/file.py:Class` outside the package). An objective's dataclass fields are its config."""

from tfx.objectives.base import (Objective, Predictions, SpecialIds, causal_visible, flat_positions, placeholder_ids,
                                  spread_rows)
from tfx.objectives.options import Option, internal
from tfx.objectives import causal_lm, masked_lm, permutation_lm, prefix_lm, span_corruption, text_infilling, ul2  # noqa: F401

__all__ = ["Objective", "Option", "Predictions", "SpecialIds", "causal_visible", "flat_positions", "internal",
           "placeholder_ids", "spread_rows"]
