"""A tiny variant of configs/nsp_base.py (configs/tiny.py's shrink: 2 layers, d_model 64, 4
heads, seq 64, vocab 1000) that trains in seconds on CPU; tests use it.

    python -m tfx.train --config configs/nsp_tiny.py --workdir runs/nsp_tiny
"""

import ml_collections

from configs import nsp_base, tiny


def get_config() -> ml_collections.ConfigDict:
  return tiny.shrink(nsp_base.get_config())
