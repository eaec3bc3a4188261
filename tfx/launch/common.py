"""What every backend shares: the job (config + workdir + overrides), slice arithmetic, checks made
before anything is created, the environment of the training processes, and Plans.

A Plan is the list of files a backend writes and commands it runs. `--dry-run` prints it (that text
is what the golden files in tests/golden/launch/ hold); otherwise `execute` writes and runs it.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from typing import Sequence

import ml_collections

from tfx import config as config_lib
from tfx.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# TPU generations: (runtime version Google documents for JAX, TensorCores per chip counted in the
# name: v4-8 and v5p-8 are 4 chips, v5litepod-8 and v6e-8 are 8).
TPU_GENERATIONS = {
    "v4": ("tpu-ubuntu2204-base", 2),
    "v5p": ("v2-alpha-tpuv5", 2),
    "v5litepod": ("v2-alpha-tpuv5-lite", 1),
    "v6e": ("v2-alpha-tpuv6e", 1),
}
CHIPS_PER_HOST = 4  # hosts of multi-host slices; v5litepod-8 / v6e-8 and smaller are one 8-chip host

# Collective/compute overlap flags MaxText sets for its FSDP runs on v5e / v5p / v6e (its configs/v5e
# scripts): all-gathers and reduce-scatters fused into async collectives that overlap the layer's matmuls.
LIBTPU_OVERLAP = ("--xla_tpu_enable_data_parallel_all_reduce_opt=true "
                  "--xla_tpu_data_parallel_opt_different_sized_ops=true "
                  "--xla_tpu_enable_async_collective_fusion=true "
                  "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true "
                  "--xla_tpu_enable_async_collective_fusion_multiple_steps=true "
                  "--xla_tpu_overlap_compute_collective_tc=true "
                  "--xla_enable_async_all_gather=true")

INSTALL = {
    "gcloud": "the Google Cloud CLI: https://cloud.google.com/sdk/docs/install "
              "(curl https://sdk.cloud.google.com | bash), then `gcloud init`",
    "sky": "pip install 'tfx[launch]' (SkyPilot with GCP support), then `sky check gcp`",
    "xpk": "pip install xpk (and kubectl + gcloud), see https://github.com/AI-Hypercomputer/xpk",
    "sbatch": "run on a SLURM login node (sbatch, squeue, scancel)",
    "squeue": "run on a SLURM login node (sbatch, squeue, scancel)",
    "scancel": "run on a SLURM login node (sbatch, squeue, scancel)",
    "kubectl": "kubectl (gcloud components install kubectl) with the cluster's credentials",
    "git": "git (the hosts get this repository at its committed HEAD)",
}


class LaunchError(UserError):
  """A launch that cannot go ahead; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class Slice:
  """What the job runs on: `devices` JAX devices over `hosts` processes (one per host)."""
  accelerator: str
  devices: int
  hosts: int
  tpu: bool
  runtime_version: str = ""

  def describe(self) -> str:
    unit = "chips" if self.tpu else "GPUs"
    return f"{self.accelerator} ({self.devices} {unit} on {self.hosts} host{'s' if self.hosts > 1 else ''})"


def tpu_slice(accelerator: str, runtime_version: str = "") -> Slice:
  match = re.fullmatch(r"(v4|v5p|v5litepod|v6e)-(\d+)", accelerator)
  if not match:
    raise LaunchError(f"launch.accelerator={accelerator!r} is not a TPU type tfx knows: use "
                      f"{', '.join(g + '-N' for g in TPU_GENERATIONS)} (e.g. v5litepod-16), or NAME:COUNT for GPUs")
  generation, size = match.group(1), int(match.group(2))
  default_runtime, cores_per_chip = TPU_GENERATIONS[generation]
  chips = size // cores_per_chip
  if chips < 1 or size % cores_per_chip:
    raise LaunchError(f"launch.accelerator={accelerator!r}: {generation} sizes count TensorCores, a multiple of "
                      f"{cores_per_chip}")
  one_host = 2 * CHIPS_PER_HOST if cores_per_chip == 1 else CHIPS_PER_HOST  # v5litepod-8 / v6e-8: one 8-chip host
  hosts = 1 if chips <= one_host else chips // CHIPS_PER_HOST
  return Slice(accelerator, chips, hosts, True, runtime_version or default_runtime)


def gpu_slice(accelerator: str, num_nodes: int) -> Slice:
  match = re.fullmatch(r"([A-Za-z0-9-]+):(\d+)", accelerator)
  if not match:
    raise LaunchError(f"launch.accelerator={accelerator!r}: GPUs are NAME:COUNT per node, e.g. H100:8")
  if num_nodes < 1:
    raise LaunchError(f"launch.num_nodes={num_nodes} must be at least 1")
  return Slice(accelerator, int(match.group(2)) * num_nodes, num_nodes, False)


def slice_of(config: ml_collections.ConfigDict) -> Slice:
  """The launch section's accelerator as a Slice (TPU type or NAME:COUNT GPUs per node)."""
  launch = config.launch
  if ":" in launch.accelerator:
    return gpu_slice(launch.accelerator, launch.num_nodes)
  return tpu_slice(launch.accelerator, launch.runtime_version)


@dataclasses.dataclass
class Job:
  """The run a backend starts: the config file (relative to the repository when inside it), the
  workdir, the command-line overrides (passed on verbatim) and the loaded config."""
  config_path: str
  workdir: str
  overrides: list[str]
  config: ml_collections.ConfigDict

  @property
  def launch(self) -> ml_collections.ConfigDict:
    return self.config.launch

  @property
  def name(self) -> str:
    if self.launch.name:
      return self.launch.name
    base = re.sub(r"[^a-z0-9-]+", "-", os.path.basename(self.workdir.rstrip("/")).lower()).strip("-")
    return ("tfx-" + base)[:40].rstrip("-") or "tfx-run"

  def train_argv(self, python: str = "python") -> list[str]:
    return [python, "-m", "tfx.train", "--config", self.config_path, "--workdir", self.workdir, *self.overrides]

  def train_command(self, python: str = "python") -> str:
    return shlex.join(self.train_argv(python))


def split_config_arg(config_path: str) -> tuple[str, str]:
  """`configs/x.py:ARG` -> ("configs/x.py", ":ARG"); a path without an argument -> (path, "")."""
  if ":" in os.path.basename(config_path):
    path, arg = config_path.rsplit(":", 1)
    return path, ":" + arg
  return config_path, ""


def load_job(config_path: str, workdir: str, overrides: Sequence[str]) -> Job:
  """Loads the config with its overrides; a config inside the repository is named relative to it
  (the hosts run from their copy of the repository), one outside it absolutely."""
  config = config_lib.load_config(config_path, list(overrides))
  path, arg = split_config_arg(config_path)
  relative = os.path.relpath(os.path.abspath(path), ROOT)
  shown = os.path.abspath(path) if relative.startswith("..") else relative
  return Job(shown + arg, workdir, list(overrides), config)


def check_fits(job: Job, where: Slice) -> None:
  """Mesh, batch and hosts against the slice, before anything is created; names the numbers."""
  try:
    config_lib.validate(job.config, num_devices=where.devices, process_count=where.hosts)
  except config_lib.ConfigError as e:
    problems = [line.strip()[2:] for line in str(e).splitlines()[1:]] or [str(e)]
    raise LaunchError(f"{where.describe()} does not fit this config: {'; '.join(problems)}") from None


def check_shared_workdir(job: Job, backend: str) -> None:
  """Cloud hosts share nothing but GCS: the workdir must be gs://."""
  if not job.workdir.startswith("gs://"):
    raise LaunchError(f"--workdir {job.workdir!r} is a local path, but the {backend} backend runs on machines that "
                      f"do not share this disk (and are replaced after a preemption): every host needs the same "
                      f"gs:// workdir, e.g. --workdir gs://BUCKET/{os.path.basename(job.workdir.rstrip('/')) or 'run'}")


def check_config_in_repo(job: Job) -> None:
  if os.path.isabs(job.config_path):
    raise LaunchError(f"--config {job.config_path!r} is outside the repository ({ROOT}); the hosts get the "
                      f"repository, so put the config file under configs/ (or anywhere in the repository) and commit it")


def check_config_committed(job: Job, commit: str) -> None:
  """For backends that ship `git archive COMMIT`: the config file must be in that commit."""
  path, _ = split_config_arg(job.config_path)
  found = subprocess.run(["git", "cat-file", "-e", f"{commit}:{path}"], cwd=ROOT, capture_output=True)
  if found.returncode:
    raise LaunchError(f"--config {path} is not in commit {commit[:12]}, which is what the hosts get (git archive): "
                      f"commit it first (git add {path} && git commit)")


def runtime_env(job: Job, where: Slice, *, local: bool = False) -> dict[str, str]:
  """Environment of every training process: heartbeat timeout, compilation cache, libtpu flags.

  compilation_cache 'auto': WORKDIR/jax_cache for a gs:// workdir (a replacement VM after a
  preemption finds it), ~/.cache/tfx/jax on a cluster's hosts, off for the local backend.
  """
  launch, env = job.launch, {}
  if launch.heartbeat_timeout > 0:
    env["TFX_HEARTBEAT_TIMEOUT"] = str(launch.heartbeat_timeout)
  cache = launch.compilation_cache
  if cache == "auto":
    if job.workdir.startswith("gs://"):
      cache = job.workdir.rstrip("/") + "/jax_cache"
    else:
      cache = "" if local else "~/.cache/tfx/jax"
  elif local and cache.startswith("~"):
    cache = os.path.expanduser(cache)
  if cache:
    env["JAX_COMPILATION_CACHE_DIR"] = cache
  if where.tpu and launch.libtpu_flags:
    env["LIBTPU_INIT_ARGS"] = LIBTPU_OVERLAP if launch.libtpu_flags == "overlap" else launch.libtpu_flags
  return env


def env_prefix(env: dict[str, str]) -> str:
  """`K=V K2=V2 ` for a shell line (a leading ~ kept unquoted so the shell expands it)."""
  parts = []
  for key, value in env.items():
    if value.startswith("~/"):
      parts.append(f"{key}=~/{shlex.quote(value[2:])}")
    else:
      parts.append(f"{key}={shlex.quote(value)}")
  return "".join(p + " " for p in parts)


def source_commit() -> str:
  """HEAD of the repository; the hosts run exactly this commit."""
  try:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    raise LaunchError(f"{ROOT} is not a git checkout (or git is missing): the hosts get the repository at a "
                      f"commit; install {INSTALL['git']}") from None


def dirty_files() -> list[str]:
  """Tracked files changed since HEAD (they would not reach the hosts)."""
  out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                       text=True).stdout
  return [line[3:] for line in out.splitlines() if line.strip()]


def require(tool: str) -> None:
  if shutil.which(tool) is None:
    raise LaunchError(f"`{tool}` was not found on PATH; install {INSTALL[tool]}")


# ----------------------------------------------------------------------------------------- plans


@dataclasses.dataclass(frozen=True)
class Write:
  path: str
  text: str
  mode: int = 0o644


@dataclasses.dataclass(frozen=True)
class Run:
  argv: tuple[str, ...]
  # Poll: rerun every 30 s until the output contains this (a TPU queued resource becoming ACTIVE).
  until: str = ""
  # Continue even if the command fails (e.g. `pkill` with nothing to stop).
  check: bool = True


@dataclasses.dataclass
class Plan:
  title: str
  steps: list = dataclasses.field(default_factory=list)

  def write(self, path: str, text: str, mode: int = 0o644) -> None:
    self.steps.append(Write(path, text, mode))

  def run(self, *argv: str, until: str = "", check: bool = True) -> None:
    self.steps.append(Run(tuple(argv), until, check))

  def render(self) -> str:
    lines = [f"# {self.title}"]
    for step in self.steps:
      if isinstance(step, Write):
        lines += [f"--- write {step.path}", step.text.rstrip("\n"), "---"]
      else:
        suffix = f"    # every 30 s until it prints {step.until}" if step.until else ""
        lines.append("$ " + shlex.join(step.argv) + suffix)
    return "\n".join(lines) + "\n"


def execute(plan: Plan, *, poll_seconds: float = 30.0, poll_limit: float = 3600.0) -> int:
  """Writes the files and runs the commands in order; stops at the first failure (its status)."""
  print(f"# {plan.title}", flush=True)
  for step in plan.steps:
    if isinstance(step, Write):
      os.makedirs(os.path.dirname(os.path.abspath(step.path)), exist_ok=True)
      with open(step.path, "w") as f:
        f.write(step.text)
      os.chmod(step.path, step.mode)
      print(f"wrote {step.path}", flush=True)
      continue
    print("$ " + shlex.join(step.argv), flush=True)
    start = time.monotonic()
    while True:
      result = subprocess.run(step.argv, capture_output=bool(step.until), text=True)
      if step.until and result.returncode == 0 and step.until not in result.stdout:
        if time.monotonic() - start > poll_limit:
          print(f"tfx.launch: still not {step.until} after {poll_limit:.0f} s; rerun later", file=sys.stderr)
          return 1
        time.sleep(poll_seconds)
        continue
      break
    if step.until:
      sys.stdout.write(result.stdout)
    if result.returncode and step.check:
      print(f"tfx.launch: `{shlex.join(step.argv[:4])} ...` failed with status {result.returncode}", file=sys.stderr)
      return result.returncode
  return 0
