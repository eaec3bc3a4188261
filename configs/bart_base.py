"""BART base (Lewis et al. 2019): 6 encoder + 6 decoder post-LN layers, d_model 768, 12 heads,
d_ff 3072, exact GELU, biases, learned absolute positions, a LayerNorm on the embeddings of each
stack (BART's layernorm_embedding), LayerNorm eps 1e-5, embeddings shared by encoder, decoder and
output, dropout 0.1; pretrained with text infilling (30% of each document in Poisson(3) spans, one
<mask> per span, 10% of them a random token) and sentence permutation, vocab 50265.

    python -m tfx.train --config configs/bart_base.py --workdir runs/bart_base

Where it differs from the released model:
- Positions are a table of data.seq_len rows from 0 (BART: 1024 positions stored from offset 2).
- No final_logits_bias (BART's is a buffer of zeros that training never changes).
- Sentences are lines: objective.sentence_end_ids = 7, the newline piece of tfx's own SentencePiece
  tokenizer (pad, eos, unk, bos, <mask>, <cls>, <sep>, then "\\n"), which suits the default stdlib
  corpus. BART split at full stops of the GPT-2 BPE: for prose, or with another tokenizer
  (data.tokenizer), set the id(s) of its '.' / newline pieces (--config.objective.sentence_end_ids=ID,ID).
- Masking is at token level, not whole words (see tfx/objectives/text_infilling.py for the rest).
- The paper gives no base-size optimisation settings; these (RoBERTa's Adam moments, 512 tokens)
  are ours. BART-large trained on batches of 8000 for 500k steps.
"""

import ml_collections

from configs import base


def get_config() -> ml_collections.ConfigDict:
  c = base.get_config()
  m = c.model
  m.family = "encoder_decoder"
  m.num_layers = 6
  m.num_decoder_layers = 6
  m.d_model = 768
  m.num_heads = 12
  m.d_ff = 3072
  m.position = "learned"
  m.norm = "post"
  m.norm_type = "layernorm"
  m.norm_eps = 1e-5
  m.embed_norm = True
  m.embed_scale = False
  m.mlp = "gelu_exact"
  m.use_bias = True
  m.tie_embeddings = True
  m.scale_tied_logits = False
  m.dropout = 0.1
  m.attention_dropout = 0.1
  c.objective.name = "text_infilling"
  c.objective.mask_ratio = 0.3
  c.objective.poisson_lambda = 3.0
  c.objective.random_ratio = 0.1
  c.objective.permute_sentences = True
  c.objective.sentence_end_ids = "7"
  c.data.seq_len = 512
  c.data.vocab_size = 50265
  c.train.batch_size = 256
  c.optim.learning_rate = 4e-4
  c.optim.warmup_steps = 10000
  c.optim.b2 = 0.98
  c.optim.eps = 1e-6
  return c
