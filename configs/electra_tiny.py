"""A tiny variant of configs/electra_base.py (configs/tiny.py's shrink: 2 layers, d_model 64, 4
heads, seq 64, vocab 1000; the generator a quarter of that: d_model 16, 1 head) that trains in
seconds on CPU; tests use it.

    python -m tfx.train --config configs/electra_tiny.py --workdir runs/electra_tiny
"""

import ml_collections

from configs import electra_base, tiny


def get_config() -> ml_collections.ConfigDict:
  c = tiny.shrink(electra_base.get_config())
  c.objective.generator_size = 0.25
  return c
