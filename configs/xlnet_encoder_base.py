"""The ablation XLNet's paper could not isolate: XLNet's permutation LM (same row layout, span
sampler, 85 predictions, bi_data) on an ordinary BERT-base encoder, with absolute learned
positions and no memory instead of Transformer-XL relative attention with memory. Compare it
with configs/xlnet_base.py (the same objective on the XLNet architecture) and
configs/bert_base.py (the same architecture with masked LM).

    python -m tfx.train --config configs/xlnet_encoder_base.py --workdir runs/xlnet_encoder_base
    # rotary positions instead of learned ones:
    python -m tfx.train --config configs/xlnet_encoder_base.py --workdir runs/xlnet_encoder_rope \\
        --config.model.position=rotary

The encoder runs both streams with shared weights (`Encoder.two_stream`): the content stream is
the usual encoder under the content mask; the query stream starts from a learned mask
embedding plus the target's position, attends the content stream's keys under the query mask,
and feeds the MLM head at the prediction slots only. Token types are the layout's 0/1/2.
"""

import ml_collections

from configs import bert_base, xlnet_base


def get_config() -> ml_collections.ConfigDict:
  c = xlnet_base.get_config()
  encoder = bert_base.get_config().model
  encoder.type_vocab_size = 3  # reuse+A / B / CLS
  c.model = encoder
  c.model.mem_len = 0
  return c
