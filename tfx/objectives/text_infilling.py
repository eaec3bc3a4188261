"""BART text infilling with sentence permutation (Lewis et al. 2019, §2.2), OBJECTIVES.md §3.2.

Each document of the packed row (segment_ids: 0 = padding) is corrupted on its own. Its last token
(EOS, or the row's cut) is never masked and stays last; the tokens before it are its body of n
tokens, of which m = ceil(mask_ratio·n) are masked. Span lengths are Poisson(λ) draws taken in order
until they reach m, the last one cut at the budget. Spans and the n - m unmasked tokens are
interleaved in a uniformly random order; each span becomes ONE encoder token: `ids.mask` (or, with
probability random_ratio, a random ordinary id). A zero-length span is an inserted mask. Then the
sentences of the corrupted document (a sentence ends after an unmasked token whose id is in
`sentence_end_ids`) are shuffled, the last token kept last. With '.' a sentence end:

    raw          a b c . d e f g . h i EOS        n = 11, m = ceil(3.3) = 4
    draws        3 0 2 ...                        spans 3 0 1 (the last cut at the budget)
    items        a [b c .] d [] e f g . [h] i     7 kept tokens, 3 spans in a random order
    corrupted    a M d M e f g . M i EOS          the masked '.' ends no sentence
    encoder      M i a M d M e f g . EOS          sentences [a M d M e f g .] [M i] shuffled
    decoder in   EOS a b c . d e f g . h i        targets shifted right, EOS as the start id
    targets      a b c . d e f g . h i EOS        the original text, every token predicted

Choices, and where they differ from fairseq's `DenoisingDataset`:
- Masking comes before the shuffle, so a sentence is cut only at tokens the encoder shows: the
  order reveals nothing about masked tokens (fairseq shuffles first, so a masked full stop still
  splits sentences), and every span is contiguous in the original text.
- Spans are placed without overlap (fairseq starts them at random word starts and lets them merge,
  masking less than the budget), at token level (fairseq: whole words), and zero-length spans are
  inserted where they fall (fairseq: at separate random places).
- At most m spans per document: if the first m draws do not reach the budget (zeros, tiny
  documents) the m-th span takes the rest. So the encoder never holds more tokens than the document
  and all shapes are static: raw_length = seq_len = encoder length = decoder length.
- Decoder start id = `ids.eos` (fairseq BART's prev_output_tokens start with </s>). No BOS is added.
- Segment ids are the raw row's on both sides, so self- and cross-attention stay in a document.
"""

import dataclasses
import fractions

import jax
import jax.numpy as jnp
import numpy as np

from tfx import flops, ops
from tfx.objectives.base import Objective, Predictions, SpecialIds
from tfx.objectives.causal_lm import shift_right_by_segment
from tfx.registry import OBJECTIVES


# ----------------------------------------------------------------------------- documents (device)


def document_bounds(segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
  """([b, t], [b, t]) int32: row positions of the first and last token of each position's segment
  (a run of padding counts as a segment)."""
  t = segment_ids.shape[1]
  index = jnp.arange(t, dtype=jnp.int32)[None, :]
  prev = jnp.pad(segment_ids[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
  nxt = jnp.pad(segment_ids[:, 1:], ((0, 0), (0, 1)), constant_values=-1)
  start = jax.lax.cummax(jnp.where(segment_ids != prev, index, 0), axis=1)  # [b, t]
  end = jax.lax.cummin(jnp.where(segment_ids != nxt, index, t - 1), axis=1, reverse=True)  # [b, t]
  return start, end


def cumsum_within(x: jax.Array, start: jax.Array) -> jax.Array:
  """[b, t] inclusive cumulative sum of x, restarted at each document start."""
  total = jnp.cumsum(x, axis=1)
  return total - jnp.take_along_axis(total - x, start, axis=1)


def per_document(x: jax.Array, start: jax.Array, end: jax.Array) -> jax.Array:
  """[b, t]: the sum of x over each position's document."""
  return jnp.take_along_axis(cumsum_within(x, start), end, axis=1)


def mask_budget(body: jax.Array, mask_ratio: float) -> jax.Array:
  """[b, t] int32 ceil(mask_ratio · body) in integer arithmetic (0.3 · 10 = 3 exactly); mask_ratio is
  taken as the nearest fraction with denominator <= 1000."""
  f = fractions.Fraction(mask_ratio).limit_denominator(1000)
  return (body * f.numerator + f.denominator - 1) // f.denominator


def span_lengths(draws: jax.Array, start: jax.Array, end: jax.Array, budget: jax.Array
                 ) -> tuple[jax.Array, jax.Array]:
  """Each document's span lengths from its own draws, which sit at its positions start + k.

  Args:
    draws: [b, t] int Poisson draws; start, end: `document_bounds`; budget: [b, t] tokens to mask.
  Returns:
    (lengths, num_spans) [b, t] int32: at position start + k the length of span k (0 = an insertion)
    for k < num_spans, else 0; the spans sum to the budget: draws are taken until they reach it
    (the last one cut), at most `budget` of them (the last then takes what is left).
  """
  rank = jnp.arange(draws.shape[1])[None, :] - start
  used = rank < budget  # [b, t]
  total = cumsum_within(jnp.where(used, draws, 0), start)  # [b, t], draws 0..k
  short = used & (total < budget)  # a prefix of each document: the draws before the budget is reached
  num_spans = jnp.minimum(budget, per_document(short.astype(jnp.int32), start, end) + 1)  # [b, t]
  lengths = jnp.where(rank < num_spans - 1, draws, budget - (total - draws))
  return jnp.where(rank < num_spans, lengths, 0).astype(jnp.int32), num_spans


def random_subset(u: jax.Array, start: jax.Array, valid: jax.Array, count: jax.Array) -> jax.Array:
  """bool [b, t]: in each document, the `count` [b, t] of its `valid` positions with the smallest u
  (a uniformly random subset for uniform u)."""
  b, t = u.shape
  index = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  # Sorting by document first keeps each document's block in place: sorted position q has rank q - start.
  *_, order = jax.lax.sort((start, (~valid).astype(jnp.int32), u, index), num_keys=3)  # [b, t]
  rank = jnp.zeros((b, t), jnp.int32).at[jnp.arange(b)[:, None], order].set(index - start)
  return valid & (rank < count)


def sentence_order(rng: jax.Array, segment_ids: jax.Array, boundary: jax.Array, last: jax.Array) -> jax.Array:
  """[b, s] int32 gather index that shuffles the sentences of each document of a compact row.

  A sentence ends after a `boundary` token; a document's `last` token stays last; documents and
  padding (segment 0, at the end) stay in place, and each sentence keeps its token order.
  """
  b, s = segment_ids.shape
  index = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  real = segment_ids > 0
  doc_start = segment_ids != jnp.pad(segment_ids[:, :-1], ((0, 0), (1, 0)), constant_values=-1)  # [b, s]
  after_boundary = jnp.pad(boundary[:, :-1], ((0, 0), (1, 0))) & ~doc_start
  sentence = jnp.cumsum(real & (doc_start | after_boundary), axis=1) - 1  # [b, s]
  key = jnp.take_along_axis(jax.random.uniform(rng, (b, s)), jnp.maximum(sentence, 0), axis=1)  # [b, s]
  doc = jnp.where(real, jax.lax.cummax(jnp.where(doc_start, index, 0), axis=1), s)  # [b, s]
  *_, order = jax.lax.sort((doc, last.astype(jnp.int32), key, index), num_keys=4)
  return order


def infill(tokens: jax.Array, segment_ids: jax.Array, rng: jax.Array, *, ids: SpecialIds,
           mask_ratio: float = 0.3, poisson_lambda: float = 3.0, random_ratio: float = 0.0,
           sentence_ends: tuple[int, ...] = (), permute: bool = True) -> dict[str, jax.Array]:
  """BART's encoder input for raw rows [b, t] (segment 0 = padding, dropped).

  Returns a dict of [b, t] arrays:
    encoder_tokens, encoder_segment_ids, encoder_positions: the encoder row (padded with `ids.pad`,
      segment 0, position 0); encoder_source: the raw position an encoder token shows, -1 for spans.
    masked: bool, raw tokens inside a span. is_span, item_length, num_spans (per raw position,
      before the shuffle): document item j (at raw position start + j) is a span of item_length
      tokens or a kept token (item_length 1); items past the document's item count have length 0.
  """
  b, t = tokens.shape
  rows, index = jnp.arange(b)[:, None], jnp.arange(t, dtype=jnp.int32)[None, :]
  real = segment_ids > 0
  start, end = document_bounds(segment_ids)
  rank = index - start  # [b, t]
  body = jnp.where(real, end - start, 0)  # [b, t], tokens before the document's last one
  budget = mask_budget(body, mask_ratio)
  draw_rng, place_rng, random_rng, id_rng, order_rng = jax.random.split(rng, 5)
  draws = jax.random.poisson(draw_rng, poisson_lambda, (b, t)).astype(jnp.int32)
  lengths, num_spans = span_lengths(draws, start, end, budget)

  item = real & (rank < body - budget + num_spans)  # [b, t], item slot j at position start + j
  is_span = random_subset(jax.random.uniform(place_rng, (b, t)), start, item, num_spans)
  span_index = cumsum_within(is_span.astype(jnp.int32), start) - 1
  span_length = jnp.take_along_axis(lengths, jnp.clip(start + span_index, 0, t - 1), axis=1)
  item_length = jnp.where(is_span, span_length, item.astype(jnp.int32))  # [b, t]
  first = start + cumsum_within(item_length, start) - item_length  # [b, t], raw position of the item's first token
  covered = is_span & (item_length > 0)
  edges = jnp.zeros((b, t + 1), jnp.int32).at[rows, jnp.where(covered, first, t)].add(1)
  edges = edges.at[rows, jnp.where(covered, first + item_length, t)].add(-1)
  masked = jnp.cumsum(edges[:, :t], axis=1) > 0  # [b, t]

  ordinary = np.setdiff1d(np.arange(ids.vocab_size), _special_ids(ids)).astype(np.int32)
  random_id = jnp.asarray(ordinary)[jax.random.randint(id_rng, (b, t), 0, len(ordinary))]
  span_token = jnp.where(jax.random.uniform(random_rng, (b, t)) < random_ratio, random_id, ids.mask)
  kept = item & ~is_span
  last = real & (index == end)
  first = jnp.clip(first, 0, t - 1)
  token = jnp.where(last, tokens, jnp.where(is_span, span_token, jnp.take_along_axis(tokens, first, axis=1)))
  source = jnp.where(last, index, jnp.where(kept, first, -1))
  ends = jnp.asarray(sentence_ends or (-1,), jnp.int32)
  boundary = kept & jnp.isin(token, ends)
  emit = item | last  # the encoder holds each document's items, then its last token
  out = jnp.where(emit, jnp.cumsum(emit, axis=1) - 1, t)  # [b, t], out of range = dropped

  def compact(x, fill):
    return jnp.full((b, t), fill, x.dtype).at[rows, out].set(x, mode="drop")

  enc = {"encoder_tokens": compact(token, ids.pad), "encoder_segment_ids": compact(segment_ids, 0),
         "encoder_source": compact(source, -1)}
  if permute:
    order = sentence_order(order_rng, enc["encoder_segment_ids"], compact(boundary, False), compact(last, False))
    enc = {k: jnp.take_along_axis(v, order, axis=1) for k, v in enc.items()}
  enc_start, _ = document_bounds(enc["encoder_segment_ids"])
  enc["encoder_positions"] = jnp.where(enc["encoder_segment_ids"] > 0, index - enc_start, 0)
  return {**enc, "masked": masked, "is_span": is_span, "item_length": item_length, "num_spans": num_spans}


def _special_ids(ids: SpecialIds) -> list[int]:
  named = (ids.pad, ids.eos, ids.bos, ids.unk, ids.mask, ids.cls, ids.sep)
  return sorted({i for i in (*ids.special, *ids.sentinels, *named) if i is not None})


def spread_rows(within_row: jax.Array) -> jax.Array:
  """[b, n, t] -> [b, n, b * t]: a per-row visibility over flat raw positions (other rows hidden)."""
  b, n, t = within_row.shape
  eye = jnp.eye(b, dtype=bool)[:, None, :, None]  # [b, 1, b, 1]
  return (eye & within_row[:, :, None, :]).reshape(b, n, b * t)


@OBJECTIVES.register("text_infilling")
@dataclasses.dataclass(frozen=True)
class TextInfilling(Objective):
  """BART denoising: text infilling (Poisson spans, one mask each) and sentence permutation.

  The encoder reads the corrupted documents, the decoder reconstructs the original row with teacher
  forcing; loss = mean CE over every real raw token. Raw, encoder and decoder rows are seq_len long.
  """

  # Share of each document's tokens (its last token excepted) covered by masked spans (BART: 0.3).
  mask_ratio: float = 0.3
  # Mean of the Poisson distribution of span lengths (BART paper: 3; its released recipe: 3.5).
  poisson_lambda: float = 3.0
  # Share of spans (insertions included) shown as a random ordinary token instead of the mask (BART: 0.1).
  random_ratio: float = 0.1
  # Shuffle the sentences of each document in the encoder input (BART: on).
  permute_sentences: bool = True
  # Comma-separated token ids that end a sentence (e.g. the tokenizer's '.' or newline); '' = one sentence per document.
  sentence_end_ids: str = ""

  families = ("encoder_decoder",)

  def __post_init__(self):
    if not 0.0 < self.mask_ratio <= 1.0:
      raise ValueError(f"objective.mask_ratio must be in (0, 1], got {self.mask_ratio}")
    if self.poisson_lambda <= 0.0:
      raise ValueError(f"objective.poisson_lambda must be > 0, got {self.poisson_lambda}")
    if not 0.0 <= self.random_ratio <= 1.0:
      raise ValueError(f"objective.random_ratio must be in [0, 1], got {self.random_ratio}")
    if self.ids.mask is None:
      raise ValueError("objective 'text_infilling' needs a mask token, and the tokenizer has none; use tfx's own "
                       "SentencePiece tokenizer (data.tokenizer='') or one with a <mask> token")
    bad = [i for i in self.sentence_ends if not 0 <= i < self.ids.vocab_size]
    if bad:
      raise ValueError(f"objective.sentence_end_ids: {bad} outside the vocabulary of {self.ids.vocab_size}")

  @property
  def sentence_ends(self) -> tuple[int, ...]:
    try:
      return tuple(int(x) for x in self.sentence_end_ids.replace(" ", "").split(",") if x)
    except ValueError:
      raise ValueError(f"objective.sentence_end_ids={self.sentence_end_ids!r}: expected comma-separated token "
                       "ids, e.g. '7' or '13,4'") from None

  def train_flops_per_row(self, model_cfg, seq_len: int) -> float:
    """Encoder and decoder both over seq_len positions."""
    return 3 * flops.seq2seq_forward_flops(model_cfg, seq_len, seq_len)

  def inputs(self, batch: dict[str, jax.Array], rng: jax.Array) -> dict[str, jax.Array]:
    """The model's inputs, the targets and weights, and what each target may see (loss and
    predictions both build on this): `infill`'s outputs plus [b, t] decoder_tokens,
    decoder_segment_ids, decoder_positions, targets, weights and bool kept (real and not masked)."""
    segment_ids = batch["segment_ids"]
    real = segment_ids > 0
    tokens = jnp.where(real, batch["tokens"], self.ids.pad)  # [b, t], padding never reaches the model
    x = infill(tokens, segment_ids, rng, ids=self.ids, mask_ratio=self.mask_ratio, poisson_lambda=self.poisson_lambda,
               random_ratio=self.random_ratio, sentence_ends=self.sentence_ends, permute=self.permute_sentences)
    start, _ = document_bounds(segment_ids)
    x["decoder_tokens"] = shift_right_by_segment(tokens, segment_ids, self.ids.eos)  # [b, t]
    x["decoder_segment_ids"] = segment_ids
    x["decoder_positions"] = jnp.where(real, jnp.arange(tokens.shape[1])[None, :] - start, 0)
    x["targets"] = tokens
    x["weights"] = real.astype(jnp.float32)
    x["kept"] = real & ~x["masked"]
    return x

  def _logits(self, model, params, x, rng, train, loss=None):
    """[b, t, v] logits, or with `loss` the token loss and its metrics."""
    return model.apply(
        {"params": params}, x["encoder_tokens"], x["encoder_segment_ids"], x["encoder_positions"],
        x["decoder_tokens"], x["decoder_segment_ids"], x["decoder_positions"],
        train=train, rngs={"dropout": rng}, loss=loss)  # [b, t, v]

  def loss(self, model, params, batch, rng, *, train):
    corrupt_rng, dropout_rng = jax.random.split(rng)
    x = self.inputs(batch, corrupt_rng)
    return self._logits(model, params, x, dropout_rng, train, self.token_targets(x["targets"], x["weights"]))

  def predictions(self, model, params, batch, rng):
    """Target j sees the kept tokens of its document (the encoder, itself included when kept) and
    the document's tokens before it (the decoder); masked tokens at or after j are hidden."""
    corrupt_rng, dropout_rng = jax.random.split(rng)
    x = self.inputs(batch, corrupt_rng)
    logits = self._logits(model, params, x, dropout_rng, False)
    segment_ids = batch["segment_ids"]
    b, t = segment_ids.shape
    real = segment_ids > 0
    index = jnp.arange(t)
    same_doc = (segment_ids[:, :, None] == segment_ids[:, None, :]) & real[:, None, :]  # [b, t (target), t (raw)]
    earlier = (index[:, None] > index[None, :])[None]  # [1, t, t]
    visible = spread_rows(same_doc & (x["kept"][:, None, :] | earlier))  # [b, t, b * t]
    source = jnp.where(real, jnp.arange(b)[:, None] * t + index[None, :], -1)
    return Predictions(logits=logits, targets=x["targets"], weights=x["weights"], source=source,
                       sees_self=x["kept"], visible=visible)
