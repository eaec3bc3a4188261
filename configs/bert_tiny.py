"""A tiny variant of configs/bert_base.py (2 layers, d_model 64, 4 heads, seq 64, vocab 1000)
that trains in seconds on CPU on the stdlib corpus; smoke runs and tests use it.

    python -m tfx.train --config configs/bert_tiny.py --workdir runs/bert_tiny
"""

import ml_collections

from configs import bert_base, tiny


def get_config() -> ml_collections.ConfigDict:
  return tiny.shrink(bert_base.get_config())
