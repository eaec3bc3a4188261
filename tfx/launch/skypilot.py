"""skypilot: a SkyPilot task (YAML) for a TPU slice or GPU nodes, started with `sky jobs launch`.

    python -m tfx.launch skypilot --config configs/t5_base.py --workdir gs://BUCKET/t5 \\
        --config.launch.accelerator=v5litepod-16
    python -m tfx.launch skypilot status|logs|stop|delete ...   (same flags)

The task syncs this repository (SkyPilot's `workdir`), installs tfx in a venv (uv, Python 3.11)
in `setup`, and starts `python -m tfx.train` in `run` on every host: on a TPU pod SkyPilot runs it
on all of the slice's hosts and JAX finds them itself; on GPU nodes the run sets JAX's coordinator
from SKYPILOT_NODE_IPS / SKYPILOT_NODE_RANK. A managed job (launch.managed, the default) is
relaunched after a spot preemption until it finishes; every relaunch runs the same command on the
same gs:// workdir, which resumes from the last checkpoint. launch.managed=false gives a plain
cluster (`sky launch`) that stops itself after launch.idle_minutes without a job.
"""

from __future__ import annotations

import json
import os

from tfx.launch.common import (
    ROOT, Job, LaunchError, Plan, Slice, check_fits, check_shared_workdir, dirty_files, runtime_env, slice_of)

ACTIONS = ("launch", "status", "logs", "stop", "delete")
COORDINATOR_PORT = 8476


def _yaml_value(value) -> str:
  return json.dumps(value)  # JSON scalars are YAML scalars


def _block(text: str, indent: str = "  ") -> str:
  return "".join(indent + line + "\n" if line else "\n" for line in text.rstrip("\n").split("\n"))


def task_yaml(job: Job, where: Slice) -> str:
  """The SkyPilot task for this run (SkyPilot's YAML schema; checked by sky.Task.from_yaml in the tests)."""
  launch = job.launch
  resources = {}
  if launch.zone:
    resources["infra"] = f"gcp/{launch.zone.rsplit('-', 1)[0]}/{launch.zone}"
  elif where.tpu:
    resources["infra"] = "gcp"
  if where.tpu:
    resources["accelerators"] = f"tpu-{where.accelerator}"
  else:
    resources["accelerators"] = where.accelerator
  resources["use_spot"] = bool(launch.spot)
  lines = [f"name: {job.name}", "", f"workdir: {ROOT}", f"num_nodes: {1 if where.tpu else where.hosts}", "", "resources:"]
  lines += [f"  {k}: {_yaml_value(v)}" for k, v in resources.items()]
  if where.tpu:
    lines += ["  accelerator_args:", f"    runtime_version: {where.runtime_version}"]
  env = runtime_env(job, where)
  if env:
    lines += ["", "envs:"] + [f"  {k}: {_yaml_value(v)}" for k, v in env.items()]
  jax_extra = "jax[tpu]" if where.tpu else "jax[cuda12]"
  setup = ("export PATH=\"$HOME/.local/bin:$PATH\"\n"
           "command -v uv > /dev/null || curl -LsSf https://astral.sh/uv/install.sh | sh\n"
           "[ -x ~/tfx-venv/bin/python ] || uv venv -q --python 3.11 ~/tfx-venv\n"
           f"uv pip install -q --python ~/tfx-venv/bin/python -e . '{jax_extra}'{' tpu-info' if where.tpu else ''}")
  run = ""
  if not where.tpu and where.hosts > 1:
    run += (f"export JAX_COORDINATOR_ADDRESS=$(echo \"$SKYPILOT_NODE_IPS\" | head -n1):{COORDINATOR_PORT}\n"
            "export JAX_NUM_PROCESSES=$SKYPILOT_NUM_NODES\n"
            "export JAX_PROCESS_ID=$SKYPILOT_NODE_RANK\n")
  run += "~/tfx-venv/bin/" + job.train_command()
  lines += ["", "setup: |", _block(setup).rstrip("\n"), "", "run: |", _block(run).rstrip("\n")]
  return "\n".join(lines) + "\n"


def task_path(job: Job) -> str:
  return os.path.join(ROOT, ".launch", job.name, "task.yaml")


def plan(job: Job, action: str = "launch", *, follow: bool = False) -> Plan:
  where = slice_of(job.config)
  launch, name = job.launch, job.name
  managed = bool(launch.managed)
  if action == "launch":
    check_shared_workdir(job, "skypilot")
    check_fits(job, where)
    out = Plan(f"tfx.launch skypilot: {where.describe()} as {'managed job' if managed else 'cluster'} {name} "
               f"({'spot' if launch.spot else 'on-demand'}), workdir {job.workdir}")
    changed = dirty_files()
    if changed:
      out.title += f"\n# note: SkyPilot syncs the working tree, including {len(changed)} uncommitted change(s)"
    path = task_path(job)
    out.write(path, task_yaml(job, where))
    if managed:
      out.run("sky", "jobs", "launch", "--name", name, "--yes", path)
    else:
      out.run("sky", "launch", "--cluster", name, "--idle-minutes-to-autostop", str(launch.idle_minutes), "--down",
              "--yes", path)
    return out
  out = Plan(f"tfx.launch skypilot {action}: {'managed job' if managed else 'cluster'} {name}")
  follow_flag = [] if follow else ["--no-follow"]
  commands = {
      ("status", True): ["sky", "jobs", "queue"],
      ("status", False): ["sky", "status", name],
      ("logs", True): ["sky", "jobs", "logs", "--name", name, *follow_flag],
      ("logs", False): ["sky", "logs", name, *follow_flag],
      ("stop", True): ["sky", "jobs", "cancel", "--name", name, "--yes"],
      ("stop", False): ["sky", "stop", name, "--yes"],
      ("delete", True): ["sky", "jobs", "cancel", "--name", name, "--yes"],
      ("delete", False): ["sky", "down", name, "--yes"],
  }
  if (action, managed) not in commands:
    raise LaunchError(f"skypilot has the actions {', '.join(ACTIONS)}; got {action!r}")
  out.run(*commands[(action, managed)])
  if action == "status" and where.tpu and not managed:
    out.run("sky", "exec", name, "~/tfx-venv/bin/tpu-info")
  return out
