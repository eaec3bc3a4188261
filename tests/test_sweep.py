"""tfx.sweep: a 2-arm x 2-seed sweep end to end (pretrain -> fine-tune -> report), the report's
arithmetic against a direct computation, valid PNGs, and a killed sweep that completes only what
is missing when run again."""

import csv
import dataclasses
import json
import math
import os
import shlex
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from scipy import stats

from tests.conftest import ROOT
from tfx import sweep, sweep_report

SWEEP_FILE = '''
from tfx.sweep import Arm, Finetune, Sweep

def get_sweep(smoke):
  common = ("data.tokenizer={tokenizer}", "data.max_documents=60", "train.batch_size=4", "train.log_every=2",
            "train.eval_every=3", "train.checkpoint_every=3", "data.eval_batches=1", "optim.warmup_steps=1")
  return Sweep(name="tiny", config="configs/tiny.py", common=common,
               arms=(Arm("causal", ("objective.name=causal_lm",)), Arm("prefix", ("objective.name=prefix_lm",))),
               seeds=(0, 1), baseline="causal", match="tokens", budget=6 * 4 * 64,
               finetune={finetune})
'''

FINETUNE = ('Finetune(task="stdlib:package", overrides=("finetune.steps=4", "finetune.batch_size=8", '
            '"finetune.max_train_examples=64", "finetune.max_eval_examples=64", "finetune.eval_every=2"))')


def _write(tmp_path, tokenizer: str, finetune: str = "None") -> str:
  path = tmp_path / "sweep.py"
  path.write_text(SWEEP_FILE.format(tokenizer=tokenizer, finetune=finetune))
  return str(path)


def test_mean_ci_and_p_value_match_a_direct_computation():
  x, y = [0.61, 0.64, 0.58, 0.66], [0.55, 0.57, 0.52]
  mean, half = sweep_report.mean_ci(x)
  s = np.std(x, ddof=1)
  assert mean == pytest.approx(np.mean(x)) and half == pytest.approx(stats.t.ppf(0.975, 3) * s / 2)
  # Welch's t by hand
  vx, vy = np.var(x, ddof=1) / 4, np.var(y, ddof=1) / 3
  t = (np.mean(x) - np.mean(y)) / math.sqrt(vx + vy)
  dof = (vx + vy) ** 2 / (vx**2 / 3 + vy**2 / 2)
  assert sweep_report.p_value(x, y) == pytest.approx(2 * stats.t.sf(abs(t), dof))
  assert math.isnan(sweep_report.mean_ci([1.0])[1]) and math.isnan(sweep_report.p_value([1.0], [2.0, 3.0]))


def test_plan_matches_the_budget_and_refuses_bad_sweeps(tmp_path, shared_tokenizer):
  s = sweep.load_sweep(_write(tmp_path, shared_tokenizer), smoke=True)
  runs = sweep.plan(s, str(tmp_path / "w"))
  assert [r.key for r in runs] == ["causal/0", "causal/1", "prefix/0", "prefix/1"]
  assert all(r.steps * r.tokens_per_step == 6 * 4 * 64 for r in runs)
  bad = tmp_path / "bad.py"
  bad.write_text("from tfx.sweep import Arm, Sweep\ndef get_sweep(smoke):\n"
                 "  return Sweep(name='x', arms=(Arm('a'), Arm('a')))\n")
  with pytest.raises(sweep.UserError, match="unique"):
    sweep.load_sweep(str(bad), smoke=True)
  bad.write_text("from tfx.sweep import Arm, Sweep\ndef get_sweep(smoke):\n"
                 "  return Sweep(name='x', arms=(Arm('lr 1e-3'), Arm('lr_1e-3')))\n")
  with pytest.raises(sweep.UserError, match="share the run directory 'lr_1e-3'"):
    sweep.load_sweep(str(bad), smoke=True)


def test_parallel_runs_get_gpus_from_the_allocation_this_process_was_given(monkeypatch):
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
  assert [sweep._device_env(slot, 2, ("gpu", 4)) for slot in (0, 1)] == [
      {"CUDA_VISIBLE_DEVICES": "4,5"}, {"CUDA_VISIBLE_DEVICES": "6,7"}]
  monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
  assert sweep._device_env(1, 2, ("gpu", 4)) == {"CUDA_VISIBLE_DEVICES": "2,3"}
  assert sweep._device_env(1, 2, ("cpu", 1)) == {}
  with pytest.raises(sweep.UserError, match="needs at least 3 GPUs; there are 2"):
    sweep._device_env(0, 3, ("gpu", 2))
  with pytest.raises(sweep.UserError, match="without --parallel"):
    sweep._device_env(0, 2, ("tpu", 4))


def test_a_single_seed_arm_is_plotted_without_an_interval(tmp_path, shared_tokenizer, monkeypatch):
  """An arm with one complete seed has no confidence interval: its bar has no error bar (not a
  zero-width one), while the two-seed arm's bar spans the t interval."""
  s = sweep.load_sweep(_write(tmp_path, shared_tokenizer), smoke=True)
  runs = sweep.plan(s, str(tmp_path / "w"))
  accuracy = {"causal/0": 0.5, "causal/1": 0.7, "prefix/0": 0.6}
  for run in runs:
    if run.key in accuracy:
      os.makedirs(os.path.join(run.directory, "pretrain"))
      open(os.path.join(run.directory, "pretrain", "metrics.jsonl"), "w").close()  # no eval curve
      record = {"arm": run.arm, "seed": run.seed, "fingerprint": run.fingerprint(),
                "finetune": {"test": {"accuracy": accuracy[run.key]}}}
      with open(os.path.join(run.directory, sweep.RUN_FILE), "w") as f:
        json.dump(record, f)
  bars = {}

  def capture(names, means, lows, highs, path, title, ylabel):
    bars.update({n: (lo, hi) for n, lo, hi in zip(names, lows, highs)})
    return str(path)

  monkeypatch.setattr("tfx.plots.bars_with_errors", capture)
  sweep_report.write_report(s, runs, str(tmp_path / "w"))
  half = stats.t.ppf(0.975, 1) * np.std([0.5, 0.7], ddof=1) / math.sqrt(2)
  assert bars["causal"] == pytest.approx((0.6 - half, 0.6 + half))
  assert all(math.isnan(x) for x in bars["prefix"])


def _png_ok(path: str) -> None:
  import matplotlib.image

  with open(path, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert matplotlib.image.imread(path).ndim == 3


def test_the_runs_compilation_cache_is_the_workdirs_unless_one_is_set(monkeypatch):
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
  assert sweep.cache_path("auto", "runs/s") == os.path.join("runs/s", sweep.CACHE_DIR)
  assert sweep.cache_path("off", "runs/s") == "" and sweep.cache_path("gs://b/c", "runs/s") == "gs://b/c"
  assert sweep.cache_path("rel/cache", "runs/s") == os.path.abspath("rel/cache")  # the same from the runs' cwd
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/shared/jax")
  assert sweep.cache_path("auto", "runs/s") == "/shared/jax"


STORES_SWEEP = '''
from tfx.sweep import Arm, Sweep

def get_sweep(smoke):
  common = ("data.max_documents=40", "data.vocab_size=800", "data.tokenizer_sample_bytes=100000",
            "data.prepare_workers=1")
  return Sweep(name="stores", config="configs/tiny.py", common=common, seeds=(0, 1),
               arms=(Arm("causal", ("objective.name=causal_lm",)), Arm("prefix", ("objective.name=prefix_lm",)),
                     Arm("small vocabulary", ("objective.name=causal_lm", "data.vocab_size=700"))))
'''


def test_runs_share_one_token_store_per_data_setting_the_same_bytes_as_their_own(tmp_path):
  """The sweep prepares each distinct token store once (a seed or an objective does not make
  another, a vocabulary does), byte for byte the store each seed would prepare for itself (its
  tokenizer is trained, and SentencePiece's training does not depend on the seed); a fine-tune
  from scratch reads that store's tokenizer instead of training its own."""
  from tfx import finetune
  from tfx.data.prepare import prepare

  path = tmp_path / "stores.py"
  path.write_text(STORES_SWEEP)
  workdir = str(tmp_path / "w")
  runs = sweep.plan(sweep.load_sweep(str(path), smoke=True), workdir, sweep.stores_path("auto", workdir))
  assert len(runs) == 6 and all(r.stores == os.path.join(workdir, "data") for r in runs)
  assert sweep.stores_path("off", workdir) == "" and sweep.stores_path("gs://b/s", workdir) == "gs://b/s"
  assert sweep.stores_path("rel/stores", workdir) == os.path.abspath("rel/stores")
  directories = sweep.prepare_stores(runs)
  assert len(directories) == 2 and all(d.startswith(os.path.join(workdir, "data", "")) for d in directories)
  assert sweep.prepare_stores(runs) == directories  # finished: only checked
  for seed in (0, 1):  # what a run of each seed prepares in its own directory
    config = sweep.run_config(dataclasses.replace(runs[seed], stores=""))
    assert config.train.seed == seed
    prepare(config.data, str(tmp_path / f"own_{seed}"), seed=seed, workers=1, progress=False)
    assert _files(tmp_path / f"own_{seed}") == _files(directories[0])
  # An interrupted sweep that planned stores off keeps preparing per run, and its commands say so.
  command = sweep._command("s.py", workdir, False, dataclasses.replace(runs[0], stores=""))
  assert command[command.index("--stores") + 1] == "off"

  scratch = dataclasses.replace(runs[0], arm=sweep.SCRATCH, scratch=True)
  tokenizer = finetune._scratch_tokenizer(sweep.run_config(scratch), str(tmp_path / "ft"), seed=1)
  assert tokenizer.model_proto == open(os.path.join(directories[0], "tokenizer.model"), "rb").read()
  assert not os.path.exists(tmp_path / "ft")  # nothing trained, nothing written


def _files(directory) -> dict[str, bytes]:
  return {name: open(os.path.join(directory, name), "rb").read() for name in sorted(os.listdir(directory))}


@pytest.mark.slow
def test_a_sweep_end_to_end_and_a_killed_sweep_completes_what_is_missing(tmp_path, shared_tokenizer, monkeypatch):
  sweep_file = _write(tmp_path, shared_tokenizer, FINETUNE)
  workdir = str(tmp_path / "w")
  # Killed: a subprocess runs the sweep and is killed once the first run is complete.
  proc = subprocess.Popen([sys.executable, "-m", "tfx.sweep", sweep_file, "--workdir", workdir], cwd=ROOT,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  first = os.path.join(workdir, "causal", "seed_0", sweep.RUN_FILE)
  deadline = time.time() + 600  # guards a hang only
  while not os.path.exists(first) and proc.poll() is None and time.time() < deadline:
    time.sleep(0.5)
  proc.kill()
  proc.wait()
  assert os.path.exists(first)
  first_record = open(first).read()

  cache_before = jax.config.jax_compilation_cache_dir
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)  # the tests' own cache (conftest.py)
  sweep.main([sweep_file, "--workdir", workdir])
  assert open(first).read() == first_record  # not run again
  # Without $JAX_COMPILATION_CACHE_DIR the runs share WORKDIR/jax_cache; this process's own setting
  # is back as it was.
  assert os.listdir(os.path.join(workdir, sweep.CACHE_DIR))
  assert jax.config.jax_compilation_cache_dir == cache_before
  # Both arms read one token store, WORKDIR/data/<key>, prepared by the sweep; no run has its own.
  assert len(os.listdir(os.path.join(workdir, sweep.STORES_DIR))) == 1
  assert not any(os.path.exists(os.path.join(workdir, arm, f"seed_{k}", "pretrain", "data"))
                 for arm in ("causal", "prefix") for k in (0, 1))
  s = sweep.load_sweep(sweep_file, smoke=False)
  runs = sweep.plan(s, workdir)
  assert {r.key for r in runs} == {"causal/0", "causal/1", "prefix/0", "prefix/1", f"{sweep.SCRATCH}/0",
                                   f"{sweep.SCRATCH}/1"}
  assert all(sweep.status(r) == "done" for r in runs)
  record = json.loads(open(first).read())
  assert record["provenance"]["git_commit"] and "jax" in record["provenance"]["versions"]
  assert record["tokens"] == 6 * 4 * 64

  # The CSV has one row per run; the markdown's mean +- CI is the direct computation from it.
  with open(os.path.join(workdir, "results.csv")) as f:
    rows = list(csv.DictReader(f))
  assert len(rows) == 6
  key = next(k for k in rows[0] if k.startswith("finetune/test/accuracy"))
  md = open(os.path.join(workdir, "results.md")).read()
  for arm in ("causal", "prefix", sweep.SCRATCH):
    values = [float(r[key]) for r in rows if r["arm"] == arm]
    mean, half = np.mean(values), stats.t.ppf(0.975, 1) * np.std(values, ddof=1) / math.sqrt(2)
    line = next(ln for ln in md.splitlines() if ln.startswith(f"| {arm} |"))
    assert f"{mean:.4f} ± {half:.4f}" in line or (half == 0 and f"{mean:.4f}" in line)
  loss = [float(r["pretrain/eval/loss"]) for r in rows if r["arm"] == "prefix"]
  base = [float(r["pretrain/eval/loss"]) for r in rows if r["arm"] == "causal"]
  p = stats.ttest_ind(loss, base, equal_var=False).pvalue
  prefix_line = next(ln for ln in md.splitlines() if ln.startswith("| prefix |"))
  assert sweep_report._fmt_p(p) in prefix_line
  for png in ("eval_loss.png", key.replace("/", "_") + ".png"):
    _png_ok(os.path.join(workdir, png))

  # --print-commands: nothing is pending any more
  assert subprocess.run([sys.executable, "-m", "tfx.sweep", sweep_file, "--workdir", workdir, "--print-commands"],
                        cwd=ROOT, capture_output=True, text=True).stdout.strip() == ""


def test_print_commands_lists_one_command_per_pending_run(tmp_path, shared_tokenizer, capsys):
  sweep_file = _write(tmp_path, shared_tokenizer, FINETUNE)
  sweep.main([sweep_file, "--workdir", str(tmp_path / "w"), "--print-commands"])
  lines = capsys.readouterr().out.strip().splitlines()
  assert len(lines) == 6 and all("-m tfx.sweep" in ln and "--only" in ln for ln in lines)
  assert any(shlex.split(ln)[-2:] == [f"{sweep.SCRATCH}/1", "--no-report"] for ln in lines)
  with pytest.raises(SystemExit, match="matches no run"):
    sweep.main([sweep_file, "--workdir", str(tmp_path / "w"), "--only", "nope"])


@pytest.mark.parametrize("study", ["objectives", "span_corruption", "plm_architecture"])
def test_every_study_plans_at_both_sizes(study, tmp_path):
  """The studies' sweep files load, their arms build valid configs, and budget matching gives
  every arm the same tokens or FLOPs (within one step)."""
  path = os.path.join(ROOT, "experiments", study, "sweep.py")
  for smoke in (True, False):
    s = sweep.load_sweep(path, smoke)
    runs = [r for r in sweep.plan(s, str(tmp_path)) if not r.scratch]
    assert len(runs) == len(s.arms) * len(s.seeds) and len(s.seeds) >= (2 if smoke else 3)
    if s.match:
      per = {"tokens": lambda r: r.tokens_per_step, "flops": lambda r: r.flops_per_step}[s.match]
      for r in runs:
        assert abs(r.steps * per(r) - s.budget) <= per(r) / 2 + 1e-6 * s.budget, (r.arm, r.steps)


def test_a_preempted_run_stops_the_whole_sweep(tmp_path, shared_tokenizer, monkeypatch, capsys):
  """A run that comes back interrupted (SIGTERM: it saved a checkpoint and stopped) ends the sweep
  there: the next runs do not start and no report is written; the same command resumes."""
  sweep_file = _write(tmp_path, shared_tokenizer)
  started = []

  def fake_execute(run):
    started.append(run.key)
    return {"status": "interrupted", "step": 3}

  monkeypatch.setattr(sweep, "execute", fake_execute)
  with pytest.raises(SystemExit) as stopped:
    sweep.main([sweep_file, "--workdir", str(tmp_path / "w")])
  assert stopped.value.code == sweep.INTERRUPTED
  assert started == ["causal/0"]
  assert "the sweep stops here: run the same command to resume" in capsys.readouterr().out
  assert not os.path.exists(tmp_path / "w" / "results.md")


def test_a_preempted_parallel_run_is_reported_as_stopped_not_failed(tmp_path, shared_tokenizer, monkeypatch,
                                                                    capsys):
  """In --parallel mode the runs are subprocesses: one stopped by SIGTERM (exit status 75) stops
  the sweep with 75 and the resume hint; any other non-zero status is a failure."""
  sweep_file = _write(tmp_path, shared_tokenizer)
  monkeypatch.setattr(sweep, "run_parallel", lambda file, workdir, smoke, runs, n, cache: [0, sweep.INTERRUPTED, 0, 0])
  with pytest.raises(SystemExit) as stopped:
    sweep.main([sweep_file, "--workdir", str(tmp_path / "w"), "--parallel", "2"])
  assert stopped.value.code == sweep.INTERRUPTED
  assert "causal/1 stopped early (checkpoints saved): run the same command" in capsys.readouterr().out
  monkeypatch.setattr(sweep, "run_parallel", lambda file, workdir, smoke, runs, n, cache: [0, sweep.INTERRUPTED, 1, 0])
  with pytest.raises(SystemExit, match="runs failed: prefix/0"):
    sweep.main([sweep_file, "--workdir", str(tmp_path / "w"), "--parallel", "2"])
