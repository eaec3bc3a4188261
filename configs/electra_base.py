"""ELECTRA base (Clark et al. 2020): the discriminator is BERT base (configs/bert_base.py: 12
post-LN layers, d_model 768, 12 heads, d_ff 3072, 512 tokens), the generator a third of its width
(d_model 256, 4 heads, d_ff 1024, 12 layers) sharing its embeddings; 15% of tokens selected (85%
shown as [MASK] to the generator, 15% kept), λ = 50, batch 256, learning rate 2e-4, 10k warmup
steps, Adam eps 1e-6, weight decay 0.01.

    python -m tfx.train --config configs/electra_base.py --workdir runs/electra_base

The run's model is the discriminator: `python -m tfx.convert --workdir runs/electra_base --to-hf
DIR` and `tfx.finetune` use it; the generator stays in the checkpoints.
"""

import ml_collections

from configs import bert_base


def get_config() -> ml_collections.ConfigDict:
  c = bert_base.get_config()
  c.objective.name = "electra"
  c.objective.generator_size = 1 / 3
  c.optim.learning_rate = 2e-4
  c.optim.weight_decay = 0.01
  return c
