"""python -m tfx.launch BACKEND [ACTION] --config CONFIG --workdir WORKDIR [--dry-run] [flags] [--config.k=v ...]

BACKEND: local, gcloud, skypilot, xpk, slurm. ACTION: launch (default), status, logs, stop, delete
(the cloud backends). Settings come from the config's `launch` section (configs/base.py documents
every field), set in the config file or as --config.launch.FIELD=VALUE; the short flags below are
the same fields. Every --config.k=v is also passed on to tfx.train, so the hosts run exactly the
config that was checked here: the slice's devices and hosts against the mesh and the global batch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from tfx.errors import UserError

BACKENDS = ("local", "gcloud", "skypilot", "xpk", "slurm")
ACTIONS = ("launch", "status", "logs", "stop", "delete")
# short flag -> launch field
SHORT_FLAGS = {"name": str, "accelerator": str, "zone": str, "project": str, "processes": int,
               "devices_per_process": int}


def parse(argv):
  parser = argparse.ArgumentParser(prog="python -m tfx.launch", description=__doc__.split("\n\n")[1],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("backend", choices=BACKENDS)
  parser.add_argument("action", nargs="?", default="launch", choices=ACTIONS)
  parser.add_argument("--config", default=None, help="config file (default configs/base.py for status/logs/stop/delete)")
  parser.add_argument("--workdir", default=None, help="run directory; gs://BUCKET/run for the cloud backends")
  parser.add_argument("--dry-run", action="store_true", help="print the files and commands instead of running them")
  parser.add_argument("--create", action="store_true", help="gcloud: create the TPU VM (or queued resource) first")
  parser.add_argument("--follow", action="store_true", help="logs: keep following")
  parser.add_argument("--port", type=int, default=0, help="local: coordinator port (0 = a free one)")
  for flag, kind in SHORT_FLAGS.items():
    parser.add_argument("--" + flag.replace("_", "-"), type=kind, default=None, help=f"= --config.launch.{flag}")
  args, overrides = parser.parse_known_args(argv)
  for flag in SHORT_FLAGS:
    value = getattr(args, flag)
    if value is not None:
      overrides.append(f"--config.launch.{flag}={value}")
  return args, overrides


def run(argv) -> int:
  from tfx.launch import common, local

  args, overrides = parse(argv)
  if args.action == "launch" and (not args.config or not args.workdir):
    raise common.LaunchError("--config and --workdir are required to launch a run")
  if args.backend == "local" and args.action != "launch":
    raise common.LaunchError("the local backend only launches (its processes run in the foreground)")
  config = args.config or os.path.join(common.ROOT, "configs", "base.py")
  if not args.workdir and not args.name:
    raise common.LaunchError(f"{args.action} needs the run's --workdir (or --name) to know which job")
  job = common.load_job(config, args.workdir or "", overrides)
  if args.backend == "local":
    port = args.port or local.free_port()
    if args.dry_run:
      sys.stdout.write(local.plan(job, port).render())
      return 0
    return local.launch(job, port)
  backend = importlib.import_module(f"tfx.launch.{args.backend}")
  plan = backend.plan(job, args.action, **({"create": args.create} if args.backend == "gcloud" else {}),
                      **({"follow": args.follow} if args.backend in ("gcloud", "skypilot") else {}))
  if args.dry_run:
    sys.stdout.write(plan.render())
    return 0
  for tool in dict.fromkeys(step.argv[0] for step in plan.steps if isinstance(step, common.Run)):
    if tool in common.INSTALL:
      common.require(tool)
  return common.execute(plan)


def main(argv=None) -> None:
  try:
    code = run(sys.argv[1:] if argv is None else argv)
  except UserError as e:
    sys.exit(f"tfx.launch: {e}")
  sys.exit(code)


if __name__ == "__main__":
  main()
