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
  the first half. On top (tfx packing), attention never crosses documents and never reaches
  padding (segment 0); a padding row sees only itself.
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

Not yet: XLNet's raw row layout [reuse, A, SEP, B, SEP, CLS] with token types 0/1/2 (rows are
one segment with token types 0; func tokens are the `ids.sep` / `ids.cls` that occur) and
bi_data (reversed rows with bi_sign = -1; the model supports it). Within a row, attention does
not cross packed documents, while the memory does carry the previous text of the stream,
documents included, as XLNet's streams do.
"""

import dataclasses

import jax
import jax.numpy as jnp

from tfx import ops
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


# ----------------------------------------------------------------------------- objective


@OBJECTIVES.register("permutation_lm")
@dataclasses.dataclass(frozen=True)
class PermutationLM(Objective):
  """XLNet permutation LM over a two-stream model (family `xlnet`).

  Lengths are resolved from the batch's static row length t (`resolve_lengths`).
  """

  num_predict: int = 0  # 0 = round(seq_len / 6)
  perm_size: int = 0  # 0 = reuse_len
  reuse_len: int = 0  # 0 = seq_len // 2
  mask_alpha: float = 6.0
  mask_beta: float = 1.0
  max_span: int = 5
  target_mode: str = "span"  # "span" | "last"
  bi_data: bool = False

  families = ("xlnet",)
  # Rows are contiguous streams advancing by reuse_len, and the memory (model.mem_len > 0) is
  # carried from step to step in the objective state.
  stateful = True
  contiguous_rows = True

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

  def __post_init__(self):
    if self.target_mode not in ("span", "last"):
      raise ValueError(f"objective.target_mode must be 'span' or 'last', got {self.target_mode!r}")
    if self.max_span < 1:
      raise ValueError(f"objective.max_span must be >= 1, got {self.max_span}")
    if self.mask_alpha <= 0 or self.mask_beta <= 0:
      raise ValueError(f"objective.mask_alpha and mask_beta must be > 0, got {self.mask_alpha}, {self.mask_beta}")
    if min(self.num_predict, self.perm_size, self.reuse_len) < 0:
      raise ValueError("objective.num_predict, perm_size and reuse_len must be >= 0 (0 = default)")
    if self.bi_data:
      raise NotImplementedError("objective.bi_data=True (reversed rows with negated distances) is not implemented "
                                "yet; set objective.bi_data=False")

  def func_ids(self) -> tuple[int, ...]:
    """Ids that are func tokens (never predicted; see everything before them in the order)."""
    return tuple(i for i in (self.ids.sep, self.ids.cls) if i is not None)

  def lengths(self, seq_len: int) -> tuple[int, int, int]:
    """(num_predict, reuse_len, perm_size) for rows of `seq_len` tokens."""
    return resolve_lengths(seq_len, self.num_predict, self.reuse_len, self.perm_size)

  def features(self, batch: dict[str, jax.Array], rng: jax.Array) -> dict[str, jax.Array]:
    """Model inputs and prediction targets of a batch.

    Returns a dict of `tokens`, `token_types`, `segment_ids`, `z` [b, t] int32;
    `targets`, `is_func` [b, t] bool; `content_mask`, `query_mask` [b, t, t] bool;
    `target_mapping` [b, n, t] float32; `target_ids` [b, n] int32; `target_mask` [b, n] float32.
    """
    tokens = batch["tokens"].astype(jnp.int32)
    segment_ids = batch["segment_ids"].astype(jnp.int32)
    b, t = tokens.shape
    num_predict, reuse_len, perm_size = self.lengths(t)
    order_rng, target_rng = jax.random.split(rng)
    z = jax.vmap(lambda k: row_order(k, t, reuse_len, perm_size))(jax.random.split(order_rng, b))  # [b, t]
    is_func = jnp.zeros_like(tokens, bool)
    for func_id in self.func_ids():
      is_func = is_func | (tokens == func_id)
    eligible = (segment_ids > 0) & ~is_func
    targets = sample_targets(
        tokens, target_rng, eligible=eligible, num_predict=num_predict, reuse_len=reuse_len,
        mode=self.target_mode, z=z, max_span=self.max_span, mask_alpha=self.mask_alpha, mask_beta=self.mask_beta)
    content, query = jax.vmap(lambda g, f, o, s: permutation_masks(g, f, o, reuse_len, s))(
        targets, is_func, z, segment_ids)  # [b, t, t] each
    predicted = targets & jnp.any(query, axis=-1)  # a target that sees no key at all is not predicted
    mapping, target_ids, target_mask = jax.vmap(lambda g, x: target_mapping(g, x, num_predict))(predicted, tokens)
    return {"tokens": tokens, "token_types": jnp.zeros_like(tokens), "segment_ids": segment_ids, "z": z,
            "targets": targets, "is_func": is_func, "content_mask": content, "query_mask": query,
            "target_mapping": mapping, "target_ids": target_ids, "target_mask": target_mask}

  def loss_on_features(self, model, params, x: dict[str, jax.Array], rng: jax.Array, *, train: bool, mems=None):
    """(loss, metrics) of the model on prepared `features`; metrics["state"] = the new memory
    when `mems` [l, b, m, e] is given (memory columns are always visible)."""
    content, query = x["content_mask"], x["query_mask"]
    if mems is not None:
      visible = jnp.ones(content.shape[:2] + (mems.shape[2],), bool)  # [b, t, m]
      content = jnp.concatenate([visible, content], axis=-1)  # [b, t, m + t]
      query = jnp.concatenate([visible, query], axis=-1)
    logits, new_mems = model.apply(
        {"params": params}, x["tokens"], x["token_types"], content, query,
        x["target_mapping"], mems, None, train=train, rngs={"dropout": rng})  # [b, n, v]
    loss, metrics = ops.weighted_cross_entropy(logits, x["target_ids"], x["target_mask"], z_loss=self.z_loss)
    if mems is not None:
      metrics = dict(metrics, state=new_mems)
    return loss, metrics

  def loss(self, model, params, batch, rng, *, train, state=None):
    """`state` is the memory carried from the previous step (None: no memory, e.g. eval)."""
    feature_rng, dropout_rng = jax.random.split(rng)
    return self.loss_on_features(model, params, self.features(batch, feature_rng), dropout_rng, train=train,
                                 mems=state)
