"""slurm: an sbatch script for GPU nodes (one tfx.train process per node, all its GPUs).

    python -m tfx.launch slurm --config configs/t5_base.py --workdir /shared/runs/t5 \\
        --config.launch.accelerator=H100:8 --config.launch.num_nodes=4
    python -m tfx.launch slurm status|logs|stop ...

srun starts one process per node; JAX's SLURM detection (TFX_DISTRIBUTED=1 makes tfx call
jax.distributed.initialize()) finds the coordinator, the process count and the rank from SLURM's
variables, and TFX_LOCAL_DEVICE_IDS gives each process all its node's GPUs (JAX's detection alone
would give it only the GPU of its task index, one per node). --requeue lets the scheduler restart
a preempted job; it resumes from the workdir, which must be on a filesystem every node mounts (an
absolute path) or gs://.
"""

from __future__ import annotations

import os
import sys

from tfx.launch.common import (
    ROOT, Job, LaunchError, Plan, check_fits, env_prefix, gpu_slice, runtime_env)

ACTIONS = ("launch", "status", "logs", "stop")


def script_path(job: Job) -> str:
  return os.path.join(ROOT, ".launch", job.name, f"{job.name}.sbatch")


def log_path(job: Job) -> str:
  return os.path.join(ROOT, ".launch", job.name, "slurm-%j.out")


def sbatch_script(job: Job) -> str:
  launch = job.launch
  where = gpu_slice(launch.accelerator, launch.num_nodes)
  gpus = launch.accelerator.split(":")[1]
  partition = f"#SBATCH --partition={launch.partition}\n" if launch.partition else ""
  return f"""#!/bin/bash
# {job.name}: python -m tfx.train on {where.describe()} (written by python -m tfx.launch slurm).
#SBATCH --job-name={job.name}
#SBATCH --nodes={launch.num_nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={gpus}
#SBATCH --time={launch.time}
#SBATCH --output={log_path(job)}
#SBATCH --requeue
#SBATCH --signal=TERM@120
{partition}set -euo pipefail
cd {ROOT}
export TFX_DISTRIBUTED=1
# JAX's SLURM detection gives a process the GPU of its task index (SLURM_LOCALID, 0 here): name all of them.
export TFX_LOCAL_DEVICE_IDS={",".join(str(i) for i in range(int(gpus)))}
srun --kill-on-bad-exit=1 env {env_prefix(runtime_env(job, where))}{job.train_command(sys.executable)}
"""


def plan(job: Job, action: str = "launch", **_) -> Plan:
  launch = job.launch
  if action == "launch":
    where = gpu_slice(launch.accelerator, launch.num_nodes)
    if not (job.workdir.startswith("gs://") or os.path.isabs(job.workdir)):
      raise LaunchError(f"--workdir {job.workdir!r}: every node must see the same workdir; give an absolute path on "
                        f"a shared filesystem or gs://BUCKET/...")
    check_fits(job, where)
    out = Plan(f"tfx.launch slurm: {where.describe()} as job {job.name}, workdir {job.workdir}")
    out.write(script_path(job), sbatch_script(job), 0o755)
    out.run("sbatch", script_path(job))
    return out
  out = Plan(f"tfx.launch slurm {action}: job {job.name}")
  if action == "status":
    out.run("squeue", f"--name={job.name}")
  elif action == "logs":
    out.run("bash", "-c", f"tail -n 200 $(ls -t {os.path.dirname(log_path(job))}/slurm-*.out | head -n1)")
  elif action == "stop":
    out.run("scancel", "--signal=TERM", "--full", f"--name={job.name}")
  else:
    raise LaunchError(f"slurm has the actions {', '.join(ACTIONS)}; got {action!r}")
  return out
