"""Two processes x 4 fake CPU devices (the multi-host path: jax.distributed, per-host data
slices, make_array_from_process_local_data, orbax from every process) train exactly like one
process with 8 devices."""

import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import ROOT
from tfx.metrics import read_metrics


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def train_cmd(workdir, tokenizer, mesh):
  d, f, t = mesh
  return [sys.executable, "-m", "tfx.train", "--config", os.path.join(ROOT, "configs", "tiny.py"), "--workdir",
          str(workdir), f"--config.data.tokenizer={tokenizer}", "--config.data.max_documents=60",
          "--config.train.steps=4", "--config.train.log_every=1", "--config.train.eval_every=2",
          "--config.train.checkpoint_every=2", "--config.train.batch_size=16", "--config.model.dropout=0.1",
          f"--config.mesh.data={d}", f"--config.mesh.fsdp={f}", f"--config.mesh.tensor={t}"]


def losses(workdir):
  return [(r["step"], r["split"], r["loss"]) for r in read_metrics(str(workdir))]


@pytest.mark.slow
def test_two_processes_match_one(tmp_path, shared_tokenizer):
  mesh = (2, 2, 2)
  base = dict(os.environ, JAX_PLATFORMS="cpu")
  single = subprocess.run(train_cmd(tmp_path / "one", shared_tokenizer, mesh), cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=dict(base, XLA_FLAGS="--xla_force_host_platform_device_count=8"))
  assert single.returncode == 0, single.stderr[-4000:]

  port = free_port()
  procs = []
  for pid in range(2):
    env = dict(base, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
               JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(pid))
    procs.append(subprocess.Popen(train_cmd(tmp_path / "two", shared_tokenizer, mesh), cwd=ROOT, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
  outs = [p.communicate(timeout=600) for p in procs]
  for p, (out, err) in zip(procs, outs):
    assert p.returncode == 0, err[-4000:]
  assert "mesh {'data': 2, 'fsdp': 2, 'tensor': 2}" in outs[0][0]
  one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
  assert [s for s, *_ in one] == [s for s, *_ in two]
  np.testing.assert_allclose([l for *_, l in two], [l for *_, l in one], rtol=1e-5)
  assert sorted(os.listdir(tmp_path / "two" / "checkpoints")) == ["2", "4"]
