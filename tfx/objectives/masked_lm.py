"""Masked language modelling (BERT/RoBERTa), OBJECTIVES.md §2.

Dynamic masking as in RoBERTa and HF `DataCollatorForLanguageModeling`: every step draws a
fresh mask from the step's rng, on device.

- Selection: each eligible token (real, i.e. segment > 0, and not a special id) is selected
  independently with probability `mask_rate` (Bernoulli, not a fixed count).
- Of the selected tokens, each independently becomes `[MASK]` with probability
  `mask_token_rate`, a uniformly random **ordinary** token (never a special id, as fairseq)
  with probability `random_token_rate`, and is kept otherwise.
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

The loss is the mean cross-entropy over the selected tokens. Random draws are made per row
from `split(rng, b)[row]`, position by position, so a row's mask does not depend on the
other rows nor on how much padding follows its real tokens.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from tfx import ops
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


def logits_and_hidden(model, params, tokens, segment_ids, positions, *, train: bool, rngs=None, token_types=None
                      ) -> tuple[jax.Array, jax.Array]:
  """An encoder's MLM logits [b, t, v] and final hidden states [b, t, e] from one forward: the
  hidden states are captured on the way (the stack's output, or the final norm's when pre-LN)."""
  last = "final_norm" if model.cfg.norm == "pre" else "encoder"
  logits, captured = model.apply(
      {"params": params}, tokens, segment_ids, positions, token_types=token_types, train=train, rngs=rngs or {},
      capture_intermediates=lambda m, _: m.name == last, mutable=["intermediates"])
  return logits, captured["intermediates"][last]["__call__"][0]


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
) -> tuple[jax.Array, jax.Array]:
  """Which tokens are selected, and how each is replaced.

  Args:
    tokens, segment_ids: [b, t] int.
    rng: the step's key.
    is_special: bool [v], True for ids that are never selected.
    mask_rate, mask_token_rate, random_token_rate: the rates of the module docstring.
    word_start: optional bool [v]; given = whole-word masking.
  Returns:
    (selected bool [b, t], kind int32 [b, t] in {KEEP, MASK, RANDOM}, meaningful where selected).
  """
  select_rng, kind_rng = jax.random.split(rng)
  eligible = (segment_ids > 0) & ~jnp.asarray(is_special)[tokens]  # [b, t]
  u = _row_uniform(select_rng, tokens.shape)  # [b, t]
  if word_start is not None:
    words = word_ids(tokens, segment_ids, eligible, jnp.asarray(word_start))  # [b, t]
    u = jnp.take_along_axis(u, words, axis=1)  # one draw per word: u[w] for word number w
  selected = eligible & (u < mask_rate)
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
      mask_token_rate=mask_token_rate, random_token_rate=random_token_rate, word_start=word_start)
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
    if self.word_start is not None and len(self.word_start) != self.ids.vocab_size:
      raise ValueError(f"word_start has {len(self.word_start)} entries, expected vocab_size={self.ids.vocab_size}")

  def needs_word_start(self) -> bool:
    return self.whole_word

  def with_word_start(self, word_start) -> "MaskedLM":
    """A copy that knows which ids start a word (bool [v], `Tokenizer.word_start_mask()`)."""
    return dataclasses.replace(self, word_start=tuple(bool(x) for x in np.asarray(word_start)))

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
        return_kept=return_kept)

  def _forward(self, model, params, batch, rng, *, train):
    mask_rng, dropout_rng = jax.random.split(rng)
    inputs, targets, weights, kept = self.mask(batch, mask_rng, return_kept=True)  # [b, t] each
    logits = model.apply(
        {"params": params}, inputs, batch["segment_ids"], batch["positions"],
        train=train, rngs={"dropout": dropout_rng})  # [b, t, v]
    return logits, targets, weights, kept

  def loss(self, model, params, batch, rng, *, train):
    logits, targets, weights, _ = self._forward(model, params, batch, rng, train=train)
    return ops.weighted_cross_entropy(logits, targets, weights, z_loss=self.z_loss)

  def predictions(self, model, params, batch, rng):
    """A selected token is predicted from its document; the kept ones (selected, left as they are)
    see themselves by design."""
    logits, targets, weights, kept = self._forward(model, params, batch, rng, train=False)
    return Predictions(logits, targets, weights, flat_positions(batch["segment_ids"]), sees_self=kept)
