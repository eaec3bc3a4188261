"""Two processes x 4 fake CPU devices, started by `python -m tfx.launch local` (the multi-host path:
jax.distributed, per-host data slices, make_array_from_process_local_data, orbax from every process),
train bitwise like one process with 8 devices; a killed process makes the other exit by itself with
one line, and the same command then resumes and still ends bitwise on the 8-device run.

Slow: about 7 minutes on 2 busy cores (five two-process runs and one single-process run)."""

import os
import signal
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest

from tests.conftest import ROOT
from tfx.metrics import read_metrics

MESH = (2, 2, 2)
HEARTBEAT = 10  # launch.heartbeat_timeout of the multi-process runs, seconds


def train_args(workdir, tokenizer, mesh=MESH, *extra):
  d, f, t = mesh
  return ["--config", os.path.join(ROOT, "configs", "tiny.py"), "--workdir", str(workdir),
          f"--config.data.tokenizer={tokenizer}", "--config.data.max_documents=60", "--config.train.steps=4",
          "--config.train.log_every=1", "--config.train.eval_every=2", "--config.train.checkpoint_every=2",
          "--config.train.batch_size=16", "--config.model.dropout=0.1", f"--config.mesh.data={d}",
          f"--config.mesh.fsdp={f}", f"--config.mesh.tensor={t}", *extra]


def launch_cmd(workdir, tokenizer, *extra):
  return [sys.executable, "-m", "tfx.launch", "local", "--processes", "2", "--devices-per-process", "4",
          *train_args(workdir, tokenizer, MESH, f"--config.launch.heartbeat_timeout={HEARTBEAT}", *extra)]


def records(workdir):
  return [(r["step"], r["split"], r["loss"]) for r in read_metrics(str(workdir))]


def final_params(workdir):
  from tfx.runs import load_trained

  _, _, _, params = load_trained(str(workdir))
  return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(params)}


def assert_same_run(got, want):
  """Every logged loss and every final parameter, bitwise."""
  assert records(got) == records(want)
  a, b = final_params(got), final_params(want)
  assert a.keys() == b.keys()
  for key in a:
    np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, shared_tokenizer):
  """The reference: one process with 8 devices on the same mesh, also started through jax.distributed
  (tfx.launch local --processes 1), so that its collectives are gloo's as in the two-process run. (A
  plain tfx.train without jax.distributed uses XLA's in-process all-reduce, which adds in another
  order: its losses differ from these in the last bit.)"""
  workdir = tmp_path_factory.mktemp("multihost") / "one"
  cmd = launch_cmd("one", shared_tokenizer)  # launched from outside the repository, the workdir relative to there
  cmd[cmd.index("--processes") + 1], cmd[cmd.index("--devices-per-process") + 1] = "1", "8"
  single = subprocess.run(cmd, cwd=workdir.parent, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT))
  assert single.returncode == 0, single.stdout[-4000:]
  assert "[p0] tfx: decoder + causal_lm" in single.stdout and "[p1]" not in single.stdout
  return workdir


@pytest.mark.slow
def test_two_processes_match_one(tmp_path, shared_tokenizer, one_process):
  two = tmp_path / "two"
  run = subprocess.run(launch_cmd(two, shared_tokenizer), cwd=ROOT, capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
  assert "[p0] tfx: decoder + causal_lm" in run.stdout and "mesh {'data': 2, 'fsdp': 2, 'tensor': 2}" in run.stdout
  assert "tfx.launch local: 2 processes finished" in run.stdout
  assert_same_run(two, one_process)
  # Written once: one metadata file, each process its own shards.
  assert sorted(os.listdir(two / "checkpoints")) == ["2", "4"]
  state = sorted(os.listdir(two / "checkpoints" / "4" / "state"))
  assert [s for s in state if s.startswith("ocdbt.process_")] == ["ocdbt.process_0", "ocdbt.process_1"]
  assert state.count("_METADATA") == 1


def resume_and_kill(workdir, tokenizer, env, victim):
  """Runs the launch command again and SIGKILLs process `victim` once the run has restored its
  checkpoint (both processes are compiling then); returns (launcher status, its output)."""
  proc = subprocess.Popen(launch_cmd(workdir, tokenizer), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  lines, pids = [], {}
  killer = threading.Timer(900, proc.kill)  # a hang fails the test instead of blocking the suite
  killer.start()
  try:
    for line in proc.stdout:
      lines.append(line)
      if line.startswith("tfx.launch local: coordinator"):
        pids = {int(part.split()[1]): int(part.split()[3]) for part in line.split("; ")[1].strip().split(", ")}
      if line.startswith("[p0] resumed from") and pids:
        os.kill(pids[victim], signal.SIGKILL)
    proc.wait()
  finally:
    killer.cancel()
  return proc.returncode, "".join(lines)


@pytest.mark.slow
def test_killed_process_others_exit_then_resume(tmp_path, shared_tokenizer, one_process):
  workdir = tmp_path / "two"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  first = subprocess.run(launch_cmd(workdir, shared_tokenizer, "--config.train.stop_after=2"), cwd=ROOT,
                         capture_output=True, text=True, timeout=900, env=env)
  assert first.returncode == 0, first.stdout[-4000:]
  assert sorted(os.listdir(workdir / "checkpoints")) == ["2"]

  # Process 1 dies: process 0 leaves by itself, with one line, before the launcher has to stop it.
  code, out = resume_and_kill(workdir, shared_tokenizer, env, victim=1)
  assert code == 128 + signal.SIGKILL, out[-4000:]
  assert "[p0] tfx: process 0: process 1 of 2 stopped sending heartbeats" in out, out[-4000:]
  assert "process 0 ended with status 75" in out and "process 1 ended with signal 9" in out
  assert "stopping process(es)" not in out
  assert "Traceback" not in out

  # Process 0 (it hosts JAX's coordination service) dies: JAX ends process 1 at once, with its own
  # message and a native stack trace (or, if the watcher sees it first, with tfx's line), not a hang.
  code, out = resume_and_kill(workdir, shared_tokenizer, env, victim=0)
  assert code == 128 + signal.SIGKILL, out[-4000:]
  assert "process 0 ended with signal 9" in out and "process 1 ended with status 0" not in out, out[-4000:]
  assert "the leader task was preempted/died" in out or "lost the coordination service (process 0)" in out
  assert "stopping process(es)" not in out

  again = subprocess.run(launch_cmd(workdir, shared_tokenizer), cwd=ROOT, capture_output=True, text=True,
                         timeout=900, env=env)
  assert again.returncode == 0, again.stdout[-4000:]
  assert "[p0] resumed from" in again.stdout
  assert_same_run(workdir, one_process)
