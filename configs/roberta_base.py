"""RoBERTa base (Liu et al. 2019): BERT base without token types (and without next-sentence
prediction), dynamic masking; 12 post-LN layers, d_model 768, 12 heads, d_ff 3072, exact GELU,
LayerNorm eps 1e-5 as released.

    python -m tfx.train --config configs/roberta_base.py --workdir runs/roberta_base

Importing the released weights instead: python -m tfx.convert --from-hf DIR --workdir OUT (tfx
positions 0.. are RoBERTa's positions 2..; see tfx/convert.py).
"""

import ml_collections

from configs import bert_base


def get_config() -> ml_collections.ConfigDict:
  c = bert_base.get_config()
  c.model.type_vocab_size = 0
  c.model.norm_eps = 1e-5
  c.data.vocab_size = 50265
  c.optim.learning_rate = 6e-4
  c.optim.warmup_steps = 24000
  c.optim.b2 = 0.98
  c.train.batch_size = 2048
  return c
