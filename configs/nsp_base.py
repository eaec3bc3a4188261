"""BERT base with its original pretraining objective (Devlin et al. 2019): masked LM plus
next-sentence prediction on `[CLS] A [SEP] B [SEP]` rows of 512 tokens (B is another row's text
half of the time), the pooler + 2-way classifier on the first token; the model of
configs/bert_base.py.

    python -m tfx.train --config configs/nsp_base.py --workdir runs/nsp_base
"""

import ml_collections

from configs import bert_base


def get_config() -> ml_collections.ConfigDict:
  c = bert_base.get_config()
  c.objective.name = "nsp"
  return c
