"""BERT base (Devlin et al. 2019): 12 post-LN layers, d_model 768, 12 heads, d_ff 3072, learned
positions (512), token types (2), LayerNorm on the embeddings, exact GELU, LayerNorm eps 1e-12,
tied MLM head with an output bias; dropout 0.1 on the embeddings, the attention probabilities and
each sublayer's output (none on the MLP's hidden layer); trained with masked language modelling.

    python -m tfx.train --config configs/bert_base.py --workdir runs/bert_base

Importing the released weights instead: python -m tfx.convert --from-hf DIR --workdir OUT.
"""

import ml_collections

from configs import base


def get_config() -> ml_collections.ConfigDict:
  c = base.get_config()
  m = c.model
  m.family = "encoder"
  m.num_layers = 12
  m.d_model = 768
  m.num_heads = 12
  m.d_ff = 3072
  m.position = "learned"
  m.norm = "post"
  m.norm_type = "layernorm"
  m.norm_eps = 1e-12
  m.embed_norm = True
  m.type_vocab_size = 2
  m.mlp = "gelu_exact"
  m.use_bias = True
  m.tie_embeddings = True
  m.dropout = 0.1
  m.attention_dropout = 0.1
  m.mlp_dropout = 0.0  # BERT drops the MLP's output, not its hidden layer
  c.objective.name = "masked_lm"
  c.data.seq_len = 512
  c.data.vocab_size = 30522
  c.train.batch_size = 256
  c.optim.learning_rate = 1e-4
  c.optim.warmup_steps = 10000
  c.optim.b2 = 0.999
  c.optim.eps = 1e-6
  return c
