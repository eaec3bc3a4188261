"""xpk: a TPU slice on GKE through xpk (JobSet + Kueue), as one generated command.

    python -m tfx.launch xpk --config configs/t5_base.py --workdir gs://BUCKET/t5 \\
        --config.launch.cluster=my-gke --config.launch.accelerator=v5litepod-16 --config.launch.zone=us-west4-a
    python -m tfx.launch xpk status|logs|stop|delete ...

xpk builds an image from a base image plus this directory (--script-dir), and runs the command on
every host of the slice, where JAX finds the others itself. --max-restarts restarts the whole
workload after a preemption or a host failure; each restart resumes from the gs:// workdir.
"""

from __future__ import annotations


from tfx.launch.common import (
    ROOT, Job, LaunchError, Plan, check_config_in_repo, check_fits, check_shared_workdir, env_prefix, runtime_env,
    tpu_slice)

ACTIONS = ("launch", "status", "logs", "stop", "delete")
BASE_IMAGE = "python:3.11-slim"


def _cluster(job: Job) -> list[str]:
  launch = job.launch
  if not launch.cluster:
    raise LaunchError("the xpk backend needs a GKE cluster made by `xpk cluster create`: set "
                      "--config.launch.cluster=NAME (and launch.zone, launch.project)")
  return [f"--cluster={launch.cluster}"] + ([f"--zone={launch.zone}"] if launch.zone else []) + \
      ([f"--project={launch.project}"] if launch.project else [])


def plan(job: Job, action: str = "launch", **_) -> Plan:
  where = tpu_slice(job.launch.accelerator, job.launch.runtime_version)
  name, cluster = job.name, _cluster(job)
  if action == "launch":
    check_shared_workdir(job, "xpk")
    check_config_in_repo(job)
    check_fits(job, where)
    command = ("pip install -q -e . 'jax[tpu]' && " + env_prefix(runtime_env(job, where)) + job.train_command())
    out = Plan(f"tfx.launch xpk: {where.describe()} as workload {name} on {job.launch.cluster}, workdir {job.workdir}")
    out.run("xpk", "workload", "create", *cluster, f"--workload={name}", f"--tpu-type={where.accelerator}",
            "--num-slices=1", f"--base-docker-image={BASE_IMAGE}", f"--script-dir={ROOT}",
            f"--max-restarts={job.launch.max_restarts}", f"--command={command}")
    return out
  out = Plan(f"tfx.launch xpk {action}: workload {name}")
  if action == "status":
    out.run("xpk", "workload", "list", *cluster, f"--filter-by-job={name}")
  elif action == "logs":
    out.run("kubectl", "logs", "--tail=200", "-l", f"jobset.sigs.k8s.io/jobset-name={name}")
  elif action in ("stop", "delete"):
    out.run("xpk", "workload", "delete", *cluster, f"--workload={name}")
  else:
    raise LaunchError(f"xpk has the actions {', '.join(ACTIONS)}; got {action!r}")
  return out


