"""A tiny decoder that trains in seconds on CPU; tests and smoke runs use it.

    python -m tfx.train --config configs/tiny.py --workdir runs/tiny

`shrink(config)` makes the same tiny, seconds-long version of any config (bert_tiny.py,
roberta_tiny.py and t5_tiny.py are `shrink` of their base configs).
"""

import ml_collections

from configs import base


def shrink(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """2 layers (per stack), d_model 64, 4 heads, seq 64, vocab 1000, 120 stdlib files, 30 steps."""
  c.model.num_layers = 2
  c.model.num_decoder_layers = 0  # encoder-decoder: as many decoder layers as encoder layers
  c.model.d_model = 64
  c.model.num_heads = 4
  c.model.d_ff = 128
  c.model.dropout = 0.0
  c.model.attention_dropout = 0.0
  c.data.seq_len = 64
  c.data.vocab_size = 1000
  c.data.max_documents = 120
  c.data.eval_batches = 2
  c.train.steps = 30
  c.train.batch_size = 8
  c.train.log_every = 5
  c.train.eval_every = 15
  c.train.checkpoint_every = 15
  c.optim.learning_rate = 3e-3
  c.optim.warmup_steps = 5
  return c


def get_config() -> ml_collections.ConfigDict:
  return shrink(base.get_config())
