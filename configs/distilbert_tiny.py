"""A tiny variant of configs/distilbert_base.py (configs/tiny.py's shrink: 2 layers, d_model 64, 4
heads, seq 64, vocab 1000) against a random teacher of its own architecture (objective.teacher =
init), so that it runs and `tfx.check_objective` checks it without a trained teacher; point it at
a real one for anything else:

    python -m tfx.train --config configs/bert_tiny.py --workdir runs/bert_tiny
    python -m tfx.train --config configs/distilbert_tiny.py --workdir runs/distilbert_tiny \
        --config.objective.teacher=runs/bert_tiny --config.data.tokenizer=runs/bert_tiny/tokenizer.model
"""

import ml_collections

from configs import distilbert_base, tiny


def get_config() -> ml_collections.ConfigDict:
  c = tiny.shrink(distilbert_base.get_config())
  c.objective.teacher = "init"
  return c
