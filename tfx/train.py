"""THE training loop: one loop for every model family and objective.

    python -m tfx.train --config configs/quickstart.py --workdir runs/quickstart [--config.k=v ...]

Reads as a story:
  1. Config: load, override, validate (before anything is compiled or read).
  2. Data: the token store (prepared from a raw source once) -> packed rows, this host's slice only.
  3. Model, objective, optimizer: looked up in the registries by name.
  4. State: created already sharded (eval_shape -> shardings -> jit with out_shardings).
  5. Step: jax.grad of objective.loss, optional gradient accumulation, optax update;
     jitted with in/out shardings and the state donated.
  6. Checkpoints: orbax, async; resume restores state, PRNG and data position.
  7. Loop: log, evaluate, checkpoint, stop (end, stop_after or SIGTERM).
"""

import dataclasses
import inspect
import json
import os
import signal
import sys
import time
from typing import Any

import flax
import flax.linen as nn
from etils import epath
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from tfx import checkpoint, config as config_lib, flops, gcs, parallel
from tfx.data import DataPipeline
from tfx.data.training import corpus_changes, training_data
from tfx.errors import DataError, UserError
from tfx.metrics import MetricsWriter, Progress
from tfx.models import build_model
from tfx.objectives import Objective, SpecialIds
from tfx.registry import OBJECTIVES, file_sha256, load_builtins


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: optimizer steps taken
  params: Any
  opt_state: Any
  rng: jax.Array  # uint32 key data; the key of step s is fold_in(rng, s)
  objective_state: Any = None  # state a stateful objective carries between steps (XLNet memory)


# ============================================================================ set-up


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


def make_optimizer(config) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW with linear warmup and cosine decay; clipping; decay on matrices only."""
  o, steps = config.optim, config.train.steps
  warmup = min(o.warmup_steps, max(steps - 1, 0))
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=o.learning_rate, warmup_steps=warmup,
      decay_steps=max(steps, warmup + 1), end_value=o.learning_rate * o.final_lr_fraction)
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  parts = [optax.clip_by_global_norm(o.grad_clip)] if o.grad_clip > 0 else []
  parts.append(optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=decay_mask))
  return optax.chain(*parts), schedule


def build(config: ml_collections.ConfigDict, workdir: str) -> Experiment:
  """Validates the config and builds data, model, objective, mesh and optimizer."""
  load_builtins()
  config_lib.validate(config, num_devices=jax.device_count(), process_count=jax.process_count())
  d = config.data
  try:
    data = training_data(config, workdir, process_index=jax.process_index())
  except (ValueError, FileNotFoundError) as e:
    raise DataError(str(e)) from e
  tokenizer = data.tokenizer
  objective = OBJECTIVES.get(config.objective.name).from_config(config.objective, SpecialIds.from_tokenizer(tokenizer))
  if objective.needs_word_start():
    objective = objective.with_word_start(tuple(bool(b) for b in tokenizer.word_start_mask()))
  model = build_model(config.model, vocab_size=tokenizer.vocab_size, max_length=d.seq_len)
  try:
    pipeline = data.pipeline(
        config, row_length=objective.raw_length(d.seq_len), process_index=jax.process_index(),
        process_count=jax.process_count(), streams=objective.contiguous_rows,
        stride=objective.row_stride(d.seq_len) if objective.contiguous_rows else 0,
        reversed_streams=objective.contiguous_rows and objective.reversed_streams())
  except ValueError as e:
    raise DataError(str(e)) from e
  tx, schedule = make_optimizer(config)
  return Experiment(config, workdir, tokenizer, objective, model, pipeline, parallel.make_mesh(config.mesh), tx, schedule,
                    data.identity)


# ============================================================================ state


def _init_fn(model: nn.Module, tx: optax.GradientTransformation, seq_len: int, objective=None, batch_size: int = 1):
  """rng -> TrainState with boxed (logically partitioned) params and objective state."""
  inputs = type(model).init_inputs(1, seq_len)

  def init(rng):
    params_rng, state_rng = jax.random.split(rng)
    params = model.init({"params": params_rng, "dropout": params_rng}, **inputs)["params"]
    objective_state = objective.init_state(batch_size, model.cfg) if objective is not None else None
    if objective_state is not None:
      objective_state = jax.tree.map(nn.LogicallyPartitioned, objective_state, objective.state_axes())
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                      rng=jax.random.key_data(state_rng), objective_state=objective_state)

  return init


def state_shardings(model: nn.Module, tx, mesh, seq_len: int, objective=None, batch_size: int = 1):
  """(abstract unboxed state, NamedShardings) from the logical axis names, without computing."""
  with parallel.context(mesh):
    boxed = jax.eval_shape(_init_fn(model, tx, seq_len, objective, batch_size), jax.random.key(0))
  shardings = parallel.logical_to_sharding(boxed, mesh)
  return nn.unbox(boxed), shardings


def init_state(model: nn.Module, tx, mesh, seq_len: int, seed: int, shardings, objective=None,
               batch_size: int = 1) -> TrainState:
  """The train state, created directly in its sharded layout (no host holds all of it)."""
  init = _init_fn(model, tx, seq_len, objective, batch_size)
  with parallel.context(mesh):
    return jax.jit(lambda r: nn.unbox(init(r)), out_shardings=shardings)(jax.random.key(seed))


# ============================================================================ steps


def _loss_and_grads(exp: Experiment, params, batch, rng, objective_state=None):
  """Mean loss and its gradient, accumulated exactly over `train.grad_accum` micro-batches.

  Returns (metrics, grads, next objective state).
  """
  if exp.objective.stateful:
    loss_fn = lambda p, b, r: exp.objective.loss(exp.model, p, b, r, train=True, state=objective_state)
  else:
    loss_fn = lambda p, b, r: exp.objective.loss(exp.model, p, b, r, train=True)
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  accum = exp.config.train.grad_accum
  if accum == 1:
    (_, metrics), grads = grad_fn(params, batch, rng)
    metrics = dict(metrics)
    return metrics, grads, metrics.pop("state", None)

  # Micro-batch a takes rows a, a + accum, ...: each device keeps its own rows.
  micro = jax.tree.map(lambda x: jnp.swapaxes(x.reshape(-1, accum, *x.shape[1:]), 0, 1), batch)

  def body(carry, xs):
    grads_sum, stats = carry
    b, a = xs
    (_, m), g = grad_fn(params, b, jax.random.fold_in(rng, a))
    n = m["num_tokens"]
    grads_sum = jax.tree.map(lambda s, gi: s + gi * n, grads_sum, g)
    stats = {k: stats[k] + m[k] * (n if k != "num_tokens" else 1.0) for k in stats}
    return (grads_sum, stats), None

  zeros = jax.tree.map(jnp.zeros_like, params)
  stat_keys = jax.eval_shape(lambda: grad_fn(params, jax.tree.map(lambda x: x[0], micro), rng)[0][1])
  stats0 = {k: jnp.zeros((), jnp.float32) for k in stat_keys}
  (grads_sum, stats), _ = jax.lax.scan(body, (zeros, stats0), (micro, jnp.arange(accum)))
  n = jnp.maximum(stats["num_tokens"], 1.0)
  grads = jax.tree.map(lambda g: g / n, grads_sum)
  metrics = {k: (v / n if k != "num_tokens" else v) for k, v in stats.items()}
  return metrics, grads, None  # stateful objectives run without accumulation (see validate)


def make_train_step(exp: Experiment, shardings):
  """Jitted (state, batch) -> (state, metrics), state donated, shardings pinned."""

  def step_fn(state: TrainState, batch):
    rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
    metrics, grads, objective_state = _loss_and_grads(exp, state.params, batch, rng, state.objective_state)
    updates, opt_state = exp.tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = dict(metrics, grad_norm=optax.global_norm(grads), learning_rate=exp.schedule(state.step))
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                         objective_state=objective_state), metrics

  jitted = jax.jit(step_fn, in_shardings=(shardings, parallel.batch_sharding(exp.mesh)),
                   out_shardings=(shardings, parallel.replicated(exp.mesh)), donate_argnums=(0,))

  def run(state, batch):
    with parallel.context(exp.mesh):
      return jitted(state, batch)

  run.jitted = jitted  # for tfx.bench: lower().compile() timing
  return run


def make_eval_step(exp: Experiment, shardings):
  def eval_fn(params, batch):
    extra = {"state": None} if exp.objective.stateful else {}  # eval starts from an empty state
    _, metrics = exp.objective.loss(exp.model, params, batch, jax.random.key(0), train=False, **extra)
    return {k: v for k, v in metrics.items() if k != "state"}

  jitted = jax.jit(eval_fn, in_shardings=(shardings.params, parallel.batch_sharding(exp.mesh)),
                   out_shardings=parallel.replicated(exp.mesh))

  def run(params, batch):
    with parallel.context(exp.mesh):
      return jitted(params, batch)

  return run


def evaluate(exp: Experiment, eval_step, params, batches) -> dict[str, float]:
  """Token-weighted mean of the eval metrics over the held-out batches."""
  totals: dict[str, float] = {}
  count = 0.0
  for batch in batches:
    m = jax.device_get(eval_step(params, parallel.global_batch(batch, exp.mesh)))
    n = float(m["num_tokens"])
    count += n
    for k, v in m.items():
      if k != "num_tokens":
        totals[k] = totals.get(k, 0.0) + float(v) * n
  out = {k: v / max(count, 1.0) for k, v in totals.items()}
  out["num_tokens"] = count
  return out


# ============================================================================ loop


class _Preemption:
  """SIGTERM sets a flag; the loop saves a checkpoint and exits at the next step."""

  def __init__(self):
    self.requested = False
    try:
      signal.signal(signal.SIGTERM, self._handle)
    except ValueError:  # not the main thread (e.g. inside a test runner thread)
      pass

  def _handle(self, signum, frame):
    self.requested = True

  def should_stop(self) -> bool:
    if jax.process_count() == 1:
      return self.requested
    from jax.experimental import multihost_utils

    flags = multihost_utils.process_allgather(np.array([self.requested]))
    return bool(np.any(flags))


def write_config(config, workdir) -> None:
  if jax.process_index() == 0:
    (epath.Path(workdir) / "config.json").write_text(config_lib.to_json(config))


def objective_source(objective: Objective) -> dict[str, Any]:
  """Where the objective's code comes from: {name, class, file, sha256} (file/sha256 None if unknown)."""
  cls = type(objective)
  try:
    path = inspect.getsourcefile(cls)
  except TypeError:
    path = None
  return {"class": f"{cls.__module__}.{cls.__qualname__}", "file": path,
          "sha256": file_sha256(path) if path and os.path.isfile(path) else None}


def _record_objective_source(exp: Experiment, writer: MetricsWriter, progress) -> None:
  """WORKDIR/objective.json records the objective's source file and its hash; a resume whose
  objective source changed says so (a warning, and an `objective_changed` record in metrics.jsonl)."""
  if jax.process_index() != 0:
    return
  path = epath.Path(exp.workdir) / "objective.json"
  now = dict(objective_source(exp.objective), name=exp.config.objective.name)
  if path.exists():
    try:
      before = json.loads(path.read_text())
    except json.JSONDecodeError:
      before = {}
    if before.get("sha256") != now["sha256"] or before.get("class") != now["class"]:
      progress.note(f"warning: the objective's source changed since this run started ({before.get('file')} "
                    f"sha256 {str(before.get('sha256'))[:12]} -> {now['file']} sha256 {str(now['sha256'])[:12]}); "
                    f"resuming with the new code")
      writer.event(0, "objective_changed", before=before, now=now)
  path.write_text(json.dumps(now, indent=2))


def _restore_data_position(exp: Experiment, data_state: dict, writer: MetricsWriter, step: int, progress) -> None:
  """Moves the pipeline to the checkpoint's position, after checking it was the same corpus."""
  changes = corpus_changes(data_state.get("corpus"), exp.corpus)
  if changes and not exp.config.data.allow_changed_corpus:
    raise DataError(
        f"the checkpoint at step {step} was trained on another corpus than data.source={exp.config.data.source!r}: "
        f"{'; '.join(changes)}. Restore the old data settings, use a new --workdir, or pass "
        f"--config.data.allow_changed_corpus=true to continue on the new corpus")
  if changes:
    progress.note(f"continuing on a changed corpus (data.allow_changed_corpus): {'; '.join(changes)}")
    writer.event(step, "corpus_changed", changes=changes, corpus=exp.corpus)
    epoch = int(data_state.get("epoch", 0))
    exp.pipeline.restore({"epoch": epoch, "row": 0})  # the new corpus from the start of the same epoch
    return
  exp.pipeline.restore({k: data_state[k] for k in ("epoch", "row") if k in data_state})


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains (or resumes) `config` in `workdir`; returns a summary of the run."""
  gcs.preflight(workdir, config.data.source, config.data.tokenizer)  # gs:// fails here, in seconds
  epath.Path(workdir).mkdir(parents=True, exist_ok=True)
  t = config.train
  exp = build(config, workdir)
  write_config(config, workdir)
  progress = Progress(t.steps)
  writer = MetricsWriter(workdir, config=config)
  _record_objective_source(exp, writer, progress)
  stats = exp.pipeline.stats
  progress.note(f"tfx: {config.model.family} + {config.objective.name} on {config.data.source}: "
                f"{stats.get('train_documents', '?')} train / {stats.get('eval_documents', '?')} eval documents, "
                f"vocab {exp.tokenizer.vocab_size}, mesh {dict(exp.mesh.shape)}, workdir {workdir}")

  abstract, shardings = state_shardings(exp.model, exp.tx, exp.mesh, config.data.seq_len, exp.objective,
                                        t.batch_size)
  mngr = checkpoint.manager(workdir, keep=t.keep_checkpoints, async_save=t.async_checkpoint)
  latest = mngr.latest_step()
  if latest is not None:
    state, data_state = checkpoint.restore(mngr, latest, checkpoint.abstract_like(abstract, shardings))
    _restore_data_position(exp, data_state, writer, latest, progress)
    writer.truncate_after(latest)
    progress.note(f"resumed from {mngr.directory}/{latest}")
  else:
    state = init_state(exp.model, exp.tx, exp.mesh, config.data.seq_len, t.seed, shardings, exp.objective,
                       t.batch_size)
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract.params))
  progress.note(f"parameters: {n_params:,}")

  train_step = make_train_step(exp, shardings)
  eval_step = make_eval_step(exp, shardings)
  eval_batches = exp.pipeline.eval_batches()
  tokens_per_step = t.batch_size * exp.pipeline.row_length
  model_flops = exp.objective.train_flops_per_row(exp.model.cfg, config.data.seq_len) * t.batch_size
  peak = flops.device_peak_flops()
  preempt = _Preemption()

  step = int(jax.device_get(state.step))
  start_step = step
  if step == 0 and t.eval_every:  # where the loss starts
    initial = evaluate(exp, eval_step, state.params, eval_batches)
    writer.write(0, "eval", initial)
    progress.eval(0, initial["loss"], initial.get("accuracy", float("nan")))
  pending: list[dict] = []
  last_time, last_step = time.time(), step
  eval_record = None
  while step < t.steps:
    batch = parallel.global_batch(exp.pipeline.next_batch(), exp.mesh)
    state, metrics = train_step(state, batch)
    step += 1
    pending.append(metrics)
    if step == start_step + 1:  # the first step compiles: keep it out of the throughput
      jax.block_until_ready(metrics)
      last_time, last_step = time.time(), step
    if step % t.log_every == 0 or step == t.steps:
      values = {k: float(np.mean([m[k] for m in jax.device_get(pending)])) for k in pending[0]}
      pending = []
      now = time.time()
      timed = step - last_step
      sec_per_step = (now - last_time) / timed if timed else None
      last_time, last_step = now, step
      values["tokens_per_sec"] = tokens_per_step / sec_per_step if sec_per_step else None
      values["mfu"] = model_flops / sec_per_step / (peak * jax.device_count()) if peak and sec_per_step else None
      writer.write(step, "train", values)
      progress.train(step, values["loss"], values["tokens_per_sec"], sec_per_step, values["mfu"])
    if (t.eval_every and step % t.eval_every == 0) or step == t.steps:
      eval_values = evaluate(exp, eval_step, state.params, eval_batches)
      eval_record = writer.write(step, "eval", eval_values)
      progress.eval(step, eval_values["loss"], eval_values.get("accuracy", float("nan")))
      last_time = time.time()  # evaluation time is not training throughput
    stopping = (t.stop_after and step - start_step >= t.stop_after) or preempt.should_stop()
    if (t.checkpoint_every and step % t.checkpoint_every == 0) or step == t.steps or stopping:
      checkpoint.save(mngr, step, state, dict(exp.pipeline.state(), corpus=exp.corpus))
      writer.flush()
    if stopping:
      progress.note(f"stopping at step {step} (checkpoint saved); run the same command to resume")
      break
  mngr.wait_until_finished()
  mngr.close()
  writer.close()
  return {"step": step, "workdir": workdir, "state": state, "last_eval": eval_record, "experiment": exp}


def load_run(workdir: str):
  """(config, tokenizer) of a trained run: WORKDIR/config.json and the run's tokenizer.

  Raises UserError (saying what to do) when the directory is not a run or its tokenizer is gone.
  """
  from tfx.data.tokenizer import fit_vocab_size, load_tokenizer, saved_tokenizer

  load_builtins()
  gcs.preflight(workdir)
  path = epath.Path(workdir) / "config.json"
  if not path.exists():
    raise UserError(f"{workdir} is not a tfx run: it has no config.json (train one with python -m tfx.train)")
  config = config_lib.from_json(path.read_text())
  tok_path = config.data.tokenizer or saved_tokenizer(workdir)
  if not tok_path or not epath.Path(tok_path).exists():
    raise UserError(f"tokenizer {tok_path or epath.Path(workdir) / 'tokenizer.model'} not found; the run's tokenizer "
                    f"is needed to encode prompts")
  try:
    tokenizer = fit_vocab_size(load_tokenizer(str(tok_path)), config.data.vocab_size)
  except (ValueError, FileNotFoundError) as e:
    raise UserError(str(e)) from e
  return config, tokenizer


def restore_params(workdir: str, config, tokenizer, model: nn.Module, mesh, step: int | None = None):
  """(params, step) of the run's latest (or given) checkpoint, placed on `mesh` by the logical
  axis rules. `config` and `tokenizer` are the run's (`load_run`); the whole train state is
  restored (its layout depends on them), and all but the parameters dropped."""
  tx, _ = make_optimizer(config)
  objective = OBJECTIVES.get(config.objective.name).from_config(config.objective, SpecialIds.from_tokenizer(tokenizer))
  abstract, shardings = state_shardings(model, tx, mesh, config.data.seq_len, objective, config.train.batch_size)
  mngr = checkpoint.manager(workdir, keep=config.train.keep_checkpoints, async_save=False)
  step = mngr.latest_step() if step is None else step
  if step is None:
    raise UserError(f"{workdir}/checkpoints has no checkpoint yet")
  state, _ = checkpoint.restore(mngr, step, checkpoint.abstract_like(abstract, shardings))
  mngr.close()
  return state.params, step


def load_trained(workdir: str, step: int | None = None):
  """(config, tokenizer, model, params) of a trained run, for generation and evaluation.

  Uses WORKDIR/config.json, the run's tokenizer and the latest (or given) checkpoint, placed
  on a mesh of all local devices (data parallel).
  """
  config, tokenizer = load_run(workdir)
  model = build_model(config.model, vocab_size=tokenizer.vocab_size, max_length=config.data.seq_len)
  with config.unlocked():
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = -1, 1, 1
  params, _ = restore_params(workdir, config, tokenizer, model, parallel.make_mesh(config.mesh), step)
  return config, tokenizer, model, params


def list_objectives() -> str:
  """Every registered objective with its families and fields (`--list-objectives`)."""
  from tfx.objectives.options import describe

  load_builtins()
  blocks = [describe(name, cls, cls.families) for name, cls in OBJECTIVES.items()]
  return ("objectives (objective.name; or path/to/file.py:ClassName for one outside the package):\n\n"
          + "\n\n".join(blocks))


def main(argv: list[str] | None = None) -> None:
  import argparse

  parser = argparse.ArgumentParser(prog="python -m tfx.train", description=__doc__.split("\n")[0])
  parser.add_argument("--config", help="config file, e.g. configs/quickstart.py")
  parser.add_argument("--workdir", help="run directory (resumed if it has checkpoints)")
  parser.add_argument("--list-objectives", action="store_true",
                      help="print every registered objective, the families it drives and its fields, then exit")
  args, overrides = parser.parse_known_args(argv)
  if args.list_objectives:
    print(list_objectives())
    return
  if not args.config or not args.workdir:
    parser.error("--config and --workdir are required")
  parallel.initialize_distributed()
  try:
    config = config_lib.load_config(args.config, overrides)
    run(config, args.workdir)
  except UserError as e:
    sys.exit(f"tfx.train: {e}")


if __name__ == "__main__":
  main()
