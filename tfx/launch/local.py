"""local: N jax.distributed processes on this machine, each with its own fake CPU devices.

    python -m tfx.launch local --processes 2 --devices-per-process 4 --config configs/tiny.py --workdir runs/mh

Process i runs `python -m tfx.train` with JAX_COORDINATOR_ADDRESS=127.0.0.1:PORT, JAX_NUM_PROCESSES,
JAX_PROCESS_ID=i and XLA_FLAGS=--xla_force_host_platform_device_count=D: the multi-host code path
(jax.distributed, per-host data slices, make_array_from_process_local_data, orbax from every process)
on one machine, for checking a multi-host config before paying for it. Output lines are prefixed
[p0], [p1], ...; if a process dies the others exit by themselves within launch.heartbeat_timeout
seconds (tfx.parallel.watch_peers), and the launcher stops any that did not after a grace period.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from tfx.launch.common import ROOT, Job, Plan, Slice, check_fits, runtime_env


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def local_slice(job: Job) -> Slice:
  n, d = job.launch.processes, job.launch.devices_per_process
  return Slice(f"local {n} x {d} CPU", n * d, n, False)


def process_env(job: Job, where: Slice, index: int, port: int) -> dict[str, str]:
  return {"JAX_PLATFORMS": "cpu",
          "XLA_FLAGS": f"--xla_force_host_platform_device_count={job.launch.devices_per_process}",
          "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": str(where.hosts),
          "JAX_PROCESS_ID": str(index), **runtime_env(job, where, local=True)}


def plan(job: Job, port: int) -> Plan:
  where = local_slice(job)
  check_fits(job, where)
  out = Plan(f"tfx.launch local: {where.hosts} processes x {job.launch.devices_per_process} CPU devices, "
             f"workdir {job.workdir}")
  for i in range(where.hosts):
    out.run("env", *[f"{k}={v}" for k, v in process_env(job, where, i, port).items()],
            *job.train_argv(sys.executable))
  return out


def _forward(stream, prefix: str) -> None:
  for line in iter(stream.readline, ""):
    sys.stdout.write(prefix + line)
    sys.stdout.flush()


def _describe(code: int) -> str:
  return f"signal {-code} ({signal.Signals(-code).name})" if code < 0 else f"status {code}"


def launch(job: Job, port: int = 0, grace_seconds: float = 30.0) -> int:
  """Starts the processes, forwards their output, waits; returns 0 or the first failure's status."""
  port = port or free_port()
  if "://" not in job.workdir:  # the processes run in the repository (the config path is relative to it)
    job = dataclasses.replace(job, workdir=os.path.abspath(job.workdir))
  where = local_slice(job)
  check_fits(job, where)
  env_base = dict(os.environ)
  env_base["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env_base.get("PYTHONPATH", "")) if p)
  for inherited in ("JAX_PLATFORM_NAME", "TFX_HEARTBEAT_TIMEOUT", "JAX_COMPILATION_CACHE_DIR"):
    env_base.pop(inherited, None)
  procs = []
  for i in range(where.hosts):
    env = dict(env_base, **process_env(job, where, i, port))
    procs.append(subprocess.Popen(job.train_argv(sys.executable), env=env, stdout=subprocess.PIPE, cwd=ROOT,
                                  stderr=subprocess.STDOUT, text=True, bufsize=1))
  print(f"tfx.launch local: coordinator 127.0.0.1:{port}; " +
        ", ".join(f"process {i} pid {p.pid}" for i, p in enumerate(procs)), flush=True)
  readers = [threading.Thread(target=_forward, args=(p.stdout, f"[p{i}] "), daemon=True) for i, p in enumerate(procs)]
  for r in readers:
    r.start()

  def forward_term(signum, frame):  # preemption of the launcher: every process checkpoints and exits
    for p in procs:
      if p.poll() is None:
        p.send_signal(signal.SIGTERM)

  previous = signal.signal(signal.SIGTERM, forward_term) if threading.current_thread() is threading.main_thread() \
      else None
  first_failure, deadline = None, None
  try:
    while any(p.poll() is None for p in procs):
      failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
      if failed and first_failure is None:
        first_failure = failed[0]
        deadline = time.monotonic() + job.launch.heartbeat_timeout + grace_seconds
      if deadline is not None and time.monotonic() > deadline:
        stragglers = [i for i, p in enumerate(procs) if p.poll() is None]
        print(f"tfx.launch local: stopping process(es) {stragglers}, still running "
              f"{job.launch.heartbeat_timeout + grace_seconds:.0f} s after process {first_failure} failed", flush=True)
        for i in stragglers:
          procs[i].terminate()
        time.sleep(10)
        for i in stragglers:
          if procs[i].poll() is None:
            procs[i].kill()
        break
      time.sleep(0.2)
  except KeyboardInterrupt:
    forward_term(None, None)
  finally:
    for p in procs:
      p.wait()
    for r in readers:
      r.join(timeout=5)
    if previous is not None:
      signal.signal(signal.SIGTERM, previous)
  codes = [p.returncode for p in procs]
  if not any(codes):
    print(f"tfx.launch local: {len(procs)} processes finished", flush=True)
    return 0
  first = first_failure if first_failure is not None else next(i for i, c in enumerate(codes) if c)
  print("tfx.launch local: " + "; ".join(f"process {i} ended with {_describe(c)}" for i, c in enumerate(codes)) +
        f". Process {first} failed first; rerun the same command to resume from the last checkpoint", flush=True)
  code = codes[first]
  return 128 - code if code < 0 else code
