"""`python -m tfx.bench ... --lower gpu|tpu`: the train step lowered for an accelerator that is not here.

    python -m tfx.bench --suite accel --lower gpu [--sweep model.attention=cudnn,pallas,xla] [--tiny]
    python -m tfx.bench --suite accel --lower tpu --sweep model.attention=splash,xla
    python -m tfx.bench --config configs/base.py --config.model.dtype=bfloat16 --lower gpu

Each step is traced for the named platform (`tfx.ops.target.lowering_for`: the attention kernel
chosen as that platform would choose it, the Pallas kernels compiled rather than interpreted) and
lowered to StableHLO for it (`lowering_platforms`), from abstract state: nothing is allocated,
compiled or run, so a full-size model takes seconds on a CPU. What that proves before a device
session is spent: the step traces and lowers there — the Pallas kernels' Triton (GPU) or Mosaic
(TPU) code is generated, JAX's cuDNN wrapper accepts tfx's arguments (its shape, layout and
dtype checks, against `tfx.ops.target.CUDNN_ASSUMED` where no cuDNN is installed) — and which
kernels the program calls, how often. The counts show the rematerialisation policy at work: with
`model.remat=dots_attention` the forward kernel appears once (its outputs are kept for the
backward pass), with `full` twice. What it cannot prove: that the device's own compiler
(XLA:GPU, Triton's PTX back end, cuDNN's engine selection, Mosaic) accepts the program, and speed.
"""

import collections
import re
import time
from typing import Any

import ml_collections

from tfx import ops, parallel
from tfx.errors import UserError
from tfx.ops import target

# Custom-call targets that are attention kernels -> the name the report gives them.
KERNEL_CALLS = (
    (re.compile(r"^__cudnn\$fmha.*Backward"), "cudnn backward"),
    (re.compile(r"^__cudnn\$fmha"), "cudnn forward"),
    (re.compile(r"^__gpu\$xla\.gpu\.triton$"), "triton (Pallas)"),
    (re.compile(r"^tpu_custom_call$"), "mosaic (Pallas)"),
    # On a mesh of several devices JAX's cuDNN attention is a custom_partitioning call, which
    # XLA's SPMD partitioner expands into the cuDNN kernels when it compiles.
    (re.compile(r"^CustomSPMDPartitioning$"), "custom-partitioned (cuDNN on a mesh)"),
)
_CUSTOM_CALL = re.compile(r"custom_call @([\w$.]+)")


def kernel_calls(module_text: str) -> dict[str, int]:
  """{kernel: number of call sites} of the attention kernels in a lowered module's text.

  A scanned layer stack's body is one call site for all its layers; a kernel the backward pass
  runs again (rematerialised) is a second site."""
  counts: collections.Counter = collections.Counter()
  for name in _CUSTOM_CALL.findall(module_text):
    for pattern, kernel in KERNEL_CALLS:
      if pattern.search(name):
        counts[kernel] += 1
        break
  return dict(sorted(counts.items()))


def lower_step(config: ml_collections.ConfigDict, platform: str) -> dict[str, Any]:
  """Lowers the train step of `config` for `platform` ('gpu' or 'tpu'); never raises for a
  failure of the trace or the lowering: the result's "error" says what failed.

  Returns {"platform", "attention": ["kernel (reason)", ...], "kernel_calls": {...}, "lower_s",
  "module_bytes", "error"} ("error" None when it lowered).
  """
  from tfx import bench_suite

  result: dict[str, Any] = {"platform": platform, "attention": [], "kernel_calls": {}, "lower_s": None,
                            "module_bytes": None, "error": None}
  start = time.perf_counter()
  chosen: list[tuple[str, str]] = []
  with target.lowering_for(platform):
    try:
      exp, jitted, args = bench_suite._abstract_step(config)
      with parallel.context(exp.mesh), ops.recorded_choices() as chosen:  # the step's choices, not init's
        lowered = jitted.trace(*args).lower(lowering_platforms=(target.LOWERING_PLATFORMS[platform],))
      text = lowered.as_text()
    except UserError:
      raise  # a bad config is the user's to fix, not a finding about the platform
    except Exception as e:  # noqa: BLE001  (the report's purpose: what fails there, fails here too)
      message = str(e).strip().splitlines()
      result["error"] = f"{type(e).__name__}: {message[0] if message else ''}"[:300]
      text = None
  result["lower_s"] = time.perf_counter() - start
  result["attention"] = [f"{kernel} ({why})" for kernel, why in dict.fromkeys(chosen)]
  if text is not None:
    result["kernel_calls"] = kernel_calls(text)
    result["module_bytes"] = len(text)
  return result


def lower_suite(root: str, platform: str, *, tiny: bool, batch_per_device: int, only: tuple[str, ...] = (),
                overrides: tuple[str, ...] = ()) -> list[dict[str, Any]]:
  """`lower_step` of every suite model (tfx/bench_suite.py) with `overrides` after its own."""
  import jax

  from tfx import bench_suite

  results = []
  for entry in bench_suite.SUITE:
    if only and entry.name not in only:
      continue
    config = bench_suite.entry_config(entry, root, tiny=tiny, batch_size=batch_per_device * jax.device_count(),
                                      extra=overrides)
    results.append({"name": entry.name, "overrides": list(overrides), "batch_size": config.train.batch_size,
                    "seq_len": config.data.seq_len, **lower_step(config, platform)})
  return results


def format_lowered(results: list[dict[str, Any]]) -> str:
  """One line per lowering: model, settings, ok / the error, the kernel calls, the kernels chosen."""
  lines = []
  for r in results:
    settings = " ".join(r.get("overrides", ())) or "defaults"
    head = f"{r.get('name', 'config')} [{settings}] for {r['platform']}"
    if r["error"]:
      lines.append(f"{head}: FAILED {r['error']}")
      continue
    calls = ", ".join(f"{k} x{n}" for k, n in r["kernel_calls"].items()) or "no attention kernel called (XLA's attention)"
    lines.append(f"{head}: lowered in {r['lower_s']:.1f} s; {calls}; attention: {'; '.join(r['attention'])}")
  return "\n".join(lines)
