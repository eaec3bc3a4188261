"""`python -m tfx.bench ... --lower gpu|tpu`: the train step lowered for an accelerator that is not here.

    python -m tfx.bench --suite accel --lower gpu [--sweep model.attention=cudnn,pallas,xla] [--tiny]
    python -m tfx.bench --suite accel --lower tpu --sweep model.attention=splash,xla
    python -m tfx.bench --config configs/base.py --config.model.dtype=bfloat16 --lower gpu
    PYTHONPATH=.tpu-libs JAX_PLATFORMS=cpu python -m tfx.bench --suite accel --lower tpu --topology v5e:2x2
    PYTHONPATH=.gpu-libs JAX_PLATFORMS=cpu python -m tfx.bench --suite accel --lower gpu --topology h100

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

The device's compiler can run here too (`--topology`, with `jax.experimental.topologies`'
compile-only devices): XLA:TPU for a slice (v5e:2x2, or v5e:16x16 for 256 chips; libtpu beside the
venv: `make tpu-libs`) and XLA:GPU for an H100 or H200 (h100, h200:8 for 8 of them; JAX's CUDA
plugin, CUDA's compiler pieces and cuDNN beside the venv: `make gpu-libs`; it skips autotuning,
which needs the device). The step is then compiled as well, which reports the compile time, the
memory per device by XLA's memory analysis, and a step that does not fit the device's memory as
the compiler's RESOURCE_EXHAUSTED error. That is MaxText's ahead-of-time compile check; it still
measures no step time.
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
_CUSTOM_CALL = re.compile(r'custom_call @"?([\w$.]+)')  # MLIR quotes a name only when it must


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


# GPUs to compile for without one, as XLA describes a GPU (its GpuTargetConfigProto, text format):
# the vendor's public figures. Both are one Hopper die (132 SMs, compute capability 9.0, 50 MiB of
# L2, 228 KiB of shared memory per SM); they differ in memory and its bandwidth. The cuDNN (9.8)
# and CUDA (12.9) versions are the least the plugin's wheels accept; `make gpu-libs` installs
# newer cuDNN libraries, which compile for it.
GPU_PARTS = {
    "h100": ("NVIDIA H100 80GB HBM3", 84_929_347_584, 3_352_320_000_000),
    "h200": ("NVIDIA H200", 150_754_820_096, 4_800_000_000_000),
}
_HOPPER = """gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth} l2_cache_size: 52428800 clock_rate_ghz: 1.98 device_memory_size: {memory}
  shared_memory_per_block_optin: 232448 cuda_compute_capability {{ major: 9 minor: 0 }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
runtime_version {{ major: 12 minor: 9 }}
device_description_str: "{description}"
"""
TPU_EXAMPLES = "v5e:2x2, v5e:16x16, v4:2x2x1, v5p:2x2x1, v6e:2x2"


def topology_platform(name: str) -> str:
  """'gpu' for a GPU part ('h100', 'h100:8' = 8 of them), 'tpu' for anything else (a slice)."""
  return "gpu" if name.partition(":")[0].lower() in GPU_PARTS else "tpu"


def topology_devices(name: str) -> list:
  """The compile-only devices of a TPU slice ('v5e:2x2', 'v5e:16x16', ...; made by libtpu) or of
  N GPUs of one host ('h100', 'h200:8'; made by JAX's CUDA plugin from `GPU_PARTS`), on a machine
  that has neither; a `UserError` that says how to get the library or name a topology when it
  cannot."""
  from jax.experimental import topologies

  platform = topology_platform(name)
  try:
    if platform == "tpu":
      return list(topologies.get_topology_desc(topology_name=name, platform="tpu").devices)
    part, _, count = name.lower().partition(":")
    if count and not (count.isdigit() and int(count) >= 1):
      raise UserError(f"--topology {name}: the GPU count after ':' must be a positive whole number (h100:8)")
    description, memory, bandwidth = GPU_PARTS[part]
    config = _HOPPER.format(description=description, memory=memory, bandwidth=bandwidth)
    return list(topologies.get_topology_desc(platform="cuda", target_config=config,
                                             topology=f"1x1x{int(count or 1)}").devices)
  except UserError:
    raise
  except Exception as e:  # noqa: BLE001  (no library, a bad name: both answered the same way)
    first = error_line(e)
    if platform == "tpu":
      how = (f"Compiling for a TPU slice without one needs libtpu: `make tpu-libs` installs it into .tpu-libs "
             f"(beside the venv, not in it); then run with PYTHONPATH=.tpu-libs JAX_PLATFORMS=cpu (and "
             f"ALLOW_MULTIPLE_LIBTPU_LOAD=1 to run two at once: `make tpu-compile` sets both), and name a slice "
             f"as GENERATION:SHAPE ({TPU_EXAMPLES}) or a GPU as {'|'.join(GPU_PARTS)}[:COUNT]")
    else:
      how = ("Compiling for a GPU without one needs JAX's CUDA plugin, CUDA and cuDNN: `make gpu-libs` installs them "
             "into .gpu-libs (beside the venv); then run with PYTHONPATH=.gpu-libs JAX_PLATFORMS=cpu")
    raise UserError(f"--topology {name}: {first}. {how}") from None


def error_line(e: Exception) -> str:
  """'Type: first line of the message' (at most 300 characters) of an exception, for a report."""
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


def _traffic(compiled) -> dict[str, int] | None:
  """Bytes the compiled step's kernels move, by kind (`tfx.bench_traffic`); None when XLA gives
  no optimized HLO text."""
  from tfx import bench_traffic

  try:
    return bench_traffic.summary(compiled.as_text())
  except Exception:  # noqa: BLE001  (a report of what XLA did; no text is not an error of the step)
    return None


def lower_step(config: ml_collections.ConfigDict, platform: str, devices: list | None = None) -> dict[str, Any]:
  """Lowers the train step of `config` for `platform` ('gpu' or 'tpu'), and with `devices` (a
  topology's compile-only devices, `topology_devices`) also compiles it for them (the persistent
  compilation cache off, so that the time is a compile's); never raises for a failure of the
  trace, the lowering or the compile (one that does not fit the device's memory included): the
  result's "error" says what failed.

  Returns {"platform", "attention": ["kernel (reason)", ...], "kernel_calls": {...}, "lower_s",
  "module_bytes", "error"} ("error" None when it lowered), and with `devices` also "device_kind",
  "device_count", "compile_s", `_compiled_numbers`' fields and "traffic" (`_traffic`).
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
        from tfx import bench

        with bench.no_compilation_cache():
          start = time.perf_counter()
          compiled = lowered.compile()
          result["compile_s"] = time.perf_counter() - start
        result.update(_compiled_numbers(compiled))
        result["traffic"] = _traffic(compiled)
    except UserError:
      raise  # a bad config is the user's to fix, not a finding about the platform
    except Exception as e:  # noqa: BLE001  (the report's purpose: what fails there, fails here too)
      result["error"] = error_line(e)
  result["attention"] = [f"{kernel} ({why})" for kernel, why in dict.fromkeys(chosen)]
  return result


def lower_suite(root: str, platform: str, *, tiny: bool, batch_per_device: int, only: tuple[str, ...] = (),
                overrides: tuple[str, ...] = (), devices: list | None = None, depth: bool = False
                ) -> list[dict[str, Any]]:
  """`lower_step` of every suite model (tfx/bench_suite.py) with `overrides` after its own, on
  `devices` (a topology's compile-only devices: then compiled too) or this machine's. With `depth` and devices,
  also GPT-2-small compiled at 12 and at 48 scanned layers (2 and 8 with `tiny`): entries named
  gpt2_small@12, gpt2_small@48."""
  import jax

  from tfx import bench_suite

  count = len(devices) if devices else jax.device_count()
  runs = [(entry, entry.name, ()) for entry in bench_suite.SUITE if not only or entry.name in only]
  if depth and devices and (not only or "gpt2_small" in only):
    depths = (2, 8) if tiny else (12, 48)
    runs += [(bench_suite.SUITE[0], f"gpt2_small@{n}", (f"model.num_layers={n}", *bench_suite.SCANNED))
             for n in depths]
  results, done = [], []  # done: (config as a dict, its result) of what was lowered already
  for entry, name, extra in runs:
    config = bench_suite.entry_config(entry, root, tiny=tiny, batch_size=batch_per_device * count,
                                      extra=(*overrides, *extra))
    # an entry whose config was lowered already (the same overrides twice) is reused, not compiled again
    as_dict = config.to_dict()
    same = next((r for c, r in done if c == as_dict), None)
    lowered = dict(same) if same else lower_step(config, platform, devices)
    done.append((as_dict, lowered))
    results.append({"name": name, "overrides": list(overrides), "batch_size": config.train.batch_size,
                    "seq_len": config.data.seq_len, **lowered})
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
    calls = (", ".join(f"{k} x{n}" for k, n in r["kernel_calls"].items())
             or "no attention kernel called (XLA's attention)")
    done = f"lowered in {r['lower_s']:.1f} s"
    if r.get("compile_s") is not None:
      gib = lambda key: f"{r[key] / 2**30:.2f}"  # noqa: E731
      done = (f"compiled for {r['device_count']} x {r['device_kind']} in {r['compile_s']:.1f} s, "
              f"{gib('device_bytes')} GiB per device (temporaries {gib('temp_bytes')})")
      if r.get("traffic"):
        from tfx import bench_traffic

        done += f", kernels move {bench_traffic.format_summary(r['traffic'])}"
    lines.append(f"{head}: {done}; {calls}; attention: {'; '.join(r['attention'])}")
  return "\n".join(lines)
