"""The objective interface: what is predicted from what.

An objective is a frozen dataclass registered by name in `tfx.registry.OBJECTIVES`. It owns
everything between the packed batch and the scalar loss: it builds the model's inputs,
targets, weights and masks with pure `jnp` functions of (batch, rng) inside the jitted step,
calls the model, and returns the mean loss over predicted tokens with named metrics.

    loss, metrics = objective.loss(model, params, batch, rng, train=True)

`batch` holds `tokens`, `segment_ids` (0 = padding) and `positions`, [b, raw_length] int32
each. `metrics` always has `loss`, `accuracy` and `num_tokens` (number of predicted tokens),
which weights gradient accumulation's micro-batches, evaluation's batches and a log window's
steps. A loss whose terms are means over different counts (MLM plus NSP / SOP's per-row term,
ELECTRA's generator and discriminator, distillation's soft and MLM terms) names them in
`loss_terms` and their counts in `metric_counts` (each count a metric of its own): accumulation
then scales each term by the whole batch's count of it, so that micro-batches give exactly the
whole batch's loss and gradient, and every aggregate weights a mean by its own count.

Stateful objectives (XLNet's memory over contiguous streams) set `stateful = True`, return
their initial state from `init_state` (global-batch shaped, with logical axis names from
`state_axes`), take `state=` in `loss` and return the next state as `metrics["state"]`. The
loop keeps it in the train state, shards it like activations and checkpoints it. They also set
`contiguous_rows = True` so that row b of step s+1 continues row b of step s (`row_stride`
tokens later; `reversed_streams` for XLNet's bi_data). `raw_length` is the raw row an objective
turns into a model row of `seq_len` tokens (its raw-row hook: span corruption needs more raw
tokens, XLNet's SEP/SEP/CLS layout fewer).

Objectives that own parameters (an ELECTRA generator and discriminator head, an NSP / SOP head)
return them from `init_params(rng, model, seq_len)`: a tree built like a model's `init` (boxed
with `nn.with_logical_partitioning`, so they are sharded by the same logical axis rules). The
loop stores them in the train state's params under the key `OBJECTIVE_PARAMS` ("objective"),
beside the model's own top-level names, so they are created sharded, optimised (same optimizer,
weight decay on matrices), checkpointed and restored with the model and count in its parameter
total; a run without them has no such key (older checkpoints restore unchanged). `loss` and
`predictions` receive that whole tree as `params` and take their part with `split_params`; the
model is applied to the model's part. Exports and fine-tuning (`tfx.runs.restore_params`,
`tfx.convert --to-hf`, `tfx.finetune`) read the model's part only: the main model is what the
objective trains for downstream use (ELECTRA's discriminator), the objective's parameters stay in
the run's checkpoints.

Objectives that read frozen arrays (a distillation teacher) set `frozen_inputs = True` and load
them in `load_frozen(model, mesh)`, placed on the mesh. The loop loads them once, passes them to
the jitted train and eval steps as an argument (never a compile-time constant) and to `loss` as
`frozen=`; they are neither optimised nor checkpointed.
"""

import dataclasses
import math
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from tfx import flops, ops
from tfx.objectives import options as options_lib


# Key of an objective's own parameters in the train state's params (see `Objective.init_params`).
OBJECTIVE_PARAMS = "objective"


def split_params(params) -> tuple[Any, Any]:
  """(the model's params, the objective's params or None) of the train state's params."""
  if isinstance(params, dict) and OBJECTIVE_PARAMS in params:
    return {k: v for k, v in params.items() if k != OBJECTIVE_PARAMS}, params[OBJECTIVE_PARAMS]
  return params, None


def model_params(params) -> Any:
  """The model's part of the train state's params (what export and fine-tuning read)."""
  return split_params(params)[0]


@dataclasses.dataclass(frozen=True)
class SpecialIds:
  """Token ids the objectives need, read from the tokenizer by name (never hard-coded)."""

  vocab_size: int
  pad: int
  eos: int
  bos: int | None = None
  unk: int | None = None
  mask: int | None = None
  cls: int | None = None
  sep: int | None = None
  sentinels: tuple[int, ...] = ()
  special: tuple[int, ...] = ()  # every id that is not an ordinary text piece

  @classmethod
  def from_tokenizer(cls, tok) -> "SpecialIds":
    return cls(
        vocab_size=tok.vocab_size, pad=tok.pad_id, eos=tok.eos_id, bos=tok.bos_id, unk=tok.unk_id,
        mask=tok.mask_id, cls=tok.cls_id, sep=tok.sep_id, sentinels=tuple(tok.sentinel_ids),
        special=tuple(tok.special_ids))


def placeholder_ids(vocab_size: int) -> SpecialIds:
  """Every special id present (100 sentinels): checks a config before the tokenizer exists."""
  vocab_size = max(vocab_size, 256)
  return SpecialIds(vocab_size=vocab_size, pad=0, eos=1, bos=2, unk=3, mask=4, cls=5, sep=6,
                    sentinels=tuple(range(vocab_size - 1, vocab_size - 101, -1)), special=tuple(range(7)))


class Predictions(NamedTuple):
  """What an objective predicts from what, for `tfx.check_objective` (`Objective.predictions`).

  Raw positions are flat indices into the batch's raw rows: `row * raw_length + position`.

  logits: [b, n, v] float, the model's output for each of n prediction slots per row.
  targets: [b, n] int, the id each slot predicts.
  weights: [b, n] float, > 0 where the slot is a real prediction (0 = padding slot).
  source: [b, n] int, the flat raw position of the token a slot predicts; -1 when it predicts
    something that is not a raw token (a sentinel, an EOS the objective appends, a class label).
  sees_self: [b, n] bool or None, slots that are shown their own token by design (BERT's kept
    10%); None = none is.
  visible: [b, n, b * raw_length] bool or None, the raw tokens each slot may depend on. None = the
    tokens of its own document (same row and segment) except its own token. Declare it when the
    objective hides more (later tokens of a factorization order, later targets) or shows other text.
  """

  logits: jax.Array
  targets: jax.Array
  weights: jax.Array
  source: jax.Array
  sees_self: jax.Array | None = None
  visible: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class Objective:
  """Base class. Subclasses set `families` and implement `loss`."""

  ids: SpecialIds
  # Weight of the z-loss (log^2 of the softmax normaliser), 0 = off (T5X uses 1e-4).
  z_loss: float = 0.0

  # Model families this objective can drive.
  families: ClassVar[tuple[str, ...]] = ()
  # Carries state from step to step (see the module docstring).
  stateful: ClassVar[bool] = False
  # Needs each batch row to continue the same row of the previous batch (a text stream).
  contiguous_rows: ClassVar[bool] = False
  # Draws masks, spans or orders from the step's key (False: deterministic, like causal LM).
  uses_rng: ClassVar[bool] = True
  # Reads frozen arrays (a teacher) given to `loss` as `frozen=` (see the module docstring).
  frozen_inputs: ClassVar[bool] = False

  @classmethod
  def from_config(cls, objective_cfg, ids: SpecialIds, *, strict: bool = True) -> "Objective":
    """Builds the objective from `config.objective` (`name` and this class's fields).

    A field the class does not have raises ValueError listing its fields; with strict=False it is
    dropped (the flat `config.objective` of runs written before objectives owned their fields)."""
    values = dict(objective_cfg.to_dict() if hasattr(objective_cfg, "to_dict") else objective_cfg)
    name = values.pop("name", cls.__name__)
    resolved = options_lib.section(cls, values, name=name, strict=strict)
    resolved.pop("name")
    return cls(ids=ids, **resolved)

  @classmethod
  def bidirectional_prompt(cls, objective_cfg) -> bool:
    """Whether a decoder trained with this objective saw its `[BOS] + prompt` bidirectionally (a
    prefix LM): tfx.generate then fills the cache with the prompt attending all of itself."""
    return False

  @classmethod
  def options(cls) -> list[options_lib.Option]:
    """This objective's configuration fields (name, type, default, the comment above it)."""
    return options_lib.options(cls)

  @classmethod
  def check_config(cls, config) -> list[str]:
    """Problems with `config` for this objective (messages that say how to fix them)."""
    problems = []
    if not family_matches(config.model.family, cls.families):
      problems.append(
          f"objective {config.objective.name!r} cannot drive model family {config.model.family!r}; "
          f"it drives: {', '.join(cls.families)}. Change objective.name or model.family.")
    if cls.stateful and config.train.grad_accum > 1:
      problems.append(f"objective {config.objective.name!r} carries state between steps and cannot accumulate "
                      "gradients over micro-batches; set train.grad_accum=1")
    if config.train.get("eval_memory", False) and not (cls.stateful and cls.contiguous_rows):
      problems.append(f"train.eval_memory=True: objective {config.objective.name!r} carries no memory between "
                      "batches; set train.eval_memory=False (it is for permutation_lm on xlnet with model.mem_len > 0)")
    # The objective's own field checks, before any tokenizer exists (ids are placeholders).
    try:
      cls.from_config(config.objective, placeholder_ids(config.data.vocab_size)).check_seq_len(config.data.seq_len)
    except (ValueError, TypeError) as e:
      problems.append(str(e))
    return problems

  def check_seq_len(self, seq_len: int) -> None:
    """Raises ValueError (with the fix) if rows of `seq_len` model tokens cannot be built."""

  def init_state(self, batch_size: int, model_cfg) -> Any:
    """The initial objective state for a global batch of `batch_size` rows (None = stateless)."""
    return None

  def state_axes(self) -> Any:
    """Logical axis names of each state array (a tree of tuples matching `init_state`)."""
    return None

  def init_params(self, rng: jax.Array, model, seq_len: int) -> Any:
    """Parameters this objective owns beside the model's (None = none), as boxed trees like a
    model's `init` output (logical axis names); stored under `params[OBJECTIVE_PARAMS]`."""
    return None

  def load_frozen(self, model, mesh) -> Any:
    """With `frozen_inputs`: the frozen arrays `loss` reads (`frozen=`), placed on `mesh`."""
    return None

  def abstract_frozen(self, model, mesh) -> Any:
    """With `frozen_inputs`: what `load_frozen` returns as `jax.ShapeDtypeStruct`s with their
    shardings, without loading anything (a step lowered and compiled but not run: `tfx.bench
    --lower`, whose devices may not be this machine's)."""
    return None

  def row_stride(self, seq_len: int) -> int:
    """With contiguous_rows: tokens between the starts of consecutive rows of a stream (0 = no overlap)."""
    return 0

  def reversed_streams(self) -> bool:
    """With contiguous_rows: the second half of every batch reads the first half's streams
    backwards (XLNet's bi_data)."""
    return False

  def needs_word_start(self) -> bool:
    """Needs the tokenizer's word starts (attach them with `with_word_start`)."""
    return False

  def with_word_start(self, word_start) -> "Objective":
    """A copy that knows which ids start a word (bool [v], `Tokenizer.word_start_mask()`)."""
    raise NotImplementedError(f"{type(self).__name__} does not use word starts")

  def train_flops_per_row(self, model_cfg, seq_len: int) -> float:
    """Model FLOPs (forward + backward = 3x forward) of one training row of `seq_len` model
    positions, for MFU; objectives whose model computes something else than one full-length
    stack with an output at every position override this."""
    return 3 * flops.row_forward_flops(model_cfg, seq_len)

  def raw_length(self, seq_len: int) -> int:
    """Raw tokens a packed row must hold for model sequence length `seq_len`."""
    return seq_len

  def token_targets(self, targets: jax.Array, weights: jax.Array) -> ops.TokenTargets:
    """What a model's `loss=` argument takes: the token loss of `targets` [b, t] weighted by
    `weights` [b, t] with this objective's z-loss, computed by the model's head (fused with the
    output projection when `model.loss_chunk` > 0; `Family.lm_head`)."""
    return ops.TokenTargets(targets, weights.astype(jnp.float32), self.z_loss)

  def loss(self, model, params, batch: dict[str, jax.Array], rng: jax.Array, *, train: bool
           ) -> tuple[jax.Array, dict[str, Any]]:
    raise NotImplementedError

  def predictions(self, model, params, batch: dict[str, jax.Array], rng: jax.Array) -> Predictions:
    """Every prediction of `loss(..., train=False)` on `batch` under `rng`, with the raw token it
    predicts and what it may see (`Predictions`). `tfx.check_objective` perturbs raw tokens with the
    key fixed and checks that no prediction depends on its own token or on a token it may not see.
    Stateful objectives run from their initial state."""
    raise NotImplementedError(f"{type(self).__name__} does not implement predictions(), which "
                              "tfx.check_objective needs to check what it predicts from what")

  def loss_from_predictions(self, predictions: Predictions) -> jax.Array | None:
    """The loss of `loss(..., train=False)` (no objective state) computed from `predictions`
    alone: by default the weighted mean cross entropy of their logits at their targets, plus the
    z-loss. `tfx.check_objective` requires the two to agree, so that the predictions it checks
    for leaks are the ones the loss trains on. An objective whose loss has other terms returns
    its own formula, or None (the check is skipped and says so)."""
    return ops.weighted_cross_entropy(predictions.logits, predictions.targets, predictions.weights,
                                      z_loss=self.z_loss)[0]

  def metric_counts(self) -> dict[str, str]:
    """The metrics that are means over a count other than num_tokens, each with the metric holding
    that count (a sum over the batch, as num_tokens is): e.g. {"sentence_loss": "sentence_rows"}.
    Gradient accumulation, evaluation and the logged windows weight each mean by its own count
    (`add_metrics`, `mean_metrics`); every other mean is weighted by num_tokens."""
    return {}

  def loss_terms(self) -> dict[str, float]:
    """A loss that is a weighted sum of means over different counts: {mean metric: its weight},
    with loss == sum(weight * metrics[name]). Gradient accumulation then scales each term of a
    micro-batch by the whole batch's count of it, so that the accumulated gradient is the whole
    batch's. Empty (the default): the loss is one mean over num_tokens."""
    return {}

  def train_differs(self) -> str:
    """Why `loss(..., train=True)` may differ from `loss(..., train=False)` with dropout off
    ("" = it may not: `tfx.check_objective` then requires them equal, since `predictions` shows
    the eval path)."""
    return ""

  def initial_loss(self, vocab_size: int) -> float:
    """The loss expected from a random model (near-uniform logits): ln(vocabulary)."""
    return math.log(vocab_size)


def count_of(objective: Objective, name: str) -> str | None:
  """The metric holding the count `name` is a mean over; None when `name` is a count itself."""
  counts = objective.metric_counts()
  if name == "num_tokens" or name in counts.values():
    return None
  return counts.get(name, "num_tokens")


def add_metrics(objective: Objective, totals: dict, metrics: dict) -> dict:
  """`totals` plus one batch's scalar metrics: counts summed, each mean as its sum (the mean times
  its count). Pure arithmetic, so it runs on host floats and on traced arrays alike; start from {}
  (or zeros)."""
  out = dict(totals)
  for k, v in metrics.items():
    count = count_of(objective, k)
    v = v if count is None else v * metrics[count]
    out[k] = out[k] + v if k in out else v
  return out


def mean_metrics(objective: Objective, totals: dict) -> dict:
  """The metrics of `add_metrics`' totals: each mean over its own summed count (at least 1), counts
  as summed, and a composite loss (`Objective.loss_terms`) recombined from its terms' means."""
  # on the host (floats, numpy scalars) no device op
  at_least_one = lambda n: jnp.maximum(n, 1.0) if isinstance(n, jax.Array) else max(float(n), 1.0)
  out = {k: v if count_of(objective, k) is None else v / at_least_one(totals[count_of(objective, k)])
         for k, v in totals.items()}
  if objective.loss_terms():
    out["loss"] = sum(weight * out[name] for name, weight in objective.loss_terms().items())
  return out


def family_matches(family: str, families: tuple[str, ...]) -> bool:
  """Whether model family `family` (a registered name or `file.py:Class`) is one of `families`
  (registered names): an outside family counts as the registered families it subclasses."""
  if family in families:
    return True
  from tfx.registry import FAMILIES, is_spec

  if not is_spec(family):
    return False
  try:
    cls = FAMILIES.get(family)
  except ValueError:
    return False
  return any(name in families and issubclass(cls, base) for name, base in FAMILIES.items())


def flat_positions(segment_ids: jax.Array) -> jax.Array:
  """[b, t] -> [b, t] int32: each raw position's flat index `row * t + position` (for `Predictions.source`)."""
  b, t = segment_ids.shape
  return (jnp.arange(b, dtype=jnp.int32)[:, None] * t + jnp.arange(t, dtype=jnp.int32)[None, :])


def causal_visible(segment_ids: jax.Array) -> jax.Array:
  """[b, t] -> [b, t, b * t] bool: position i may see the raw tokens before it in its own document."""
  b, t = segment_ids.shape
  same_doc = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (segment_ids[:, None, :] > 0)  # [b, t, t]
  earlier = jnp.arange(t)[None, :, None] > jnp.arange(t)[None, None, :]  # [1, t, t]
  return spread_rows(same_doc & earlier)


def spread_rows(within_row: jax.Array) -> jax.Array:
  """[b, n, t] -> [b, n, b * t]: a per-row visibility as flat raw positions (other rows invisible)."""
  b, n, t = within_row.shape
  eye = jnp.eye(b, dtype=bool)[:, None, :, None]  # [b, 1, b, 1]
  return (eye & within_row[:, :, None, :]).reshape(b, n, b * t)
