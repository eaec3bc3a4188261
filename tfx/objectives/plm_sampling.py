"""The sampling side of XLNet's permutation LM (OBJECTIVES.md §4): static lengths, target spans,
factorization orders, the content/query masks, and XLNet's [reuse, A, SEP, B, SEP, CLS] rows.

Pure `jnp` functions of (tokens, rng), used by `tfx.objectives.permutation_lm.PermutationLM`.
"""

import jax
import jax.numpy as jnp


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
  equal groups; with bi_data the forward and the reversed rows) at a random offset. XLNet does
  not use the A/B label; BERT's next-sentence prediction does (`random_b`). Without sentence boundaries in the corpus, the
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
    does); `is_func` [b, t] bool (the two SEPs and the CLS); `source` [b, t] int32, the flat raw
    index (row * (t - 3) + column) each position's token comes from, -1 for SEP/CLS and padding;
    `random_b` [b] bool, B is another row's text; `a_len` [b] int32, the tokens of A.
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
  source = jnp.where(is_func | ~real, -1, source_row * raw + source_col)  # [b, t] flat raw index
  return {"tokens": out.astype(jnp.int32), "token_types": token_types.astype(jnp.int32),
          "segment_ids": real.astype(jnp.int32), "is_func": is_func, "source": source.astype(jnp.int32),
          "random_b": random_b[:, 0], "a_len": a_len[:, 0].astype(jnp.int32)}


# ----------------------------------------------------------------------------- objective

LAYOUTS = ("xlnet", "plain")
