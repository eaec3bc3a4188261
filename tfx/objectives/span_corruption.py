"""T5 span corruption, OBJECTIVES.md §3.1.

The raw row (length L) is one stream of tokens, as T5's `reduce_concat_tokens` concatenates
documents before `split_tokens`, so document boundaries inside a row are ignored. One difference:
tfx's pipeline ends every document with EOS, for every objective, and those EOS stay in the
stream (as in Hugging Face's run_t5_mlm_flax, whose tokenizer appends </s> to each text); T5's
own pipeline joins documents without separators. `random_spans_noise_mask` marks n = round(L·d) tokens as noise, in s = round(n/μ)
spans alternating with s non-noise spans (the row starts with non-noise and ends with noise).

    raw       t0 t1 t2 t3 t4 t5 t6 t7 t8 t9          (L = 10, d = .15, μ = 3: n = 2, s = 1)
    noise      0  0  0  0  0  0  0  0  1  1
    inputs    t0 t1 t2 t3 t4 t5 t6 t7 S0 EOS         S_k = ids.sentinels[k] (<extra_id_k>)
    targets   S0 t8 t9 EOS

inputs = the non-noise tokens with each noise span replaced by its sentinel, then EOS;
targets = for each span k, sentinel k followed by the span's tokens, then EOS (no trailing
sentinel). Both are padded with `ids.pad` (segment 0) to static lengths: with the raw length
of `compute_lengths`, L = 568 gives exactly 512 inputs and 114 targets and no padding.

Padding in the raw row (segment 0, eval rows only) is dropped: the mask is drawn on the
static length L as usual, then padded positions are removed from both sides (a noise
position that is padding is not a target; a span made only of padding has no sentinel), and
spans are counted over the remaining real tokens, so there are never more than s of them.

The model is an encoder-decoder: encoder = inputs, decoder input = targets shifted right with
`ids.pad` as the start id (T5), loss = mean CE over real target tokens (EOS included).
"""

import dataclasses

import jax
import jax.numpy as jnp

from tfx import flops, ops
from tfx.objectives.base import Objective, Predictions, SpecialIds, flat_positions, spread_rows
from tfx.objectives.causal_lm import shift_right_by_segment
from tfx.registry import OBJECTIVES


# ----------------------------------------------------------------------------- lengths (host)


def compute_lengths(inputs_length: int, noise_density: float = 0.15, mean_span_length: float = 3.0
                    ) -> tuple[int, int]:
  """(raw_length, targets_length) for `inputs_length` encoder tokens (T5 `random_spans_helper`).

  raw_length is the largest t (counting up from inputs_length - 1) whose inputs fit in
  `inputs_length`; with noise_density 0.5 the targets are trimmed to at most the inputs.
  512 -> (568, 114). The lengths are those the noise mask makes (`output_lengths`): T5's own
  formula allows 0 noise spans, which the mask never makes, and so promised rows one token
  shorter than made for short rows (8 tokens at mean span 3, up to 61 at mean span 20).
  """
  t = inputs_length - 1
  while output_lengths(t + 1, noise_density, mean_span_length)[0] <= inputs_length:
    t += 1
  targets_length = output_lengths(t, noise_density, mean_span_length)[1]
  if noise_density == 0.5 and targets_length > inputs_length:
    t -= 1
    targets_length = output_lengths(t, noise_density, mean_span_length)[1]
  return t, targets_length


def noise_counts(length: int, noise_density: float, mean_span_length: float) -> tuple[int, int]:
  """(n noise tokens, s noise spans) of `random_spans_noise_mask` for a static `length`."""
  padded = max(length, 2)
  n = min(max(int(round(padded * noise_density)), 1), padded - 1)
  s = max(1, int(round(n / mean_span_length)))
  if s > padded - n:
    raise ValueError(f"span corruption of {length} tokens: {s} noise spans need as many non-noise spans, but "
                     f"only {padded - n} non-noise tokens remain; lower objective.noise_density or raise "
                     "objective.mean_span_length")
  return n, s


def output_lengths(length: int, noise_density: float, mean_span_length: float) -> tuple[int, int]:
  """(inputs, targets) lengths, EOS included, that a raw row of `length` tokens needs."""
  n, s = noise_counts(length, noise_density, mean_span_length)
  return length - n + s + 1, n + s + 1


def check_sentinels(length: int, noise_density: float, mean_span_length: float, ids: SpecialIds) -> None:
  """Raises if rows of `length` raw tokens have more noise spans than the tokenizer has sentinels."""
  _, s = noise_counts(length, noise_density, mean_span_length)
  if s > len(ids.sentinels):
    raise ValueError(
        f"span corruption of {length} raw tokens makes {s} noise spans but the tokenizer has only "
        f"{len(ids.sentinels)} sentinels (<extra_id_k>); lower data.seq_len or objective.noise_density, raise "
        "objective.mean_span_length, or use a tokenizer with more sentinels")


# ----------------------------------------------------------------------------- noise mask (device)


def random_segmentation(rng: jax.Array, num_items: int, num_segments: int) -> jax.Array:
  """[num_segments] int32 positive lengths summing to `num_items`, uniformly random.

  The s - 1 cut points are chosen uniformly among the m - 1 gaps between items.
  """
  first_in_segment = jax.random.permutation(rng, jnp.arange(num_items - 1) < num_segments - 1)  # [m - 1]
  first_in_segment = jnp.pad(first_in_segment, (1, 0))  # [m]
  segment_id = jnp.cumsum(first_in_segment)  # [m]
  return jnp.zeros(num_segments, jnp.int32).at[segment_id].add(1)


def random_spans_noise_mask(length: int, rng: jax.Array, noise_density: float, mean_span_length: float
                            ) -> jax.Array:
  """bool [length]: T5's noise mask, n noise tokens in s spans; mask[0] False, mask[-1] True."""
  padded = max(length, 2)
  n, s = noise_counts(length, noise_density, mean_span_length)
  noise_rng, nonnoise_rng = jax.random.split(rng)
  noise_lengths = random_segmentation(noise_rng, n, s)  # [s]
  nonnoise_lengths = random_segmentation(nonnoise_rng, padded - n, s)  # [s]
  interleaved = jnp.stack([nonnoise_lengths, noise_lengths], axis=1).reshape(2 * s)  # [2s]
  span_starts = jnp.cumsum(interleaved)[:-1]  # [2s - 1]
  span_num = jnp.cumsum(jnp.zeros(padded, jnp.int32).at[span_starts].add(1))  # [L']
  return (span_num % 2 == 1)[:length]


def noise_masks(rng: jax.Array, batch: int, length: int, noise_density: float, mean_span_length: float
                ) -> jax.Array:
  """bool [batch, length]: one independent noise mask per row (row r from split(rng, batch)[r])."""
  keys = jax.random.split(rng, batch)
  return jax.vmap(lambda k: random_spans_noise_mask(length, k, noise_density, mean_span_length))(keys)


# ----------------------------------------------------------------------------- corruption (device)


def _previous_real_is_noise(noise: jax.Array, real: jax.Array) -> jax.Array:
  """[b, t] bool: whether the closest real token before each position is noise (False if none)."""
  index = jnp.arange(noise.shape[1])
  last_real = jax.lax.cummax(jnp.where(real, index, -1), axis=1)  # [b, t], at or before i
  prev_real = jnp.pad(last_real[:, :-1], ((0, 0), (1, 0)), constant_values=-1)  # [b, t], strictly before i
  prev_noise = jnp.take_along_axis(noise, jnp.maximum(prev_real, 0), axis=1)
  return prev_noise & (prev_real >= 0)


def corrupt_with_mask(
    tokens: jax.Array,
    segment_ids: jax.Array,
    noise: jax.Array,
    *,
    ids: SpecialIds,
    inputs_length: int,
    targets_length: int,
) -> dict[str, jax.Array]:
  """Inputs and targets of span corruption for a given noise mask.

  Args:
    tokens, segment_ids: [b, L] int (segment 0 = padding, dropped).
    noise: [b, L] bool noise mask.
    ids: special ids (`pad`, `eos`, `sentinels`).
    inputs_length, targets_length: static output lengths (EOS included); must be large enough.
  Returns:
    dict of [b, inputs_length] `inputs`, `input_segment_ids` and [b, targets_length] `targets`,
    `target_segment_ids` (int32; segment 1 on real tokens and EOS, 0 on padding and on every
    position of a row without real tokens), and [b, L]
    `target_index`: the decoder slot of each raw noise token (targets_length for the others).
  """
  b, _ = tokens.shape
  rows = jnp.arange(b)[:, None]
  real = segment_ids > 0
  noise = noise & real
  span_start = noise & ~_previous_real_is_noise(noise, real)  # [b, L]
  span_index = jnp.cumsum(span_start, axis=1) - 1  # [b, L], the span of each noise token
  sentinel = jnp.asarray(ids.sentinels, jnp.int32)[jnp.clip(span_index, 0, len(ids.sentinels) - 1)]  # [b, L]

  keep = real & (~noise | span_start)  # a span's first token becomes its sentinel, the rest goes
  input_index = jnp.where(keep, jnp.cumsum(keep, axis=1) - 1, inputs_length)  # [b, L], out of range = dropped
  input_token = jnp.where(span_start, sentinel, tokens)
  inputs = jnp.full((b, inputs_length), ids.pad, jnp.int32).at[rows, input_index].set(input_token, mode="drop")
  num_inputs = jnp.sum(keep, axis=1, keepdims=True)  # [b, 1], before EOS

  # Target of a noise token: after the noise tokens before it and one sentinel per span so far.
  target_index = jnp.where(noise, jnp.cumsum(noise, axis=1) - 1 + span_index + 1, targets_length)  # [b, L]
  sentinel_index = jnp.where(span_start, target_index - 1, targets_length)
  targets = jnp.full((b, targets_length), ids.pad, jnp.int32)
  targets = targets.at[rows, target_index].set(tokens, mode="drop")
  targets = targets.at[rows, sentinel_index].set(sentinel, mode="drop")
  num_targets = jnp.sum(noise, axis=1, keepdims=True) + jnp.sum(span_start, axis=1, keepdims=True)  # [b, 1]

  def finish(x, count, length):
    position = jnp.arange(length)[None, :]
    return jnp.where(position == count, ids.eos, x).astype(jnp.int32), (position <= count).astype(jnp.int32)

  inputs, input_segment_ids = finish(inputs, num_inputs, inputs_length)
  targets, target_segment_ids = finish(targets, num_targets, targets_length)
  has_real = jnp.any(real, axis=1, keepdims=True)  # [b, 1]; a padding row (a short eval batch) predicts nothing
  inputs, input_segment_ids = jnp.where(has_real, inputs, ids.pad), input_segment_ids * has_real
  targets, target_segment_ids = jnp.where(has_real, targets, ids.pad), target_segment_ids * has_real
  return {"inputs": inputs, "input_segment_ids": input_segment_ids,
          "targets": targets, "target_segment_ids": target_segment_ids,
          "target_index": jnp.where(target_index < targets_length, target_index, targets_length).astype(jnp.int32)}


def span_corrupt(
    tokens: jax.Array,
    segment_ids: jax.Array,
    rng: jax.Array,
    *,
    ids: SpecialIds,
    noise_density: float = 0.15,
    mean_span_length: float = 3.0,
    inputs_length: int | None = None,
    targets_length: int | None = None,
) -> dict[str, jax.Array]:
  """T5 span corruption of raw rows [b, L] (see `corrupt_with_mask` for the outputs).

  The output lengths default to exactly what L needs (L = 568: 512 / 114); larger values pad.
  """
  b, length = tokens.shape
  check_sentinels(length, noise_density, mean_span_length, ids)
  need_inputs, need_targets = output_lengths(length, noise_density, mean_span_length)
  inputs_length = need_inputs if inputs_length is None else inputs_length
  targets_length = need_targets if targets_length is None else targets_length
  if inputs_length < need_inputs or targets_length < need_targets:
    raise ValueError(f"span corruption of {length} raw tokens needs {need_inputs} inputs and {need_targets} "
                     f"targets, got {inputs_length} and {targets_length}")
  noise = noise_masks(rng, b, length, noise_density, mean_span_length)  # [b, L]
  return corrupt_with_mask(tokens, segment_ids, noise, ids=ids, inputs_length=inputs_length,
                           targets_length=targets_length)


def seq2seq_logits(model, params, x: dict[str, jax.Array], rng: jax.Array, *, train: bool, start_id: int,
                   loss: ops.TokenTargets | None = None):
  """[b, t, v] logits of an encoder-decoder on `inputs` / `targets` with their segment ids (the
  `corrupt_with_mask` keys), teacher-forced: decoder input = targets shifted right, `start_id` first.
  With `loss`, the token loss and its metrics instead (`Family.lm_head`). The inputs and targets of
  `corrupt_with_mask` (and UL2's) are one segment a row, real tokens first: the model builds its
  masks from the rows' lengths (`one_segment`, which cuDNN reads as sequence lengths)."""
  input_positions = jnp.arange(x["inputs"].shape[1]) * x["input_segment_ids"]  # [b, s]
  target_positions = jnp.arange(x["targets"].shape[1]) * x["target_segment_ids"]  # [b, t]
  decoder_inputs = shift_right_by_segment(x["targets"], x["target_segment_ids"], start_id)  # [b, t]
  return model.apply(
      {"params": params}, x["inputs"], x["input_segment_ids"], input_positions,
      decoder_inputs, x["target_segment_ids"], target_positions,
      train=train, rngs={"dropout": rng}, loss=loss, one_segment=True)  # [b, t, v]


@OBJECTIVES.register("span_corruption")
@dataclasses.dataclass(frozen=True)
class SpanCorruption(Objective):
  """T5 span corruption for an encoder-decoder.

  `inputs_length` is the encoder length (0 = data.seq_len, passed by the loop); the raw rows
  are longer (`raw_length`) and the decoder length is `targets_length(seq_len)`.
  """

  # Share of the raw tokens that become noise.
  noise_density: float = 0.15
  # Mean length of a noise span (T5: 3; ByT5: 20).
  mean_span_length: float = 3.0
  # Encoder input length, 0 = data.seq_len (the raw row is then longer: 568 raw tokens give 512
  # inputs and 114 targets).
  inputs_length: int = 0

  families = ("encoder_decoder",)

  def __post_init__(self):
    if not 0.0 < self.noise_density < 1.0:
      raise ValueError(f"objective.noise_density must be in (0, 1), got {self.noise_density}")
    if self.mean_span_length < 1.0:
      raise ValueError(f"objective.mean_span_length must be >= 1, got {self.mean_span_length}")
    if self.inputs_length:
      check_sentinels(self.raw_length(self.inputs_length), self.noise_density, self.mean_span_length, self.ids)

  def _lengths(self, seq_len: int) -> tuple[int, int]:
    return compute_lengths(self.inputs_length or seq_len, self.noise_density, self.mean_span_length)

  def raw_length(self, seq_len: int) -> int:
    raw = self._lengths(seq_len)[0]
    check_sentinels(raw, self.noise_density, self.mean_span_length, self.ids)
    return raw

  def train_flops_per_row(self, model_cfg, seq_len: int) -> float:
    """Encoder over the inputs, decoder over the (shorter) targets: 512 + 114 positions."""
    inputs, targets = self.inputs_length or seq_len, self.targets_length(seq_len)
    return 3 * flops.seq2seq_forward_flops(model_cfg, inputs, targets)

  def targets_length(self, seq_len: int) -> int:
    """Decoder length (EOS included) for encoder length `seq_len`: 512 -> 114."""
    return self._lengths(seq_len)[1]

  def corrupt(self, batch: dict[str, jax.Array], rng: jax.Array) -> dict[str, jax.Array]:
    """Encoder inputs and decoder targets of a raw batch (`corrupt_with_mask` outputs)."""
    length = batch["tokens"].shape[1]
    need_inputs, _ = output_lengths(length, self.noise_density, self.mean_span_length)
    return span_corrupt(
        batch["tokens"], batch["segment_ids"], rng, ids=self.ids, noise_density=self.noise_density,
        mean_span_length=self.mean_span_length, inputs_length=max(self.inputs_length, need_inputs))

  def _forward(self, model, params, batch, rng, *, train, loss=False):
    """(logits [b, t, v], or with `loss` the token loss and its metrics; the corrupted batch)."""
    corrupt_rng, dropout_rng = jax.random.split(rng)
    x = self.corrupt(batch, corrupt_rng)
    weights = x["target_segment_ids"].astype(jnp.float32)  # [b, t]
    targets = self.token_targets(x["targets"], weights) if loss else None
    return seq2seq_logits(model, params, x, dropout_rng, train=train, start_id=self.ids.pad, loss=targets), x

  def loss(self, model, params, batch, rng, *, train):
    return self._forward(model, params, batch, rng, train=train, loss=True)[0]

  def predictions(self, model, params, batch, rng):
    """Target slot j predicts a noise token (sentinels and EOS: source -1) from the row's other
    tokens (T5 treats the row as one stream) except the noise tokens of slots j and later."""
    logits, x = self._forward(model, params, batch, rng, train=False)
    b, raw = batch["tokens"].shape
    slots = x["targets"].shape[1]
    rank = x["target_index"]  # [b, raw], slot of each noise token (slots = none)
    flat = flat_positions(batch["segment_ids"])  # [b, raw]
    rows = jnp.arange(b)[:, None]
    source = jnp.full((b, slots + 1), -1, jnp.int32).at[rows, rank].set(flat)[:, :slots]  # [b, slots]
    later = (rank[:, None, :] < slots) & (rank[:, None, :] >= jnp.arange(slots)[None, :, None])  # [b, slots, raw]
    visible = (batch["segment_ids"][:, None, :] > 0) & ~later
    return Predictions(logits, x["targets"], x["target_segment_ids"].astype(jnp.float32), source,
                       visible=spread_rows(visible))
