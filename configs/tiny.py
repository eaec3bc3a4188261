"""A tiny decoder that trains in seconds on CPU; tests and smoke runs use it.

    python -m tfx.train --config configs/tiny.py --workdir runs/tiny
"""

from configs import base


def get_config():
  c = base.get_config()
  c.model.num_layers = 2
  c.model.d_model = 64
  c.model.num_heads = 4
  c.model.d_ff = 128
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
