"""The quickstart: a small GPT-style decoder on the Python standard library's own source.

    make quickstart
    # or: python -m tfx.train --config configs/quickstart.py --workdir runs/quickstart

About 3 minutes on 2 CPU cores: 4 layers, d_model 128, seq 128, rotary positions, a
2000-piece unigram sentencepiece model trained on the corpus, global batch 32 (4096 tokens),
400 steps (1.6 M tokens). Small and short on purpose: the point is a run you can watch end
to end, not a good model.
"""

from configs import base


def get_config():
  c = base.get_config()
  c.model.num_layers = 4
  c.model.d_model = 128
  c.model.num_heads = 4
  c.model.d_ff = 512
  c.model.position = "rotary"
  c.data.source = "stdlib"
  c.data.seq_len = 128
  c.data.vocab_size = 2000
  c.data.eval_batches = 8
  c.train.steps = 400
  c.train.batch_size = 32
  c.train.log_every = 20
  c.train.eval_every = 100
  c.train.checkpoint_every = 100
  c.optim.learning_rate = 3e-3
  c.optim.warmup_steps = 40
  c.generate.max_new_tokens = 48
  return c
