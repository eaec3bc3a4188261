"""Every config's own train step, and the accelerator suite's four steps (the programs a device
session times, and GPT-2-small: no config of its own is a decoder), compiled for an accelerator this
machine does not have, each in a process of its own: what a TPU VM or a GPU host would compile
before its first step.

    make compile-configs ARGS="[--topology v5e:2x2|h100] [--configs 'configs/*_base.py'] [--suite gpt2_small,...]
                               [--batch-per-device 8] [--record FILE | --check FILE] [-- --config.KEY=VALUE ...]"

`python -m tfx.bench --config C --lower PLATFORM --topology T` per config (bf16 compute, the config's
own attention, dropout and remat settings; a suite model as `accel.NAME`, at the suite's settings:
dropout off, layers unrolled), with libtpu (`make tpu-libs`) or JAX's CUDA plugin
(`make gpu-libs`) on the path. A compiler that crashes (XLA:TPU died with a segmentation fault on
BERT's own config until stop 67) takes its own process down, not the others'. An objective with a
frozen teacher (DistilBERT's) is compiled with the student's shapes (`objective.teacher=init`).
Prints one line per config (its memory and the bytes its kernels move, or what failed) and exits 1
if any failed.

`--record FILE` writes what each config's step moves a step (`tfx.bench_traffic`'s bytes by kind)
and needs per device (XLA's memory analysis) to FILE (JSON); `--check FILE` compares this run with
such a record and exits 1 where a config's bytes or memory moved by more than TOLERANCE of its
recorded value, naming each change. Until a device times a step, the bytes are what an accelerator
change can be judged by (docs/performance/8-records.md): the tests check the records in
tests/golden/ (`tests/test_compile_configs.py`, `tests/test_compile_configs_h100.py`), so a change
that adds traffic to any config's step, or takes some away, says so, and the record is taken again
with the change that meant it.
"""

import argparse
import glob
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUITE_PREFIX = "accel."  # a suite model's name in the output and the record (configs/bert_base.py is "bert_base")


def libs_dir(platform: str) -> str:
  """The folder beside the venv with `platform`'s compiler (make tpu-libs / gpu-libs)."""
  return os.path.join(ROOT, ".tpu-libs" if platform == "tpu" else ".gpu-libs")


def environment(platform: str) -> dict[str, str]:
  """The environment of a compile for `platform` on a machine without it (as the Makefile's
  tpu-compile / gpu-compile set it)."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join([libs_dir(platform), ROOT])}
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


# A compile is deterministic for the same libraries: anything past this share of a recorded number
# is a change of the program, not noise.
TOLERANCE = 0.001


def numbers(result: dict) -> dict:
  """What a record keeps of one config's compile (a `tfx.bench --lower ... --json` entry): the bytes
  its kernels move a step, by kind and in total, and the bytes it needs per device."""
  moved = {kind: n for kind, n in (result.get("traffic") or {}).items() if n}
  return {"moved": moved, "device_bytes": result["device_bytes"]}


def versions(platform: str) -> dict[str, str]:
  """The libraries that make the program and compile it: jax, jaxlib, flax and optax from this
  environment, libtpu or the CUDA plugin and cuDNN from the folder beside the venv that the compile
  puts on the path."""
  found = {name: importlib.metadata.version(name) for name in ("jax", "jaxlib", "flax", "optax")}
  for dist in importlib.metadata.distributions(path=[libs_dir(platform)]):
    name = dist.metadata["Name"]
    if name.startswith(("libtpu", "jax-cuda", "jax_cuda", "nvidia-cudnn")):
      found[name] = dist.version
  return found


def differences(record: dict, run: dict) -> list[str]:
  """How `run` (this compile, as `--record` writes it) differs from `record`: a line per config
  whose bytes moved or memory per device changed by more than TOLERANCE of the recorded value,
  that compiles where the record says it failed or the other way round, or that the record lacks;
  or one line saying that the two compiled different things."""
  setting = ("topology", "batch_per_device", "overrides")  # a run of fewer configs is compared name by name
  if any(record.get(key) != run.get(key) for key in setting):
    return [f"the record was taken for {', '.join(f'{k}={record.get(k)!r}' for k in setting)}, this run is "
            f"{', '.join(f'{k}={run.get(k)!r}' for k in setting)}: compare like with like"]
  failed_then, failed_now = set(record.get("failed", [])), set(run.get("failed", []))
  lines = []
  for name in sorted(failed_now - failed_then):
    lines.append(f"{name}: failed to compile, where the record has its numbers" if name in record["configs"]
                 else f"{name}: failed to compile, and the record does not have it")
  for name, now in run["configs"].items():
    then = record["configs"].get(name)
    if then is None:
      lines.append(f"{name}: compiles, where the record says it failed" if name in failed_then
                   else f"{name}: not in the record (a new config)")
      continue
    changed = []
    for what, old, new, unit, scale in (("moves", then["moved"].get("total", 0), now["moved"].get("total", 0),
                                         "GB a step", 1e9),
                                        ("needs", then["device_bytes"], now["device_bytes"], "GiB a device", 2**30)):
      if abs(new - old) > TOLERANCE * max(old, 1):
        changed.append(f"{what} {new / scale:.3f} {unit} where the record says {old / scale:.3f} "
                       f"({(new - old) / max(old, 1):+.1%})")
    if changed:
      kinds = sorted((set(then["moved"]) | set(now["moved"])) - {"total", "indices"})
      by_kind = ", ".join(f"{k} {then['moved'].get(k, 0) / 1e9:.2f} -> {now['moved'].get(k, 0) / 1e9:.2f}"
                          for k in kinds if then["moved"].get(k, 0) != now["moved"].get(k, 0))
      lines.append(f"{name}: " + "; ".join(changed) + (f" (GB by kind: {by_kind})" if by_kind else ""))
  if lines and record.get("versions") != run.get("versions"):
    lines.append(f"the libraries differ from the record's ({record.get('versions')} then, {run.get('versions')} "
                 "now), which alone changes what XLA compiles")
  return lines


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  extra = argv[argv.index("--") + 1:] if "--" in argv else []
  argv = argv[:argv.index("--")] if "--" in argv else argv
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--topology", default="v5e:2x2", help="a TPU slice (v5e:2x2) or GPUs (h100, h100:8)")
  parser.add_argument("--configs", default="configs/*_base.py", help="a glob under the repository")
  parser.add_argument("--suite", default=None,
                      help="the accelerator suite's models to compile too, named accel.NAME (tfx/bench_suite.py: "
                           "its settings, dropout off; comma-separated, '' for none; default: all four)")
  parser.add_argument("--batch-per-device", type=int, default=8)
  parser.add_argument("--timeout", type=int, default=900, help="seconds per config")
  saved = parser.add_mutually_exclusive_group()
  saved.add_argument("--record", metavar="FILE", help="write each config's bytes moved and memory to FILE (JSON)")
  saved.add_argument("--check", metavar="FILE", help="compare each config's bytes moved and memory with the record "
                     f"in FILE; exit 1 where one moved by more than {TOLERANCE:.1%}")
  args = parser.parse_args(argv)
  record = None
  if args.check:
    try:
      with open(args.check) as f:
        record = json.load(f)
    except (OSError, ValueError) as e:
      parser.error(f"--check {args.check}: no record to compare with ({e}); take one with --record")
  sys.path.insert(0, ROOT)
  from tfx.bench_lower import topology_platform
  from tfx.bench_suite import SUITE

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
  known = [entry.name for entry in SUITE]
  suite = known if args.suite is None else [name for name in args.suite.split(",") if name]
  if any(name not in known for name in suite):
    parser.error(f"--suite {args.suite}: the suite's models are {', '.join(known)}")
  lowered = [sys.executable, "-m", "tfx.bench", "--lower", platform, "--topology", args.topology]
  steps = [(os.path.splitext(os.path.basename(path))[0],
            [*lowered, "--config", path, "--config.model.dtype=bfloat16",
             f"--config.train.batch_size={args.batch_per_device * devices}",
             *(["--config.objective.teacher=init"] if has_teacher(path) else [])]) for path in paths]
  steps += [(SUITE_PREFIX + name, [*lowered, "--suite", "accel", "--only", name, "--skip-depth",
                                    "--batch", str(args.batch_per_device)]) for name in suite]
  failed = []
  run = {"topology": args.topology, "batch_per_device": args.batch_per_device, "overrides": extra, "suite": suite,
         "versions": versions(platform), "configs": {}}
  with tempfile.TemporaryDirectory() as scratch:
    for name, command in steps:
      result_path = os.path.join(scratch, f"{name}.json")
      command = [*command, *extra, "--json", result_path]
      try:
        proc = subprocess.run(command, env=environment(platform), cwd=ROOT, capture_output=True, text=True,
                              timeout=args.timeout)
        ok, line = outcome(proc)
      except subprocess.TimeoutExpired:
        ok, line = False, f"FAILED (no result in {args.timeout} s)"
      if ok and not os.path.exists(result_path):
        ok, line = False, f"FAILED (tfx.bench wrote no JSON) {line}"
      print(f"{name}: {line}", flush=True)
      if not ok:
        failed.append(name)
        continue
      with open(result_path) as f:
        run["configs"][name] = numbers(json.load(f)[-1])
  run["failed"] = failed
  print(f"{len(steps) - len(failed)} of {len(steps)} compiled for {args.topology}"
        + (f"; failed: {', '.join(failed)}" if failed else ""))
  if args.record:  # what failed too: a check then says when it compiles
    with open(args.record, "w") as f:
      json.dump(run, f, indent=1, sort_keys=True)
      f.write("\n")
    print(f"recorded in {args.record}")
  changed = differences(record, run) if record is not None else []
  if changed:
    print(f"{len(changed)} difference(s) from the record in {args.check}:\n  " + "\n  ".join(changed)
          + f"\nIf the change is meant, take the record again: make compile-configs ARGS=\"--topology "
          f"{args.topology} --record {args.check}\" (and say what moved in the commit).")
  elif record is not None:
    print(f"bytes moved and memory as recorded in {args.check}, within {TOLERANCE:.1%}"
          + (f"; {', '.join(failed)} failed, as recorded" if failed else ""))
    return 0  # a failure the record has is known, not news
  return 1 if failed or changed else 0


if __name__ == "__main__":
  sys.exit(main())
