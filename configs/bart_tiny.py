"""A tiny variant of configs/bart_base.py (2 + 2 layers, d_model 64, 4 heads, seq 64, vocab 1000)
that trains in seconds on CPU on the stdlib corpus; smoke runs and tests use it. Raw, encoder and
decoder rows are all 64 tokens; lines are the sentences that are shuffled.

    python -m tfx.train --config configs/bart_tiny.py --workdir runs/bart_tiny
"""

import ml_collections

from configs import bart_base, tiny


def get_config() -> ml_collections.ConfigDict:
  return tiny.shrink(bart_base.get_config())
