"""DistilBERT (Sanh et al. 2019): a 6-layer student of BERT base's width (d_model 768, 12 heads,
d_ff 3072) distilled from a trained BERT-base teacher on the soft targets at temperature 2, masked
LM and the cosine of the hidden states (weights 5 / 2 / 1), learning rate 5e-4.

    python -m tfx.train --config configs/distilbert_base.py --workdir runs/distilbert \
        --config.objective.teacher=runs/bert_base          # or hf:path/to/bert-base-uncased

The teacher is a tfx run (configs/bert_base.py) or an HF directory (hf:DIR, through
tfx.convert); the student must use the teacher's tokenizer (data.tokenizer). DistilBERT also
initialises the student from every other teacher layer and trains with batches of up to 4k
sequences; neither is done here.
"""

import ml_collections

from configs import bert_base


def get_config() -> ml_collections.ConfigDict:
  c = bert_base.get_config()
  c.model.num_layers = 6
  c.objective.name = "distillation"
  c.objective.teacher = "runs/bert_base"
  c.optim.learning_rate = 5e-4
  return c
