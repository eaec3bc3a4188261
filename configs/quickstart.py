"""The quickstart: a small GPT-style decoder on the Python standard library's own source.

    make quickstart
    # or: python -m tfx.train --config configs/quickstart.py --workdir runs/quickstart

About 4 minutes on 2 CPU cores. 4 layers, d_model 256, seq 128, vocab 8000 (a unigram
sentencepiece model trained on the corpus), rotary positions, global batch 16.
"""

from configs import base


def get_config():
  c = base.get_config()
  c.model.num_layers = 4
  c.model.d_model = 256
  c.model.num_heads = 4
  c.model.d_ff = 1024
  c.model.position = "rotary"
  c.data.source = "stdlib"
  c.data.seq_len = 128
  c.data.vocab_size = 8000
  c.data.eval_batches = 8
  c.train.steps = 300
  c.train.batch_size = 16
  c.train.log_every = 20
  c.train.eval_every = 100
  c.train.checkpoint_every = 100
  c.optim.learning_rate = 1e-3
  c.optim.warmup_steps = 30
  c.generate.max_new_tokens = 48
  return c
