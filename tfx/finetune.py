"""Fine-tuning a pretrained run on a classification task, with the pretraining loop's pieces.

    python -m tfx.finetune --from runs/tiny --task stdlib:package --workdir runs/tiny-package [--config.finetune.k=v ...]
    python -m tfx.finetune --from runs/tiny --task stdlib:package --workdir runs/scratch --config.finetune.init=scratch
    python -m tfx.finetune --from none --config configs/tiny.py --task jsonl:data/sst --workdir runs/scratch

Reads as a story:
  1. Config: the pretrained run's config.json (architecture, tokenizer, mesh) plus the `finetune`
     section (configs/base.py) and overrides of finetune.*, mesh.*, log.* and model dropout / dtype /
     attention / remat; `finetune.steps`, `batch_size`, `learning_rate`, `warmup_steps`, `weight_decay`
     and `seed` become the run's train.* / optim.* for tfx.train's optimizer. `--from none` takes
     the architecture and data from --config and starts from random weights.
  2. Task (tfx.tasks): examples -> one right-padded row each, `finetune.max_length` tokens (0 = the
     pretraining data.seq_len), laid out per family (tfx.tasks.rows: BERT's [CLS] a [SEP] b [SEP], GPT's
     [BOS] a [SEP] b [EOS], T5's a [SEP] b [EOS], XLNet's a [SEP] b [SEP] [CLS]); [SEP] is the
     tokenizer's sep id, else eos; token types 0 / 1 for the two texts (XLNet's [CLS]: 2).
  3. Model: tfx.models.Classifier: the family as `backbone` + ClassifierHead, pooled per family
     (encoder first token, decoder / XLNet last real token, encoder-decoder encoder mean).
  4. State: tfx.train.state_shardings / init_state (sharded by the mesh config); the head from the
     key of `finetune.seed`; the backbone copied from the pretrained checkpoint by parameter path
     (`init=pretrained`) or left at its random init (`init=scratch`).
  5. Step: tfx.train.make_train_step with a classification loss (cross-entropy of the logits).
  6. Every `eval_every` steps: validation accuracy, macro-F1 (and MCC for binary tasks), in numpy
     on the host; the best params so far (by `select_metric`) are kept, in the checkpoint too;
     `patience` evaluations without improvement stop the run.
  7. Checkpoints: orbax in WORKDIR/checkpoints (train state + best params + early-stopping state);
     the same command resumes, exactly (the batch of step s is a function of (seed, s)).
  8. End: the test split is scored once, with the best params; WORKDIR/finetune_result.json.

metrics.jsonl splits: "finetune" (training), "finetune_eval" (validation), "test" (once).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Sequence

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from etils import epath

from tfx import checkpoint, config as config_lib, flops, parallel, train
from tfx.data import store
from tfx.errors import UserError, exit_with, quiet_background
from tfx.guard import Guard
from tfx.metrics import MetricsWriter, Progress, read_metrics
from tfx.models import build_classifier, build_model
from tfx.tasks import SPLITS, Task, classification_metrics, format_balance, load_task, majority_baseline
from tfx.tasks.rows import Rows, encode_split, eval_batches, train_indices

RESULT_FILE = "finetune_result.json"
# Config keys a fine-tune may set besides the pretrained run's (the architecture is the run's).
OVERRIDABLE = ("finetune.", "mesh.", "log.", "model.dropout", "model.attention_dropout", "model.dtype",
               "model.attention", "model.remat")


# ============================================================================ config


def _base_finetune() -> ml_collections.ConfigDict:
  """configs/base.py's `finetune` section (the repository's configs/ sits beside tfx/)."""
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "base.py")
  return config_lib.load_config_file(path).finetune


def _apply_overrides(cfg: ml_collections.ConfigDict, overrides: Sequence[str]) -> None:
  flags = [o if o.startswith("--config.") else f"--config.{o}" for o in overrides]
  for key, value in config_lib.parse_overrides(flags):
    if not any(key == p or key.startswith(p) for p in OVERRIDABLE):
      raise UserError(f"--config.{key}: a fine-tune takes its architecture and data from the pretrained run; it may "
                      f"set {', '.join(p + '*' if p.endswith('.') else p for p in OVERRIDABLE)}")
    config_lib.apply_override(cfg, key, value)


def _scratch_tokenizer(cfg, workdir: str, seed: int):
  """`--from none`: data.tokenizer, else the tokenizer of the token store pretraining would read
  where that store exists already (a `prepared:` one, or one in data.store_root: a sweep's), else
  the SentencePiece model pretraining on data.source with train.seed=`seed` would train (the same
  function, sample and seed), saved in WORKDIR."""
  from tfx.data.prepare import Spec, resolve_tokenizer
  from tfx.data.tokenizer import fit_vocab_size, load_tokenizer, saved_tokenizer, tokenizer_from_bytes
  from tfx.data.training import store_dir

  try:
    if cfg.data.tokenizer:
      return fit_vocab_size(load_tokenizer(cfg.data.tokenizer), cfg.data.vocab_size)
    shared = saved_tokenizer(store_dir(cfg, workdir))  # a prepared: store or one in data.store_root
    if shared is not None:
      return fit_vocab_size(tokenizer_from_bytes(shared.read_bytes(), path=str(shared)), cfg.data.vocab_size)
    tok = resolve_tokenizer(cfg.data, epath.Path(workdir), Spec.from_config(cfg.data), seed=seed)
    return fit_vocab_size(tok, cfg.data.vocab_size)
  except (ValueError, FileNotFoundError) as e:
    raise UserError(str(e)) from e


def apply_run_settings(cfg: ml_collections.ConfigDict, num_devices: int | None = None) -> None:
  """The fine-tune's steps, batch, seed, learning rate, warmup and weight decay become the run's
  train.* / optim.* (what tfx.train's optimizer and step read); then both validations."""
  ft = cfg.finetune
  cfg.train.steps, cfg.train.batch_size, cfg.train.seed, cfg.train.grad_accum = ft.steps, ft.batch_size, ft.seed, 1
  cfg.optim.learning_rate, cfg.optim.warmup_steps, cfg.optim.weight_decay = (ft.learning_rate, ft.warmup_steps,
                                                                              ft.weight_decay)
  num_devices = num_devices or jax.device_count()
  config_lib.validate_finetune(cfg, num_devices=num_devices, process_count=jax.process_count())
  config_lib.validate(cfg, num_devices=num_devices, process_count=jax.process_count())


def example_length(cfg: ml_collections.ConfigDict) -> int:
  """Tokens a fine-tuning row holds: `finetune.max_length`, 0 = the pretraining data.seq_len."""
  return cfg.finetune.max_length or cfg.data.seq_len


def resolve_config(config: ml_collections.ConfigDict | None, from_workdir: str | None, task: str, workdir: str,
                   overrides: Sequence[str] = ()):
  """(the fine-tune run's config, tokenizer): see step 1 of the module docstring."""
  if from_workdir:
    cfg, tokenizer = train.load_run(from_workdir)
    source = config.get("finetune") if config is not None else cfg.get("finetune")
  elif config is None:
    raise UserError("--from none (random initialisation without a pretrained run) needs --config: the "
                    "architecture and data settings of the run to compare with")
  else:
    cfg = ml_collections.ConfigDict(config.to_dict())
    tokenizer = None
    source = config.get("finetune")
  pretraining_seed = cfg.train.seed
  ft = _base_finetune()
  for key, value in (source or {}).items():
    if key not in ft:
      raise UserError(f"finetune.{key} is not a fine-tuning setting; the settings are {', '.join(sorted(ft))}")
    ft[key] = type(ft[key])(value) if isinstance(ft[key], (tuple, list)) else value
  cfg.finetune = ft
  if config is not None:
    cfg.mesh = ml_collections.ConfigDict(config.mesh.to_dict())
    if "log" in config:
      cfg.log = ml_collections.ConfigDict(config.log.to_dict())
  _apply_overrides(cfg, overrides)
  ft.task, ft.from_workdir = task, from_workdir or ""
  if not from_workdir:
    ft.init = "scratch"
  apply_run_settings(cfg)
  if tokenizer is None:
    tokenizer = _scratch_tokenizer(cfg, workdir, pretraining_seed)
  return cfg, tokenizer


# ============================================================================ batches


def _local(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """This host's rows of a global batch."""
  p, k = jax.process_index(), jax.process_count()
  rows = len(batch["labels"]) // k
  return {name: v[p * rows:(p + 1) * rows] for name, v in batch.items()}


# ============================================================================ model, state, steps


@dataclasses.dataclass(frozen=True)
class ClassificationLoss:
  """The objective tfx.train.make_train_step drives for a Classifier: the mean cross-entropy of the
  logits over rows with a label (>= 0); metrics["num_tokens"] counts those rows.

  num_classes, last_layer_queries: the classifier's (`Classifier.last_layer_queries`), for the
  FLOP count of a row (MFU in the log, `tfx.bench --finetune`)."""

  num_classes: int = 2
  last_layer_queries: int | None = None
  stateful = False  # no state between steps (tfx.objectives.base.Objective's contract)

  def raw_length(self, seq_len: int) -> int:
    return seq_len  # one right-padded example a row, as long as the model's rows

  def train_flops_per_row(self, model_cfg, seq_len: int) -> float:
    """Forward + backward (3x forward) of one row (`tfx.flops.classifier_forward_flops`)."""
    return 3 * flops.classifier_forward_flops(model_cfg, seq_len, self.num_classes,
                                              last_layer_queries=self.last_layer_queries)

  def loss(self, model, params, batch, rng, *, train: bool):
    logits = model.apply({"params": params}, batch["tokens"], batch["segment_ids"], batch["positions"],
                         batch["token_types"], train=train, rngs={"dropout": rng})  # [b, k]
    labels = batch["labels"][:, 0]  # [b]
    weights = (labels >= 0).astype(jnp.float32)  # [b]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(labels, 0))  # [b]
    n = jnp.sum(weights)
    correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
    loss = jnp.sum(ce * weights) / jnp.maximum(n, 1.0)
    return loss, {"loss": loss, "accuracy": jnp.sum(correct * weights) / jnp.maximum(n, 1.0), "num_tokens": n}


@dataclasses.dataclass
class Setup:
  """Everything built before anything is compiled."""

  config: ml_collections.ConfigDict  # the fine-tune run's
  pretrained_config: ml_collections.ConfigDict | None  # the pretrained run's, as it trained
  task: Task
  rows: dict[str, Rows]
  length: int
  exp: train.Experiment


def build(config, from_workdir: str | None, task_spec: str, workdir: str, overrides: Sequence[str] = ()) -> Setup:
  """Config, tokenizer, task rows, classifier, mesh and optimizer (no compilation, no weights)."""
  cfg, tokenizer = resolve_config(config, from_workdir, task_spec, workdir, overrides)
  pretrained_config = train.load_run(from_workdir)[0] if from_workdir else None
  ft = cfg.finetune
  task = load_task(task_spec, ft)
  if ft.select_metric == "mcc" and task.num_classes != 2:
    raise UserError(f"finetune.select_metric='mcc' needs a binary task; {task.name} has {task.num_classes} classes")
  length = example_length(cfg)
  backbone = build_model(cfg.model, vocab_size=tokenizer.vocab_size, max_length=cfg.data.seq_len)
  model = build_classifier(backbone, task.num_classes, pooling=ft.pooling, dropout=ft.dropout)
  rows = {s: encode_split(task.splits[s], tokenizer, cfg.model.family, length) for s in SPLITS}
  tx, schedule = train.make_optimizer(cfg)
  exp = train.Experiment(cfg, workdir, tokenizer, ClassificationLoss(task.num_classes, model.last_layer_queries()),
                         model, None, parallel.make_mesh(cfg.mesh), tx, schedule)
  return Setup(cfg, pretrained_config, task, rows, length, exp)


def graft(params: dict, pretrained: dict) -> tuple[dict, list[str]]:
  """params with params["backbone"] replaced, path by path, by the pretrained parameters (placed
  like the backbone's); also the pretrained paths the classifier does not use (LM heads, ...)."""
  flat = flax.traverse_util.flatten_dict(params["backbone"], sep="/")
  source = flax.traverse_util.flatten_dict(pretrained, sep="/")
  missing = [k for k in flat if k not in source]
  wrong = [f"{k} {source[k].shape} vs {flat[k].shape}" for k in flat if k in source and source[k].shape != flat[k].shape]
  if missing or wrong:
    raise UserError(f"the pretrained checkpoint does not fit the classifier's backbone: missing {missing[:5]}, "
                    f"other shapes {wrong[:5]}; was the run trained with another architecture than its config.json?")
  backbone = {k: jax.device_put(source[k], flat[k].sharding) for k in flat}
  unused = sorted(k for k in source if k not in flat)
  return dict(params, backbone=flax.traverse_util.unflatten_dict(backbone, sep="/")), unused


def make_predict_step(exp: train.Experiment, shardings):
  """Jitted (params, batch) -> logits [b, k], replicated."""

  def predict(params, batch):
    return exp.model.apply({"params": params}, batch["tokens"], batch["segment_ids"], batch["positions"],
                           batch["token_types"], train=False)

  jitted = jax.jit(predict, in_shardings=(shardings.params, parallel.batch_sharding(exp.mesh)),
                   out_shardings=parallel.replicated(exp.mesh))

  def run(params, batch):
    with parallel.context(exp.mesh):
      return jitted(params, batch)

  return run


def evaluate_rows(predict, params, rows: Rows, split: str, batch_size: int, mesh, num_classes: int) -> dict[str, float]:
  """loss (mean cross-entropy), accuracy, macro_f1 (and mcc) of `params` on every row of `split`."""
  logits = np.concatenate([np.asarray(jax.device_get(predict(params, parallel.global_batch(_local(b), mesh))))
                           for b in eval_batches(rows, batch_size)])[:len(rows)].astype(np.float64)  # [n, k]
  log_probs = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
  loss = float(-np.mean(log_probs[np.arange(len(rows)), rows.labels]))
  return dict(classification_metrics(rows.labels, np.argmax(logits, axis=-1), num_classes), loss=loss)


def _copier(exp: train.Experiment, shardings):
  """A fresh on-device copy of the params (the train step donates its input buffers)."""
  jitted = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=shardings.params)

  def run(params):
    with parallel.context(exp.mesh):
      return jitted(params)

  return run


# ============================================================================ loop


def _check_workdir(workdir: str, cfg, task: Task) -> None:
  """Refuses a workdir that holds a fine-tune with other settings (stop_after aside)."""
  path = epath.Path(workdir) / "config.json"
  if not path.exists():
    return
  old = config_lib.from_json(path.read_text())
  ignore = {"stop_after"}
  # a key the old config lacks is a field added to tfx since the fine-tune started: its default applies
  old_ft, old_model = old.get("finetune", {}), old.model
  changes = [f"finetune.{k}: {old_ft.get(k)!r} -> {v!r}" for k, v in cfg.finetune.items()
             if k not in ignore and k in old_ft and old_ft.get(k) != (list(v) if isinstance(v, tuple) else v)]
  changes += [f"model.{k}: {old_model.get(k)!r} -> {v!r}" for k, v in cfg.model.items()
              if k in old_model and old_model.get(k) != v]
  task_file = epath.Path(workdir) / "finetune_task.json"
  if task_file.exists() and json.loads(task_file.read_text())["labels"] != list(task.labels):
    changes.append("the task's labels")
  if changes:
    raise UserError(f"{workdir} holds a fine-tune with other settings ({'; '.join(changes[:6])}); use a new "
                    f"--workdir, or the same settings to resume it")


def _write_json(path: epath.Path, value: Any) -> None:
  if jax.process_index() == 0:
    store.write_atomic(path, json.dumps(value, indent=2, sort_keys=True).encode())


def _task_record(setup: Setup) -> dict:
  task = setup.task
  return {"task": task.name, "notes": task.notes, "labels": list(task.labels), "num_classes": task.num_classes,
          "pair": task.pair, "class_balance": task.balance(), "sizes": {s: len(setup.rows[s]) for s in SPLITS},
          "truncated": {s: setup.rows[s].truncated for s in SPLITS}, "max_length": setup.length}


def _initial_state(setup: Setup, shardings, copy, progress: Progress):
  """(state, best params, bookkeeping) of a new fine-tune: random init, then the pretrained backbone."""
  exp, ft = setup.exp, setup.config.finetune
  state = train.init_state(exp.model, exp.tx, exp.mesh, setup.length, ft.seed, shardings)
  pretrained_step = None
  if ft.init == "pretrained":
    pretrained, pretrained_step = train.restore_params(ft.from_workdir, setup.pretrained_config, exp.tokenizer,
                                                       exp.model.backbone, exp.mesh)
    params, unused = graft(state.params, pretrained)
    state = state.replace(params=params)
    progress.note(f"backbone from {ft.from_workdir} (checkpoint {pretrained_step}); not used: "
                  f"{', '.join(unused[:8]) or 'nothing'}{' ...' if len(unused) > 8 else ''}")
  else:
    progress.note(f"backbone: random initialisation (finetune.init=scratch, seed {ft.seed})")
  book = {"best_step": 0, "best_score": None, "best_validation": {}, "evals_since_best": 0, "evaluations": 0,
          "stopped_early": False, "done": False, "pretrained_step": pretrained_step}
  return state, copy(state.params), book


def run(config: ml_collections.ConfigDict | None, from_workdir: str | None, task: str, workdir: str, *,
        overrides: Sequence[str] = ()) -> dict[str, Any]:
  """Fine-tunes (or resumes, or returns the finished result of) `task` in `workdir`.

  Args:
    config: supplies the `finetune`, `mesh` (and `log`) sections; None = the pretrained run's (or
      configs/base.py's). With `from_workdir=None` it is also the architecture and data (random init).
    from_workdir: the pretrained run directory (its config.json, tokenizer, latest checkpoint), or None.
    task: a task spec (tfx.tasks.TASK_FORMS).
    workdir: the fine-tune's run directory.
    overrides: `--config.k=v` (or `k=v`) for finetune.*, mesh.*, log.*, model dropout / dtype / attention / remat.

  Returns:
    finetune_result.json's content (module docstring, step 8), or {"status": "interrupted", "step",
    "workdir"} when `finetune.stop_after` or a SIGTERM stopped it before the end.
  """
  epath.Path(workdir).mkdir(parents=True, exist_ok=True)
  setup = build(config, from_workdir, task, workdir, overrides)
  cfg, ft, exp, rows = setup.config, setup.config.finetune, setup.exp, setup.rows
  _check_workdir(workdir, cfg, setup.task)
  result_path = epath.Path(workdir) / RESULT_FILE
  progress = Progress(ft.steps)
  if result_path.exists():
    result = json.loads(result_path.read_text())
    progress.note(f"{workdir} is finished (the test split was scored); its result:")
    _print_result(result, progress)
    return result
  train.write_config(cfg, workdir)
  _write_json(epath.Path(workdir) / "finetune_task.json", _task_record(setup))
  if jax.process_index() == 0 and not (epath.Path(workdir) / exp.tokenizer.filename).exists():
    store.write_atomic(epath.Path(workdir) / exp.tokenizer.filename, exp.tokenizer.model_proto)
  writer = MetricsWriter(workdir, config=cfg)
  progress.note(f"tfx.finetune: {cfg.model.family} ({ft.init}{' from ' + ft.from_workdir if ft.from_workdir else ''}) "
                f"on {setup.task.name}: {setup.task.num_classes} classes, rows of {setup.length} tokens "
                f"(truncated: {', '.join(f'{s} {rows[s].truncated}' for s in SPLITS)}), pooling "
                f"{exp.model.pooling}, mesh {dict(exp.mesh.shape)}, workdir {workdir}\n  {setup.task.notes}\n"
                f"class balance:\n{format_balance(setup.task)}")

  abstract, shardings = train.state_shardings(exp.model, exp.tx, exp.mesh, setup.length)
  copy = _copier(exp, shardings)
  mngr = checkpoint.manager(workdir, keep=2, async_save=True)
  latest = mngr.latest_step()
  if latest is not None:
    target = {"train": checkpoint.abstract_like(abstract, shardings),
              "best": checkpoint.abstract_like(abstract.params, shardings.params)}
    restored, book = checkpoint.restore(mngr, latest, target)
    state, best = restored["train"], restored["best"]
    writer.truncate_after(latest)
    progress.note(f"resumed from {mngr.directory}/{latest}")
  else:
    state, best, book = _initial_state(setup, shardings, copy, progress)
  progress.note(f"parameters: {sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract.params)):,}")

  train_step = train.make_train_step(exp, shardings)
  predict = make_predict_step(exp, shardings)
  evaluate = lambda params, split: evaluate_rows(predict, params, rows[split], split, ft.batch_size, exp.mesh,
                                                 setup.task.num_classes)
  preempt = train._Preemption()
  step = start_step = int(jax.device_get(state.step))
  guard = _guard(exp.config, writer, progress, latest)
  sign = -1.0 if ft.select_metric == "loss" else 1.0
  model_flops = exp.objective.train_flops_per_row(exp.model.backbone.cfg, setup.length) * ft.batch_size
  peak = flops.device_peak_flops()
  pending: list[dict] = []  # device metrics not yet read
  host: list[dict] = []  # read (one transfer per log or save) and passed by the guard
  last_time, last_step = time.time(), step
  while not book["done"]:
    indices = train_indices(len(rows["train"]), ft.batch_size, ft.seed, step)
    state, metrics = train_step(state, parallel.global_batch(_local(rows["train"].take(indices)), exp.mesh))
    step += 1
    pending.append(metrics)
    if step == start_step + 1:  # the first step compiles: keep it out of the throughput
      jax.block_until_ready(metrics)
      last_time, last_step = time.time(), step
    log_due = step % ft.log_every == 0 or step == ft.steps
    evaluated = step % ft.eval_every == 0 or step == ft.steps
    every = ft.checkpoint_every
    save_due = bool((every and step % every == 0) or (not every and evaluated) or step >= ft.steps)
    if log_due or save_due or evaluated:  # non-finite steps: stop (or skip) before anything is kept
      host, pending = _read_checked(guard, host, pending, step), []
    if log_due:
      finite = [m for m in host if not m["nonfinite"]] or host
      values = {k: float(np.mean([m[k] for m in finite])) for k in host[0] if k not in ("nonfinite", "learning_rate")}
      values["learning_rate"] = float(host[-1]["learning_rate"])  # the logged step's, as tfx.train logs it
      values["examples"] = values.pop("num_tokens")
      host, now = [], time.time()
      sec_per_step = (now - last_time) / (step - last_step) if step > last_step else None
      last_time, last_step = now, step
      values["tokens_per_sec"] = ft.batch_size * setup.length / sec_per_step if sec_per_step else None
      values["mfu"] = model_flops / sec_per_step / (peak * jax.device_count()) if peak and sec_per_step else None
      writer.write(step, "finetune", values)
      progress.train(step, values["loss"], values["tokens_per_sec"], sec_per_step, values["mfu"])
      last_time = time.time()  # writing the record is not training time
    if evaluated:
      paused = time.time()  # the steps before it were read (finished) above
      scores = evaluate(state.params, "validation")
      book["evaluations"] += 1
      if book["best_score"] is None or sign * scores[ft.select_metric] > book["best_score"]:
        best = copy(state.params)
        book.update(best_step=step, best_score=sign * scores[ft.select_metric], best_validation=scores,
                    evals_since_best=0)
      else:
        book["evals_since_best"] += 1
      writer.write(step, "finetune_eval", dict(scores, best_step=book["best_step"]))
      progress.eval(step, scores["loss"], scores["accuracy"])
      book["stopped_early"] = bool(ft.patience and book["evals_since_best"] >= ft.patience)
      last_time += time.time() - paused  # evaluation time is not training throughput (the steps before it are)
    book["done"] = step >= ft.steps or book["stopped_early"]
    stopping = bool(ft.stop_after and step - start_step >= ft.stop_after) or preempt.should_stop()
    if save_due or book["done"] or stopping:
      if pending:  # stopping between reads
        host, pending = _read_checked(guard, host, pending, step), []
      checkpoint.save(mngr, step, {"train": state, "best": best}, json.loads(json.dumps(book)))  # a snapshot
      guard.saved(step)
      writer.flush()
    if stopping and not book["done"]:
      progress.note(f"stopping at step {step} (checkpoint saved); run the same command to resume")
      break
  mngr.wait_until_finished()
  mngr.close()
  if not book["done"]:
    writer.close()
    return {"status": "interrupted", "step": step, "workdir": workdir}
  if book["stopped_early"]:
    progress.note(f"early stop at step {step}: no better validation {ft.select_metric} in {ft.patience} evaluations")
  result = _finish(setup, book, best, evaluate, writer, step)
  writer.close()
  _print_result(result, progress)
  return result


def _read_checked(guard: Guard, host: list[dict], pending: list, step: int) -> list[dict]:
  """`host` plus the metrics of the steps in `pending` (one transfer), after the guard passed them."""
  fresh = jax.device_get(pending)
  guard.check(fresh, step)
  return host + fresh


def _guard(config, writer: MetricsWriter, progress: Progress, latest: int | None) -> Guard:
  """The pretraining run's non-finite policy for the fine-tune: `skip` drops such steps (inside the
  jitted step), `stop` and `rewind` stop with one line (a fine-tune is short: run it again with a
  lower finetune.learning_rate). Nothing after the last finite checkpoint is saved."""
  t = config.train  # (a run older than the guard lacks its keys: their defaults)
  skip = t.get("on_nonfinite", "stop") == "skip"
  # spike_factor 0: a fine-tune's loss falls fast, a running median says little
  settings = ml_collections.ConfigDict({"on_nonfinite": "skip" if skip else "stop", "spike_factor": 0.0,
                                        "max_skipped": t.get("max_skipped", 10), "poison_step": 0})
  guard = Guard(settings, writer, progress,
                advice="Lower finetune.learning_rate (or raise finetune.warmup_steps) and run the same command "
                       "to resume from the last good checkpoint")
  guard.good_checkpoint = latest
  return guard


def _finish(setup: Setup, book: dict, best, evaluate, writer: MetricsWriter, step: int) -> dict[str, Any]:
  """Scores the test split once with the best params; writes finetune_result.json."""
  cfg, ft, task, rows = setup.config, setup.config.finetune, setup.task, setup.rows
  test = evaluate(best, "test")
  majority = majority_baseline(rows["train"].labels, rows["test"].labels, task.num_classes)
  majority["class"] = task.labels[majority.pop("majority_class")]
  already = any(r.get("split") == "test" for r in read_metrics(setup.exp.workdir))
  if not already:  # a rerun after a crash between this record and the result file
    writer.write(step, "test", dict(test, best_step=book["best_step"], majority_accuracy=majority["accuracy"],
                                    majority_macro_f1=majority["macro_f1"]))
  result = dict(_task_record(setup), init=ft.init, from_workdir=ft.from_workdir,
                pretrained_step=book["pretrained_step"], family=cfg.model.family, pooling=setup.exp.model.pooling,
                seed=ft.seed, steps=ft.steps, steps_run=step, best_step=book["best_step"],
                stopped_early=book["stopped_early"], select_metric=ft.select_metric,
                validation=book["best_validation"], test=test, baselines={"majority": majority},
                workdir=str(setup.exp.workdir))
  _write_json(epath.Path(setup.exp.workdir) / RESULT_FILE, result)
  return result


def _print_result(result: dict, progress: Progress) -> None:
  fmt = lambda m: " | ".join(f"{k.replace('macro_f1', 'macro-F1')} {m[k]:.3f}" for k in ("accuracy", "macro_f1", "mcc")
                             if k in m)
  majority = result["baselines"]["majority"]
  balance = ", ".join(f"{k} {v}" for k, v in result["class_balance"]["test"].items())
  progress.note(f"{result['task']} ({result['init']}), best step {result['best_step']} of {result['steps_run']}:\n"
                f"  validation  {fmt(result['validation'])}\n"
                f"  test        {fmt(result['test'])}\n"
                f"  majority    {fmt(majority)}   (always {majority['class']!r}, train's most frequent class)\n"
                f"  test class balance: {balance}")


def load_finetuned(workdir: str, which: str = "best"):
  """(config, tokenizer, classifier, params, labels) of a fine-tune run, e.g. for predictions: the
  best params (`which="best"`) or those of the last checkpointed step (`which="last"`)."""
  from tfx.data.tokenizer import fit_vocab_size, load_tokenizer, saved_tokenizer

  path = epath.Path(workdir)
  if not (path / "config.json").exists() or not (path / "finetune_task.json").exists():
    raise UserError(f"{workdir} is not a tfx.finetune run (no config.json / finetune_task.json)")
  cfg = config_lib.from_json((path / "config.json").read_text())
  labels = tuple(json.loads((path / "finetune_task.json").read_text())["labels"])
  tokenizer = fit_vocab_size(load_tokenizer(str(saved_tokenizer(workdir))), cfg.data.vocab_size)
  backbone = build_model(cfg.model, vocab_size=tokenizer.vocab_size, max_length=cfg.data.seq_len)
  model = build_classifier(backbone, len(labels), pooling=cfg.finetune.pooling, dropout=cfg.finetune.dropout)
  tx, _ = train.make_optimizer(cfg)
  mesh = parallel.make_mesh(ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1}))
  length = example_length(cfg)
  abstract, shardings = train.state_shardings(model, tx, mesh, length)
  mngr = checkpoint.manager(workdir, keep=2, async_save=False)
  if mngr.latest_step() is None:
    raise UserError(f"{workdir}/checkpoints has no checkpoint yet")
  target = {"train": checkpoint.abstract_like(abstract, shardings),
            "best": checkpoint.abstract_like(abstract.params, shardings.params)}
  restored, _ = checkpoint.restore(mngr, mngr.latest_step(), target)
  mngr.close()
  return cfg, tokenizer, model, restored["best"] if which == "best" else restored["train"].params, labels


def main(argv: list[str] | None = None) -> None:
  import argparse

  parser = argparse.ArgumentParser(prog="python -m tfx.finetune", description=__doc__.split("\n")[0])
  parser.add_argument("--from", dest="from_workdir", required=True,
                      help="the pretrained run directory, or 'none' (random init; needs --config)")
  parser.add_argument("--task", required=True, help="stdlib:package, stdlib:docstring, jsonl:PATH, hf:glue:NAME, ...")
  parser.add_argument("--workdir", required=True, help="the fine-tune's directory (resumed if it has checkpoints)")
  parser.add_argument("--config", default=None, help="a config file whose finetune / mesh / log sections to use "
                      "(with --from none: also the architecture and data)")
  parser.add_argument("--debug", action="store_true", help="show the traceback of an error (instead of one line)")
  args, overrides = parser.parse_known_args(argv)
  quiet_background(args.debug)
  parallel.initialize_distributed()
  try:
    from_workdir = None if args.from_workdir.lower() == "none" else args.from_workdir
    config = None
    if args.config:
      config = config_lib.load_config(args.config, [o for o in overrides if not from_workdir])
    run(config, from_workdir, args.task, args.workdir, overrides=overrides if from_workdir else ())
  except Exception as e:  # noqa: BLE001  (one line for every error; --debug shows the traceback)
    if args.debug:
      raise
    exit_with("tfx.finetune", e, args.workdir, command_line=argv is None)


if __name__ == "__main__":
  main()
