"""UL2's mixture of denoisers (Tay et al. 2022, "UL2: Unifying Language Learning Paradigms").

Every row is corrupted by ONE denoiser drawn from a weighted mixture, and its input starts
with that denoiser's mode token so the model knows which task it is doing:

  R  regular span corruption (T5: short spans, 15% noise)            mode token [R]
  X  extreme span corruption (long spans and/or 50% noise)           mode token [X]
  S  sequential: prefix LM, predict the rest of the row from a prefix  mode token [S]

R and X are T5 span corruption (`span_corruption.py`, OBJECTIVES.md §3.1) with their own
(μ mean span length, r noise density); S splits the row at a random point (inputs = prefix,
targets = suffix, EOS after each, no sentinel). A raw row t0..t9 (L = 10) may become

    R (μ 3, r .15)  encoder  [R] t0 t1 t2 t3 t4 t5 t6 t7 S0 EOS      decoder  S0 t8 t9 EOS
    X (μ 3, r .5)   encoder  [X] t0 t1 S0 t4 t5 t6 S1 EOS            decoder  S0 t2 t3 S1 t7 t8 t9 EOS
    S (split 6)     encoder  [S] t0 t1 t2 t3 t4 t5 EOS               decoder  t6 t7 t8 t9 EOS

Families. encoder_decoder (`layout="encoder_decoder"`): encoder = mode token + inputs, decoder
= targets shifted right (T5), loss on every real target (sentinels and EOS included). decoder
(`layout="decoder"`, prefix-LM form as seqio's PrefixLMFeatureConverter): one row
[mode, inputs..., targets...], e.g. `[X] t0 t1 S0 t4 t5 t6 S1 EOS | S0 t2 t3 S1 t7 t8 t9 EOS`,
fed shifted right with BOS like `prefix_lm.py`; bidirectional over BOS + mode + inputs
(`ops.prefix_lm_mask` with prefix = len(mode + inputs) + 1), causal after, loss on targets.

Default mixture, the paper's final UL2 configuration (OBJECTIVES.md §3.3): R (μ 3, r .15),
R (μ 8, r .15); X (μ 3, r .5), X (μ 8, r .5), X (μ 64, r .15), X (μ 64, r .5); S. S gets 20%
of the rows and the six span denoisers share the other 80% equally (2/15 each): relative
weights 2,2,2,2,2,2,3 in `mixture`. The paper's exact per-denoiser split is our reading of it;
the weights are configuration.

Mode tokens. The tokenizer has no [R]/[S]/[X] pieces, so the top three sentinels are reserved:
[R] = <extra_id_{N-3}>, [S] = <extra_id_{N-2}>, [X] = <extra_id_{N-1}> (N = len(ids.sentinels),
100 by default: <extra_id_97..99>). R/X span corruption uses only sentinels 0..N-4, and a
mixture whose rows would need more than N-3 spans is refused.

Static shapes, per-row choice. One denoiser index is drawn per row (categorical over the
weights). Every denoiser processes every row (each with its own key, all padded to the same
static encoder/decoder lengths) and `jnp.where` keeps, per row, the chosen denoiser's version:
no data-dependent shapes, one compiled step. (For R/X what is selected is the noise mask; one
`corrupt_with_mask` then corrupts all R/X rows: the same rows, one corruption instead of six.)
The lengths depend only on the raw length L (`static_lengths`): encoder_decoder: encoder = max
over R/X of 1 + L - n + s + 1, decoder = max over R/X of n + s + 1 (or `targets_length` if
larger); decoder layout: row = max over R/X of L + 2s + 3 (and L + 3 for S). `raw_length(seq_len)`
is the largest L whose lengths fit in seq_len: seq_len 512 with the default mixture gives L = 567,
encoder 512, decoder 380 (X μ 3 r .5 has the longest targets); the decoder layout gives L = 381
(that denoiser's 2s sentinels take the rest). S's split point P is uniform over the splits that
fit: P in [max(1, m - T + 1), min(m - 1, I - 2)] for m real tokens, decoder length T, encoder
length I (188..510 for the encoder_decoder at L = 567; the decoder layout allows every P in
[1, m - 1]).

As in span corruption, the raw row is one stream (T5 concatenates documents without
separators): document boundaries inside a row are ignored, by every denoiser. Padding (segment
0, eval rows) is dropped; a row with no real token gives no input and no prediction.
"""

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from tfx import flops, ops
from tfx.objectives.base import Objective, Predictions, SpecialIds, family_matches
from tfx.objectives.causal_lm import shift_right_by_segment
from tfx.objectives.span_corruption import corrupt_with_mask, noise_counts, noise_masks, seq2seq_logits
from tfx.registry import OBJECTIVES

MODES = ("R", "S", "X")  # mode token of MODES[i] = ids.sentinels[-3 + i]
LAYOUTS = ("encoder_decoder", "decoder")
DEFAULT_MIXTURE = "R:3:0.15=2,R:8:0.15=2,X:3:0.5=2,X:8:0.5=2,X:64:0.15=2,X:64:0.5=2,S=3"


class Denoiser(NamedTuple):
  mode: str  # 'R', 'S' or 'X'
  mean_span_length: float  # μ (0 for S)
  noise_density: float  # r (0 for S)
  weight: float  # probability of a row (normalised)


@functools.lru_cache(maxsize=64)
def parse_mixture(spec: str) -> tuple[Denoiser, ...]:
  """'R:3:0.15=2,...,S=3' -> denoisers with normalised weights (ValueError saying what is wrong)."""
  form = ("objective.mixture: write comma-separated MODE:MEAN_SPAN:RATE[=WEIGHT] for R and X "
          "and S[=WEIGHT] for the prefix LM, e.g. 'R:3:0.15=2,X:64:0.5=2,S=1'")
  out = []
  for entry in (e.strip() for e in spec.split(",")):
    body, _, weight = entry.partition("=")
    fields = body.strip().split(":")
    try:
      w = float(weight) if weight else 1.0
      mu, r = (float(fields[1]), float(fields[2])) if len(fields) == 3 else (0.0, 0.0)
    except ValueError:
      raise ValueError(f"{form}; cannot read {entry!r}") from None
    mode = fields[0].strip().upper()
    if mode not in MODES or (mode == "S") != (len(fields) == 1) or len(fields) not in (1, 3):
      raise ValueError(f"{form}; cannot read {entry!r}")
    if not 0 < w < float("inf"):
      raise ValueError(f"objective.mixture: weight of {entry!r} must be positive and finite")
    if mode != "S" and not (mu >= 1.0 and 0.0 < r < 1.0):
      raise ValueError(f"objective.mixture: {entry!r} needs a mean span length >= 1 and a rate in (0, 1)")
    if any((d.mode, d.mean_span_length, d.noise_density) == (mode, mu, r) for d in out):
      raise ValueError(f"objective.mixture: {body!r} appears twice; merge the two weights")
    out.append(Denoiser(mode, mu, r, w))
  total = sum(d.weight for d in out)
  return tuple(d._replace(weight=d.weight / total) for d in out)


def mode_id(ids: SpecialIds, mode: str) -> int:
  """The id of mode token [R], [S] or [X]: one of the top three sentinels."""
  return ids.sentinels[len(ids.sentinels) - len(MODES) + MODES.index(mode)]


def span_ids(ids: SpecialIds) -> SpecialIds:
  """`ids` with the mode tokens removed from the sentinels R/X span corruption may use."""
  return dataclasses.replace(ids, sentinels=ids.sentinels[:len(ids.sentinels) - len(MODES)])


# ----------------------------------------------------------------------------- lengths (host)


class Lengths(NamedTuple):
  inputs: int  # encoder length (mode token and EOS included); decoder layout: the inputs part's bound
  targets: int  # decoder length (EOS included); decoder layout: the targets part's bound
  row: int  # decoder layout: the model row [mode, inputs, targets]; encoder_decoder: inputs + targets


@functools.lru_cache(maxsize=256)
def static_lengths(layout: str, length: int, denoisers: tuple[Denoiser, ...], targets_length: int = 0) -> Lengths:
  """The static lengths every denoiser fits in, for raw rows of `length` tokens (see the docstring)."""
  spans = [noise_counts(length, d.noise_density, d.mean_span_length) for d in denoisers if d.mode != "S"]
  has_s = any(d.mode == "S" for d in denoisers)
  inputs = max([1 + length - n + s + 1 for n, s in spans], default=0)
  targets = max([n + s + 1 for n, s in spans] + [targets_length], default=0)
  if layout == "decoder":
    row = max([length + 2 * s + 3 for _, s in spans] + [length + 3] * has_s)
    return Lengths(max(inputs, (length + 1) * has_s), max(targets, length * has_s), row)
  if not spans:  # S only: room for any split (the 512 / 512 of UL2's encoder-decoder)
    inputs, targets = length + 1, max(targets, length)
  return Lengths(max(inputs, 3), max(targets, 2), max(inputs, 3) + max(targets, 2))


def max_raw_length(layout: str, seq_len: int, denoisers: tuple[Denoiser, ...], targets_length: int = 0) -> int:
  """The largest raw length whose static lengths fit in `seq_len` model positions."""
  def fits(length):
    x = static_lengths(layout, length, denoisers, targets_length)
    return x.row <= seq_len if layout == "decoder" else max(x.inputs, x.targets) <= seq_len
  if not fits(2):
    raise ValueError(f"data.seq_len={seq_len} is too short for objective 'ul2' ({layout}): even 2 raw tokens "
                     "do not fit; raise data.seq_len or lower objective.targets_length")
  length = 2
  while fits(length + 1):  # every static length grows with the raw length
    length += 1
  return length


def check_spans(length: int, denoisers: tuple[Denoiser, ...], ids: SpecialIds) -> None:
  """Raises if an R/X denoiser makes more spans than the sentinels left after the mode tokens."""
  room = len(ids.sentinels) - len(MODES)
  for d in (d for d in denoisers if d.mode != "S"):
    s = noise_counts(length, d.noise_density, d.mean_span_length)[1]
    if s > room:
      raise ValueError(
          f"objective 'ul2': {d.mode} (mean span {d.mean_span_length:g}, rate {d.noise_density:g}) makes {s} spans "
          f"in {length} raw tokens, but only {room} sentinels are left after reserving the top {len(MODES)} as "
          "mode tokens [R] [S] [X]; lower data.seq_len, raise that denoiser's mean span length in "
          "objective.mixture, or use a tokenizer with more sentinels")


# ----------------------------------------------------------------------------- corruption (device)


def choose_denoisers(rng: jax.Array, batch: int, weights: tuple[float, ...]) -> jax.Array:
  """[batch] int32: one denoiser index per row, drawn independently with probabilities `weights`."""
  logits = jnp.log(jnp.asarray(weights, jnp.float32))
  return jax.random.categorical(rng, logits, shape=(batch,)).astype(jnp.int32)


def prefix_split(segment_ids: jax.Array, rng: jax.Array, max_prefix: int, max_suffix: int) -> jax.Array:
  """[b] int32 prefix length P ~ U{max(1, m - max_suffix), ..., min(m - 1, max_prefix)} for m real
  tokens per row (P = 0 when m <= 1: the lone token is the target)."""
  m = jnp.sum(segment_ids > 0, axis=1)  # [b]
  lo, hi = jnp.maximum(1, m - max_suffix), jnp.minimum(m - 1, max_prefix)
  u = jax.random.uniform(rng, m.shape)  # [b]
  prefix = jnp.minimum(lo + jnp.floor(u * (hi - lo + 1)).astype(jnp.int32), hi)
  return jnp.where(hi >= lo, prefix, 0).astype(jnp.int32)


def _append_eos(x: jax.Array, count: jax.Array, eos: int) -> tuple[jax.Array, jax.Array]:
  """EOS at position `count` ([b, 1]) of each row; segment ids 1 up to and including it."""
  position = jnp.arange(x.shape[1])[None, :]
  return jnp.where(position == count, eos, x).astype(jnp.int32), (position <= count).astype(jnp.int32)


def split_prefix_suffix(tokens: jax.Array, segment_ids: jax.Array, prefix: jax.Array, *, ids: SpecialIds,
                        inputs_length: int, targets_length: int) -> dict[str, jax.Array]:
  """S-denoiser: inputs = first `prefix` [b] real tokens + EOS, targets = the rest + EOS (padded;
  the same keys as `corrupt_with_mask`)."""
  b, _ = tokens.shape
  rows = jnp.arange(b)[:, None]
  real = segment_ids > 0
  rank = jnp.cumsum(real, axis=1) - 1  # [b, L], index among the row's real tokens
  in_prefix = real & (rank < prefix[:, None])
  in_suffix = real & ~in_prefix
  inputs = jnp.full((b, inputs_length), ids.pad, jnp.int32).at[
      rows, jnp.where(in_prefix, rank, inputs_length)].set(tokens, mode="drop")
  targets = jnp.full((b, targets_length), ids.pad, jnp.int32).at[
      rows, jnp.where(in_suffix, rank - prefix[:, None], targets_length)].set(tokens, mode="drop")
  inputs, input_segment_ids = _append_eos(inputs, jnp.sum(in_prefix, axis=1, keepdims=True), ids.eos)
  targets, target_segment_ids = _append_eos(targets, jnp.sum(in_suffix, axis=1, keepdims=True), ids.eos)
  return {"inputs": inputs, "input_segment_ids": input_segment_ids,
          "targets": targets, "target_segment_ids": target_segment_ids}


def ul2_corrupt(tokens: jax.Array, segment_ids: jax.Array, rng: jax.Array, *, denoisers: tuple[Denoiser, ...],
                ids: SpecialIds, inputs_length: int, targets_length: int) -> dict[str, jax.Array]:
  """Every row [b, L] corrupted by its own denoiser, drawn from the mixture.

  Every R/X denoiser draws a noise mask for every row (its own key); `jnp.where` keeps the chosen
  denoiser's mask per row, and one `corrupt_with_mask` turns all R/X rows into inputs and targets
  (the same result as corrupting with each denoiser and selecting, with one corruption instead of
  six). S splits every row; its version is selected for the rows that chose S.

  Returns `corrupt_with_mask`'s keys ([b, inputs_length] inputs starting with the mode token,
  [b, targets_length] targets) and `denoiser` [b] int32 (index into `denoisers`). The masks and
  splits depend only on (segment_ids, rng), never on the token values.
  """
  b, length = tokens.shape
  choice_rng, *keys = jax.random.split(rng, 1 + len(denoisers))
  choice = choose_denoisers(choice_rng, b, tuple(d.weight for d in denoisers))  # [b]
  noise, out = jnp.zeros((b, length), bool), None
  for k, (d, key) in enumerate(zip(denoisers, keys)):
    if d.mode != "S":
      noise_k = noise_masks(key, b, length, d.noise_density, d.mean_span_length)  # [b, L]
      noise = jnp.where((choice == k)[:, None], noise_k, noise)
  if any(d.mode != "S" for d in denoisers):
    out = corrupt_with_mask(tokens, segment_ids, noise, ids=span_ids(ids), inputs_length=inputs_length - 1,
                            targets_length=targets_length)
  for k, (d, key) in enumerate(zip(denoisers, keys)):
    if d.mode == "S":  # at most one (parse_mixture refuses repeats)
      prefix = prefix_split(segment_ids, key, inputs_length - 2, targets_length - 1)  # [b]
      x = split_prefix_suffix(tokens, segment_ids, prefix, ids=ids, inputs_length=inputs_length - 1,
                              targets_length=targets_length)
      out = x if out is None else {n: jnp.where((choice == k)[:, None], x[n], out[n]) for n in x}  # per row
  modes = jnp.asarray([mode_id(ids, d.mode) for d in denoisers], jnp.int32)[choice]  # [b]
  out["inputs"] = jnp.concatenate([modes[:, None], out["inputs"]], axis=1)  # [b, I]
  out["input_segment_ids"] = jnp.pad(out["input_segment_ids"], ((0, 0), (1, 0)), constant_values=1)
  has_real = jnp.any(segment_ids > 0, axis=1, keepdims=True)  # [b, 1]; an all-padding row gives nothing
  for name in ("inputs", "targets"):
    seg = out[f"{name[:-1]}_segment_ids"] * has_real
    out[f"{name[:-1]}_segment_ids"] = seg
    out[name] = jnp.where(seg > 0, out[name], ids.pad)
  out["denoiser"] = choice
  return out


def decoder_row(x: dict[str, jax.Array], length: int, pad: int) -> dict[str, jax.Array]:
  """The decoder layout [mode, inputs..., targets..., pad...] of `ul2_corrupt`'s output.

  Returns `tokens`, `segment_ids` (1 on real tokens) [b, length], `prefix` [b] (mode + inputs)
  and `weights` [b, length] float32 (1 on the targets part)."""
  b = x["inputs"].shape[0]
  rows = jnp.arange(b)[:, None]
  n_in = jnp.sum(x["input_segment_ids"], axis=1)  # [b]
  n_total = n_in + jnp.sum(x["target_segment_ids"], axis=1)  # [b]
  in_pos = jnp.where(x["input_segment_ids"] > 0, jnp.arange(x["inputs"].shape[1]), length)  # [b, I]
  t_pos = jnp.where(x["target_segment_ids"] > 0, n_in[:, None] + jnp.arange(x["targets"].shape[1]), length)
  tokens = jnp.full((b, length), pad, jnp.int32).at[rows, in_pos].set(x["inputs"], mode="drop")
  tokens = tokens.at[rows, t_pos].set(x["targets"], mode="drop")  # [b, length]
  position = jnp.arange(length)[None, :]
  segment_ids = (position < n_total[:, None]).astype(jnp.int32)
  weights = ((position >= n_in[:, None]) & (segment_ids > 0)).astype(jnp.float32)
  return {"tokens": tokens, "segment_ids": segment_ids, "prefix": n_in, "weights": weights}


def visible_before(stream: jax.Array, offset: int, size: int) -> jax.Array:
  """[b, m] stream of raw-index tokens (flat raw index + offset; smaller = not a raw token) ->
  [b, m, size] bool: the raw tokens at stream positions strictly before each position."""
  onehot = (stream[:, :, None] - offset == jnp.arange(size)[None, None, :]).astype(jnp.int32)  # [b, m, size]
  return (jnp.cumsum(onehot, axis=1) - onehot) > 0


@OBJECTIVES.register("ul2")
@dataclasses.dataclass(frozen=True)
class UL2(Objective):
  """UL2 mixture of denoisers (R/X span corruption, S prefix LM) with [R]/[S]/[X] mode tokens.

  One denoiser per row, drawn from `mixture`; every denoiser is computed and the chosen one is
  selected per row, so shapes are static. Encoder-decoder or decoder (prefix-LM) layout.
  """

  # Denoisers and relative weights, comma-separated: MODE:MEAN_SPAN:RATE[=WEIGHT] for R and X
  # (T5 span corruption), S[=WEIGHT] for the prefix LM. Default: UL2's seven denoisers, S 20%,
  # each span denoiser 2/15.
  mixture: str = DEFAULT_MIXTURE
  # Model family the rows are laid out for, 'encoder_decoder' or 'decoder'; must equal model.family
  # (the raw row length depends on it).
  layout: str = "encoder_decoder"
  # encoder_decoder: decoder length; 0 = the smallest that fits every R/X denoiser. A larger
  # value widens the S denoiser's split range (shorter prefixes, longer suffixes).
  targets_length: int = 0

  families = LAYOUTS

  @classmethod
  def bidirectional_prompt(cls, objective_cfg) -> bool:
    return objective_cfg.get("layout", "encoder_decoder") == "decoder"

  def __post_init__(self):
    denoisers = parse_mixture(self.mixture)
    if self.layout not in LAYOUTS:
      raise ValueError(f"objective.layout={self.layout!r}: choose 'encoder_decoder' or 'decoder' (= model.family)")
    if self.targets_length < 0 or (self.targets_length and self.layout == "decoder"):
      raise ValueError(f"objective.targets_length={self.targets_length} must be >= 0, and 0 with layout='decoder'")
    need = len(MODES) + any(d.mode != "S" for d in denoisers)
    if len(self.ids.sentinels) < need:
      raise ValueError(f"objective 'ul2' needs at least {need} sentinels (the top {len(MODES)} are the mode tokens "
                       f"[R] [S] [X]); the tokenizer has {len(self.ids.sentinels)}")

  @property
  def denoisers(self) -> tuple[Denoiser, ...]:
    return parse_mixture(self.mixture)

  @property
  def bos_id(self) -> int:
    return self.ids.bos if self.ids.bos is not None else self.ids.eos

  @classmethod
  def check_config(cls, config) -> list[str]:
    problems = super().check_config(config)
    layout = config.objective.get("layout", "encoder_decoder")
    if layout in LAYOUTS and not family_matches(config.model.family, (layout,)):
      problems.append(f"objective.layout={layout!r} but model.family={config.model.family!r}; set "
                      f"objective.layout to the model family ('encoder_decoder' or 'decoder')")
    return problems

  def check_seq_len(self, seq_len: int) -> None:
    self.raw_length(seq_len)

  def raw_length(self, seq_len: int) -> int:
    length = max_raw_length(self.layout, seq_len, self.denoisers, self.targets_length)
    check_spans(length, self.denoisers, self.ids)
    return length

  def lengths(self, raw_length: int) -> Lengths:
    return static_lengths(self.layout, raw_length, self.denoisers, self.targets_length)

  def train_flops_per_row(self, model_cfg, seq_len: int) -> float:
    """encoder_decoder: encoder over `inputs`, decoder over `targets` positions; decoder: the row."""
    x = self.lengths(self.raw_length(seq_len))
    if self.layout == "decoder":
      return 3 * flops.row_forward_flops(model_cfg, x.row)
    return 3 * flops.seq2seq_forward_flops(model_cfg, x.inputs, x.targets)

  def corrupt(self, batch: dict[str, jax.Array], rng: jax.Array) -> dict[str, jax.Array]:
    """`ul2_corrupt` of a raw batch at this objective's static lengths."""
    x = self.lengths(batch["tokens"].shape[1])
    check_spans(batch["tokens"].shape[1], self.denoisers, self.ids)
    return ul2_corrupt(batch["tokens"], batch["segment_ids"], rng, denoisers=self.denoisers, ids=self.ids,
                       inputs_length=x.inputs, targets_length=x.targets)

  def _rows(self, x: dict[str, jax.Array], length: int) -> dict[str, jax.Array]:
    """Model rows of a corrupted batch: `targets`, `weights` per prediction slot, `stream` (what
    slot j sees: stream[:first + j]) and `first`; model inputs for the layout."""
    if self.layout == "decoder":
      row = decoder_row(x, self.lengths(length).row, self.ids.pad)
      return dict(row, targets=row["tokens"], stream=row["tokens"], first=0)
    weights = x["target_segment_ids"].astype(jnp.float32)
    return dict(x, weights=weights, stream=jnp.concatenate([x["inputs"], x["targets"]], axis=1),
                first=x["inputs"].shape[1])

  def _forward(self, model, params, batch, rng, *, train, loss=False):
    """(logits, model rows, corrupted batch): what `loss` and `predictions` share. With `loss`, the
    token loss and its metrics in place of the logits."""
    cfg_family = getattr(getattr(model, "cfg", None), "family", None)
    if cfg_family and not family_matches(cfg_family, (self.layout,)):
      raise ValueError(f"objective.layout={self.layout!r} cannot drive model family {cfg_family!r}")
    corrupt_rng, dropout_rng = jax.random.split(rng)
    x = self.corrupt(batch, corrupt_rng)
    rows = self._rows(x, batch["tokens"].shape[1])
    targets = self.token_targets(rows["targets"], rows["weights"]) if loss else None
    if self.layout == "decoder":
      segment_ids = rows["segment_ids"]
      positions = jnp.arange(segment_ids.shape[1])[None, :] * segment_ids  # [b, t]
      mask = ops.prefix_lm_mask(segment_ids, positions, rows["prefix"][:, None] + 1)  # [b, 1, t, t]
      logits = model.apply(
          {"params": params}, shift_right_by_segment(rows["tokens"], segment_ids, self.bos_id), segment_ids,
          positions, mask=mask, train=train, rngs={"dropout": dropout_rng}, loss=targets)  # [b, t, v]
    else:
      logits = seq2seq_logits(model, params, x, dropout_rng, train=train, start_id=self.ids.pad,
                              loss=targets)  # [b, t, v]
    return logits, rows, corrupt_rng

  def loss(self, model, params, batch, rng, *, train):
    return self._forward(model, params, batch, rng, train=train, loss=True)[0]

  def predictions(self, model, params, batch, rng) -> Predictions:
    """Slot j predicts targets[j] (decoder layout: row position j) and may see every raw token that
    reaches the model before it: the (corrupted) inputs and the targets before j (teacher forcing).

    Found by corrupting a batch of raw *indices* (row * L + position, offset past every token id)
    with the same key: the masks and splits do not depend on token values, so each index lands
    exactly where its token does."""
    logits, rows, corrupt_rng = self._forward(model, params, batch, rng, train=False)
    b, length = batch["tokens"].shape
    offset = max(self.ids.vocab_size, *self.ids.sentinels, self.ids.pad, self.ids.eos) + 1
    index = jnp.arange(b * length, dtype=jnp.int32).reshape(b, length) + offset  # [b, L]
    where = self._rows(self.corrupt(dict(batch, tokens=index), corrupt_rng), length)
    n, first = rows["targets"].shape[1], where["first"]
    source = jnp.where((where["targets"] >= offset) & (rows["weights"] > 0), where["targets"] - offset, -1)
    visible = visible_before(where["stream"], offset, b * length)[:, first:first + n]  # [b, n, b * L]
    return Predictions(logits=logits, targets=rows["targets"], weights=rows["weights"], source=source,
                       visible=visible)
