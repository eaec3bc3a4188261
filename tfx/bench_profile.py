"""Where a profiled step's device time goes: `python -m tfx.bench_profile TRACE [--steps N]`.

TRACE is what `python -m tfx.bench --profile DIR` wrote (DIR, or one `.xplane.pb` file under it;
the newest is read). Every kernel the device ran is summed by name and put in one of a few
kinds: matrix products (cuBLAS, cuBLASLt's nvjet, XLA's Triton GEMM fusions), attention kernels
(cuDNN's fused attention), Triton/Pallas kernels, copies, and XLA's own fusions (the elementwise
work and reductions: norms, activations, the loss, the optimizer). Kernels that run once a step
are outside the scanned layers (embedding, head, loss, optimizer); those run once per layer (or
a multiple) are the layers'. Read with `jax.profiler.ProfileData`, so no TensorBoard is needed.

On a TPU only the device plane's "XLA Ops" line is read (its other lines span the ops). On a CPU
there is no device plane: the XLA:CPU thunks on the host's threads (events with an
`hlo_op`) are summed instead, and their kinds come from the optimized HLO where it is given
(a YNNPACK matmul is a `ynn_fusion` like YNNPACK's reductions). With more than one intra-op thread
those times mislead in two ways, and the summary says so (`CPU_THREADS_CAVEAT`): independent
thunks run at once, and an Eigen matmul (`dot.N`, e.g. the weight gradients x^T . dy) is traced
for its hand-off to the threads only (T5 medium: 0.9 ms a step for four of them on two cores,
127 ms pinned to one). For per-kernel times pin the process to one core (`taskset -c 0`).

Given the compiled step's optimized HLO as well (`tfx.bench --profile` passes it), each HLO
instruction's time (the kernels a trace attributes to it through their `hlo_op`) is joined with
the bytes `tfx.bench_traffic` counts for it: per kernel, milliseconds, GB and the bandwidth it
reached, the model operation it came from, sorted by time (`join_bytes`). Kernels far below the
device's bandwidth are where a step's time goes beyond moving its bytes; those at it can only get
faster by moving less. The summary also lists the elementwise kernels and reductions by their
bandwidth, lowest first (`slowest_per_byte`): one far below the others is a kernel to read. Its
200 longest kernels go into the benchmark's JSON and the HLO beside the trace, so that a device
session's profile can be read again without the device.
"""

from __future__ import annotations

import argparse
import collections
import sys
from typing import Any

KINDS = ("matmul", "attention", "triton", "copies", "xla fusions")
CONTROL_FLOW = ("while", "conditional", "call")
KEPT_ROWS = 200  # kernels kept by `join_bytes`, the heaviest (a GPT-2 step has about 1000)
SLOW_SHARE = 0.005  # `slowest_per_byte` lists kernels of at least this share of the step
HLO_FILE = "step_after_optimizations.txt"  # the optimized HLO `tfx.bench --profile` writes beside its trace
TPU_OPS_LINE = "XLA Ops"  # a TPU device plane's line of ops (beside "XLA Modules", "Steps", ...)
CPU_POOL_LINE = "XLAEigen"  # XLA:CPU's intra-op threads are named tf_XLAEigen/<id> in a host trace
HLO_KINDS = {"matmul": "matmul", "attention": "attention", "copy": "copies"}  # tfx.bench_traffic's -> ours
CPU_THREADS_CAVEAT = ("XLA:CPU ran on {threads} intra-op threads: independent kernels overlapped and Eigen "
                      "matmuls (dot.N) count their hand-off only; pin to one core (taskset -c 0) for kernel times")


def kind_of(name: str) -> str:
  """The kind of one kernel, from its name (see the module docstring)."""
  low = name.lower()
  if low.startswith("nvjet") or any(s in low for s in ("gemm", "cublas", "cutlass", "xmma")) or low.startswith("dot"):
    return "matmul"
  if "cudnn" in low or "sdpa" in low or "flash" in low:
    return "attention"
  if "triton" in low or "pallas" in low:
    return "triton"
  if low.startswith(("memcpy", "memset")) or "copy" in low:
    return "copies"
  return "xla fusions"


def find_trace(path: str) -> str:
  """`path` itself if it is a file, else the newest .xplane.pb under it."""
  from etils import epath

  p = epath.Path(path)
  if p.is_file():
    return str(p)
  # jax.profiler.trace writes DIR/plugins/profile/<yyyy_mm_dd_hh_mm_ss>/<host>.xplane.pb
  found = sorted(p.glob("plugins/profile/*/*.xplane.pb"), key=lambda f: (f.parent.name, f.name))
  if not found:
    raise FileNotFoundError(f"no .xplane.pb under {path}: give the folder `tfx.bench --profile` wrote")
  return str(found[-1])


def device_lines(plane) -> list:
  """The lines of a device plane whose events are the kernels, each once. A GPU's plane has a line
  per stream, all of them kernels. A TPU's has the ops on its "XLA Ops" line beside lines that span
  them ("XLA Modules", "Steps"): only that line, or every op would be counted two or three times."""
  ops = [line for line in plane.lines if line.name == TPU_OPS_LINE]
  return ops or list(plane.lines)


def trace_times(trace: str) -> tuple[dict[str, int], dict[str, int], dict[str, int], str, int]:
  """One pass over a trace: ({kernel name: total ns}, {kernel name: calls}, {HLO instruction: total
  ns}, where, threads). The kernels are the device planes' (`device_lines`, threads 0) or, on a
  CPU, the host's XLA thunks (events with an `hlo_op`; control flow, a scan's while loop, spans the
  thunks it runs and is counted through them; threads: how many of XLA:CPU's intra-op threads ran
  them). A kernel's instruction is its `hlo_op` stat; a device kernel without one counts under its
  own name, which for XLA's fusions is the instruction's with '_' for '.' (`join_bytes` matches
  either spelling)."""
  from jax.profiler import ProfileData

  data = ProfileData.from_file(trace)
  total: dict[str, int] = collections.Counter()
  calls: dict[str, int] = collections.Counter()
  by_op: dict[str, int] = collections.Counter()

  def count(event, op) -> None:
    ns = int(event.duration_ns)
    total[event.name] += ns
    calls[event.name] += 1
    by_op[op] += ns

  for plane in data.planes:
    if plane.name.startswith("/device:"):
      for line in device_lines(plane):
        for event in line.events:
          count(event, _hlo_op(event) or event.name)
  if total:
    return total, calls, by_op, "device", 0
  pool = set()  # the intra-op threads that ran a thunk
  for plane in data.planes:
    if plane.name.startswith("/host:CPU"):
      for line in plane.lines:
        for event in line.events:
          op = _hlo_op(event)
          if op and not event.name.startswith(CONTROL_FLOW):
            count(event, op)
            if CPU_POOL_LINE in line.name:
              pool.add(line.name)
  return total, calls, by_op, "host (XLA:CPU thunks)", len(pool)


def _hlo_op(event) -> str | None:
  return next((str(value) for key, value in event.stats if key == "hlo_op"), None)


def _normal(name: str) -> str:
  """An HLO name as a kernel's symbol spells it (PTX names have '_' for '.' and '-')."""
  return name.replace(".", "_").replace("-", "_")


def join_bytes(times: dict[str, int], hlo_text: str, *, steps: int, devices: int = 1,
               kernels: list | None = None) -> dict[str, Any]:
  """Each kernel of a compiled step (`tfx.bench_traffic.kernels` of its optimized HLO) with the
  time `times` ({instruction or kernel symbol: ns}, `trace_times`) gives it: rows of {kernel, kind,
  op, ms_per_step, gb_per_step, tb_per_s} by time, `matched_share` (the part of the traced time
  that found its kernel) and `outside_layers` (the time and bytes of kernels whose model op is not
  in the layers: embedding, head, loss, optimizer; by the op, not by how often a kernel ran, which
  in an unrolled stack does not tell a layer's kernel from the head's).

  `devices`: how many devices the trace ran the program on (their times are summed in it; the
  HLO is one device's program). `kernels`: `tfx.bench_traffic.kernels(hlo_text)` when the caller
  has parsed it already."""
  from tfx import bench_traffic

  by_normal = collections.Counter()
  for op, ns in times.items():
    by_normal[_normal(op)] += ns
  rows, matched = [], 0
  for kernel in bench_traffic.kernels(hlo_text) if kernels is None else kernels:
    ns = times.get(kernel.name, 0) or by_normal.get(_normal(kernel.name), 0)
    if not ns:
      continue
    matched += ns
    ms = ns / steps / devices / 1e6
    moved = kernel.count * (kernel.read + kernel.written)  # bytes a step
    rows.append({"kernel": kernel.name, "kind": kernel.kind, "op": kernel.op, "ms_per_step": ms,
                 "gb_per_step": moved / 1e9, "tb_per_s": moved / (ms * 1e-3) / 1e12 if ms else None})
  rows.sort(key=lambda row: -row["ms_per_step"])
  all_ns = sum(times.values())
  outside = [row for row in rows if "/layers/" not in row["op"]]  # embedding, head, loss, optimizer
  return {"matched_share": matched / all_ns if all_ns else 0.0,
          "outside_layers": {"ms_per_step": sum(row["ms_per_step"] for row in outside),
                             "gb_per_step": sum(row["gb_per_step"] for row in outside)},
          "kernels": rows[:KEPT_ROWS]}


def slowest_per_byte(joined: dict[str, Any], busy_ms: float, n: int) -> list[dict[str, Any]]:
  """The `n` kernels of `join_bytes` that are not matrix products or attention (XLA's fusions,
  copies, in-place updates) and take at least `SLOW_SHARE` of the step, lowest bandwidth first.

  Elementwise work and reductions should all stream their bytes at about one rate; one far below
  the others is a kernel worth reading (on a CPU, XLA:CPU's YNNPACK reduce of [b, t, k, 1, d] ran
  at a tenth of the layer norms' rate, and of a [680, 32000] bias gradient at a twentieth). First
  touches of freshly allocated memory (a CPU's `wrapped_broadcast` zero fills) read slow too."""
  floor = SLOW_SHARE * busy_ms
  rows = [row for row in joined["kernels"]
          if row["kind"] not in ("matmul", "attention") and row["tb_per_s"] and row["ms_per_step"] >= floor]
  return sorted(rows, key=lambda row: row["tb_per_s"])[:n]


def summarize(trace: str, steps: int = 3, top: int = 15, hlo_text: str | None = None,
              devices: int = 1) -> dict[str, Any]:
  """Per-step milliseconds by kind, outside and inside the layers, and the `top` kernels; with the
  step's optimized HLO, also every kernel's bytes and bandwidth (`join_bytes`, under "bytes")."""
  total, calls, by_op, where, threads = trace_times(trace)
  kind, kernels = kind_of, None
  if hlo_text:
    from tfx import bench_traffic

    kernels = bench_traffic.kernels(hlo_text)  # parsed once, for the kinds here and join_bytes
  if where != "device" and kernels:  # a thunk is traced under its instruction: the HLO knows its kind
    kinds = {k.name: HLO_KINDS.get(k.kind, "xla fusions") for k in kernels}
    kind = lambda name: kinds.get(name) or kind_of(name)
  all_ns = sum(total.values())
  by_kind = collections.Counter()
  once = collections.Counter()  # kernels called at most once a step: outside the scanned layers
  for name, ns in total.items():
    by_kind[kind(name)] += ns
    if calls[name] <= steps:
      once[kind(name)] += ns
  per_step = lambda ns: ns / steps / 1e6
  return {
      "trace": trace,
      "source": where,
      "intra_op_threads": threads,
      **({"caveat": CPU_THREADS_CAVEAT.format(threads=threads)} if threads > 1 else {}),
      "steps": steps,
      "busy_ms_per_step": per_step(all_ns),
      "kinds": {k: {"ms_per_step": per_step(by_kind[k]), "share": by_kind[k] / all_ns if all_ns else 0.0,
                    "once_a_step_ms": per_step(once[k])} for k in KINDS if by_kind[k]},
      "top": [{"kernel": name, "kind": kind(name), "ms_per_step": per_step(ns),
               "calls_per_step": calls[name] / steps}
              for name, ns in sorted(total.items(), key=lambda item: -item[1])[:top]],
      **({"bytes": join_bytes(by_op, hlo_text, steps=steps, devices=devices, kernels=kernels)} if hlo_text else {}),
  }


def _rate(tb_per_s: float | None) -> str:
  """A bandwidth in 11 characters: TB/s (a device's), GB/s below 0.1 TB/s (a CPU's), or blanks."""
  if tb_per_s is None:
    return " " * 11
  return f"{tb_per_s:6.2f} TB/s" if tb_per_s >= 0.1 else f"{1e3 * tb_per_s:6.2f} GB/s"


def format_summary(summary: dict[str, Any], top: int = 15) -> str:
  threads = summary.get("intra_op_threads", 0)
  pool = f", {threads} intra-op thread{'s' if threads > 1 else ''}" if threads else ""
  lines = [f"{summary['trace']}: {summary['busy_ms_per_step']:.1f} ms of kernels a step ({summary['source']}{pool}, "
           f"{summary['steps']} steps)",
           *([f"note: {summary['caveat']}"] if "caveat" in summary else []),
           f"{'kind':12s} {'ms/step':>8s} {'share':>6s} {'of which once a step':>21s}"]
  for kind, row in summary["kinds"].items():
    lines.append(f"{kind:12s} {row['ms_per_step']:8.2f} {100 * row['share']:5.1f}% {row['once_a_step_ms']:21.2f}")
  lines.append("top kernels:")
  for row in summary["top"]:
    lines.append(f"  {row['ms_per_step']:7.2f} ms  x{row['calls_per_step']:<5g} {row['kind']:12s} {row['kernel'][:90]}")
  if "bytes" in summary:
    joined = summary["bytes"]
    lines.append(f"the heaviest HLO kernels with their bytes ({100 * joined['matched_share']:.0f}% of the time "
                 f"found its kernel; outside the layers {joined['outside_layers']['ms_per_step']:.2f} ms, "
                 f"{joined['outside_layers']['gb_per_step']:.2f} GB):")
    row_line = lambda row: (f"  {row['ms_per_step']:7.2f} ms {1e3 * row['gb_per_step']:8.1f} MB "
                            + _rate(row["tb_per_s"])
                            + f"  {row['kind']:9s} {row['kernel'][:36]:36s} {row['op'][-60:]}")
    lines.extend(row_line(row) for row in joined["kernels"][:top])
    slow = slowest_per_byte(joined, summary["busy_ms_per_step"], min(top, 10))
    if slow:
      lines.append(f"the slowest per byte of the other kernels over {100 * SLOW_SHARE:g}% of the step (one far below "
                   "the rest is worth reading; first touches of fresh memory read slow too):")
      lines.extend(row_line(row) for row in slow)
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m tfx.bench_profile", description=__doc__.split("\n")[0])
  parser.add_argument("trace", help="a .xplane.pb, or the folder `tfx.bench --profile` wrote")
  parser.add_argument("--steps", type=int, default=3, help="steps in the trace (tfx.bench --profile traces 3)")
  parser.add_argument("--top", type=int, default=15, help="kernels listed")
  parser.add_argument("--hlo", help="the step's optimized HLO text, to join kernels with their bytes (default: "
                                    f"{HLO_FILE} in the trace folder, where tfx.bench --profile writes it)")
  parser.add_argument("--devices", type=int, default=1, help="devices the traced program ran on")
  args = parser.parse_args(argv)
  try:
    trace = find_trace(args.trace)
  except FileNotFoundError as e:
    sys.exit(f"tfx.bench_profile: {e}")
  from etils import epath

  hlo = epath.Path(args.hlo) if args.hlo else epath.Path(args.trace) / HLO_FILE
  if args.hlo and not hlo.is_file():
    sys.exit(f"tfx.bench_profile: --hlo {args.hlo} is not a file")
  text = hlo.read_text() if hlo.is_file() else None
  print(format_summary(summarize(trace, steps=args.steps, top=args.top, hlo_text=text, devices=args.devices),
                       top=args.top))


if __name__ == "__main__":
  main()
