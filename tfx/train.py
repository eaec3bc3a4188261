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

import inspect
import json
import os
import shutil
import signal
import sys
import time
from typing import Any

from etils import epath
import jax
import ml_collections
import numpy as np

from tfx import checkpoint, config as config_lib, drift, flops, gcs, ops, parallel
from tfx.data import store
from tfx.data.training import corpus_changes, training_data
from tfx.errors import DataError, UserError, exit_with, quiet_background
from tfx.guard import REWIND, Guard, NonFiniteError
from tfx.lock import WorkdirLock
from tfx.metrics import MetricsWriter, Progress
from tfx.models import build_model
from tfx.objectives import Objective, SpecialIds, add_metrics, count_of, mean_metrics
from tfx.registry import OBJECTIVES, file_sha256, load_builtins
# The step's pieces and the run reader live in their own modules; re-exported here because
# tfx.train is where scripts have always found them.
from tfx.runs import load_run, load_trained, restore_params  # noqa: F401
from tfx.steps import (  # noqa: F401
    Experiment, TrainState, _init_fn, _loss_and_grads, evaluate, init_state, make_eval_step, make_optimizer,
    make_train_step, state_shardings)


# ============================================================================ set-up


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
        reversed_streams=objective.contiguous_rows and objective.reversed_streams(),
        eval_streams=objective.contiguous_rows and bool(config.train.get("eval_memory", False)))
  except ValueError as e:
    raise DataError(str(e)) from e
  tx, schedule = make_optimizer(config)
  return Experiment(config, workdir, tokenizer, objective, model, pipeline, parallel.make_mesh(config.mesh), tx, schedule,
                    data.identity)

# ============================================================================ loop


class _Preemption:
  """SIGTERM (and, with `interrupt`, a first Ctrl-C) sets a flag; the loop saves a checkpoint and
  exits at the next step. A second Ctrl-C raises KeyboardInterrupt at once. `close` puts the
  previous handlers back."""

  def __init__(self, interrupt: bool = False):
    self.requested = False
    self._previous = {}
    for sig in (signal.SIGTERM, signal.SIGINT) if interrupt else (signal.SIGTERM,):
      try:
        self._previous[sig] = signal.signal(sig, self._handle)
      except ValueError:  # not the main thread (e.g. inside a test runner thread)
        pass

  def _handle(self, signum, frame):
    if signum == signal.SIGINT:
      if self.requested:
        raise KeyboardInterrupt
      print("\nCtrl-C: saving a checkpoint at the end of this step, then stopping (Ctrl-C again to abort "
            "without saving)", file=sys.stderr, flush=True)
    self.requested = True

  def close(self) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous = {}

  def should_stop(self) -> bool:
    if jax.process_count() == 1:
      return self.requested
    from jax.experimental import multihost_utils

    flags = multihost_utils.process_allgather(np.array([self.requested]))
    return bool(np.any(flags))


def write_config(config, workdir) -> None:
  drift.write_config(config, workdir)


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
  store.write_atomic(path, json.dumps(now, indent=2).encode())


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
  """Trains (or resumes) `config` in `workdir`; returns a summary of the run.

  Nothing is written to the workdir before the config is valid and (on resume) agrees with the
  run's config.json; then the run holds WORKDIR/tfx.lock until it returns."""
  d = config.data
  gcs.preflight(workdir, d.source, d.tokenizer, d.get("store_root", ""))  # gs:// fails here, in seconds
  load_builtins()
  config_lib.validate(config, num_devices=jax.device_count(), process_count=jax.process_count())
  diffs = drift.check(config, workdir, checkpoint_steps=tuple(checkpoint.steps(workdir)))
  created = not epath.Path(workdir).exists()
  epath.Path(workdir).mkdir(parents=True, exist_ok=True)
  with WorkdirLock(workdir, timeout=config.train.lock_timeout) as lock:
    progress = Progress(config.train.steps)
    if lock.took_over is not None:
      progress.note(f"took over the lock of a run that is gone (host {lock.took_over.get('host')}, pid "
                    f"{lock.took_over.get('pid')})")
    return _run_locked(config, workdir, diffs, progress, created, lock)


def _run_locked(config, workdir: str, diffs: dict, progress: Progress, created: bool,
                lock: WorkdirLock) -> dict[str, Any]:
  t = config.train
  try:
    exp = build(config, workdir)
  except UserError:  # bad data settings: a workdir this call created goes away again
    if created and "://" not in workdir and jax.process_index() == 0:
      shutil.rmtree(workdir, ignore_errors=True)
    raise
  writer = MetricsWriter(workdir, config=config)
  mngr = checkpoint.manager(workdir, keep=t.keep_checkpoints, async_save=t.async_checkpoint)
  try:
    if mngr.latest_step() is None:
      writer.truncate_after(-1)  # records of an earlier attempt that died before its first checkpoint
    _record_objective_source(exp, writer, progress)
    stats = exp.pipeline.stats
    progress.note(f"tfx: {config.model.family} + {config.objective.name} on {config.data.source}: "
                  f"{stats.get('train_documents', '?')} train / {stats.get('eval_documents', '?')} eval documents, "
                  f"vocab {exp.tokenizer.vocab_size}, mesh {dict(exp.mesh.shape)}, workdir {workdir}")
    abstract, shardings = state_shardings(exp.model, exp.tx, exp.mesh, config.data.seq_len, exp.objective,
                                          t.batch_size)
    guard = Guard(t, writer, progress)
    return _train(exp, mngr, guard, writer, progress, abstract, shardings, diffs, lock)
  finally:  # a save in flight completes (or fails loudly) on every way out
    checkpoint.finish(mngr)
    mngr.close()
    writer.close()


def _fresh_state(exp: Experiment, shardings):
  t = exp.config.train
  return init_state(exp.model, exp.tx, exp.mesh, exp.config.data.seq_len, t.seed, shardings, exp.objective,
                    t.batch_size)


def _train(exp: Experiment, mngr, guard: Guard, writer: MetricsWriter, progress: Progress, abstract, shardings,
           diffs: dict, lock: WorkdirLock):
  config, workdir, t = exp.config, exp.workdir, exp.config.train
  restored = checkpoint.restore_good(workdir, mngr, checkpoint.abstract_like(abstract, shardings),
                                      step=t.restore_step, note=progress.note)
  window: list[dict] = []
  if restored is not None:
    state, data_state, latest = restored
    _restore_data_position(exp, data_state, writer, latest, progress)
    window = log_window_from(data_state)
    writer.truncate_after(latest)
    guard.good_checkpoint = latest
    progress.note(f"resumed from {mngr.directory}/{latest}")
  else:
    latest, state = 0, _fresh_state(exp, shardings)
  drift.write_config(config, workdir, latest)  # only now: the restore succeeded
  drift.record(writer, progress, latest, diffs, config)
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract.params))
  progress.note(f"parameters: {n_params:,}")

  preempt = _Preemption(interrupt=True)
  try:
    return _loop(exp, mngr, guard, writer, progress, abstract, shardings, state, preempt, lock, window)
  finally:
    preempt.close()


def _loop(exp: Experiment, mngr, guard: Guard, writer: MetricsWriter, progress: Progress, abstract, shardings, state,
          preempt: _Preemption, lock: WorkdirLock, window: list[dict]):
  config, workdir, t = exp.config, exp.workdir, exp.config.train
  train_step = make_train_step(exp, shardings)
  eval_step = make_eval_step(exp, shardings)
  eval_batches = exp.pipeline.eval_batches()
  if t.eval_every and getattr(exp.pipeline, "eval_note", ""):
    progress.note(f"eval: {exp.pipeline.eval_note}")
  tokens_per_step = t.batch_size * exp.pipeline.row_length
  model_flops = exp.objective.train_flops_per_row(exp.model.cfg, config.data.seq_len) * t.batch_size
  peak = flops.device_peak_flops()

  step = int(jax.device_get(state.step))
  start_step = step
  if step == 0 and t.eval_every:  # where the loss starts
    initial = evaluate(exp, eval_step, state.params, eval_batches)
    writer.write(0, "eval", initial)
    progress.eval(0, initial["loss"], initial.get("accuracy", float("nan")))
  pending: list[dict] = []  # the metrics (device arrays) of the steps not yet read
  # Those read (one transfer per log or save), passed by the guard, not yet logged: the log window,
  # which a checkpoint carries, so that a resumed run logs the same means as an uninterrupted one.
  host: list[dict] = window
  last_time, last_step = time.time(), step
  eval_record = None
  packed = _PackedFit(exp.model.cfg.packed_runs) if getattr(exp.model.cfg, "packed_runs", 0) else None
  while step < t.steps:
    rows = exp.pipeline.next_batch()
    if packed is not None and not packed.said:  # counted until the first log says it, no longer
      packed.add(rows.get("segment_ids"))
    batch = parallel.global_batch(rows, exp.mesh)
    state, metrics = train_step(state, batch, guard.poison(step + 1))
    step += 1
    pending.append(metrics)
    if step == start_step + 1:  # the first step compiles: keep it out of the throughput
      jax.block_until_ready(metrics)
      last_time, last_step = time.time(), step
    log_due = step % t.log_every == 0 or step == t.steps
    stopping = (t.stop_after and step - start_step >= t.stop_after) or preempt.should_stop()
    save_due = (t.checkpoint_every and step % t.checkpoint_every == 0) or step == t.steps or stopping
    if log_due or save_due:  # the flags are read with the metrics (and before any save)
      fresh, pending = jax.device_get(pending), []
      if guard.check(fresh, step) == REWIND:
        state, step, host = _rewind(exp, mngr, guard, writer, abstract, shardings)
        last_time, last_step = time.time(), step
        continue
      host += fresh
    if log_due:
      values = _train_values(host, exp.objective)
      host = []
      now = time.time()
      timed = step - last_step
      sec_per_step = (now - last_time) / timed if timed else None
      last_time, last_step = now, step
      values["tokens_per_sec"] = tokens_per_step / sec_per_step if sec_per_step else None
      values["mfu"] = model_flops / sec_per_step / (peak * jax.device_count()) if peak and sec_per_step else None
      writer.write(step, "train", values)
      progress.train(step, values["loss"], values["tokens_per_sec"], sec_per_step, values["mfu"])
      if packed is not None and not packed.said:
        progress.note(packed.say())
      last_time = time.time()  # writing the record (the first opens the event files) is not training time
    eval_due = (t.eval_every and step % t.eval_every == 0) or step == t.steps
    if eval_due or save_due:  # the steps queued so far are training time: finish them before the pause
      jax.block_until_ready(state.params)
    paused = time.time()  # evaluation and saving are not training throughput: the clock skips them
    if eval_due:
      eval_values = evaluate(exp, eval_step, state.params, eval_batches)
      eval_record = writer.write(step, "eval", eval_values)
      progress.eval(step, eval_values["loss"], eval_values.get("accuracy", float("nan")))
    if save_due:
      lock.check()  # another run took the workdir over while this one stalled: write nothing more
      _save(exp, mngr, guard, step, state, host)
      writer.flush()
    last_time += time.time() - paused
    if stopping:
      progress.note(f"stopping at step {step} (checkpoint saved); run the same command to resume")
      break
  return {"step": step, "workdir": workdir, "state": state, "last_eval": eval_record, "experiment": exp}


class _PackedFit:
  """How many of the batches so far fit `model.packed_runs` (this host's rows: at most that many
  runs of one segment id a row), said once, at the first log: the number to size it by."""

  def __init__(self, max_runs: int):
    self.max_runs, self.batches, self.fitting, self.most, self.said = max_runs, 0, 0, 0, False

  def add(self, segment_ids) -> None:
    if segment_ids is None:
      return
    runs = int(ops.runs_per_row(segment_ids).max())
    self.batches += 1
    self.fitting += runs <= self.max_runs
    self.most = max(self.most, runs)

  def say(self) -> str:
    self.said = True
    return (f"model.packed_runs={self.max_runs}: {self.fitting} of the first {self.batches} batches fit cuDNN's "
            f"packed layout (rows of up to {self.most} runs of one segment id seen); on a GPU the others attend "
            f"with the mask")


def _train_values(host: list[dict], objective: Objective) -> dict[str, float]:
  """The metrics of the logged steps: each mean over all the window's tokens (or the objective's own
  count, `Objective.metric_counts`), as evaluation and gradient accumulation weight them (an MLM
  step predicts a varying number of tokens); counts (num_tokens, ...) and grad_norm as plain means
  over the steps; learning_rate as applied at the window's last step, the step the record is logged
  at (a mean over a warmup window is no rate that was ever applied). Steps skipped as non-finite
  are left out (and counted)."""
  finite = [m for m in host if not float(m["nonfinite"])]
  steps = finite or host
  totals: dict = {}
  for m in steps:
    totals = add_metrics(objective, totals, {k: float(v) for k, v in m.items()
                                             if k not in ("nonfinite", "learning_rate", "grad_norm")})
  values = {k: float(v) / (len(steps) if count_of(objective, k) is None else 1.0)
            for k, v in mean_metrics(objective, totals).items()}
  if "grad_norm" in host[0]:
    values["grad_norm"] = float(np.mean([float(m["grad_norm"]) for m in steps]))
  if "learning_rate" in host[-1]:
    values["learning_rate"] = float(host[-1]["learning_rate"])
  if len(finite) < len(host):
    values["skipped"] = float(len(host) - len(finite))
  return values


def log_window_to(host: list[dict]) -> list[dict]:
  """The log window's per-step metrics as JSON: {name: [value, dtype]}, exact for float32."""
  return [{k: [np.asarray(v).item(), np.asarray(v).dtype.name] for k, v in m.items()} for m in host]


def log_window_from(data_state: dict) -> list[dict]:
  """The window `log_window_to` wrote (a checkpoint of an older tfx has none: [])."""
  return [{k: np.asarray(v, dtype)[()] for k, (v, dtype) in m.items()} for m in data_state.get("log_window", [])]


def _save(exp: Experiment, mngr, guard: Guard, step: int, state, host: list[dict]) -> None:
  """Checkpoints a state known to be finite (the guard read every step's flags; the parameters are
  checked once more on device here): a bad state is never saved."""
  if not checkpoint.all_finite(state.params):
    raise NonFiniteError(f"the parameters at step {step} are not finite although every step's loss and gradient "
                         f"were; nothing was saved (last good checkpoint: {guard.good_checkpoint}). "
                         f"Lower optim.learning_rate and run the same command to resume")
  checkpoint.save(mngr, step, state, dict(exp.pipeline.state(), corpus=exp.corpus, log_window=log_window_to(host)))
  guard.saved(step)


def _rewind(exp: Experiment, mngr, guard: Guard, writer: MetricsWriter, abstract, shardings):
  """The state of the last good checkpoint (or the initial state), keeping the data position: the
  steps after it are redone on the next batches. Records after that step are dropped."""
  checkpoint.finish(mngr)
  step = guard.good_checkpoint
  window: list[dict] = []
  if step is None:
    state, step = _fresh_state(exp, shardings), 0
  else:
    state, data_state = checkpoint.restore(mngr, step, checkpoint.abstract_like(abstract, shardings))
    window = log_window_from(data_state)
  writer.truncate_after(step)
  guard.rewound(step)
  return state, step, window


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
  parser.add_argument("--debug", action="store_true", help="show the traceback of an error (instead of one line)")
  parser.add_argument("--list-objectives", action="store_true",
                      help="print every registered objective, the families it drives and its fields, then exit")
  args, overrides = parser.parse_known_args(argv)
  if args.list_objectives:
    print(list_objectives())
    return
  if not args.config or not args.workdir:
    parser.error("--config and --workdir are required")
  quiet_background(args.debug)
  parallel.initialize_distributed()
  try:
    config = config_lib.load_config(args.config, overrides)
    run(config, args.workdir)
  except KeyboardInterrupt:
    print(f"tfx.train: aborted by a second Ctrl-C; the last checkpoint in {args.workdir} is kept: run the same "
          f"command to resume from it", file=sys.stderr)
    sys.exit(130)
  except Exception as e:  # noqa: BLE001  (one line for every error; --debug shows the traceback)
    if args.debug:
      raise
    exit_with("tfx.train", e, args.workdir, command_line=argv is None)


if __name__ == "__main__":
  main()
