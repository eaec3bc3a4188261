"""gcloud: the zero-dependency path to a TPU VM slice, with nothing but the Google Cloud CLI.

    python -m tfx.launch gcloud --create --config configs/t5_base.py --workdir gs://BUCKET/t5 \\
        --config.launch.accelerator=v5litepod-16 --config.launch.zone=us-west4-a
    python -m tfx.launch gcloud status|logs|stop|delete --config ... --workdir ...   (same flags)

launch: [create the TPU VM, or a queued resource and wait until it is ACTIVE;] pack this commit of
the repository (git archive), copy it and a run script to every host (scp --worker=all), then run the
script on every host (ssh --worker=all): it installs tfx in a venv (uv, Python 3.11) and starts
`python -m tfx.train` detached, its console log in ~/NAME.log, copied to WORKDIR/logs/HOST.log every
minute and at the end. status: the VM's state, whether tfx.train runs on each host, its last lines and
`tpu-info` (device memory and utilisation). logs: the log of worker 0. stop: SIGTERM to tfx.train on
every host (a checkpoint, then exit; the same launch resumes). delete: the VM (or queued resource).
"""

from __future__ import annotations

import os
import shlex

from tfx.launch.common import (
    ROOT, Job, LaunchError, Plan, Slice, check_config_committed, check_config_in_repo, check_fits, check_shared_workdir,
    dirty_files, runtime_env, slice_of, source_commit)

ACTIONS = ("launch", "status", "logs", "stop", "delete")


def tpu_of(job: Job) -> Slice:
  where = slice_of(job.config)
  if not where.tpu:
    raise LaunchError(f"the gcloud backend creates TPU VMs; launch.accelerator={job.launch.accelerator!r} is a GPU "
                      f"type: use the skypilot or slurm backend for GPUs")
  return where


def _where(job: Job) -> list[str]:
  launch = job.launch
  if not launch.zone:
    raise LaunchError("the gcloud backend needs a zone with capacity for the TPU type: set "
                      "--config.launch.zone=ZONE (e.g. us-west4-a for v5litepod; `gcloud compute tpus "
                      "accelerator-types list --zone=ZONE` lists what a zone has)")
  return [f"--zone={launch.zone}"] + ([f"--project={launch.project}"] if launch.project else [])


def _tpu(*args: str) -> list[str]:
  return ["gcloud", "compute", "tpus", *args]


def _ssh(job: Job, worker: str, command: str) -> list[str]:
  return _tpu("tpu-vm", "ssh", job.name, *_where(job), f"--worker={worker}", f"--command={command}")


def run_script(job: Job, where: Slice, commit: str) -> str:
  """The script every host runs: set-up, then tfx.train detached with its log synced to the workdir."""
  name, short = job.name, commit[:12]
  logs = job.workdir.rstrip("/") + "/logs"
  exports = "".join(f"export {k}={_shell_value(v)}\n" for k, v in runtime_env(job, where).items())
  return f"""#!/bin/bash
# {name}: tfx at commit {commit} on every host of the TPU VM (written by python -m tfx.launch gcloud).
set -euo pipefail
SRC=~/tfx-{short}
LOG=~/{name}.log
if [ "${{1:-}}" != "--detached" ]; then
  if [ ! -d "$SRC" ]; then mkdir -p "$SRC" && tar -xzf ~/tfx-{short}.tar.gz -C "$SRC"; fi
  export PATH="$HOME/.local/bin:$PATH"
  command -v uv > /dev/null || curl -LsSf https://astral.sh/uv/install.sh | sh
  [ -x ~/tfx-venv/bin/python ] || uv venv -q --python 3.11 ~/tfx-venv
  uv pip install -q --python ~/tfx-venv/bin/python -e "$SRC" 'jax[tpu]' tpu-info
  nohup bash "$0" --detached > /dev/null 2>&1 < /dev/null &
  echo "tfx: {name} started on $(hostname); log $LOG, copied to {logs}/$(hostname).log"
  exit 0
fi
cd "$SRC"
{exports}sync_log() {{ gcloud storage cp -q "$LOG" "{logs}/$(hostname).log" || true; }}
( while sleep 60; do sync_log; done ) &
SYNC=$!
status=0
~/tfx-venv/bin/{job.train_command()} > "$LOG" 2>&1 || status=$?
echo "tfx: tfx.train exited with status $status" >> "$LOG"
kill "$SYNC" || true
sync_log
"""


def _shell_value(value: str) -> str:
  return "~/" + shlex.quote(value[2:]) if value.startswith("~/") else shlex.quote(value)


def plan(job: Job, action: str = "launch", *, create: bool = False, follow: bool = False) -> Plan:
  where = tpu_of(job)
  launch, name = job.launch, job.name
  zone = _where(job)
  if action == "launch":
    check_shared_workdir(job, "gcloud")
    check_config_in_repo(job)
    check_fits(job, where)
    commit = source_commit()
    check_config_committed(job, commit)
    out = Plan(f"tfx.launch gcloud: {where.describe()} as {name} ({'spot' if launch.spot else 'on-demand'}"
               f"{', queued' if launch.queued else ''}), commit {commit}, workdir {job.workdir}")
    changed = dirty_files()
    if changed:
      out.title += (f"\n# warning: {len(changed)} tracked file(s) differ from {commit[:12]} ({', '.join(changed[:3])}"
                    f"{', ...' if len(changed) > 3 else ''}); the hosts run the commit: commit first")
    spot = ["--spot"] if launch.spot else []
    if create and launch.queued:
      out.run(*_tpu("queued-resources", "create", name, f"--node-id={name}", *zone,
                    f"--accelerator-type={where.accelerator}", f"--runtime-version={where.runtime_version}", *spot))
      out.run(*_tpu("queued-resources", "describe", name, *zone, "--format=value(state.state)"), until="ACTIVE")
    elif create:
      out.run(*_tpu("tpu-vm", "create", name, *zone, f"--accelerator-type={where.accelerator}",
                    f"--version={where.runtime_version}", *spot))
    stage = os.path.join(ROOT, ".launch", name)
    tarball, script = f"{stage}/tfx-{commit[:12]}.tar.gz", f"{stage}/{name}.sh"
    out.run("mkdir", "-p", stage)
    out.run("git", "-C", ROOT, "archive", "--format=tar.gz", "-o", tarball, commit)
    out.write(script, run_script(job, where, commit), 0o755)
    out.run(*_tpu("tpu-vm", "scp", tarball, script, f"{name}:", *zone, "--worker=all"))
    out.run(*_ssh(job, "all", f"bash ~/{name}.sh"))
    return out
  out = Plan(f"tfx.launch gcloud {action}: {name}")
  if action == "status":
    if launch.queued:
      out.run(*_tpu("queued-resources", "describe", name, *zone, "--format=value(state.state)"))
    out.run(*_tpu("tpu-vm", "describe", name, *zone, "--format=value(state,acceleratorType)"))
    out.run(*_ssh(job, "all", f"echo \"== $(hostname)\"; pgrep -af '[t]fx[.]train' || echo 'no training process'; "
                              f"tail -n 3 ~/{name}.log; ~/tfx-venv/bin/tpu-info || true"))
  elif action == "logs":
    out.run(*_ssh(job, "0", f"tail -n 200 {'-f ' if follow else ''}~/{name}.log"))
  elif action == "stop":
    out.run(*_ssh(job, "all", "pkill -TERM -f '[t]fx[.]train --config' || true"))
  elif action == "delete":
    if launch.queued:
      out.run(*_tpu("queued-resources", "delete", name, *zone, "--force", "--quiet"))
    else:
      out.run(*_tpu("tpu-vm", "delete", name, *zone, "--quiet"))
  else:
    raise LaunchError(f"gcloud has the actions {', '.join(ACTIONS)}; got {action!r}")
  return out
