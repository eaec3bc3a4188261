"""A tiny variant of configs/roberta_base.py (2 layers, d_model 64, 4 heads, seq 64, vocab 1000)
that trains in seconds on CPU on the stdlib corpus; smoke runs and tests use it.

    python -m tfx.train --config configs/roberta_tiny.py --workdir runs/roberta_tiny
"""

import ml_collections

from configs import roberta_base, tiny


def get_config() -> ml_collections.ConfigDict:
  return tiny.shrink(roberta_base.get_config())
