"""A tiny variant of configs/sop_base.py (configs/tiny.py's shrink: 2 layers, d_model 64, 4
heads, seq 64, vocab 1000) that trains in seconds on CPU; tests use it.

    python -m tfx.train --config configs/sop_tiny.py --workdir runs/sop_tiny
"""

import ml_collections

from configs import sop_base, tiny


def get_config() -> ml_collections.ConfigDict:
  return tiny.shrink(sop_base.get_config())
