"""Masked language modelling (BERT/RoBERTa), OBJECTIVES.md §2.

Dynamic masking as in RoBERTa and HF `DataCollatorForLanguageModeling`: every step draws a
fresh mask from the step's rng, on device.

- Selection: each eligible token (real, i.e. segment > 0, and not a special id) is selected
  independently with probability `mask_rate` (Bernoulli, not a fixed count).
- Of the selected tokens, each independently becomes `[MASK]` with probability
  `mask_token_rate`, a uniformly random **ordinary** token (never a special id, as fairseq)
  with probability `random_token_rate`, and is kept otherwise.
- At most `max_predictions` tokens of a row are selected (BERT's `max_predictions_per_seq`):
  beyond it, the selected tokens with the largest draws are left unselected (whole words with
  whole-word masking). By default the cap is the mean + 4 standard deviations of the row's
  Binomial(seq_len, mask_rate) count, rounded up to a multiple of 8 (`prediction_slots`): it
  binds in about 3 rows in 100,000.
- Whole-word masking (`whole_word=True`): words are selected all-or-none with probability
  `mask_rate`; the 80/10/10 replacement is then decided **per token**, as in BERT's
  `create_masked_lm_predictions` and HF's whole-word collator. A word is a word-start token
  followed by the non-start tokens after it in the same document; special tokens and
  padding are words of their own (and never selected). Which pieces start a word comes from
  the tokenizer (`Tokenizer.word_start_mask()`), attached with `with_word_start`.

    tokens    a  b  c  d  e  | pad
    selected  0  1  0  0  1  |  0
    inputs    a  M  c  d  r  | pad      (M = [MASK], r = random ordinary token)
    targets   a  b  c  d  e  | pad
    weights   0  1  0  0  1  |  0

The loss is the mean cross-entropy over the selected tokens. With `gather_predictions` (the
default) the MLM head runs on the selected positions only, gathered into `max_predictions` slots
per row, as BERT's `gather_indexes` does: the same loss, without the vocabulary projection at the
85% of positions that predict nothing. Random draws are made per row
from `split(rng, b)[row]`, position by position, so a row's mask does not depend on the
other rows nor on how much padding follows its real tokens.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from tfx import flops, ops
from tfx.objectives.base import Objective, Predictions, SpecialIds, flat_positions
from tfx.objectives.options import internal
from tfx.registry import OBJECTIVES

# Replacement kinds of a selected token.
KEEP, MASK, RANDOM = 0, 1, 2


def special_table(ids: SpecialIds) -> np.ndarray:
  """bool [v]: True for every id that is not an ordinary text piece."""
  table = np.zeros(ids.vocab_size, bool)
  named = (ids.pad, ids.eos, ids.bos, ids.unk, ids.mask, ids.cls, ids.sep)
  for i in (*ids.special, *ids.sentinels, *(i for i in named if i is not None)):
    table[i] = True
  return table


def ordinary_ids(ids: SpecialIds) -> np.ndarray:
  """int32 [n]: the ordinary ids, from which random replacements are drawn."""
  return np.flatnonzero(~special_table(ids)).astype(np.int32)


def word_ids(tokens: jax.Array, segment_ids: jax.Array, eligible: jax.Array, word_start: jax.Array) -> jax.Array:
  """[b, t] -> [b, t] int32: the number (within its row) of the word each token belongs to.

  A new word starts at a word-start token, at the first token of a document, at every
  ineligible token (special or padding) and right after one.
  """
  prev_eligible = jnp.pad(eligible[:, :-1], ((0, 0), (1, 0)), constant_values=False)
  prev_segment = jnp.pad(segment_ids[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
  starts = word_start[tokens] | ~eligible | ~prev_eligible | (segment_ids != prev_segment)  # [b, t]
  return jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1


def logits_and_hidden(model, params, tokens, segment_ids, positions, *, train: bool, rngs=None, token_types=None,
                      float32_logits: bool = True) -> tuple[jax.Array, jax.Array]:
  """An encoder's MLM logits [b, t, v] (float32, or without `float32_logits` in the compute
  dtype) and final hidden states [b, t, e] from one forward: the hidden states are captured on the
  way (the stack's output, or the final norm's when pre-LN)."""
  last = "final_norm" if model.cfg.norm == "pre" else "encoder"
  logits, captured = model.apply(
      {"params": params}, tokens, segment_ids, positions, token_types=token_types, train=train, rngs=rngs or {},
      capture_intermediates=lambda m, _: m.name == last, mutable=["intermediates"],
      **({} if float32_logits else {"float32_logits": False}))
  return logits, captured["intermediates"][last]["__call__"][0]


def prediction_slots(length: int, rate: float, max_predictions: int = 0) -> int:
  """The cap on selected tokens per row of `length`: `max_predictions`, or by default (0) the mean
  + 4 standard deviations of a Binomial(length, rate) count, rounded up to a multiple of 8; at
  most `length`."""
  mean, sd = length * rate, math.sqrt(length * rate * (1.0 - rate))
  return min(length, max_predictions or 8 * math.ceil((mean + 4.0 * sd) / 8))


def cap_selection(u: jax.Array, eligible: jax.Array, rate: float, cap: int) -> jax.Array:
  """[b, t] draws u and eligibility -> [b, t] bool: eligible & (u < rate), keeping at most `cap`
  per row, those with the smallest draws (tokens sharing a draw, a word's, go in or out together)."""
  selected = eligible & (u < rate)
  if cap >= u.shape[1]:
    return selected
  # The (cap+1)-th smallest draw of the row's eligible tokens (2 = none): strictly below it are at most cap.
  bound = -jax.lax.top_k(-jnp.where(eligible, u, 2.0), cap + 1)[0][:, -1:]  # [b, 1]
  return selected & (u < bound)


def selected_positions(weights: jax.Array, slots: int) -> jax.Array:
  """[b, t] weights (> 0 = selected, at most `slots` per row) -> [b, slots] int32: each row's
  selected positions in order, then unselected ones (weight 0) to fill its remaining slots."""
  t = weights.shape[1]
  score = jnp.where(weights > 0, t - jnp.arange(t, dtype=jnp.int32), 0)  # [b, t], earlier = higher
  return jax.lax.top_k(score, slots)[1].astype(jnp.int32)


def _row_uniform(rng: jax.Array, shape: tuple[int, int]) -> jax.Array:
  """[b, t] uniforms, row r drawn from split(rng, b)[r] (prefix-stable in t)."""
  keys = jax.random.split(rng, shape[0])
  return jax.vmap(lambda k: jax.random.uniform(k, (shape[1],)))(keys)


def _row_randint(rng: jax.Array, shape: tuple[int, int], maxval: int) -> jax.Array:
  keys = jax.random.split(rng, shape[0])
  return jax.vmap(lambda k: jax.random.randint(k, (shape[1],), 0, maxval))(keys)


def select_and_replace(
    tokens: jax.Array,
    segment_ids: jax.Array,
    rng: jax.Array,
    *,
    is_special: np.ndarray,
    mask_rate: float,
    mask_token_rate: float,
    random_token_rate: float,
    word_start: np.ndarray | None = None,
    max_selected: int | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Which tokens are selected, and how each is replaced.

  Args:
    tokens, segment_ids: [b, t] int.
    rng: the step's key.
    is_special: bool [v], True for ids that are never selected.
    mask_rate, mask_token_rate, random_token_rate: the rates of the module docstring.
    word_start: optional bool [v]; given = whole-word masking.
    max_selected: optional cap on the selected tokens of a row (`cap_selection`).
  Returns:
    (selected bool [b, t], kind int32 [b, t] in {KEEP, MASK, RANDOM}, meaningful where selected).
  """
  select_rng, kind_rng = jax.random.split(rng)
  eligible = (segment_ids > 0) & ~jnp.asarray(is_special)[tokens]  # [b, t]
  u = _row_uniform(select_rng, tokens.shape)  # [b, t]
  if word_start is not None:
    words = word_ids(tokens, segment_ids, eligible, jnp.asarray(word_start))  # [b, t]
    u = jnp.take_along_axis(u, words, axis=1)  # one draw per word: u[w] for word number w
  selected = cap_selection(u, eligible, mask_rate, tokens.shape[1] if max_selected is None else max_selected)
  r = _row_uniform(kind_rng, tokens.shape)  # [b, t]
  kind = jnp.where(r < mask_token_rate, MASK, jnp.where(r < mask_token_rate + random_token_rate, RANDOM, KEEP))
  return selected, kind.astype(jnp.int32)


def mask_tokens(
    tokens: jax.Array,
    segment_ids: jax.Array,
    rng: jax.Array,
    *,
    ids: SpecialIds,
    mask_rate: float = 0.15,
    mask_token_rate: float = 0.8,
    random_token_rate: float = 0.1,
    word_start: np.ndarray | tuple[bool, ...] | None = None,
    max_selected: int | None = None,
    return_kept: bool = False,
) -> tuple[jax.Array, ...]:
  """Dynamic BERT masking of a packed batch.

  Args:
    tokens, segment_ids: [b, t] int (segment 0 = padding).
    rng: the step's key; the same key gives the same mask.
    ids: special ids (`ids.mask` is the [MASK] id; `ids.special` etc. are never selected).
    mask_rate: probability that an eligible token (or word) is selected.
    mask_token_rate: probability that a selected token becomes [MASK].
    random_token_rate: probability that a selected token becomes a random ordinary token.
    word_start: optional bool [v], which ids start a word; given = whole-word masking.
    max_selected: optional cap on the selected tokens of a row (None = no cap).
  Returns:
    (inputs [b, t] int32, targets [b, t] int32 = tokens, weights [b, t] float32 = selected), and with
    `return_kept` also kept [b, t] bool: the selected tokens left unchanged in the inputs.
  """
  if ids.mask is None:
    raise ValueError("masked_lm needs a [MASK] id, but the tokenizer has none")
  is_special = special_table(ids)
  ordinary = ordinary_ids(ids)
  if word_start is not None:
    word_start = np.asarray(word_start, bool)
    if word_start.shape != (ids.vocab_size,):
      raise ValueError(f"word_start has shape {word_start.shape}, expected ({ids.vocab_size},)")
  select_rng, random_rng = jax.random.split(rng)
  selected, kind = select_and_replace(
      tokens, segment_ids, select_rng, is_special=is_special, mask_rate=mask_rate,
      mask_token_rate=mask_token_rate, random_token_rate=random_token_rate, word_start=word_start,
      max_selected=max_selected)
  random_tokens = jnp.asarray(ordinary)[_row_randint(random_rng, tokens.shape, len(ordinary))]  # [b, t]
  replaced = jnp.where(kind == MASK, ids.mask, jnp.where(kind == RANDOM, random_tokens, tokens))
  inputs = jnp.where(selected, replaced, tokens).astype(jnp.int32)
  if return_kept:  # the selected tokens shown as they are, by design (the "10% unchanged")
    return inputs, tokens.astype(jnp.int32), selected.astype(jnp.float32), selected & (kind == KEEP)
  return inputs, tokens.astype(jnp.int32), selected.astype(jnp.float32)


@OBJECTIVES.register("masked_lm")
@dataclasses.dataclass(frozen=True)
class MaskedLM(Objective):
  """BERT/RoBERTa masked-token prediction with a bidirectional, document-isolated encoder.

  Whole-word masking needs `word_start` (bool per vocabulary id, from
  `Tokenizer.word_start_mask()`): build with `objective.with_word_start(mask)`.
  """

  # Probability that an eligible token (or word, with whole_word) is selected.
  mask_rate: float = 0.15
  # Share of the selected tokens replaced by <mask>.
  mask_token_rate: float = 0.8
  # Share replaced by a random ordinary token (the rest are kept as they are).
  random_token_rate: float = 0.1
  # Select whole words (the tokenizer's word starts) instead of single pieces.
  whole_word: bool = False
  # At most this many selected tokens per row (BERT's max_predictions_per_seq); the ones with the
  # largest draws beyond it are left unselected. 0 = the mean + 4 standard deviations of the row's
  # Binomial(seq_len, mask_rate) count, rounded up to a multiple of 8 (binds in ~3 rows in 100,000).
  max_predictions: int = 0
  # Run the MLM head (transform, vocabulary projection) only on the selected tokens, gathered into
  # max_predictions slots per row (BERT's gather_indexes), instead of at every position: same loss.
  # The encoder's last layer then also runs its queries, attention output and MLP on those slots
  # only (its keys and values at every position). Needs a model with `mlm_head` and `rows` (the
  # encoder family); others always run the head everywhere.
  gather_predictions: bool = True
  word_start: tuple[bool, ...] | None = internal()

  families = ("encoder",)

  def __post_init__(self):
    for name in ("mask_rate", "mask_token_rate", "random_token_rate"):
      value = getattr(self, name)
      if not 0.0 <= value <= 1.0:
        raise ValueError(f"objective.{name} must be in [0, 1], got {value}")
    if self.mask_token_rate + self.random_token_rate > 1.0:
      raise ValueError("objective.mask_token_rate + objective.random_token_rate must be <= 1, got "
                       f"{self.mask_token_rate} + {self.random_token_rate}")
    if self.ids.mask is None:
      raise ValueError("masked_lm needs a [MASK] id, but the tokenizer has none")
    if self.max_predictions < 0:
      raise ValueError(f"objective.max_predictions must be >= 0 (0 = automatic), got {self.max_predictions}")
    if self.word_start is not None and len(self.word_start) != self.ids.vocab_size:
      raise ValueError(f"word_start has {len(self.word_start)} entries, expected vocab_size={self.ids.vocab_size}")

  def needs_word_start(self) -> bool:
    return self.whole_word

  def with_word_start(self, word_start) -> "MaskedLM":
    """A copy that knows which ids start a word (bool [v], `Tokenizer.word_start_mask()`)."""
    return dataclasses.replace(self, word_start=tuple(bool(x) for x in np.asarray(word_start)))

  def prediction_slots(self, length: int) -> int:
    """The cap on selected tokens per row of `length` (`max_predictions`, 0 = automatic)."""
    return prediction_slots(length, self.mask_rate, self.max_predictions)

  def mask(self, batch: dict[str, jax.Array], rng: jax.Array, *, return_kept: bool = False
           ) -> tuple[jax.Array, ...]:
    """(inputs, targets, weights), [b, t] each, of `batch` under this objective's settings (and the
    kept tokens with `return_kept`, see `mask_tokens`)."""
    word_start = None
    if self.whole_word:
      if self.word_start is None:
        raise ValueError("objective.whole_word=True needs the tokenizer's word starts: build the objective "
                         "with .with_word_start(tokenizer.word_start_mask())")
      word_start = np.asarray(self.word_start, bool)
    return mask_tokens(
        batch["tokens"], batch["segment_ids"], rng, ids=self.ids, mask_rate=self.mask_rate,
        mask_token_rate=self.mask_token_rate, random_token_rate=self.random_token_rate, word_start=word_start,
        max_selected=self.prediction_slots(batch["tokens"].shape[1]), return_kept=return_kept)

  def _forward(self, model, params, batch, rng, *, train, hidden: bool = False, float32_logits: bool = True):
    """(logits [b, t, v] (float32, or without `float32_logits` in the compute dtype), or the final
    hidden states [b, t, e] with `hidden`; targets, weights, kept [b, t])."""
    mask_rng, dropout_rng = jax.random.split(rng)
    inputs, targets, weights, kept = self.mask(batch, mask_rng, return_kept=True)  # [b, t] each
    out = model.apply(
        {"params": params}, inputs, batch["segment_ids"], batch["positions"],
        train=train, rngs={"dropout": dropout_rng}, **({"return_hidden": True} if hidden else {}),
        **({} if float32_logits else {"float32_logits": False}))
    return out, targets, weights, kept

  def head_positions(self, seq_len: int) -> int:
    """Positions per row of `seq_len` the MLM head runs on in training (for the FLOP count)."""
    return self.prediction_slots(seq_len) if self.gather_predictions else seq_len

  def last_layer_queries(self, model_cfg, seq_len: int) -> int | None:
    """The encoder's last-layer query positions per row in training when that layer runs at the
    gathered slots only (`rows_loss`; not under a relative-position bias), else None (for the FLOP
    count)."""
    head = self.head_positions(seq_len)
    rows = head < seq_len and getattr(model_cfg, "family", "") == "encoder" and model_cfg.position != "relative"
    return head if rows else None

  def train_flops_per_row(self, model_cfg, seq_len: int) -> float:
    return 3 * flops.row_forward_flops(model_cfg, seq_len, self.head_positions(seq_len),
                                       last_layer_queries=self.last_layer_queries(model_cfg, seq_len))

  def gather_slots(self, model, length: int) -> int | None:
    """The head's slots per row when the loss gathers the selected tokens (`gather_predictions`,
    a model with `mlm_head`, fewer slots than positions); None when it runs the head everywhere."""
    slots = self.prediction_slots(length)
    return slots if self.gather_predictions and hasattr(model, "mlm_head") and slots < length else None

  def mlm_loss(self, model, params, out, targets, weights, slots: int | None):
    """weighted_cross_entropy of the MLM predictions. slots None: `out` is the logits [b, t, v].
    Otherwise `out` is the final hidden states [b, t, e] and the head runs on each row's selected
    positions only, gathered into `slots` slots (at most that many are selected per row)."""
    if slots is None:
      return ops.weighted_cross_entropy(out, targets, weights, z_loss=self.z_loss)
    where = selected_positions(weights, slots)  # [b, slots]
    return self.slots_loss(model, params, jnp.take_along_axis(out, where[..., None], axis=1), targets, weights, where)

  def slots_loss(self, model, params, hidden, targets, weights, where):
    """weighted_cross_entropy of the MLM head on final hidden states [b, n, e] that are those of
    positions `where` [b, n] (targets and weights: [b, t])."""
    take = lambda a: jnp.take_along_axis(a, where, axis=1)
    # the loss computed by the head: bf16 logits stay bf16 (one pass for their gradient)
    return model.apply({"params": params}, hidden, self.token_targets(take(targets), take(weights)),
                       method="mlm_head")  # (loss, metrics) over [b, n, v] logits

  def loss(self, model, params, batch, rng, *, train):
    slots = self.gather_slots(model, batch["tokens"].shape[1])
    if slots is not None:
      return self.rows_loss(model, params, batch, rng, slots, train=train)
    # the head at every position: tfx's encoder (a model with `mlm_head`) gives its logits in the
    # compute dtype (the loss reads them in float32, and bf16 ones get its one-pass gradient)
    out, targets, weights, _ = self._forward(model, params, batch, rng, train=train,
                                             float32_logits=not hasattr(model, "mlm_head"))
    return self.mlm_loss(model, params, out, targets, weights, None)

  def rows_loss(self, model, params, batch, rng, slots: int, *, train):
    """The loss with the model run to its logits at each row's selected positions only
    (`selected_positions`, `slots` per row): the head there, and the encoder's last layer
    computes its queries, attention output and MLP there alone (`rows`, `Stack.last_layer_queries`).
    The same loss as the head at every position (tests/test_masked_lm.py)."""
    mask_rng, dropout_rng = jax.random.split(rng)
    inputs, targets, weights = self.mask(batch, mask_rng)  # [b, t] each
    where = selected_positions(weights, slots)  # [b, slots]
    hidden = model.apply({"params": params}, inputs, batch["segment_ids"], batch["positions"], train=train,
                         rngs={"dropout": dropout_rng}, return_hidden=True, rows=where)  # [b, slots, e]
    return self.slots_loss(model, params, hidden, targets, weights, where)

  def predictions(self, model, params, batch, rng):
    """A selected token is predicted from its document; the kept ones (selected, left as they are)
    see themselves by design."""
    logits, targets, weights, kept = self._forward(model, params, batch, rng, train=False)
    return Predictions(logits, targets, weights, flat_positions(batch["segment_ids"]), sees_self=kept)
