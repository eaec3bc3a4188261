"""UL2 (Tay et al. 2022) on a T5 v1.1 base encoder-decoder: the model of configs/t5_base.py (12 + 12
pre-norm layers, d_model 768, 12 heads, d_ff 2048, RMSNorm, no biases, geglu, relative position
buckets, untied output, no dropout), trained with UL2's mixture of denoisers instead of span
corruption: R (mean span 3 and 8, 15% noise), X (3 and 8 at 50%, 64 at 15% and 50%) and S (prefix
LM) with S on 20% of the rows, each row's encoder input starting with its mode token [R] / [X] / [S]
(the top three sentinels, see tfx/objectives/ul2.py). 512 encoder tokens: 567 raw tokens per row,
380 decoder tokens (the longest target, X with mean span 3 at 50%); vocab 32128.

    python -m tfx.train --config configs/ul2_base.py --workdir runs/ul2_base

A decoder-only UL2 (prefix-LM layout) instead: --config.model.family=decoder
--config.objective.layout=decoder --config.model.position=rotary.
"""

import ml_collections

from configs import t5_base


def get_config() -> ml_collections.ConfigDict:
  c = t5_base.get_config()
  c.objective.name = "ul2"
  c.objective.layout = "encoder_decoder"
  return c
