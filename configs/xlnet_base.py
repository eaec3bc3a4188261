"""XLNet base with the paper's pretraining settings (Yang et al. 2019; XLNet README, issue #59):
12 layers, d_model 768, 12 heads, d_ff 3072, post-LN, exact GELU, sequence 512, reuse 256,
permutation blocks of 256, memory 384, 85 predictions per row (43 + 42 over the two halves),
span sampler with alpha 6, beta 1, untied relative biases, no clamping.

    python -m tfx.train --config configs/xlnet_base.py --workdir runs/xlnet_base

Rows are XLNet's [reuse 256, A, <sep>, B, <sep>, <cls>] with token types 0/1/2, built from
contiguous text streams that advance by reuse_len (256), so the memory built from a row's first
256 positions is the text right before the next row; B continues A or (half the time) is random
text. bi_data: the second half of every batch reads the same streams backwards, with negated
relative distances. Spans start at word starts, as XLNet's sampler. See
tfx/objectives/permutation_lm.py.
"""

import ml_collections

from configs import base


def get_config() -> ml_collections.ConfigDict:
  c = base.get_config()
  c.model.family = "xlnet"
  c.model.num_layers = 12
  c.model.d_model = 768
  c.model.num_heads = 12
  c.model.d_ff = 3072
  c.model.norm = "post"
  c.model.norm_type = "layernorm"
  c.model.norm_eps = 1e-12
  c.model.mlp = "gelu_exact"
  c.model.position = "relative"
  c.model.mem_len = 384
  c.model.reuse_len = 256
  c.model.clamp_len = -1
  c.model.untie_r = True
  c.model.tie_embeddings = True
  c.model.dropout = 0.1
  c.model.attention_dropout = 0.1
  c.objective.name = "permutation_lm"
  c.objective.num_predict = 85
  c.objective.reuse_len = 256
  c.objective.perm_size = 256
  c.objective.mask_alpha = 6.0
  c.objective.mask_beta = 1.0
  c.objective.row_layout = "xlnet"
  c.objective.bi_data = True
  c.objective.word_spans = True
  c.data.seq_len = 512
  c.data.vocab_size = 32000
  c.train.batch_size = 32
  c.train.steps = 500_000
  c.optim.learning_rate = 1e-4
  c.optim.warmup_steps = 40_000
  c.optim.weight_decay = 0.01
  c.optim.b2 = 0.999
  c.optim.eps = 1e-6
  return c
