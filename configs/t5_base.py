"""T5 v1.1 base (Raffel et al. 2020; the v1.1 recipe): 12 encoder + 12 decoder pre-norm layers,
d_model 768, 12 heads, d_ff 2048, RMSNorm, no biases, gated GELU (geglu) MLP, relative position
buckets (32, max distance 128), unscaled attention, untied output projection, no dropout in
pretraining; span corruption with 512 encoder tokens (568 raw tokens, 114 targets), vocab 32128.

    python -m tfx.train --config configs/t5_base.py --workdir runs/t5_base

Importing the released weights instead: python -m tfx.convert --from-hf DIR --workdir OUT.
"""

import ml_collections

from configs import base


def get_config() -> ml_collections.ConfigDict:
  c = base.get_config()
  m = c.model
  m.family = "encoder_decoder"
  m.num_layers = 12
  m.num_decoder_layers = 12
  m.d_model = 768
  m.num_heads = 12
  m.d_ff = 2048
  m.position = "relative"
  m.relative_buckets = 32
  m.relative_max_distance = 128
  m.norm = "pre"
  m.norm_type = "rmsnorm"
  m.norm_eps = 1e-6
  m.use_bias = False
  m.mlp = "geglu"
  m.scale_attention = False
  m.tie_embeddings = False
  m.scale_tied_logits = False
  m.dropout = 0.0
  m.attention_dropout = 0.0
  m.init_std = 1.0 / 768**0.5
  c.objective.name = "span_corruption"
  c.data.seq_len = 512
  c.data.vocab_size = 32128
  c.train.batch_size = 128
  c.optim.learning_rate = 1e-3
  c.optim.warmup_steps = 10000
  return c
