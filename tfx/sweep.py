"""Sweeps: arms x seeds, pretraining then an optional fine-tuning stage, skipped when done, resumed
when interrupted, aggregated into a table with confidence intervals and plots.

    python -m tfx.sweep experiments/objectives/sweep.py --workdir runs/objectives [--smoke]
        [--parallel N] [--print-commands] [--only ARM[/SEED]] [--report-only]

A sweep file defines `get_sweep(smoke: bool) -> Sweep`:

    Sweep(name="objectives", config="configs/tiny.py", common=("train.batch_size=8",),
          arms=(Arm("causal LM", ("objective.name=causal_lm",)), Arm("MLM", (...))),
          seeds=(0, 1, 2), baseline="causal LM", match="tokens", budget=2e6,
          finetune=Finetune(task="stdlib:package"))

Each run (arm, seed) lives in WORKDIR/<arm>/seed_<k>/: `pretrain/` is a tfx.train run directory,
`finetune/` a tfx.finetune one, and `run.json` is written when both are complete. It records the
summary metrics, the planned config overrides (a rerun with other overrides stops rather than
mixes results), the git commit, the library versions and the devices. A run without `run.json`
is (re)started, and tfx.train / tfx.finetune resume it from its last checkpoint, so a killed
sweep rerun with the same command completes only what is missing. A run stopped early (SIGTERM:
a preemption; it saved a checkpoint) stops the sweep with exit status 75, with no report.

Budget matching (`match`): every arm trains `budget` tokens ("tokens": tokens the pipeline reads
per step = batch x row length) or `budget` training FLOPs ("flops": the objective's own count,
tfx.flops, the same as MFU uses); each arm's step count is derived from it and the table shows
both. `--parallel N` runs N runs at a time as subprocesses, on disjoint device subsets when
there are GPUs (CUDA_VISIBLE_DEVICES, within the one this process was given); `--print-commands` prints
one command per pending run, for a cluster scheduler. The report (tfx/sweep_report.py) is
written after every sweep and by `--report-only`.

The runs share JAX's persistent compilation cache (`--compilation-cache`, default WORKDIR/jax_cache,
or $JAX_COMPILATION_CACHE_DIR where that is set): the seeds of an arm compile the same programs
(the seed is an input, not a constant), so only the first compiles them; the results are the same.
They share their token stores too (`--stores`, default WORKDIR/data, given to each run as
data.store_root): runs whose data settings agree read one store, which the sweep prepares (trains
the tokenizer, tokenizes the corpus) once, before any run starts. The store does not depend on the
seed (SentencePiece's training is deterministic on tfx's fixed sample), so the runs read the bytes
they would have prepared for themselves.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from etils import epath

from tfx.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository (configs/ beside tfx/)
RUN_FILE = "run.json"
CACHE_DIR = "jax_cache"  # WORKDIR/jax_cache: the runs' compiled programs (--compilation-cache auto)
STORES_DIR = "data"  # WORKDIR/data: the runs' token stores (--stores auto)


@dataclasses.dataclass(frozen=True)
class Finetune:
  """The downstream stage after pretraining: `task` (see tfx.finetune), config overrides, and
  whether to also fine-tune the baseline arm's architecture from random initialisation."""

  task: str
  overrides: tuple[str, ...] = ()
  scratch: bool = True


@dataclasses.dataclass(frozen=True)
class Arm:
  """One configuration: a name, config overrides (`key=value`, as `--config.key=value`), and an
  optional config file of its own (default: the sweep's)."""

  name: str
  overrides: tuple[str, ...] = ()
  config: str = ""
  finetune_overrides: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Sweep:
  name: str
  arms: tuple[Arm, ...]
  config: str = "configs/tiny.py"  # relative to the repository, or absolute
  common: tuple[str, ...] = ()  # overrides for every arm (before the arm's own)
  seeds: tuple[int, ...] = (0, 1, 2)
  baseline: str = ""  # default: the first arm
  match: str = ""  # "" (each arm's own train.steps), "tokens" or "flops"
  budget: float = 0.0  # tokens or FLOPs per run when `match` is set
  finetune: Finetune | None = None
  question: str = ""  # one line for the report's header

  def baseline_arm(self) -> str:
    return self.baseline or self.arms[0].name


SCRATCH = "scratch (random init)"  # the arm name of the fine-tune-from-scratch baseline


@dataclasses.dataclass(frozen=True)
class Planned:
  """A run of the sweep: arm x seed, with everything needed to run it."""

  arm: str
  seed: int
  directory: str
  overrides: tuple[str, ...]  # pretraining: --config.key=value
  config_file: str
  steps: int
  tokens_per_step: int
  flops_per_step: float
  finetune: tuple[str, ...] | None  # fine-tuning overrides, None without a stage
  task: str = ""  # the fine-tuning task
  scratch: bool = False  # fine-tune from random init (no pretraining)
  stores: str = ""  # data.store_root of the run ('' = its own WORKDIR/data); where, not what: not in the fingerprint

  @property
  def key(self) -> str:
    return f"{self.arm}/{self.seed}"

  def fingerprint(self) -> str:
    blob = json.dumps([os.path.relpath(self.config_file, ROOT), self.overrides, self.finetune, self.task,
                       self.scratch], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# ============================================================================ loading and planning


def load_sweep(path: str, smoke: bool) -> Sweep:
  """Imports a sweep file and calls its `get_sweep(smoke)`."""
  if not os.path.isfile(path):
    raise UserError(f"sweep file {path} does not exist (e.g. experiments/objectives/sweep.py)")
  spec = importlib.util.spec_from_file_location(f"tfx_sweep_{abs(hash(path))}", path)
  module = importlib.util.module_from_spec(spec)
  sys.path.insert(0, ROOT)
  try:
    spec.loader.exec_module(module)
  finally:
    sys.path.remove(ROOT)
  if not hasattr(module, "get_sweep"):
    raise UserError(f"{path} has no get_sweep(smoke: bool) -> tfx.sweep.Sweep")
  sweep = module.get_sweep(smoke)
  names = [a.name for a in sweep.arms]
  if len(set(names)) != len(names) or SCRATCH in names:
    raise UserError(f"{path}: arm names must be unique and not {SCRATCH!r}: {names}")
  dirs = collections.Counter(_dirname(n) for n in [*names, SCRATCH])
  if clash := [n for n in names if dirs[_dirname(n)] > 1]:
    raise UserError(f"{path}: arm names {clash} share the run directory {_dirname(clash[0])!r} (characters other "
                    "than letters, digits, '-', '_' and '.' become '_'): rename one of them")
  if sweep.baseline and sweep.baseline not in names:
    raise UserError(f"{path}: baseline {sweep.baseline!r} is not an arm ({', '.join(names)})")
  if sweep.match not in ("", "tokens", "flops") or (sweep.match and sweep.budget <= 0):
    raise UserError(f"{path}: match must be '', 'tokens' or 'flops', with a positive budget")
  return sweep


def _flag(override: str) -> str:
  return override if override.startswith("--") else f"--config.{override}"


def _config_path(sweep: Sweep, arm: Arm) -> str:
  path = arm.config or sweep.config
  return path if os.path.isabs(path) else os.path.join(ROOT, path)


def _dirname(name: str) -> str:
  return "".join(c if c.isalnum() or c in "-_." else "_" for c in name).strip("_") or "arm"


def _per_step(config) -> tuple[int, float]:
  """(tokens the pipeline reads per step, training FLOPs per step) of a config, without data."""
  from tfx.nn.layers import ModelConfig  # noqa: PLC0415
  from tfx.objectives.base import placeholder_ids  # noqa: PLC0415
  from tfx.registry import OBJECTIVES, load_builtins  # noqa: PLC0415

  load_builtins()
  objective = OBJECTIVES.get(config.objective.name).from_config(config.objective,
                                                                 placeholder_ids(config.data.vocab_size))
  model_cfg = ModelConfig.from_config(config.model, vocab_size=config.data.vocab_size, max_length=config.data.seq_len)
  batch = config.train.batch_size
  return batch * objective.raw_length(config.data.seq_len), batch * objective.train_flops_per_row(
      model_cfg, config.data.seq_len)


def plan(sweep: Sweep, workdir: str, stores: str = "") -> list[Planned]:
  """Every run of the sweep, arms in order, then the scratch baseline (if any), seeds inside; the
  runs prepare their token stores in `stores` (a --stores path; '' = each in its own directory)."""
  from tfx.config import load_config  # noqa: PLC0415

  runs = []
  for arm in sweep.arms:
    flags = [_flag(o) for o in (*sweep.common, *arm.overrides)]
    config = load_config(_config_path(sweep, arm), flags)
    tokens, flops = _per_step(config)
    steps = config.train.steps
    if sweep.match == "tokens":
      steps = max(1, round(sweep.budget / tokens))
    elif sweep.match == "flops":
      steps = max(1, round(sweep.budget / flops))
    finetune = (*sweep.finetune.overrides, *arm.finetune_overrides) if sweep.finetune else None
    for seed in sweep.seeds:
      run_flags = (*flags, f"--config.train.seed={seed}", f"--config.train.steps={steps}")
      runs.append(Planned(arm.name, seed, os.path.join(workdir, _dirname(arm.name), f"seed_{seed}"), run_flags,
                          _config_path(sweep, arm), steps, tokens, flops, finetune,
                          sweep.finetune.task if sweep.finetune else "", stores=stores))
  if sweep.finetune and sweep.finetune.scratch:
    base = next(r for r in runs if r.arm == sweep.baseline_arm())
    for seed in sweep.seeds:
      runs.append(dataclasses.replace(base, arm=SCRATCH, seed=seed, scratch=True, steps=0,
                                      directory=os.path.join(workdir, _dirname(SCRATCH), f"seed_{seed}"),
                                      overrides=(*base.overrides[:-2], f"--config.train.seed={seed}",
                                                 "--config.train.steps=0")))
  return runs


def status(run: Planned) -> str:
  """'done', 'partial' (started, not complete) or 'pending'; raises if the directory holds a run
  of other settings."""
  record = epath.Path(run.directory) / RUN_FILE
  if record.exists():
    recorded = json.loads(record.read_text()).get("fingerprint")
    if recorded != run.fingerprint():
      raise UserError(f"{run.directory} holds a completed run of other settings than the sweep file's {run.key} "
                      "(its overrides changed); use another --workdir, or delete that directory to run it again")
    return "done"
  return "partial" if epath.Path(run.directory).exists() else "pending"


# ============================================================================ running


def provenance() -> dict[str, Any]:
  """The git commit (and whether the tree had changes), library versions and devices."""
  import jax  # noqa: PLC0415
  from importlib import metadata  # noqa: PLC0415

  def git(*args: str) -> str:
    try:
      return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
      return ""

  versions = {}
  for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "grain", "sentencepiece", "tokenizers"):
    try:
      versions[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
      pass
  devices = jax.devices()
  return {"git_commit": git("rev-parse", "HEAD"), "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
          "versions": versions, "python": platform.python_version(),
          "devices": {"platform": devices[0].platform, "kind": getattr(devices[0], "device_kind", ""),
                      "count": len(devices)}, "host": platform.node()}


def _final_metrics(directory: str) -> dict[str, float]:
  from tfx.metrics import read_metrics  # noqa: PLC0415

  records = read_metrics(directory)
  out: dict[str, float] = {}
  for split in ("train", "eval"):
    rows = [r for r in records if r.get("split") == split]
    if rows:
      for k, v in rows[-1].items():
        if k not in ("step", "split") and isinstance(v, (int, float)) and v is not None:
          out[f"{split}/{k}"] = float(v)
  return out


def run_config(run: Planned):
  """The pretraining config of `run`: its file, its overrides and where its token store is."""
  from tfx.config import load_config  # noqa: PLC0415

  stores = [f"--config.data.store_root={run.stores}"] if run.stores else []
  return load_config(run.config_file, [*run.overrides, *stores])


def prepare_stores(runs: list[Planned]) -> list[str]:
  """Prepares the token store of every pretraining run that shares them (`Planned.stores`), each
  distinct one once, here, before the runs start (so that runs a scheduler starts together do not
  all hold their devices while one of them prepares); the store directories, in order. A finished
  store is only checked. (A scratch run reads the tokenizer of its baseline arm's store, see
  tfx.finetune.)"""
  from tfx.data.prepare import PREPARED  # noqa: PLC0415
  from tfx.data.training import prepare_store, store_dir  # noqa: PLC0415

  directories: list[str] = []
  for run in runs:
    config = run_config(run) if run.stores and not run.scratch else None
    if config is None or config.data.source.startswith(PREPARED):
      continue
    directory = str(store_dir(config, run.directory))
    if directory in directories:
      continue
    directories.append(directory)
    print(f"tfx.sweep: token store {directory} ({config.data.source}, vocabulary {config.data.vocab_size})",
          file=sys.stderr, flush=True)
    try:
      prepare_store(config, directory, tokenizer_path=config.data.tokenizer)
    except ValueError as e:  # StoreError: a source that cannot be read, a vocabulary it cannot fill, ...
      raise UserError(str(e)) from e
  return directories


def execute(run: Planned) -> dict[str, Any]:
  """Runs (or resumes) one planned run in this process and writes its run.json."""
  from tfx import train  # noqa: PLC0415

  started = time.time()
  pretrain = os.path.join(run.directory, "pretrain")
  record: dict[str, Any] = {"arm": run.arm, "seed": run.seed, "fingerprint": run.fingerprint(),
                            "steps": run.steps, "tokens": run.steps * run.tokens_per_step,
                            "flops": run.steps * run.flops_per_step, "overrides": list(run.overrides),
                            "config_file": os.path.relpath(run.config_file, ROOT), "scratch": run.scratch}
  if not run.scratch:
    summary = train.run(run_config(run), pretrain)
    if summary["step"] < run.steps:  # stopped (train.stop_after or a preemption): not complete
      return {"status": "interrupted", "step": summary["step"]}
    record["pretrain"] = _final_metrics(pretrain)
  if run.finetune is not None:
    from tfx import finetune  # noqa: PLC0415

    flags = [*run.finetune, f"finetune.seed={run.seed}"]
    target = os.path.join(run.directory, "finetune")
    if run.scratch:  # the baseline arm's architecture and data, random weights
      result = finetune.run(run_config(run), None, run.task, target, overrides=flags)
    else:
      result = finetune.run(None, pretrain, run.task, target, overrides=flags)
    if result.get("status") == "interrupted":
      return result
    record["finetune"] = {k: result[k] for k in ("test", "validation", "baselines", "best_step", "steps_run",
                                                 "num_classes") if k in result}
  record["seconds"] = time.time() - started
  record["provenance"] = provenance()
  epath.Path(run.directory).mkdir(parents=True, exist_ok=True)
  (epath.Path(run.directory) / RUN_FILE).write_text(json.dumps(record, indent=2, sort_keys=True))
  return record


def _shared_dir(choice: str, auto: str) -> str:
  """A directory the runs share, from a DIR|auto|off option: 'auto' = `auto`, 'off' = '', else
  the path (local, made absolute: the runs' subprocesses start in the repository; or gs://)."""
  if choice in ("auto", "off"):
    return auto if choice == "auto" else ""
  return choice if "://" in choice else os.path.abspath(choice)


def cache_path(choice: str, workdir: str) -> str:
  """The compilation cache of a sweep's runs: 'auto' = $JAX_COMPILATION_CACHE_DIR if set, else
  WORKDIR/jax_cache; 'off' = none (''); anything else is the path."""
  return _shared_dir(choice, os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(workdir, CACHE_DIR))


def compilation_cache(path: str) -> contextlib.AbstractContextManager:
  """JAX's persistent compilation cache at `path` inside the block ('' = left as it is), restored
  after it: the runs executed here reuse each other's compiled steps."""
  if not path:
    return contextlib.nullcontext()
  from tfx import parallel  # noqa: PLC0415  (jax: not at import, the report alone needs none)

  return parallel.compilation_cache(path)


INTERRUPTED = 75  # exit status of a sweep (or one run of it) stopped by SIGTERM after a checkpoint (EX_TEMPFAIL)


def stores_path(choice: str, workdir: str) -> str:
  """The token stores' directory of a sweep's runs: 'auto' = WORKDIR/data; 'off' = each run its own
  (''); anything else is the path (several sweeps may share one)."""
  return _shared_dir(choice, os.path.join(workdir, STORES_DIR))


def _command(sweep_file: str, workdir: str, smoke: bool, run: Planned, cache: str = "") -> list[str]:
  """The command that runs `run` alone: its --stores the planned one, its compilation cache `cache`
  (a `cache_path`, '' = none), both as paths."""
  return [sys.executable, "-m", "tfx.sweep", sweep_file, "--workdir", workdir, *(["--smoke"] if smoke else []),
          "--stores", run.stores or "off", "--compilation-cache", cache or "off", "--only", run.key, "--no-report"]


def _accelerators() -> tuple[str, int]:
  """(platform, device count) of this machine, asked of a child process: a parent that started a
  GPU backend itself would hold (preallocate) memory on every GPU that its runs need."""
  probe = "import jax; d = jax.devices(); print(d[0].platform, len(d))"
  out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT)
  if out.returncode != 0:
    raise UserError(f"--parallel: could not list the devices: {out.stderr.strip()[-500:]}")
  platform_name, count = out.stdout.split()[-2:]
  return platform_name, int(count)


def _device_env(slot: int, parallel: int, accelerators: tuple[str, int]) -> dict[str, str]:
  """Environment that gives subprocess `slot` of `parallel` its own GPUs (none on CPU). The ids are
  taken from this process's own CUDA_VISIBLE_DEVICES when it has one (a scheduler's allocation:
  GPUs 4-7 stay 4-7), else 0..count-1."""
  platform_name, count = accelerators
  if platform_name == "cpu" or parallel <= 1:
    return {}
  if platform_name != "gpu":
    raise UserError(f"--parallel {parallel} on {platform_name}: one host's TPU chips belong to one process "
                    "unless each is given its own process bounds and ports, which tfx.sweep does not set up; run "
                    "the sweep without --parallel (one run at a time on all chips), or one --only ARM per host")
  per = count // parallel
  if per < 1:
    raise UserError(f"--parallel {parallel} needs at least {parallel} GPUs; there are {count}")
  visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
  pool = visible if len(visible) == count else [str(i) for i in range(count)]
  return {"CUDA_VISIBLE_DEVICES": ",".join(pool[slot * per:(slot + 1) * per])}


def run_parallel(sweep_file: str, workdir: str, smoke: bool, runs: list[Planned], parallel: int,
                 cache: str = "") -> list[int]:
  """Runs `runs` as subprocesses, `parallel` at a time, each on its own device subset and with the
  compilation cache `cache` (a `cache_path`, '' = none); exit codes."""
  accelerators = _accelerators()
  _device_env(0, parallel, accelerators)  # devices that cannot be split stop here, before any run
  slots = list(range(parallel))

  def one(run: Planned) -> int:
    slot = slots.pop()
    try:
      log = epath.Path(run.directory)
      log.mkdir(parents=True, exist_ok=True)
      with open(os.path.join(run.directory, "sweep.log"), "a") as f:
        return subprocess.run(_command(sweep_file, workdir, smoke, run, cache), stdout=f, stderr=subprocess.STDOUT,
                              env={**os.environ, **_device_env(slot, parallel, accelerators)}, cwd=ROOT).returncode
    finally:
      slots.append(slot)

  with ThreadPoolExecutor(parallel) as pool:
    return list(pool.map(one, runs))


def _select(runs: list[Planned], only: str) -> list[Planned]:
  if not only:
    return runs
  chosen = [r for r in runs if r.key == only or r.arm == only]
  if not chosen:
    raise UserError(f"--only {only!r} matches no run; runs are {', '.join(r.key for r in runs)}")
  return chosen


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m tfx.sweep", description=__doc__.split("\n")[0])
  parser.add_argument("sweep_file", help="a sweep file (e.g. experiments/objectives/sweep.py)")
  parser.add_argument("--workdir", required=True, help="where the runs and the report go")
  parser.add_argument("--smoke", action="store_true", help="the sweep file's smoke size (minutes on a CPU)")
  parser.add_argument("--parallel", type=int, default=1, help="runs at a time (subprocesses, disjoint devices)")
  parser.add_argument("--print-commands", action="store_true", help="print one command per pending run and exit")
  parser.add_argument("--only", default="", help="only this arm, or ARM/SEED")
  parser.add_argument("--report-only", action="store_true", help="only aggregate what is complete")
  parser.add_argument("--compilation-cache", default="auto", metavar="DIR|auto|off",
                      help="JAX's persistent compilation cache shared by the runs (auto: $JAX_COMPILATION_CACHE_DIR "
                           f"if set, else WORKDIR/{CACHE_DIR})")
  parser.add_argument("--stores", default="auto", metavar="DIR|auto|off",
                      help=f"where the runs' token stores are prepared, once per distinct data setting (auto: "
                           f"WORKDIR/{STORES_DIR}; off: each run in its own directory)")
  parser.add_argument("--no-report", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  try:
    from tfx import sweep_report  # noqa: PLC0415

    sweep = load_sweep(args.sweep_file, args.smoke)
    workdir = os.path.abspath(args.workdir)
    stores, cache = stores_path(args.stores, workdir), cache_path(args.compilation_cache, workdir)
    runs = plan(sweep, args.workdir, stores)
    pending = [r for r in _select(runs, args.only) if status(r) != "done"]
    if not args.report_only:
      prepare_stores(pending)  # before any run starts (and before the commands of a scheduler's runs)
    if args.print_commands:
      for run in pending:
        print(shlex.join(_command(os.path.abspath(args.sweep_file), workdir, args.smoke, run, cache)))
      return
    if not args.report_only:
      done = len(runs) - len([r for r in runs if status(r) != "done"])
      print(f"tfx.sweep {sweep.name}: {len(runs)} runs, {done} complete, {len(pending)} to run", flush=True)
      if args.parallel > 1:
        codes = run_parallel(os.path.abspath(args.sweep_file), workdir, args.smoke, pending, args.parallel, cache)
        failed = [r.key for r, c in zip(pending, codes) if c not in (0, INTERRUPTED)]
        if failed:
          raise UserError(f"runs failed: {', '.join(failed)} (see sweep.log in their directories)")
        if stopped := [r.key for r, c in zip(pending, codes) if c == INTERRUPTED]:
          print(f"tfx.sweep: {', '.join(stopped)} stopped early (checkpoints saved): run the same command to resume",
                flush=True)
          sys.exit(INTERRUPTED)
      else:
        with compilation_cache(cache):
          for i, run in enumerate(pending):
            print(f"tfx.sweep: [{i + 1}/{len(pending)}] {run.key} -> {run.directory}", flush=True)
            result = execute(run)
            if result.get("status") == "interrupted":  # SIGTERM (a preemption): the whole sweep stops
              print(f"tfx.sweep: {run.key} stopped at step {result.get('step')} (checkpoint saved); the sweep stops "
                    f"here: run the same command to resume", flush=True)
              sys.exit(INTERRUPTED)
    if not args.no_report:
      paths = sweep_report.write_report(sweep, runs, args.workdir)
      print(f"tfx.sweep: report {', '.join(paths)}")
  except UserError as e:
    sys.exit(f"tfx.sweep: {e}")


if __name__ == "__main__":
  main()
