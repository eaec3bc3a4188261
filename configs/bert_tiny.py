"""A tiny bert variant of configs/bert_base.py (2 layers, d_model 64, 4 heads, seq 64, vocab 1000)
that trains in seconds on CPU on the stdlib corpus; smoke runs and tests use it.

    python -m tfx.train --config configs/bert_tiny.py --workdir runs/bert_tiny
"""

import ml_collections

from configs import bert_base


def get_config() -> ml_collections.ConfigDict:
  c = bert_base.get_config()
  c.model.num_layers = 2
  c.model.num_heads = 4
  c.model.d_model = 64
  c.model.d_ff = 128
  c.model.dropout = 0.0
  c.model.attention_dropout = 0.0
  c.model.init_std = 0.02
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
  c.optim.b2 = 0.95
  c.optim.eps = 1e-8
  return c
