"""Permutation language modelling (XLNet), OBJECTIVES.md §4.

Every step draws, per row and on device, which tokens are predicted and in which
factorization order, then drives a two-stream model (family `xlnet`) with the matching
attention masks.

A row of t = seq_len tokens is cut into two halves, the "reuse" half [0, reuse_len) and the
rest [reuse_len, t), as in zihangdai/xlnet (the reuse half is what becomes the next step's
memory).

- Targets (`sample_targets`), per half, with goals ceil(num_predict/2) for the reuse half and
  floor(num_predict/2) for the rest (85 -> 43 + 42):
  - `target_mode="span"`: the §4.1 sampler. Repeat: n ~ {1..max_span} with p ∝ 1/n, clipped to
    what is left of the goal; ctx = floor(n·mask_alpha/mask_beta) (at least 1); l_ctx ~
    U{0..ctx-1}; the span starts at cur + l_ctx, moved forward to the next eligible position
    (and word start, when `word_start` is given); it covers n positions, cut short at the
    first ineligible one. A span that would reach the end of the half stops the loop;
    otherwise cur = end + ctx - l_ctx. Then uniformly random single eligible positions are
    added until the goal is met exactly (or no eligible position is left).
  - `target_mode="last"`: the last `goal` eligible positions of the half's factorization order.
  Eligible = real (segment > 0) and not a func token (`ids.sep`, `ids.cls`), so spans never
  cover SEP/CLS/padding, and a half with enough eligible positions gets exactly its goal.
  Word alignment: by default spans are n pieces with no word alignment (which is what the
  original computes in practice: its n-gram end test reads seg[beg] instead of seg[end], so
  its spans are n subword pieces that merely start at a word start, §4.1). Passing
  `word_start` (bool per position) to `sample_targets` reproduces that: spans start at a word
  start and cover n pieces.
- Order (`local_permutation`): per half, one random permutation of the offsets in a block of
  perm_size, shared by all blocks of the half; blocks keep their order. z[p] is the rank of
  position p in the factorization order (ranks of the second half are offset by reuse_len).
- Masks (`permutation_masks`), tfx convention (True = may attend), from XLNet's perm_mask
  (1 = cannot), built within each half exactly as `_local_perm`:

      nonmask  = ~target & ~func
      rev      = -1 on nonmask, else z
      selfrev  = rev on targets, else rev + 1
      perm[i,j] = selfrev[i] <= rev[j] and not nonmask[j]
      query    = ~perm;   content = query with the diagonal set

  Across halves: first-half rows see nothing of the second half; second-half rows see all of
  the first half. On top, attention never crosses segment ids (documents in the plain
  layout; the XLNet layout makes the row one segment) and never reaches padding (segment 0);
  a padding row sees only itself.
- Predictions (`target_mapping`): one one-hot row per target, in position order, zero rows
  after, num_predict rows in all (a target with no visible key at all, possible only in tiny
  or heavily padded rows without memory, is dropped rather than predicted from a uniform
  softmax over masked keys).
- Loss: Σ CE · target_mask / Σ target_mask over the query stream's logits.

Memory (model.mem_len > 0): the objective is stateful. Its state is the memory [layers, batch,
mem_len, d_model] (zeros at the start), passed to the model as `mems` with the memory columns
always visible, and replaced by the model's new memory after every step; the loop checkpoints
it. Rows are contiguous text streams that advance by reuse_len (`row_stride`), so the memory
of a row's first reuse_len positions is the text right before the next row. Evaluation runs
without memory.

Row layout (`row_layout`, the objective's raw-row hook):
- "xlnet" (default): XLNet's row [reuse, A, SEP, B, SEP, CLS] with token types 0/1/2, built
  on device from a raw stream row of seq_len - 3 tokens (`xlnet_rows`): A follows the reuse
  part, B continues A or (probability `random_b_rate`) is random text from another row. The
  row is one text: attention crosses the stream's documents (separated by EOS), exactly as the
  memory carries the stream's previous text. Func tokens are the two SEPs and the CLS.
- "plain": the packed row as it is; attention stays inside each document and func tokens are
  SEP/CLS ids wherever they occur.

bi_data: the pipeline serves the second half of every batch as the first half's streams read
backwards (`reversed_streams`), and the xlnet family gets bi_sign = -1 on those rows, which
negates their relative distances (a reversed row with -1 computes what the forward row
computes with +1). Evaluation batches are forward text.

Families: `xlnet`, or the ordinary `encoder` through its `two_stream` method (absolute or
rotary positions, no memory): the ablation that separates the objective from Transformer-XL.
"""

import dataclasses

import jax
import jax.numpy as jnp

from tfx import flops, ops
from tfx.objectives.base import Objective, SpecialIds
from tfx.registry import OBJECTIVES


# ----------------------------------------------------------------------------- lengths (static)


def resolve_lengths(seq_len: int, num_predict: int = 0, reuse_len: int = 0, perm_size: int = 0
                    ) -> tuple[int, int, int]:
  """(num_predict, reuse_len, perm_size) with the 0 = default rules applied, checked.

  num_predict 0 -> round(seq_len / 6) (round-half-to-even: 512 -> 85); reuse_len 0 ->
  seq_len // 2; perm_size 0 -> reuse_len. Both halves must be whole numbers of perm_size blocks.
  """
  num_predict = num_predict or int(round(seq_len / 6))
  reuse_len = reuse_len or seq_len // 2
  perm_size = perm_size or reuse_len
  if not 0 < reuse_len < seq_len:
    raise ValueError(f"objective.reuse_len must be in (0, seq_len={seq_len}), got {reuse_len}")
  if reuse_len % perm_size or (seq_len - reuse_len) % perm_size:
    raise ValueError(f"objective.perm_size={perm_size} must divide both halves of the row (reuse_len={reuse_len} "
                     f"and seq_len - reuse_len={seq_len - reuse_len}); set objective.perm_size to a common divisor")
  if num_predict < 1:
    raise ValueError(f"objective.num_predict must be >= 1 (0 = round(seq_len/6)), got {num_predict}")
  return num_predict, reuse_len, perm_size


def half_goals(num_predict: int) -> tuple[int, int]:
  """(reuse half, second half) goals: ceil / floor of num_predict / 2 (85 -> 43, 42), as xlnet."""
  second = num_predict // 2
  return num_predict - second, second


# ----------------------------------------------------------------------------- targets (device)


def _next_true(x: jax.Array) -> jax.Array:
  """bool [L] -> int32 [L + 1]: the smallest index >= p where x is True (L if none)."""
  length = x.shape[0]
  index = jnp.where(x, jnp.arange(length), length)
  nxt = jax.lax.cummin(index, axis=0, reverse=True)
  return jnp.concatenate([nxt, jnp.array([length])]).astype(jnp.int32)


def _fill_randomly(chosen: jax.Array, eligible: jax.Array, need: jax.Array, rng: jax.Array) -> jax.Array:
  """bool [L]: `chosen` plus `need` uniformly random eligible, unchosen positions (all if fewer)."""
  candidate = eligible & ~chosen
  score = jnp.where(candidate, jax.random.uniform(rng, chosen.shape), 2.0)  # [L]
  rank = jnp.argsort(jnp.argsort(score))  # [L], 0 = smallest score
  return chosen | (candidate & (rank < need))


def span_phase(
    eligible: jax.Array,
    rng: jax.Array,
    *,
    goal: int,
    max_span: int = 5,
    mask_alpha: float = 6.0,
    mask_beta: float = 1.0,
    word_start: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """The span loop of the §4.1 sampler on one half (before the random single positions).

  Runs at most `goal` iterations (each one that does not stop adds >= 1 target). Spans never
  touch each other (at least one context position separates them) and stay inside the half.

  Args:
    eligible: bool [L], positions that may be predicted (real, not SEP/CLS).
    rng: key of the span loop.
    goal: static number of targets.
    max_span, mask_alpha, mask_beta: span lengths n ∈ {1..max_span} with p ∝ 1/n, context
      floor(n·mask_alpha/mask_beta) (at least 1).
    word_start: optional bool [L]; spans then start at a word start (and cover n pieces).
  Returns:
    (bool [L] span positions, int32 [] their number, <= goal).
  """
  length = eligible.shape[0]
  index = jnp.arange(length)
  starts = eligible if word_start is None else eligible & word_start
  next_start = _next_true(starts)  # [L + 1]
  next_blocked = _next_true(~eligible)  # [L + 1]
  log_p = jnp.log(1.0 / jnp.arange(1, max_span + 1))  # [max_span], unnormalised
  keys = jax.random.split(rng, max(goal, 1))  # [goal], one per iteration (each adds >= 1 target)

  def body(k, state):
    mask, count, cur, done = state
    n_key, ctx_key = jax.random.split(keys[k])
    n = jax.random.categorical(n_key, log_p) + 1
    n = jnp.minimum(n, goal - count)
    ctx = jnp.maximum(jnp.floor(n * mask_alpha / mask_beta).astype(jnp.int32), 1)
    l_ctx = jax.random.randint(ctx_key, (), 0, ctx)
    beg = next_start[jnp.minimum(cur + l_ctx, length)]
    stop = done | (count >= goal) | (beg + n >= length)
    end = jnp.minimum(beg + n, next_blocked[jnp.minimum(beg, length)])
    span = (index >= beg) & (index < end) & ~stop  # [L]
    return (mask | span, count + jnp.sum(span), jnp.where(stop, cur, end + ctx - l_ctx), stop)

  init = (jnp.zeros(length, bool), jnp.int32(0), jnp.int32(0), jnp.bool_(False))
  mask, count, _, _ = jax.lax.fori_loop(0, goal, body, init)
  return mask, count


def span_targets(
    eligible: jax.Array,
    rng: jax.Array,
    *,
    goal: int,
    max_span: int = 5,
    mask_alpha: float = 6.0,
    mask_beta: float = 1.0,
    word_start: jax.Array | None = None,
) -> jax.Array:
  """The §4.1 sampler on one half: bool [L] with exactly min(goal, Σ eligible) True.

  `span_phase`, then uniformly random single eligible positions up to the goal (arguments as
  there).
  """
  if goal <= 0:
    return jnp.zeros(eligible.shape, bool)
  span_rng, fill_rng = jax.random.split(rng)
  mask, count = span_phase(eligible, span_rng, goal=goal, max_span=max_span, mask_alpha=mask_alpha,
                           mask_beta=mask_beta, word_start=word_start)
  return _fill_randomly(mask, eligible, goal - count, fill_rng)


def last_targets(eligible: jax.Array, z: jax.Array, *, goal: int) -> jax.Array:
  """bool [L]: the last `goal` eligible positions of the factorization order z [L] (all if fewer)."""
  score = jnp.where(eligible, -z, jnp.iinfo(jnp.int32).max)  # latest in the order first
  rank = jnp.argsort(jnp.argsort(score))
  return eligible & (rank < goal)


def sample_targets(
    tokens: jax.Array,
    rng: jax.Array,
    *,
    eligible: jax.Array,
    num_predict: int,
    reuse_len: int,
    mode: str = "span",
    z: jax.Array | None = None,
    max_span: int = 5,
    mask_alpha: float = 6.0,
    mask_beta: float = 1.0,
    word_start: jax.Array | None = None,
) -> jax.Array:
  """Which positions are predicted, per row and per half.

  Args:
    tokens: [b, t] int (only its shape is used; eligibility comes in `eligible`).
    rng: the step's key; row r uses split(rng, b)[r], half h split(that, 2)[h].
    eligible: bool [b, t], real non-func positions.
    num_predict: static total goal per row, split ceil/floor over the two halves.
    reuse_len: static length of the first half.
    mode: "span" (§4.1 sampler) or "last" (end of the factorization order; needs z).
    z: int [b, t] factorization ranks (mode "last").
    max_span, mask_alpha, mask_beta, word_start ([b, t] bool or None): see `span_targets`.
  Returns:
    bool [b, t] targets.
  """
  b, t = tokens.shape
  goals = half_goals(num_predict)
  bounds = ((0, reuse_len), (reuse_len, t))
  if mode == "last":
    if z is None:
      raise ValueError("target_mode 'last' needs the factorization order z")
    return jnp.concatenate(
        [jax.vmap(lambda e, o, g=g: last_targets(e, o, goal=g))(eligible[:, lo:hi], z[:, lo:hi])
         for (lo, hi), g in zip(bounds, goals)], axis=1)
  if mode != "span":
    raise ValueError(f"objective.target_mode must be 'span' or 'last', got {mode!r}")
  keys = jax.vmap(lambda k: jax.random.split(k, 2))(jax.random.split(rng, b))  # [b, 2] keys
  halves = []
  for h, ((lo, hi), g) in enumerate(zip(bounds, goals)):
    starts = None if word_start is None else word_start[:, lo:hi]

    def one(e, k, s, g=g):
      return span_targets(e, k, goal=g, max_span=max_span, mask_alpha=mask_alpha, mask_beta=mask_beta,
                          word_start=s)

    halves.append(jax.vmap(one)(eligible[:, lo:hi], keys[:, h], starts))
  return jnp.concatenate(halves, axis=1)


# ----------------------------------------------------------------------------- order and masks (device)


def local_permutation(rng: jax.Array, t: int, perm_size: int) -> jax.Array:
  """int32 [t]: factorization rank z of each position; one offset permutation shared by all blocks.

  z[p] = (p // perm_size) * perm_size + π(p % perm_size): blocks keep their order.
  """
  if t % perm_size:
    raise ValueError(f"perm_size={perm_size} must divide the length {t}")
  offsets = jax.random.permutation(rng, perm_size).astype(jnp.int32)  # [perm_size]
  position = jnp.arange(t, dtype=jnp.int32)
  return (position // perm_size) * perm_size + offsets[position % perm_size]


def row_order(rng: jax.Array, t: int, reuse_len: int, perm_size: int) -> jax.Array:
  """int32 [t]: independent local permutations of the two halves (ranks offset by reuse_len)."""
  first_rng, second_rng = jax.random.split(rng)
  return jnp.concatenate([local_permutation(first_rng, reuse_len, perm_size),
                          reuse_len + local_permutation(second_rng, t - reuse_len, perm_size)])


def xlnet_perm_mask(targets: jax.Array, is_func: jax.Array, z: jax.Array, reuse_len: int) -> jax.Array:
  """bool [t, t]: XLNet's perm_mask (True = i cannot attend j), §4.2 rules 2-5.

  Args:
    targets, is_func: bool [t]; z: int [t] factorization ranks; reuse_len: first-half length.
  """
  t = targets.shape[0]
  targets = targets & ~is_func
  nonmask = ~targets & ~is_func
  rev = jnp.where(nonmask, -1, z)  # [t]
  selfrev = jnp.where(targets, rev, rev + 1)  # [t]
  within = (selfrev[:, None] <= rev[None, :]) & ~nonmask[None, :]  # [t, t]
  second = jnp.arange(t) >= reuse_len  # [t]
  same_half = second[:, None] == second[None, :]
  first_row_second_col = ~second[:, None] & second[None, :]
  return jnp.where(same_half, within, first_row_second_col)


def permutation_masks(
    targets: jax.Array,
    is_func: jax.Array,
    z: jax.Array,
    reuse_len: int,
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """(content_mask, query_mask), bool [t, t] each, True = may attend.

  Args:
    targets: bool [t] predicted positions.
    is_func: bool [t] SEP/CLS positions.
    z: int [t] factorization ranks.
    reuse_len: static length of the first half.
    segment_ids: optional int [t] (0 = padding): attention then stays inside documents and
      never reaches padding; a padding row sees only itself.
  Returns:
    content_mask = query_mask with the diagonal set; query_mask = ~perm_mask.
  """
  t = targets.shape[0]
  query = ~xlnet_perm_mask(targets, is_func, z, reuse_len)
  eye = jnp.eye(t, dtype=bool)
  if segment_ids is not None:
    real = segment_ids > 0
    same = (segment_ids[:, None] == segment_ids[None, :]) & real[:, None] & real[None, :]
    query = (query & same) | (eye & ~real[:, None])
  return query | eye, query


def target_mapping(targets: jax.Array, tokens: jax.Array, num_predict: int
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The prediction slots of one row.

  Args:
    targets: bool [t]; tokens: int [t]; num_predict: static number of slots n.
  Returns:
    (mapping float32 [n, t]: row m one-hot at the m-th target in position order, zero rows
    after; target_ids int32 [n], 0 on empty rows; target_mask float32 [n]). Targets beyond
    the n-th are dropped.
  """
  t = targets.shape[0]
  (index,) = jnp.nonzero(targets, size=num_predict, fill_value=0)  # [n]
  mask = jnp.arange(num_predict) < jnp.sum(targets)  # [n]
  mapping = jax.nn.one_hot(index, t, dtype=jnp.float32) * mask[:, None]  # [n, t]
  target_ids = jnp.where(mask, tokens[index], 0).astype(jnp.int32)
  return mapping, target_ids, mask.astype(jnp.float32)


# ----------------------------------------------------------------------------- row layout (device)


def check_layout(seq_len: int, reuse_len: int) -> None:
  """The XLNet row needs at least one token each for A and B after the reuse part."""
  if seq_len - reuse_len < 5:
    raise ValueError(f"the XLNet row layout needs seq_len - reuse_len >= 5 (A, SEP, B, SEP, CLS), got "
                     f"seq_len={seq_len}, reuse_len={reuse_len}; lower objective.reuse_len or set "
                     "objective.row_layout=plain")


def xlnet_rows(
    tokens: jax.Array,
    segment_ids: jax.Array,
    rng: jax.Array,
    *,
    reuse_len: int,
    sep: int,
    cls: int,
    pad: int,
    random_b_rate: float = 0.5,
    groups: int = 1,
) -> dict[str, jax.Array]:
  """XLNet's row [reuse, A, SEP, B, SEP, CLS] (§4.1) from raw stream rows of t - 3 tokens.

  The reuse part is the raw row's first reuse_len tokens and A follows it in the stream; A has
  a_len ~ U{1..n-1} tokens, n = t - reuse_len - 3, and B the other n - a_len, so the row is
  always full. B continues A (the raw tokens after it) or, with probability `random_b_rate`,
  is a stretch of the next row of the same direction group (rows are split into `groups`
  equal groups; with bi_data the forward and the reversed rows) at a random offset. The A/B
  label is not returned: XLNet does not use it. Without sentence boundaries in the corpus, the
  cut is uniform over token positions (XLNet cuts at a random line end).

  Args:
    tokens, segment_ids: [b, t - 3] int raw rows (segment 0 = padding).
    rng: key of the layout draws.
    reuse_len, sep, cls, pad: static layout lengths and ids.
    random_b_rate: probability that B is random text rather than A's continuation.
    groups: static number of row groups that B may be drawn across (never across groups).
  Returns:
    `tokens` [b, t] int32; `token_types` [b, t] int32 (0: reuse, A, first SEP; 1: B, second
    SEP; 2: CLS); `segment_ids` [b, t] int32, 1 on real positions and 0 on padding (the row is
    one text: attention crosses the stream's documents, as XLNet's does and as its memory
    does); `is_func` [b, t] bool (the two SEPs and the CLS).
  """
  b, raw = tokens.shape
  t = raw + 3
  n = raw - reuse_len  # tokens of A and B together
  check_layout(t, reuse_len)
  if b % groups:
    raise ValueError(f"batch of {b} rows cannot be split into {groups} groups")
  cut_rng, coin_rng, offset_rng = jax.random.split(rng, 3)
  a_len = jax.random.randint(cut_rng, (b, 1), 1, n)  # [b, 1] in [1, n - 1]
  random_b = jax.random.bernoulli(coin_rng, random_b_rate, (b, 1))  # [b, 1]
  b_len = n - a_len  # [b, 1]
  offset = jnp.floor(jax.random.uniform(offset_rng, (b, 1)) * (raw - b_len + 1)).astype(jnp.int32)  # [b, 1]
  size = b // groups
  row = jnp.arange(b)[:, None]  # [b, 1]
  other = (row // size) * size + (row % size + 1) % size  # [b, 1] next row of the same group
  p = jnp.arange(t)[None, :]  # [1, t]
  first_sep = reuse_len + a_len  # [b, 1]
  in_b = (p > first_sep) & (p < t - 2)  # [b, t]
  k = p - first_sep - 1  # [b, t] index inside B
  source_row = jnp.where(in_b & random_b, other, row)  # [b, t]
  source_col = jnp.where(in_b, jnp.where(random_b, offset + k, p - 1), p)  # continuation: skip the SEP
  source_col = jnp.clip(source_col, 0, raw - 1)
  text = tokens[source_row, source_col]  # [b, t]
  real_text = segment_ids[source_row, source_col] > 0
  is_sep = (p == first_sep) | (p == t - 2)
  is_cls = p == t - 1
  is_func = is_sep | is_cls
  real = jnp.where(is_func, jnp.any(segment_ids > 0, axis=1, keepdims=True), real_text)  # [b, t]
  out = jnp.where(is_sep, sep, jnp.where(is_cls, cls, jnp.where(real, text, pad)))
  token_types = jnp.where(p <= first_sep, 0, jnp.where(is_cls, 2, 1))
  return {"tokens": out.astype(jnp.int32), "token_types": token_types.astype(jnp.int32),
          "segment_ids": real.astype(jnp.int32), "is_func": is_func}


def bi_signs(batch_size: int) -> jax.Array:
  """float32 [b]: +1 for the forward rows [0, b/2), -1 for the reversed rows (bi_data)."""
  return jnp.where(jnp.arange(batch_size) < batch_size // 2, 1.0, -1.0).astype(jnp.float32)


# ----------------------------------------------------------------------------- objective

LAYOUTS = ("xlnet", "plain")


@OBJECTIVES.register("permutation_lm")
@dataclasses.dataclass(frozen=True)
class PermutationLM(Objective):
  """XLNet permutation LM over a two-stream model: the `xlnet` family, or the ordinary `encoder`
  (absolute or rotary positions, no memory) through its `two_stream` method.

  Lengths are resolved from the model row length t (`resolve_lengths`): the raw row length, plus
  3 with the XLNet layout.
  """

  num_predict: int = 0  # 0 = round(seq_len / 6)
  perm_size: int = 0  # 0 = reuse_len
  reuse_len: int = 0  # 0 = seq_len // 2
  mask_alpha: float = 6.0
  mask_beta: float = 1.0
  max_span: int = 5
  target_mode: str = "span"  # "span" | "last"
  bi_data: bool = False
  row_layout: str = "xlnet"  # "xlnet" | "plain"
  random_b_rate: float = 0.5
  word_spans: bool = False  # spans start at a word start (needs word_start)
  word_start: tuple[bool, ...] | None = None

  families = ("xlnet", "encoder")
  # Rows are contiguous streams advancing by reuse_len, and the memory (model.mem_len > 0) is
  # carried from step to step in the objective state.
  stateful = True
  contiguous_rows = True

  @classmethod
  def check_config(cls, config) -> list[str]:
    problems = super().check_config(config)
    m, o = config.model, config.objective
    if m.family == "encoder":
      if m.mem_len:
        problems.append(f"permutation_lm on the encoder family has no memory; set model.mem_len=0 (got {m.mem_len}) "
                        "or use model.family=xlnet")
      if m.position == "relative":
        problems.append("permutation_lm on the encoder family needs model.position learned, sinusoidal or rotary "
                        "(the two-stream encoder has no T5 relative bias); the xlnet family has relative positions")
      if o.get("row_layout", "xlnet") == "xlnet" and 0 < m.type_vocab_size < 3:
        problems.append(f"the XLNet row layout has token types 0/1/2 but model.type_vocab_size={m.type_vocab_size}; "
                        "set model.type_vocab_size=3 (or 0), or objective.row_layout=plain")
    if m.family == "xlnet" and m.mem_len:
      try:
        _, reuse_len, _ = resolve_lengths(config.data.seq_len, o.num_predict, o.reuse_len, o.perm_size)
      except ValueError:
        reuse_len = None  # reported by the objective's own checks
      if reuse_len is not None and m.reuse_len != reuse_len:
        problems.append(f"model.reuse_len={m.reuse_len} must equal the objective's reuse length {reuse_len} "
                        "(objective.reuse_len, 0 = seq_len // 2): the memory is built from the first reuse_len "
                        "positions, which the next row continues; set both to the same value")
    if o.get("bi_data", False) and config.train.batch_size % 2:
      problems.append(f"objective.bi_data=True reads half the batch backwards and needs an even train.batch_size, "
                      f"got {config.train.batch_size}")
    return problems

  def init_state(self, batch_size: int, model_cfg):
    """Zero memory [layers, batch, mem_len, d_model] (XLNet starts from zeros), or None."""
    if not model_cfg.mem_len:
      return None
    return jnp.zeros((model_cfg.num_layers, batch_size, model_cfg.mem_len, model_cfg.d_model), jnp.float32)

  def state_axes(self):
    return ("layers", "act_batch", "act_length", "act_embed")

  def row_stride(self, seq_len: int) -> int:
    """Consecutive rows of a stream start reuse_len tokens apart: the memory built from a row's
    first reuse_len positions is then exactly the text before the next row."""
    return self.lengths(seq_len)[1]

  def reversed_streams(self) -> bool:
    return self.bi_data

  def raw_length(self, seq_len: int) -> int:
    """The XLNet layout adds SEP, SEP and CLS to seq_len - 3 stream tokens."""
    return seq_len - 3 if self.row_layout == "xlnet" else seq_len

  def needs_word_start(self) -> bool:
    return self.word_spans

  def with_word_start(self, word_start) -> "PermutationLM":
    return dataclasses.replace(self, word_start=tuple(bool(x) for x in word_start))

  def __post_init__(self):
    if self.target_mode not in ("span", "last"):
      raise ValueError(f"objective.target_mode must be 'span' or 'last', got {self.target_mode!r}")
    if self.row_layout not in LAYOUTS:
      raise ValueError(f"objective.row_layout must be one of {LAYOUTS}, got {self.row_layout!r}")
    if self.max_span < 1:
      raise ValueError(f"objective.max_span must be >= 1, got {self.max_span}")
    if self.mask_alpha <= 0 or self.mask_beta <= 0:
      raise ValueError(f"objective.mask_alpha and mask_beta must be > 0, got {self.mask_alpha}, {self.mask_beta}")
    if min(self.num_predict, self.perm_size, self.reuse_len) < 0:
      raise ValueError("objective.num_predict, perm_size and reuse_len must be >= 0 (0 = default)")
    if not 0.0 <= self.random_b_rate <= 1.0:
      raise ValueError(f"objective.random_b_rate must be in [0, 1], got {self.random_b_rate}")
    if self.row_layout == "xlnet" and (self.ids.sep is None or self.ids.cls is None):
      raise ValueError("the XLNet row layout needs <sep> and <cls> ids, but the tokenizer has none; "
                       "set objective.row_layout=plain")
    if self.word_start is not None and len(self.word_start) != self.ids.vocab_size:
      raise ValueError(f"word_start has {len(self.word_start)} entries, expected vocab_size={self.ids.vocab_size}")

  def func_ids(self) -> tuple[int, ...]:
    """Ids that are func tokens in the plain layout (never predicted; see everything before them)."""
    return tuple(i for i in (self.ids.sep, self.ids.cls) if i is not None)

  def lengths(self, seq_len: int) -> tuple[int, int, int]:
    """(num_predict, reuse_len, perm_size) for model rows of `seq_len` tokens."""
    return resolve_lengths(seq_len, self.num_predict, self.reuse_len, self.perm_size)

  def train_flops_per_row(self, model_cfg, seq_len: int) -> float:
    """Content stream over the row (plus memory), query stream over num_predict slots."""
    num_predict, _, _ = self.lengths(seq_len)
    memory = model_cfg.mem_len if model_cfg.family == "xlnet" else 0
    return 3 * flops.two_stream_forward_flops(model_cfg, seq_len, num_predict, memory)

  def check_seq_len(self, seq_len: int) -> None:
    _, reuse_len, _ = self.lengths(seq_len)
    if self.row_layout == "xlnet":
      check_layout(seq_len, reuse_len)

  def layout(self, batch: dict[str, jax.Array], rng: jax.Array) -> dict[str, jax.Array]:
    """The model row of each raw row: `tokens`, `token_types`, `segment_ids`, `positions` [b, t]
    int32 and `is_func` [b, t] bool (see `xlnet_rows`; the plain layout keeps the packed row,
    attention stays inside its documents, and func tokens are SEP/CLS wherever they occur)."""
    tokens = batch["tokens"].astype(jnp.int32)
    segment_ids = batch["segment_ids"].astype(jnp.int32)
    if self.row_layout == "plain":
      is_func = jnp.zeros_like(tokens, bool)
      for func_id in self.func_ids():
        is_func = is_func | (tokens == func_id)
      return {"tokens": tokens, "token_types": jnp.zeros_like(tokens), "segment_ids": segment_ids,
              "positions": batch["positions"].astype(jnp.int32), "is_func": is_func}
    b, raw = tokens.shape
    _, reuse_len, _ = self.lengths(raw + 3)
    row = xlnet_rows(tokens, segment_ids, rng, reuse_len=reuse_len, sep=self.ids.sep, cls=self.ids.cls,
                     pad=self.ids.pad, random_b_rate=self.random_b_rate, groups=2 if self.bi_data else 1)
    row["positions"] = jnp.broadcast_to(jnp.arange(raw + 3, dtype=jnp.int32), (b, raw + 3))
    return row

  def features(self, batch: dict[str, jax.Array], rng: jax.Array) -> dict[str, jax.Array]:
    """Model inputs and prediction targets of a batch.

    Returns a dict of `tokens`, `token_types`, `segment_ids`, `positions`, `z` [b, t] int32;
    `targets`, `is_func` [b, t] bool; `content_mask`, `query_mask` [b, t, t] bool;
    `target_mapping` [b, n, t] float32; `target_ids` [b, n] int32; `target_mask` [b, n] float32.
    """
    layout_rng, order_rng, target_rng = jax.random.split(rng, 3)
    x = self.layout(batch, layout_rng)
    tokens, segment_ids, is_func = x["tokens"], x["segment_ids"], x["is_func"]
    b, t = tokens.shape
    num_predict, reuse_len, perm_size = self.lengths(t)
    z = jax.vmap(lambda k: row_order(k, t, reuse_len, perm_size))(jax.random.split(order_rng, b))  # [b, t]
    eligible = (segment_ids > 0) & ~is_func
    word_start = None
    if self.word_spans:
      if self.word_start is None:
        raise ValueError("objective.word_spans=True needs the tokenizer's word starts: build the objective with "
                         ".with_word_start(tokenizer.word_start_mask())")
      word_start = jnp.asarray(self.word_start, bool)[tokens]  # [b, t]
    targets = sample_targets(
        tokens, target_rng, eligible=eligible, num_predict=num_predict, reuse_len=reuse_len,
        mode=self.target_mode, z=z, max_span=self.max_span, mask_alpha=self.mask_alpha, mask_beta=self.mask_beta,
        word_start=word_start)
    content, query = jax.vmap(lambda g, f, o, s: permutation_masks(g, f, o, reuse_len, s))(
        targets, is_func, z, segment_ids)  # [b, t, t] each
    predicted = targets & jnp.any(query, axis=-1)  # a target that sees no key at all is not predicted
    mapping, target_ids, target_mask = jax.vmap(lambda g, y: target_mapping(g, y, num_predict))(predicted, tokens)
    return dict(x, z=z, targets=targets, content_mask=content, query_mask=query, target_mapping=mapping,
                target_ids=target_ids, target_mask=target_mask)

  def loss_on_features(self, model, params, x: dict[str, jax.Array], rng: jax.Array, *, train: bool, mems=None,
                       bi_sign=None):
    """(loss, metrics) of the model on prepared `features`; metrics["state"] = the new memory
    when `mems` [l, b, m, e] is given (memory columns are always visible). `bi_sign` [b] (+1 /
    -1 per row) flips the relative distances of reversed rows (xlnet family only)."""
    content, query = x["content_mask"], x["query_mask"]
    if hasattr(model, "two_stream"):  # an ordinary family: absolute / rotary positions, no memory
      if mems is not None:
        raise ValueError("the two-stream encoder has no memory; set model.mem_len=0")
      logits = model.apply(
          {"params": params}, x["tokens"], x["positions"], content, query, x["target_mapping"],
          token_types=x["token_types"], train=train, rngs={"dropout": rng}, method="two_stream")  # [b, n, v]
      new_mems = None
    else:
      if mems is not None:
        visible = jnp.ones(content.shape[:2] + (mems.shape[2],), bool)  # [b, t, m]
        content = jnp.concatenate([visible, content], axis=-1)  # [b, t, m + t]
        query = jnp.concatenate([visible, query], axis=-1)
      logits, new_mems = model.apply(
          {"params": params}, x["tokens"], x["token_types"], content, query,
          x["target_mapping"], mems, bi_sign, train=train, rngs={"dropout": rng})  # [b, n, v]
    loss, metrics = ops.weighted_cross_entropy(logits, x["target_ids"], x["target_mask"], z_loss=self.z_loss)
    if mems is not None:
      metrics = dict(metrics, state=new_mems)
    return loss, metrics

  def loss(self, model, params, batch, rng, *, train, state=None):
    """`state` is the memory carried from the previous step (None: no memory, e.g. eval). With
    bi_data, training batches hold reversed rows in their second half (`bi_signs`); evaluation
    batches are forward text only."""
    feature_rng, dropout_rng = jax.random.split(rng)
    x = self.features(batch, feature_rng)
    bi_sign = bi_signs(x["tokens"].shape[0]) if self.bi_data and train else None
    return self.loss_on_features(model, params, x, dropout_rng, train=train, mems=state, bi_sign=bi_sign)
