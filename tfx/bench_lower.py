"""`python -m tfx.bench ... --lower gpu|tpu`: the train step lowered for an accelerator that is not here.

    python -m tfx.bench --suite accel --lower gpu [--sweep model.attention=cudnn,pallas,xla] [--tiny]
    python -m tfx.bench --suite accel --lower tpu --sweep model.attention=splash,xla
    python -m tfx.bench --config configs/base.py --config.model.dtype=bfloat16 --lower gpu
    PYTHONPATH=.tpu-libs JAX_PLATFORMS=cpu python -m tfx.bench --suite accel --lower tpu --topology v5e:2x2

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

For a TPU the compiler can run here too: with `--topology v5e:2x2` (any slice libtpu knows, e.g.
v5e:16x16 for 256 chips) the step is also compiled by XLA:TPU for that slice's compile-only
devices (`jax.experimental.topologies`; libtpu beside the venv: `make tpu-libs`), which reports
the compile time, the memory per device by XLA's memory analysis, and a step that does not fit
the chips' memory as the compiler's RESOURCE_EXHAUSTED error. That is MaxText's ahead-of-time
compile check; it still measures no step time.
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


def topology_devices(name: str) -> list:
  """The compile-only devices of a TPU slice ('v5e:2x2', 'v5e:16x16', 'v4:2x2x1', 'v5p:2x2x1',
  'v6e:2x2'), made by libtpu on a machine without a TPU; a `UserError` that says how to get libtpu
  or name a topology when it cannot."""
  try:
    from jax.experimental import topologies

    return list(topologies.get_topology_desc(topology_name=name, platform="tpu").devices)
  except Exception as e:  # noqa: BLE001  (no libtpu, a bad name: both answered the same way)
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    raise UserError(f"--topology {name}: {first}. Compiling for a TPU slice without one needs libtpu: `make "
                    f"tpu-libs` installs it into .tpu-libs (beside the venv, not in it); then run with "
                    f"PYTHONPATH=.tpu-libs JAX_PLATFORMS=cpu, and name a slice as GENERATION:SHAPE "
                    f"(v5e:2x2, v5e:16x16, v4:2x2x1, v5p:2x2x1, v6e:2x2)") from None


def _first_line(e: Exception) -> str:
  message = str(e).strip().splitlines()
  return f"{type(e).__name__}: {message[0] if message else ''}"[:300]


def _compiled_numbers(compiled) -> dict[str, Any]:
  """Per-device bytes of a compiled step (XLA's memory analysis). Not its FLOPs: XLA's cost
  analysis counts a scanned layer stack's loop body once (`tfx.flops` counts the model's)."""
  memory = compiled.memory_analysis()
  out = {"argument_bytes": memory.argument_size_in_bytes, "output_bytes": memory.output_size_in_bytes,
         "temp_bytes": memory.temp_size_in_bytes, "alias_bytes": memory.alias_size_in_bytes}
  out["device_bytes"] = out["argument_bytes"] + out["temp_bytes"] + out["output_bytes"] - out["alias_bytes"]
  return out


def lower_step(config: ml_collections.ConfigDict, platform: str, devices: list | None = None) -> dict[str, Any]:
  """Lowers the train step of `config` for `platform` ('gpu' or 'tpu'), and with `devices` (a TPU
  topology's, `topology_devices`) also compiles it for them; never raises for a failure of the
  trace, the lowering or the compile (one that does not fit the device's memory included): the
  result's "error" says what failed.

  Returns {"platform", "attention": ["kernel (reason)", ...], "kernel_calls": {...}, "lower_s",
  "module_bytes", "error"} ("error" None when it lowered), and with `devices` also "device_kind",
  "device_count", "compile_s" and `_compiled_numbers`' fields.
  """
  from tfx import bench_suite

  result: dict[str, Any] = {"platform": platform, "attention": [], "kernel_calls": {}, "lower_s": None,
                            "module_bytes": None, "error": None}
  if devices:
    result.update(device_kind=devices[0].device_kind, device_count=len(devices), compile_s=None)
  start = time.perf_counter()
  chosen: list[tuple[str, str]] = []
  lowered = None
  with target.lowering_for(platform):
    try:
      exp, jitted, args = bench_suite._abstract_step(config, devices)
      with parallel.context(exp.mesh), ops.recorded_choices() as chosen:  # the step's choices, not init's
        lowered = jitted.trace(*args).lower(lowering_platforms=(target.LOWERING_PLATFORMS[platform],))
      text = lowered.as_text()
      result["lower_s"] = time.perf_counter() - start
      result["kernel_calls"], result["module_bytes"] = kernel_calls(text), len(text)
      if devices:
        start = time.perf_counter()
        compiled = lowered.compile()
        result["compile_s"] = time.perf_counter() - start
        result.update(_compiled_numbers(compiled))
    except UserError:
      raise  # a bad config is the user's to fix, not a finding about the platform
    except Exception as e:  # noqa: BLE001  (the report's purpose: what fails there, fails here too)
      result["error"] = _first_line(e)
  result["attention"] = [f"{kernel} ({why})" for kernel, why in dict.fromkeys(chosen)]
  return result


def lower_suite(root: str, platform: str, *, tiny: bool, batch_per_device: int, only: tuple[str, ...] = (),
                overrides: tuple[str, ...] = (), devices: list | None = None, depth: bool = False
                ) -> list[dict[str, Any]]:
  """`lower_step` of every suite model (tfx/bench_suite.py) with `overrides` after its own, on
  `devices` (a TPU topology's: then compiled too) or this machine's. With `depth` and devices,
  also GPT-2-small compiled at 12 and at 48 scanned layers (2 and 8 with `tiny`): entries named
  gpt2_small@12, gpt2_small@48."""
  import jax

  from tfx import bench_suite

  count = len(devices) if devices else jax.device_count()
  runs = [(entry, entry.name, ()) for entry in bench_suite.SUITE if not only or entry.name in only]
  if depth and devices and (not only or "gpt2_small" in only):
    runs += [(bench_suite.SUITE[0], f"gpt2_small@{n}", (f"model.num_layers={n}",)) for n in ((2, 8) if tiny else (12, 48))]
  results = []
  for entry, name, extra in runs:
    config = bench_suite.entry_config(entry, root, tiny=tiny, batch_size=batch_per_device * count,
                                      extra=(*overrides, *extra))
    results.append({"name": name, "overrides": list(overrides), "batch_size": config.train.batch_size,
                    "seq_len": config.data.seq_len, **lower_step(config, platform, devices)})
  return results


def format_lowered(results: list[dict[str, Any]]) -> str:
  """One line per lowering: model, settings, ok / the error, the kernel calls, the kernels chosen."""
  lines = []
  for r in results:
    settings = " ".join(r.get("overrides", ())) or "defaults"
    shape = f"{r['batch_size']} x {r['seq_len']}, " if r.get("batch_size") else ""
    head = f"{r.get('name', 'config')} [{shape}{settings}] for {r['platform']}"
    if r["error"]:
      lines.append(f"{head}: FAILED {r['error']}")
      continue
    calls = ", ".join(f"{k} x{n}" for k, n in r["kernel_calls"].items()) or "no attention kernel called (XLA's attention)"
    done = f"lowered in {r['lower_s']:.1f} s"
    if r.get("compile_s") is not None:
      gib = lambda key: f"{r[key] / 2**30:.2f}"  # noqa: E731
      done = (f"compiled for {r['device_count']} x {r['device_kind']} in {r['compile_s']:.1f} s, "
              f"{gib('device_bytes')} GiB per device (temporaries {gib('temp_bytes')})")
    lines.append(f"{head}: {done}; {calls}; attention: {'; '.join(r['attention'])}")
  return "\n".join(lines)
