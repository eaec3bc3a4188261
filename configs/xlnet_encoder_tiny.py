"""A tiny variant of configs/xlnet_encoder_base.py (permutation LM on an ordinary encoder) that
trains in seconds on CPU on the stdlib corpus.

    python -m tfx.train --config configs/xlnet_encoder_tiny.py --workdir runs/xlnet_encoder_tiny
"""

import ml_collections

from configs import tiny, xlnet_encoder_base


def get_config() -> ml_collections.ConfigDict:
  c = tiny.shrink(xlnet_encoder_base.get_config())
  c.objective.num_predict = 0  # round(64 / 6) = 11
  c.objective.reuse_len = 32
  c.objective.perm_size = 32
  return c
