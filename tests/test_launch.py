"""python -m tfx.launch without a cloud: each backend's --dry-run against golden files (reviewed by
hand), the gcloud and sky flows end to end against fake executables on PATH that record their
arguments, SkyPilot's own parser on the task YAML when skypilot is installed, and the bad inputs.

Regenerate the golden files after a deliberate change with UPDATE_GOLDEN=1 (then read the diff)."""

import json
import os
import subprocess
import sys
import tarfile

import pytest

from tests.conftest import ROOT
from tfx.launch import cli, common

GOLDEN = os.path.join(ROOT, "tests", "golden", "launch")
TINY = os.path.join(ROOT, "configs", "tiny.py")
GS = "gs://tfx-bucket/tiny"

CASES = {
    "local": ["local", "--port", "12345", "--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2"],
    "gcloud": ["gcloud", "--zone", "us-west4-a", "--accelerator", "v5litepod-16", "--config.mesh.fsdp=-1",
               "--config.mesh.data=1", "--config.launch.libtpu_flags=overlap", "--config.train.batch_size=32"],
    "gcloud_create_queued": ["gcloud", "--create", "--zone", "us-east5-a", "--accelerator", "v5p-16",
                             "--config.launch.queued=true", "--config.launch.spot=false", "--project", "my-proj"],
    "gcloud_status": ["gcloud", "status", "--zone", "us-west4-a"],
    "skypilot": ["skypilot", "--accelerator", "v5litepod-16", "--config.launch.zone=us-west4-a",
                 "--config.train.batch_size=32"],
    "skypilot_gpu_cluster": ["skypilot", "--accelerator", "H100:8", "--config.launch.num_nodes=2",
                             "--config.launch.managed=false", "--config.train.batch_size=32"],
    "xpk": ["xpk", "--accelerator", "v5litepod-16", "--config.launch.cluster=my-gke", "--zone", "us-west4-a",
            "--config.train.batch_size=32"],
    "slurm": ["slurm", "--accelerator", "H100:8", "--config.launch.num_nodes=2", "--config.launch.partition=gpu",
              "--config.train.batch_size=32"],
}


def normalize(text: str) -> str:
  commit = common.source_commit()
  lines = [line for line in text.splitlines() if not line.startswith(("# warning:", "# note:"))]
  text = "\n".join(lines) + "\n"
  return (text.replace(commit, "<commit>").replace(commit[:12], "<short>").replace(sys.executable, "<python>")
          .replace(ROOT, "<repo>"))


@pytest.mark.parametrize("case", sorted(CASES))
def test_dry_run_matches_golden(case, capsys):
  backend, *flags = CASES[case]
  action = [flags.pop(0)] if flags and flags[0] in cli.ACTIONS else []
  assert cli.run([backend, *action, "--dry-run", "--config", TINY, "--workdir", GS, *flags]) == 0
  got = normalize(capsys.readouterr().out)
  path = os.path.join(GOLDEN, case + ".txt")
  if os.environ.get("UPDATE_GOLDEN"):
    os.makedirs(GOLDEN, exist_ok=True)
    with open(path, "w") as f:
      f.write(got)
  with open(path) as f:
    assert got == f.read(), f"{case}: dry run differs from {path} (UPDATE_GOLDEN=1 rewrites it)"


def plan_of(case):
  """The Plan of a CASES entry, built as the command line would."""
  args, overrides = cli.parse([*CASES[case], "--config", TINY, "--workdir", GS])
  backend = __import__(f"tfx.launch.{args.backend}", fromlist=["plan"])
  return backend.plan(common.load_job(TINY, GS, overrides), args.action)


def test_generated_scripts_are_valid_shell(tmp_path):
  for case in ("gcloud", "slurm"):
    writes = [step for step in plan_of(case).steps if isinstance(step, common.Write)]
    assert writes
    for step in writes:
      script = tmp_path / os.path.basename(step.path)
      script.write_text(step.text)
      check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
      assert check.returncode == 0, check.stderr


def test_slices():
  want = {"v4-8": (4, 1), "v4-32": (16, 4), "v5p-8": (4, 1), "v5p-128": (64, 16), "v5litepod-4": (4, 1),
          "v5litepod-8": (8, 1), "v5litepod-16": (16, 4), "v6e-8": (8, 1), "v6e-256": (256, 64)}
  for accelerator, (devices, hosts) in want.items():
    where = common.tpu_slice(accelerator)
    assert (where.devices, where.hosts) == (devices, hosts), accelerator
  assert common.tpu_slice("v5litepod-16").runtime_version == "v2-alpha-tpuv5-lite"
  assert (common.gpu_slice("H100:8", 4).devices, common.gpu_slice("H100:8", 4).hosts) == (32, 4)


def test_runtime_env():
  job = common.load_job(TINY, GS, ["--config.launch.libtpu_flags=overlap"])
  tpu = common.runtime_env(job, common.tpu_slice("v5litepod-16"))
  assert tpu["JAX_COMPILATION_CACHE_DIR"] == GS + "/jax_cache"  # survives the VM
  assert "--xla_tpu_enable_async_collective_fusion=true" in tpu["LIBTPU_INIT_ARGS"]
  assert tpu["TFX_HEARTBEAT_TIMEOUT"] == "60"
  assert "LIBTPU_INIT_ARGS" not in common.runtime_env(job, common.gpu_slice("H100:8", 1))
  local = common.load_job(TINY, "/shared/run", ["--config.launch.compilation_cache=auto"])
  assert common.runtime_env(local, common.gpu_slice("H100:8", 1))["JAX_COMPILATION_CACHE_DIR"] == "~/.cache/tfx/jax"
  assert "JAX_COMPILATION_CACHE_DIR" not in common.runtime_env(local, common.gpu_slice("H100:8", 1), local=True)
  off = common.load_job(TINY, GS, ["--config.launch.compilation_cache=", "--config.launch.heartbeat_timeout=0"])
  assert common.runtime_env(off, common.tpu_slice("v4-8")) == {}


# ------------------------------------------------------------------ fake executables on PATH

FAKE = r'''#!{python}
import json, os, sys
with open(os.environ["FAKE_CALLS"], "a") as f:
  f.write(json.dumps([os.path.basename(sys.argv[0])] + sys.argv[1:]) + "\n")
if "describe" in sys.argv:
  print("ACTIVE" if "queued-resources" in sys.argv else "READY\tV5LITE_POD")
'''


@pytest.fixture
def fake_path(tmp_path):
  """A bin/ with fake gcloud, sky and sbatch first on PATH; FAKE_CALLS records every call."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  for tool in ("gcloud", "sky", "sbatch"):
    path = bin_dir / tool
    path.write_text(FAKE.format(python=sys.executable))
    path.chmod(0o755)
  calls = tmp_path / "calls.jsonl"
  env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", FAKE_CALLS=str(calls),
             PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")

  def launch(*argv):
    result = subprocess.run([sys.executable, "-m", "tfx.launch", *argv], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    recorded = [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []
    calls.unlink(missing_ok=True)
    return result, recorded

  return launch


def test_gcloud_flow(fake_path, tmp_path):
  common_flags = ["--config", TINY, "--workdir", GS, "--zone", "us-west4-a", "--name", "tfx-flow"]
  result, calls = fake_path("gcloud", "--create", *common_flags)
  assert result.returncode == 0, result.stderr
  assert [c[:4] for c in calls] == [["gcloud", "compute", "tpus", "tpu-vm"]] * 3
  create, scp, ssh = calls
  assert create[4:6] == ["create", "tfx-flow"] and "--spot" in create and "--version=v2-alpha-tpuv5-lite" in create
  tarball, script = scp[5], scp[6]
  assert scp[4] == "scp" and scp[7] == "tfx-flow:" and "--worker=all" in scp
  with tarfile.open(tarball) as tar:  # this commit of the repository, what every host unpacks
    assert "tfx/launch/cli.py" in tar.getnames() and "configs/tiny.py" in tar.getnames()
  text = open(script).read()
  assert f"python -m tfx.train --config configs/tiny.py --workdir {GS}" in text
  assert f"{GS}/logs/$(hostname).log" in text and "export JAX_COMPILATION_CACHE_DIR=" + GS + "/jax_cache" in text
  assert ssh[4:6] == ["ssh", "tfx-flow"] and "--worker=all" in ssh and ssh[-1] == "--command=bash ~/tfx-flow.sh"

  result, calls = fake_path("gcloud", "status", *common_flags)
  assert result.returncode == 0 and "READY" in result.stdout, result.stderr
  assert calls[0][4:6] == ["describe", "tfx-flow"] and "tpu-info" in calls[1][-1] and "--worker=all" in calls[1]
  status = calls[1][-1].removeprefix("--command=")
  result, calls = fake_path("gcloud", "logs", *common_flags)
  assert calls == [["gcloud", "compute", "tpus", "tpu-vm", "ssh", "tfx-flow", "--zone=us-west4-a", "--worker=0",
                    "--command=tail -n 200 ~/tfx-flow.log"]]
  result, calls = fake_path("gcloud", "stop", *common_flags)
  assert "pkill -TERM -f '[t]fx[.]train --config'" in calls[0][-1] and "--worker=all" in calls[0]
  stop = calls[0][-1].removeprefix("--command=")
  # gcloud's ssh runs the command as `bash -c COMMAND`, whose own command line holds the pattern: it
  # must not match itself (status would never say that nothing runs, stop would kill its own shell).
  # Run here with the process name swapped for one nothing else has.
  unique = lambda command: command.replace("fx[.]train", "zq8w5[.]probe")
  found = subprocess.run(["bash", "-c", unique(status)], capture_output=True, text=True, cwd=tmp_path)
  assert "no training process" in found.stdout, found.stdout
  stopped = subprocess.run(["bash", "-c", unique(stop)], capture_output=True, text=True)
  assert stopped.returncode == 0, stopped
  result, calls = fake_path("gcloud", "delete", *common_flags)
  assert calls == [["gcloud", "compute", "tpus", "tpu-vm", "delete", "tfx-flow", "--zone=us-west4-a", "--quiet"]]


def test_skypilot_flow(fake_path):
  flags = ["--config", TINY, "--workdir", GS, "--accelerator", "v5litepod-16", "--name", "tfx-sky",
           "--config.train.batch_size=32"]
  result, calls = fake_path("skypilot", *flags)
  assert result.returncode == 0, result.stderr
  (launch,) = calls
  assert launch[:5] == ["sky", "jobs", "launch", "--name", "tfx-sky"]
  task = open(launch[-1]).read()
  assert "accelerators: \"tpu-v5litepod-16\"" in task and "use_spot: true" in task
  for action, want in [("status", ["sky", "jobs", "queue"]),
                       ("logs", ["sky", "jobs", "logs", "--name", "tfx-sky", "--no-follow"]),
                       ("stop", ["sky", "jobs", "cancel", "--name", "tfx-sky", "--yes"])]:
    result, calls = fake_path("skypilot", action, *flags)
    assert result.returncode == 0 and calls == [want], (action, result.stderr)


def test_skypilot_yaml_parses_with_skypilot(tmp_path):
  sky = pytest.importorskip("sky", reason="skypilot is not installed (pip install 'tfx[launch]'): the task YAML is "
                                          "checked against the golden file only")
  from tfx.launch import skypilot

  for accelerator, nodes in (("v5litepod-16", 1), ("H100:8", 2)):
    job = common.load_job(TINY, GS, [f"--config.launch.accelerator={accelerator}",
                                     f"--config.launch.num_nodes={nodes}", "--config.train.batch_size=32"])
    path = tmp_path / "task.yaml"
    path.write_text(skypilot.task_yaml(job, common.slice_of(job.config)))
    task = sky.Task.from_yaml(str(path))
    assert task.num_nodes == (1 if accelerator.startswith("v5") else 2)
    assert "tfx.train" in task.run


# ------------------------------------------------------------------ bad input


def _error(argv) -> str:
  with pytest.raises(common.LaunchError) as e:
    cli.run([*argv, "--dry-run"])
  return str(e.value)


def test_refusals():
  message = _error(["gcloud", "--config", TINY, "--workdir", "runs/tiny", "--zone", "z"])
  assert "local path" in message and "gs://BUCKET/tiny" in message
  message = _error(["skypilot", "--config", TINY, "--workdir", GS, "--accelerator", "v5litepod-16",
                    "--config.train.batch_size=12"])
  assert "v5litepod-16 (16 chips on 4 hosts) does not fit" in message and "train.batch_size=12" in message
  message = _error(["gcloud", "--config", TINY, "--workdir", GS, "--zone", "z", "--accelerator", "v4-32",
                    "--config.mesh.data=2", "--config.mesh.fsdp=2"])
  assert "needs 4 devices but there are 16" in message
  assert "not a TPU type" in _error(["gcloud", "--config", TINY, "--workdir", GS, "--zone", "z", "--accelerator", "v9-8"])
  assert "creates TPU VMs" in _error(["gcloud", "--config", TINY, "--workdir", GS, "--zone", "z", "--accelerator", "H100:8"])
  assert "launch.zone" in _error(["gcloud", "--config", TINY, "--workdir", GS])
  assert "launch.cluster" in _error(["xpk", "--config", TINY, "--workdir", GS])
  assert "does not fit" in _error(["local", "--config", TINY, "--workdir", "runs/x", "--processes", "3",
                                   "--devices-per-process", "2"])


def test_missing_tools(tmp_path):
  empty = tmp_path / "bin"
  empty.mkdir()
  env = dict(os.environ, PATH=str(empty), PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  for backend, install in (("gcloud", "https://cloud.google.com/sdk/docs/install"), ("skypilot", "tfx[launch]")):
    result = subprocess.run([sys.executable, "-m", "tfx.launch", backend, "status", "--workdir", GS, "--zone", "z"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert "was not found on PATH; install" in result.stderr and install in result.stderr, result.stderr


def test_slurm_processes_get_every_gpu_of_their_node(monkeypatch):
  """One process per node: JAX's SLURM detection alone would give it local_device_ids=[SLURM_LOCALID],
  the node's first GPU only; the sbatch script names them all and tfx passes them on."""
  import jax

  from tfx import parallel

  job = common.load_job(TINY, "/shared/run", ["--config.launch.accelerator=H100:4", "--config.launch.num_nodes=2"])
  from tfx.launch import slurm
  assert "export TFX_LOCAL_DEVICE_IDS=0,1,2,3\n" in slurm.sbatch_script(job)
  seen = {}
  monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: seen.update(kw))
  monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
  monkeypatch.setenv("TFX_DISTRIBUTED", "1")
  monkeypatch.setenv("TFX_HEARTBEAT_TIMEOUT", "0")
  monkeypatch.setenv("TFX_LOCAL_DEVICE_IDS", "0,1,2,3")
  parallel.initialize_distributed()
  assert seen == {"local_device_ids": [0, 1, 2, 3]}


def test_gcloud_refuses_a_config_the_commit_lacks():
  """gcloud's hosts get `git archive HEAD`: an untracked or uncommitted config would be missing on all of them."""
  import dataclasses

  job = common.load_job(TINY, GS, [])
  commit = common.source_commit()
  common.check_config_committed(job, commit)  # configs/tiny.py is committed
  with pytest.raises(common.LaunchError, match=r"--config configs/mine.py is not in commit .*git add configs/mine.py"):
    common.check_config_committed(dataclasses.replace(job, config_path="configs/mine.py"), commit)
