"""A tiny variant of configs/ul2_base.py (2 layers, d_model 64, 4 heads, seq 64, vocab 1000) that
trains in seconds on CPU on the stdlib corpus; smoke runs and tests use it. 64 encoder tokens:
69 raw tokens per row, 46 decoder tokens.

    python -m tfx.train --config configs/ul2_tiny.py --workdir runs/ul2_tiny

The decoder-only form: add --config.model.family=decoder --config.objective.layout=decoder
--config.model.position=rotary.
"""

import ml_collections

from configs import tiny, ul2_base


def get_config() -> ml_collections.ConfigDict:
  return tiny.shrink(ul2_base.get_config())
