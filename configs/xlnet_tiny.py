"""A tiny variant of configs/xlnet_base.py (2 layers, d_model 64, 4 heads, seq 64, vocab 1000,
reuse/perm 32, 11 predictions per row) that trains in seconds on CPU on the stdlib corpus.

    python -m tfx.train --config configs/xlnet_tiny.py --workdir runs/xlnet_tiny
"""

import ml_collections

from configs import tiny, xlnet_base


def get_config() -> ml_collections.ConfigDict:
  c = tiny.shrink(xlnet_base.get_config())
  c.model.mem_len = 48
  c.model.reuse_len = 32
  c.objective.num_predict = 0  # round(64 / 6) = 11
  c.objective.reuse_len = 32
  c.objective.perm_size = 32
  return c
