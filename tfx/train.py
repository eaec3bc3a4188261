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
import signal
import sys
import time
from typing import Any

from etils import epath
import jax
import ml_collections
import numpy as np

from tfx import checkpoint, config as config_lib, flops, gcs, parallel
from tfx.data.training import corpus_changes, training_data
from tfx.errors import DataError, UserError
from tfx.metrics import MetricsWriter, Progress
from tfx.models import build_model
from tfx.objectives import Objective, SpecialIds
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
        reversed_streams=objective.contiguous_rows and objective.reversed_streams())
  except ValueError as e:
    raise DataError(str(e)) from e
  tx, schedule = make_optimizer(config)
  return Experiment(config, workdir, tokenizer, objective, model, pipeline, parallel.make_mesh(config.mesh), tx, schedule,
                    data.identity)

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
