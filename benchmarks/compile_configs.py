"""Every config's own train step compiled for an accelerator this machine does not have, each in a
process of its own: what a TPU VM or a GPU host would compile before its first step.

    make compile-configs ARGS="[--topology v5e:2x2|h100] [--configs 'configs/*_base.py'] [--batch-per-device 8]
                               [-- --config.KEY=VALUE ...]"

`python -m tfx.bench --config C --lower PLATFORM --topology T` per config (bf16 compute, the config's
own attention, dropout and remat settings), with libtpu (`make tpu-libs`) or JAX's CUDA plugin
(`make gpu-libs`) on the path. A compiler that crashes (XLA:TPU died with a segmentation fault on
BERT's own config until stop 67) takes its own process down, not the others'. An objective with a
frozen teacher (DistilBERT's) is compiled with the student's shapes (`objective.teacher=init`).
Prints one line per config (its memory and the bytes its kernels move, or what failed) and exits 1
if any failed.
"""

import argparse
import glob
import os
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def environment(platform: str) -> dict[str, str]:
  """The environment of a compile for `platform` on a machine without it (as the Makefile's
  tpu-compile / gpu-compile set it)."""
  libs = os.path.join(ROOT, ".tpu-libs" if platform == "tpu" else ".gpu-libs")
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join([libs, ROOT])}
  if platform == "tpu":  # no TPU VM metadata to probe for, and no lock on a TPU that is not there
    env.update(TPU_SKIP_MDS_QUERY="1", TPU_WORKER_HOSTNAMES="localhost", TPU_ACCELERATOR_TYPE="v5litepod-4",
               ALLOW_MULTIPLE_LIBTPU_LOAD="1")
  return env


def has_teacher(path: str) -> bool:
  from tfx.config import load_config_file

  objective = load_config_file(path).get("objective")
  return objective is not None and "teacher" in objective


def outcome(proc: subprocess.CompletedProcess) -> tuple[bool, str]:
  """(compiled, the line to print): tfx.bench's summary line, or how the process ended."""
  lines = [line for line in proc.stdout.splitlines() if " for gpu: " in line or " for tpu: " in line]
  if proc.returncode == 0 and lines:
    return True, lines[-1].split(": ", 1)[1]
  if proc.returncode < 0:
    name = signal.Signals(-proc.returncode).name
    where = next((line.strip() for line in proc.stderr.splitlines() if line.strip().startswith("PC:")), "")
    return False, f"CRASHED ({name}) {where}"
  tail = (lines[-1] if lines else "") or (proc.stderr.strip().splitlines() or ["no output"])[-1]
  return False, f"FAILED (exit {proc.returncode}) {tail}"


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  extra = argv[argv.index("--") + 1:] if "--" in argv else []
  argv = argv[:argv.index("--")] if "--" in argv else argv
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--topology", default="v5e:2x2", help="a TPU slice (v5e:2x2) or GPUs (h100, h100:8)")
  parser.add_argument("--configs", default="configs/*_base.py", help="a glob under the repository")
  parser.add_argument("--batch-per-device", type=int, default=8)
  parser.add_argument("--timeout", type=int, default=900, help="seconds per config")
  args = parser.parse_args(argv)
  sys.path.insert(0, ROOT)
  from tfx.bench_lower import topology_platform

  platform = topology_platform(args.topology)
  devices = 1
  if platform == "gpu":
    devices = int(args.topology.partition(":")[2] or 1)
  else:  # a slice's chips: the product of its shape (v5e:2x2 = 4, v4:2x2x1 = 4)
    for n in args.topology.partition(":")[2].split("x"):
      devices *= int(n)
  paths = sorted(glob.glob(os.path.join(ROOT, args.configs)))
  if not paths:
    parser.error(f"no config matches {args.configs!r} under {ROOT}")
  failed = []
  for path in paths:
    command = [sys.executable, "-m", "tfx.bench", "--config", path, "--lower", platform, "--topology", args.topology,
               "--config.model.dtype=bfloat16", f"--config.train.batch_size={args.batch_per_device * devices}",
               *(["--config.objective.teacher=init"] if has_teacher(path) else []), *extra]
    name = os.path.splitext(os.path.basename(path))[0]
    try:
      proc = subprocess.run(command, env=environment(platform), cwd=ROOT, capture_output=True, text=True,
                            timeout=args.timeout)
      ok, line = outcome(proc)
    except subprocess.TimeoutExpired:
      ok, line = False, f"FAILED (no result in {args.timeout} s)"
    print(f"{name}: {line}", flush=True)
    if not ok:
      failed.append(name)
  print(f"{len(paths) - len(failed)} of {len(paths)} compiled for {args.topology}"
        + (f"; failed: {', '.join(failed)}" if failed else ""))
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
