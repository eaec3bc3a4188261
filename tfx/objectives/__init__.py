"""Objectives, one file each, registered by name in tfx.registry.OBJECTIVES (or loaded from
`path/to/file.py:Class` outside the package). An objective's dataclass fields are its config."""

from tfx.objectives.base import (OBJECTIVE_PARAMS, Objective, Predictions, SpecialIds, add_metrics, causal_visible,
                                  count_of, flat_positions, mean_metrics, model_params, placeholder_ids, split_params,
                                  spread_rows)
from tfx.objectives.options import Option, internal
from tfx.objectives import (causal_lm, distillation, electra, masked_lm, permutation_lm, prefix_lm, sentence_prediction,  # noqa: F401
                            span_corruption, text_infilling, ul2)

__all__ = ["OBJECTIVE_PARAMS", "Objective", "Option", "Predictions", "SpecialIds", "add_metrics", "causal_visible",
           "count_of", "flat_positions", "internal", "mean_metrics", "model_params", "placeholder_ids", "split_params",
           "spread_rows"]
