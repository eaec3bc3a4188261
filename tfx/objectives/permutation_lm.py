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
backwards (`reversed_streams`), and the xlnet family gets bi_sign = -1 on those rows (`HALVES`:
each half's encodings projected once), which negates their relative distances (a reversed row with
-1 computes what the forward row computes with +1). Evaluation batches are forward text.

Families: `xlnet`, or the ordinary `encoder` through its `two_stream` method (absolute or
rotary positions, no memory): the ablation that separates the objective from Transformer-XL.
"""

import dataclasses

import jax
import jax.numpy as jnp

from tfx import flops, ops
from tfx.nn.xlnet import HALVES
from tfx.objectives.base import Objective, Predictions, flat_positions, placeholder_ids
from tfx.objectives.options import internal
from tfx.objectives.plm_sampling import (  # noqa: F401  (re-exported: the sampling API lives there)
    LAYOUTS, resolve_lengths, half_goals, span_phase, span_targets, last_targets, sample_targets, local_permutation, row_order, xlnet_perm_mask, permutation_masks, target_mapping, check_layout, xlnet_rows)
from tfx.registry import OBJECTIVES


@OBJECTIVES.register("permutation_lm")
@dataclasses.dataclass(frozen=True)
class PermutationLM(Objective):
  """XLNet permutation LM over a two-stream model: the `xlnet` family, or the ordinary `encoder`
  (absolute or rotary positions, no memory) through its `two_stream` method.

  Lengths are resolved from the model row length t (`resolve_lengths`): the raw row length, plus
  3 with the XLNet layout.
  """

  # Prediction slots per row, 0 = round(seq_len/6) (85 for 512), split ceil/floor over the two halves.
  num_predict: int = 0
  # Block size of the local permutation, 0 = reuse_len; must divide both halves.
  perm_size: int = 0
  # Length of the first half (next step's memory), 0 = seq_len // 2.
  reuse_len: int = 0
  # Span context = mask_alpha * n / mask_beta around an n-token span (XLNet 6, 1).
  mask_alpha: float = 6.0
  # Divides the span context (see mask_alpha).
  mask_beta: float = 1.0
  # Longest span; lengths n in 1..max_span with p proportional to 1/n.
  max_span: int = 5
  # 'span' (XLNet's span sampler) or 'last' (the last 1/K of each half's factorization order).
  target_mode: str = "span"
  # XLNet's bi_data: the second half of every batch reads the first half's text streams backwards,
  # and the xlnet family negates their relative distances (even batch size).
  bi_data: bool = False
  # 'xlnet' = XLNet's row [reuse, A, <sep>, B, <sep>, <cls>] with token types 0/1/2 from seq_len - 3
  # stream tokens, attention crossing the stream's documents (as the memory does); 'plain' = the packed
  # row as is, attention inside each document.
  row_layout: str = "xlnet"
  # XLNet layout: probability that B is random text instead of A's continuation.
  random_b_rate: float = 0.5
  # Spans start at a word start (XLNet's sampler; sentencepiece '▁' pieces).
  word_spans: bool = False
  word_start: tuple[bool, ...] | None = internal()

  families = ("xlnet", "encoder")
  # Rows are contiguous streams advancing by reuse_len, and the memory (model.mem_len > 0) is
  # carried from step to step in the objective state.
  stateful = True
  contiguous_rows = True

  @classmethod
  def check_config(cls, config) -> list[str]:
    problems = super().check_config(config)
    m = config.model
    try:
      o = cls.from_config(config.objective, placeholder_ids(config.data.vocab_size))
    except (ValueError, TypeError):
      return problems  # reported by the base class's checks
    if m.family == "encoder":
      if m.mem_len:
        problems.append(f"permutation_lm on the encoder family has no memory; set model.mem_len=0 (got {m.mem_len}) "
                        "or use model.family=xlnet")
      if m.position == "relative":
        problems.append("permutation_lm on the encoder family needs model.position learned, sinusoidal or rotary "
                        "(the two-stream encoder has no T5 relative bias); the xlnet family has relative positions")
      if o.row_layout == "xlnet" and 0 < m.type_vocab_size < 3:
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
    if config.train.get("eval_memory", False) and not (m.family == "xlnet" and m.mem_len):
      problems.append("train.eval_memory=True needs memory: model.family=xlnet with model.mem_len > 0 "
                      f"(got {m.family}, mem_len {m.mem_len}); set train.eval_memory=False")
    accum = config.train.get("grad_accum", 1)
    if o.bi_data and config.train.batch_size % 2:
      problems.append(f"objective.bi_data=True reads half the batch backwards and needs an even train.batch_size, "
                      f"got {config.train.batch_size}")
    elif o.bi_data and accum > 1 and (config.train.batch_size // accum) % 2:
      # micro-batch a takes rows a, a + accum, ...: its first half forward, its second reversed
      problems.append(f"objective.bi_data=True with train.grad_accum={accum}: each micro-batch of "
                      f"{config.train.batch_size // accum} rows must hold as many forward rows as reversed ones; "
                      "make train.batch_size / train.grad_accum even")
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

  def train_differs(self) -> str:
    return "bi_data: in training the second half of the batch reads its distances reversed" if self.bi_data else ""

  def train_flops_per_row(self, model_cfg, seq_len: int) -> float:
    """Content stream over the row (plus memory), query stream over num_predict slots; the xlnet
    family projects its relative encodings per row only with bi_data and dropout on them (drawn per
    row); bi_data without dropout projects one encoding per half of the batch (`HALVES`)."""
    num_predict, _, _ = self.lengths(seq_len)
    memory = model_cfg.mem_len if model_cfg.family == "xlnet" else 0
    per_row = self.bi_data and model_cfg.dropout > 0
    return 3 * flops.two_stream_forward_flops(model_cfg, seq_len, num_predict, memory, per_row_encoding=per_row)

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
              "positions": batch["positions"].astype(jnp.int32), "is_func": is_func,
              "source": jnp.where(segment_ids > 0, flat_positions(segment_ids), -1)}
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
    slots = self.token_targets(x["target_ids"], x["target_mask"])  # the loss computed by the model's head
    (loss, metrics), new_mems = self.logits_on_features(model, params, x, rng, train=train, mems=mems, bi_sign=bi_sign,
                                                        loss=slots)
    if mems is not None:
      metrics = dict(metrics, state=new_mems.astype(mems.dtype))  # bf16 compute: the carried memory stays float32
    return loss, metrics

  def logits_on_features(self, model, params, x: dict[str, jax.Array], rng: jax.Array, *, train: bool, mems=None,
                         bi_sign=None, loss: ops.TokenTargets | None = None):
    """(logits [b, n, v] of the prediction slots, new memory or None); with `loss` (the slots'
    `ops.TokenTargets`) the head's (loss, metrics) in place of the logits (`Family.lm_head`)."""
    content, query = x["content_mask"], x["query_mask"]
    if hasattr(model, "two_stream"):  # an ordinary family: absolute / rotary positions, no memory
      if mems is not None:
        raise ValueError("the two-stream encoder has no memory; set model.mem_len=0")
      out = model.apply(  # [b, n, v] logits, or (loss, metrics)
          {"params": params}, x["tokens"], x["positions"], content, query, x["target_mapping"],
          token_types=x["token_types"], train=train, rngs={"dropout": rng}, method="two_stream", loss=loss)
      new_mems = None
    else:
      if mems is not None:
        visible = jnp.ones(content.shape[:2] + (mems.shape[2],), bool)  # [b, t, m]
        content = jnp.concatenate([visible, content], axis=-1)  # [b, t, m + t]
        query = jnp.concatenate([visible, query], axis=-1)
      out, new_mems = model.apply(
          {"params": params}, x["tokens"], x["token_types"], content, query,
          x["target_mapping"], mems, bi_sign, train=train, rngs={"dropout": rng}, loss=loss)
    return out, new_mems

  def predictions(self, model, params, batch, rng):
    """Slot m predicts the raw token at its target position from what its query stream may see:
    the tokens before it in the factorization order (and, in the XLNet layout, the row's text,
    which may cross documents and include B from another row). No memory."""
    feature_rng, dropout_rng = jax.random.split(rng)
    x = self.features(batch, feature_rng)
    logits, _ = self.logits_on_features(model, params, x, dropout_rng, train=False)
    b, raw = batch["tokens"].shape
    position = jnp.argmax(x["target_mapping"], axis=-1)  # [b, n], the model position of each slot
    source = jnp.take_along_axis(x["source"], position, axis=1)  # [b, n]
    query = jnp.take_along_axis(x["query_mask"], position[:, :, None], axis=1)  # [b, n, t]
    from_raw = jax.nn.one_hot(x["source"], b * raw, dtype=jnp.float32)  # [b, t, b * raw]; -1 -> zeros
    visible = jnp.einsum("bnt,btq->bnq", query.astype(jnp.float32), from_raw) > 0  # [b, n, b * raw]
    return Predictions(logits, x["target_ids"], x["target_mask"], source, visible=visible)

  def loss(self, model, params, batch, rng, *, train, state=None):
    """`state` is the memory carried from the previous step (None: no memory, e.g. eval). With
    bi_data, training batches hold reversed rows in their second half (`HALVES`); so do eval
    batches evaluated with memory (train.eval_memory); other evaluation batches are forward text."""
    feature_rng, dropout_rng = jax.random.split(rng)
    x = self.features(batch, feature_rng)
    # eval with memory (state given) reads the training layout, reversed half included
    bi_sign = HALVES if self.bi_data and (train or state is not None) else None
    return self.loss_on_features(model, params, x, dropout_rng, train=train, mems=state, bi_sign=bi_sign)
