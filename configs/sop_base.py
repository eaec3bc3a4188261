"""ALBERT's sentence-order prediction (Lan et al. 2020) beside masked LM, on the BERT-base
encoder of configs/bert_base.py (ALBERT's factorized embeddings and cross-layer sharing are not
modelled: this isolates the objective): `[CLS] A [SEP] B [SEP]` rows of 512 tokens whose two
consecutive segments are swapped half of the time.

    python -m tfx.train --config configs/sop_base.py --workdir runs/sop_base
"""

import ml_collections

from configs import bert_base


def get_config() -> ml_collections.ConfigDict:
  c = bert_base.get_config()
  c.objective.name = "sop"
  return c
