"""The pieces of a training step, shared by tfx.train, tfx.finetune, tfx.bench and the checker.

  Experiment        everything built from a config before anything is compiled
  make_optimizer    AdamW + warmup/cosine schedule + clipping (decay on matrices only: `decay_mask`)
  state_shardings / init_state   the train state, created directly in its sharded layout
  make_train_step / make_eval_step / evaluate   the jitted steps and the token-weighted eval
"""

import dataclasses
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax

from tfx import parallel
from tfx.data import DataPipeline
from tfx.objectives import OBJECTIVE_PARAMS, Objective, add_metrics, count_of, mean_metrics

@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: optimizer steps taken
  params: Any
  opt_state: Any
  rng: jax.Array  # uint32 key data; the key of step s is fold_in(rng, s)
  objective_state: Any = None  # state a stateful objective carries between steps (XLNet memory)



@dataclasses.dataclass
class Experiment:
  """Everything built from the config before anything is compiled."""

  config: ml_collections.ConfigDict
  workdir: str
  tokenizer: Any
  objective: Objective
  model: nn.Module
  pipeline: DataPipeline
  mesh: jax.sharding.Mesh
  tx: optax.GradientTransformation
  schedule: optax.Schedule
  corpus: dict = dataclasses.field(default_factory=dict)  # the store's identity, in every checkpoint
  frozen: Any = None  # the objective's frozen inputs (a teacher), loaded once by `objective_frozen`


def make_optimizer(config) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW with linear warmup and cosine decay; clipping; decay on matrices only."""
  o, steps = config.optim, config.train.steps
  warmup = min(o.warmup_steps, max(steps - 1, 0))
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=o.learning_rate, warmup_steps=warmup,
      decay_steps=max(steps, warmup + 1), end_value=o.learning_rate * o.final_lr_fraction)
  # No clipping is an identity in the same place: the optimizer state has one structure whatever
  # optim.grad_clip is, so a resume may turn clipping on or off (drift calls it safe).
  clip = optax.clip_by_global_norm(o.grad_clip) if o.grad_clip > 0 else optax.identity()
  adamw = optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=decay_mask)
  return optax.chain(clip, adamw), schedule


def applied_learning_rate(schedule: optax.Schedule, opt_state) -> jax.Array:
  """The rate the update applies: the schedule at the optimizer's own count, which a non-finite step
  skipped under train.on_nonfinite=skip does not advance (the train step counter does)."""
  counts = [count for path, count in optax.tree_utils.tree_get_all_with_path(opt_state, "count")
            if getattr(path[-1], "tuple_name", "") == "ScaleByScheduleState"]
  return schedule(counts[0])


def decay_mask(params) -> Any:
  """True for the parameters weight decay applies to: matrices (kernels, embeddings), not biases
  (`bias`, `output_bias`, XLNet's `r_w_bias` ...), norm scales or vectors. A scanned stack's
  leading layers axis does not make a vector a matrix (its path holds the `layers` key)."""

  def decays(path, p) -> bool:
    keys = [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]  # (a partitioning box's .value is not)
    name = keys[-1] if keys else ""
    ndim = p.ndim - (1 if "layers" in keys[:-1] else 0)
    return ndim >= 2 and not name.endswith("bias") and name != "scale"

  return jax.tree_util.tree_map_with_path(decays, params)



# ============================================================================ state


def _init_fn(model: nn.Module, tx: optax.GradientTransformation, seq_len: int, objective=None, batch_size: int = 1):
  """rng -> TrainState with boxed (logically partitioned) params and objective state."""

  def init(rng):
    inputs = type(model).init_inputs(1, seq_len)  # traced with the rest: no array made on a device
    params_rng, state_rng = jax.random.split(rng)
    params = model.init({"params": params_rng, "dropout": params_rng}, **inputs)["params"]
    own = objective.init_params(jax.random.fold_in(params_rng, 1), model, seq_len) if objective is not None else None
    if own is not None:  # the objective's parameters, beside the model's (tfx/objectives/base.py)
      params = {**params, OBJECTIVE_PARAMS: own}
    objective_state = objective.init_state(batch_size, model.cfg) if objective is not None else None
    if objective_state is not None:
      objective_state = jax.tree.map(nn.LogicallyPartitioned, objective_state, objective.state_axes())
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                      rng=jax.random.key_data(state_rng), objective_state=objective_state)

  return init


def state_shardings(model: nn.Module, tx, mesh, seq_len: int, objective=None, batch_size: int = 1):
  """(abstract unboxed state, NamedShardings) from the logical axis names, without computing."""
  key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
  with parallel.context(mesh):
    boxed = jax.eval_shape(_init_fn(model, tx, seq_len, objective, batch_size), key)
  shardings = parallel.logical_to_sharding(boxed, mesh)
  return nn.unbox(boxed), shardings


def init_state(model: nn.Module, tx, mesh, seq_len: int, seed: int, shardings, objective=None,
               batch_size: int = 1) -> TrainState:
  """The train state, created directly in its sharded layout (no host holds all of it)."""
  init = _init_fn(model, tx, seq_len, objective, batch_size)
  with parallel.context(mesh):
    return jax.jit(lambda r: nn.unbox(init(r)), out_shardings=shardings)(jax.random.key(seed))


# ============================================================================ steps


def objective_frozen(exp: Experiment):
  """(frozen inputs, their shardings) of the objective (a teacher; None, None without), loaded once."""
  if not getattr(exp.objective, "frozen_inputs", False):
    return None, None
  if exp.frozen is None:
    exp.frozen = exp.objective.load_frozen(exp.model, exp.mesh)
  return exp.frozen, jax.tree.map(lambda x: x.sharding, exp.frozen)


def objective_kwargs(objective, objective_state=None, frozen=None) -> dict:
  """The keyword arguments `objective.loss` takes besides the batch: its carried state (stateful
  objectives; None = start from an empty state) and its frozen inputs (objectives with a teacher)."""
  extra = {"state": objective_state} if objective.stateful else {}
  if getattr(objective, "frozen_inputs", False):
    extra["frozen"] = frozen
  return extra


def _loss_and_grads(exp: Experiment, params, batch, rng, objective_state=None, frozen=None):
  """Mean loss and its gradient, accumulated over `train.grad_accum` micro-batches so that both are
  the whole batch's: a micro-batch's gradient weighted by its share of num_tokens, or, for a loss
  whose terms are means over different counts (`Objective.loss_terms`), each term scaled by the
  whole batch's count of it (counted first, from the objective's inputs alone: the model's
  forward pass in that count is dead code, which XLA removes).

  Returns (metrics, grads, next objective state).
  """
  objective = exp.objective
  extra = objective_kwargs(objective, objective_state, frozen)
  loss_fn = lambda p, b, r: objective.loss(exp.model, p, b, r, train=True, **extra)
  accum = exp.config.train.grad_accum
  if accum == 1:
    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, rng)
    metrics = dict(metrics)
    return metrics, grads, metrics.pop("state", None)

  # Micro-batch a takes rows a, a + accum, ...: each device keeps its own rows.
  micro = jax.tree.map(lambda x: jnp.swapaxes(x.reshape(-1, accum, *x.shape[1:]), 0, 1), batch)
  micro_rngs = jax.vmap(lambda a: jax.random.fold_in(rng, a))(jnp.arange(accum))
  terms = objective.loss_terms()
  if terms:
    term_counts = sorted({count_of(objective, name) for name in terms})
    counts = jax.lax.map(lambda xs: {c: jax.lax.stop_gradient(loss_fn(params, *xs)[1][c]) for c in term_counts},
                         (micro, micro_rngs))  # {count: [accum]}
    totals = {c: jnp.maximum(jnp.sum(v), 1.0) for c, v in counts.items()}

    def micro_loss(p, b, r):  # this micro-batch's share of the whole batch's loss
      _, m = loss_fn(p, b, r)
      count = lambda name: count_of(objective, name)
      return sum(w * m[name] * m[count(name)] / totals[count(name)] for name, w in terms.items()), m
  else:
    micro_loss = loss_fn
  grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

  def body(carry, xs):
    grads_sum, stats = carry
    (_, m), g = grad_fn(params, *xs)
    scale = 1.0 if terms else m["num_tokens"]  # the plain mean's gradient is weighted here
    grads_sum = jax.tree.map(lambda s, gi: s + gi * scale, grads_sum, g)
    return (grads_sum, add_metrics(objective, stats, m)), None

  zeros = jax.tree.map(jnp.zeros_like, params)
  stat_keys = jax.eval_shape(lambda: loss_fn(params, *jax.tree.map(lambda x: x[0], (micro, micro_rngs)))[1])
  stats0 = {k: jnp.zeros((), jnp.float32) for k in stat_keys}
  (grads_sum, stats), _ = jax.lax.scan(body, (zeros, stats0), (micro, micro_rngs))
  scale = 1.0 if terms else 1.0 / jnp.maximum(stats["num_tokens"], 1.0)
  grads = jax.tree.map(lambda g: g * scale, grads_sum)
  return mean_metrics(objective, stats), grads, None  # stateful objectives run without accumulation (see validate)


def make_train_step(exp: Experiment, shardings):
  """Jitted (state, batch[, poison]) -> (state, metrics), state donated, shardings pinned.

  The objective's frozen inputs (a teacher) are the jitted function's third argument.
  metrics["nonfinite"] is 1.0 when the step's loss or gradient norm is not finite (computed on
  device, read with the other metrics). With train.on_nonfinite == "skip" such a step leaves
  params, optimizer and objective state as they were (the step counter still advances). With
  train.poison_step > 0 (a test hook) the step takes a fourth argument, a float32 scalar that
  multiplies the parameters the loss sees: 1.0 normally, NaN to inject a non-finite step.
  """
  train_cfg = exp.config.get("train", {})
  skip = train_cfg.get("on_nonfinite", "stop") == "skip"
  poisonable = train_cfg.get("poison_step", 0) > 0
  frozen, frozen_shardings = objective_frozen(exp)

  def step_fn(state: TrainState, batch, frozen, poison=None):
    rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
    params_in = state.params if poison is None else jax.tree.map(lambda p: p * poison.astype(p.dtype), state.params)
    metrics, grads, objective_state = _loss_and_grads(exp, params_in, batch, rng, state.objective_state, frozen)
    updates, opt_state = exp.tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    grad_norm = optax.global_norm(grads)
    finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
    new = state.replace(step=state.step + 1, params=params, opt_state=opt_state, objective_state=objective_state)
    if skip:  # a non-finite step changes nothing but the counter
      keep = lambda n, o: jnp.where(finite, n, o)
      new = new.replace(params=jax.tree.map(keep, new.params, state.params),
                        opt_state=jax.tree.map(keep, new.opt_state, state.opt_state),
                        objective_state=jax.tree.map(keep, new.objective_state, state.objective_state))
    metrics = dict(metrics, grad_norm=grad_norm, learning_rate=applied_learning_rate(exp.schedule, state.opt_state),
                   nonfinite=1.0 - finite.astype(jnp.float32))
    return new, metrics

  in_shardings = (shardings, parallel.batch_sharding(exp.mesh), frozen_shardings)
  if poisonable:
    in_shardings += (parallel.replicated(exp.mesh),)
  jitted = jax.jit(step_fn, in_shardings=in_shardings,
                   out_shardings=(shardings, parallel.replicated(exp.mesh)), donate_argnums=(0,))

  def run(state, batch, poison=None):
    with parallel.context(exp.mesh):
      if poisonable:
        return jitted(state, batch, frozen, jnp.float32(1.0 if poison is None else poison))
      return jitted(state, batch, frozen)

  run.jitted = jitted  # for tfx.bench: lower().compile() timing, called as jitted(state, batch, run.frozen)
  run.frozen = frozen
  return run


def make_eval_step(exp: Experiment, shardings):
  """Jitted (params, batch) -> metrics. A stateful objective evaluates from an empty state, or,
  with train.eval_memory, carries its state (XLNet's memory) from one eval batch to the next as
  in training: then the step is (params, batch, state) -> (metrics, state) and `run.initial_state()`
  gives the state to start from (the eval batches are then contiguous held-out streams)."""
  frozen, frozen_shardings = objective_frozen(exp)
  carry = bool(exp.objective.stateful and exp.config.get("train", {}).get("eval_memory", False))

  def eval_fn(params, batch, frozen, state=None):
    extra = objective_kwargs(exp.objective, state, frozen)  # state None: eval starts from an empty state
    _, metrics = exp.objective.loss(exp.model, params, batch, jax.random.key(0), train=False, **extra)
    out = {k: v for k, v in metrics.items() if k != "state"}
    return (out, metrics["state"]) if carry else out

  in_shardings = (shardings.params, parallel.batch_sharding(exp.mesh), frozen_shardings)
  out_shardings = parallel.replicated(exp.mesh)
  if carry:
    in_shardings += (shardings.objective_state,)
    out_shardings = (out_shardings, shardings.objective_state)
  jitted = jax.jit(eval_fn, in_shardings=in_shardings, out_shardings=out_shardings)

  def run(params, batch, state=None):
    with parallel.context(exp.mesh):
      return jitted(params, batch, frozen, state) if carry else jitted(params, batch, frozen)

  def initial_state():
    init = exp.objective.init_state(exp.config.train.batch_size, exp.model.cfg)
    return jax.device_put(init, shardings.objective_state)

  run.jitted = jitted  # (params, batch, frozen inputs[, state])
  run.carry, run.initial_state = carry, initial_state
  return run


def evaluate(exp: Experiment, eval_step, params, batches) -> dict[str, float]:
  """The eval metrics over the held-out batches: each mean weighted by its count (num_tokens, or
  the objective's own, `Objective.metric_counts`), counts summed."""
  totals: dict[str, float] = {}
  carry = getattr(eval_step, "carry", False)
  state = eval_step.initial_state() if carry else None
  for batch in batches:
    out = eval_step(params, parallel.global_batch(batch, exp.mesh), *((state,) if carry else ()))
    out, state = out if carry else (out, None)
    totals = add_metrics(exp.objective, totals, {k: float(v) for k, v in jax.device_get(out).items()})
  if not totals:
    return {"num_tokens": 0.0}
  return {k: float(v) for k, v in mean_metrics(exp.objective, totals).items()}
