"""The encoder-decoder family: T5 (v1.0 / v1.1) and the original Vaswani Transformer.

T5 v1.1: `position=relative` (bucketed relative bias, one table per stack shared by its
layers), `norm_type=rmsnorm`, `use_bias=False`, `mlp=geglu`, `scale_attention=False`,
untied output. T5 v1.0: `mlp=relu`, tied output with `scale_tied_logits=True`.
Vaswani: `position=sinusoidal`, `norm=post`, `embed_scale=True`.

Dropout: on the embeddings, the attention probabilities (`attention_dropout`), each sublayer's
output and (`mlp_dropout`) the MLP's hidden layer; with pre-LN also on each stack's output after
its final norm (T5's). A post-LN stack (BART, Vaswani) ends at its last layer's norm, as theirs do.

The token embedding is shared by the encoder, the decoder and (when tied) the output.
Decoder blocks cross-attend to the encoder output with mask "same document, both real".
Rows of one segment each (span corruption's, UL2's: `one_segment=True`) get their masks as each
row's lengths (`ops.LengthMask`), which cuDNN reads as sequence lengths beside the [1, h, t, s]
relative bias instead of a [b, h, t, s] bias with the mask folded in.
"""

import flax.linen as nn
import jax

from tfx import ops
from tfx.models.base import Family
from tfx.nn import Embed, Stack, make_norm
from tfx.nn.layers import Dropout, take_rows
from tfx.registry import FAMILIES


@FAMILIES.register("encoder_decoder")
class EncoderDecoder(Family):
  """Sequence-to-sequence transformer.

  `__call__(encoder_tokens, encoder_segment_ids, encoder_positions, decoder_tokens,
  decoder_segment_ids, decoder_positions, *, train, decode, encoded, one_segment)` -> logits [b, t, v].
  All inputs [b, s] (encoder) / [b, t] (decoder) int; the decoder tokens are the targets
  shifted right (teacher forcing). Without decoder inputs it returns the encoder output
  [b, s, e]; passing `encoded` skips the encoder (generation: encode once, then decode step by
  step with decode=True, the self-attention KV cache in the "cache" collection; decoding
  starts at position 0 with no padding, which the relative bias relies on). `one_segment=True`
  promises rows of one segment each, real tokens first (segment ids 1 then 0, encoder and decoder
  alike): the masks are then the same function of the rows' lengths (`ops.rows_mask`).
  """

  INPUTS = ("encoder_tokens", "encoder_segment_ids", "encoder_positions",
            "decoder_tokens", "decoder_segment_ids", "decoder_positions")
  # Classification reads the encoder only and averages it: T5 itself classifies by generating the
  # label's text with the decoder; an encoder-only mean is the common alternative (Sentence-T5's
  # "mean" encoder pooling), needs no decoder step and no label verbalisation.
  POOLING = "mean"

  def sequence_hidden(self, tokens, segment_ids, positions, token_types=None, *, train: bool = False, rows=None):
    """[b, s, e] encoder output (final norm and dropout applied); the decoder is not run. At `rows`:
    gathered from the full output (the encoder's relative-position bias keeps its last layer whole)."""
    return take_rows(self(tokens, segment_ids, positions, train=train), rows)

  @nn.compact
  def __call__(self, encoder_tokens, encoder_segment_ids, encoder_positions, decoder_tokens=None,
               decoder_segment_ids=None, decoder_positions=None, *, train: bool = False, decode: bool = False,
               encoded=None, loss: ops.TokenTargets | None = None, one_segment: bool = False):
    cfg = self.cfg
    # One segment a row: the masks as the rows' lengths where the kernel reads them (cuDNN; not
    # while decoding, where a step's queries are not a row's first tokens).
    kernel = ops.attention.choose_implementation(cfg.attention, cfg.compute_dtype, cfg.head_dim)[0]
    lengths = one_segment and not decode and kernel == "cudnn"
    embed = Embed(cfg.vocab_size, cfg.d_model, init_std=cfg.init_std, dtype=cfg.compute_dtype, name="token_embed")
    if encoded is None:
      encoded = self._encode(embed, encoder_tokens, encoder_segment_ids, encoder_positions, train, lengths)
    if decoder_tokens is None:
      return encoded
    x = self.embed_inputs(embed, decoder_tokens, decoder_positions, train=train, prefix="decoder_")
    if decode:
      mask = None  # built from the KV cache
      k_positions = jax.numpy.broadcast_to(jax.numpy.arange(cfg.max_length), (x.shape[0], cfg.max_length))
    else:
      mask = ops.rows_mask(decoder_segment_ids, causal=True, lengths=lengths)  # [b, 1, t, t] or lengths
      k_positions = decoder_positions
    bias = self.relative_bias(decoder_positions, k_positions, bidirectional=False, name="decoder_relative_bias",
                              decode=decode)
    cross_mask = ops.rows_mask(decoder_segment_ids, encoder_segment_ids, lengths=lengths)  # [b, 1, t, s] or lengths
    x = Stack(cfg, cfg.decoder_layers, deterministic=not train, decode=decode, cross=True, name="decoder")(
        x, mask, decoder_positions, decoder_segment_ids, bias, encoded, cross_mask)
    if cfg.norm == "pre":
      x = make_norm(cfg, "decoder_final_norm")(x)
    x = Dropout(_final_dropout(cfg))(x, deterministic=not train)
    return self.lm_head(embed, x, loss=loss)

  def _encode(self, embed, tokens, segment_ids, positions, train, lengths=False):
    """[b, s, e]; `lengths`: the mask as the rows' lengths (`ops.rows_mask`)."""
    cfg = self.cfg
    x = self.embed_inputs(embed, tokens, positions, train=train, prefix="encoder_")
    bias = self.relative_bias(positions, positions, bidirectional=True, name="encoder_relative_bias")
    mask = ops.rows_mask(segment_ids, lengths=lengths)  # [b, 1, s, s] or lengths
    x = Stack(cfg, cfg.num_layers, deterministic=not train, name="encoder")(x, mask, positions, segment_ids, bias)
    if cfg.norm == "pre":
      x = make_norm(cfg, "encoder_final_norm")(x)
    return Dropout(_final_dropout(cfg))(x, deterministic=not train)


def _final_dropout(cfg) -> float:
  """The rate of the dropout on a stack's output: T5's after its final norm (pre-LN); none after a
  post-LN stack's last layer (BART, the Vaswani Transformer). At rate 0 the module draws nothing,
  so the other dropouts' random streams are unchanged."""
  return cfg.dropout if cfg.norm == "pre" else 0.0
