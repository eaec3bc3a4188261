"""tfx against Hugging Face's Flax models, both compiled by XLA:GPU for a GPU this machine lacks.

    make bench-peer-gpu ARGS="[--topology h100] [--models gpt2,bert,t5] [--sizes base,medium] [--json out.json]"
    # = the peer venv and .gpu-libs (the CUDA plugin, CUDA's compiler pieces, cuDNN), then
    JAX_PLATFORMS=cpu PYTHONPATH=.gpu-libs benchmarks/.venv-peer/bin/python benchmarks/hf_flax/compile_peer.py ...

The same models and weights as `bench_peer.py` (tfx's initial weights exported with tfx's own
converter and loaded into the HF Flax class, whose losses `bench_peer.py` checks equal on the CPU),
in bf16 compute with fp32 weights on both sides, each train step (the same objective transform,
forward, backward, AdamW) compiled for the compile-only devices of `--topology`
(`tfx.bench_lower.topology_devices`). Reported per model and size, tfx / HF: XLA's temporary
memory of the compiled step and the compile time (median of 3, interleaved). Nothing runs: no
step time. XLA:GPU skips its autotuning without a device, so a compile on the GPU takes longer.
tfx runs its default attention for the GPU (cuDNN's fused kernel for bf16); HF's Flax classes run
their own einsum attention. Without autotuning XLA:GPU can fail to tile a Triton matmul of an odd
shape (HF's T5 at 16 x 114 targets: "Couldn't find output tile sizes"): XLA_FLAGS=
--xla_gpu_enable_triton_gemm=false sends every matmul of both sides to cuBLAS instead. A model
that fails is reported and the others still run.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import bench_peer
from bench_peer import SIZES, make_hf_step, shim_flax_t5, tfx_config
from tfx import bench, bench_lower, bench_suite, parallel
from tfx.bench_lower import error_line
from tfx.convert import to_hf
from tfx.ops import target
from tfx.steps import init_state, state_shardings

def abstract_on(tree, device):
  """The tree's arrays as ShapeDtypeStructs placed on one (compile-only) device."""
  sharding = jax.sharding.SingleDeviceSharding(device)
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def compile_seconds_and_temp(jitted, *args) -> tuple[float, int]:
  start = time.perf_counter()
  with target.lowering_for("gpu"), bench.no_compilation_cache():
    compiled = jitted.trace(*args).lower().compile()
  return time.perf_counter() - start, int(compiled.memory_analysis().temp_size_in_bytes)


def run_one(model: str, size: str, devices: list, log) -> dict:
  import transformers

  here = tfx_config(model, size)  # bf16 (main): the weights are made on this CPU, then exported to HF
  exp = bench.build_experiment(here)
  seq_len, batch_size = here.data.seq_len, here.train.batch_size
  _, shardings = state_shardings(exp.model, exp.tx, exp.mesh, seq_len, exp.objective, batch_size)
  state = init_state(exp.model, exp.tx, exp.mesh, seq_len, here.train.seed, shardings, exp.objective, batch_size)
  with tempfile.TemporaryDirectory() as tmp:
    arch = to_hf(here, jax.device_get(state.params), tmp)
    cls = getattr(transformers, "Flax" + arch)
    hf_model = cls.from_pretrained(tmp, from_pt=True, dtype=jnp.bfloat16)  # bf16 compute, fp32 weights
  hf_state = (hf_model.params, exp.tx.init(hf_model.params), state.rng, state.step)
  hf_state = abstract_on(hf_state, devices[0])
  rows = jax.ShapeDtypeStruct((batch_size, exp.objective.raw_length(seq_len)), np.int32,
                              sharding=jax.sharding.SingleDeviceSharding(devices[0]))
  hf_batch = {key: rows for key in bench.BATCH_KEYS}

  tfx_times, hf_times = [], []
  for _ in range(3):  # fresh jits, interleaved
    with target.lowering_for("gpu"):
      there, jitted, args = bench_suite._abstract_step(here, devices)
    with parallel.context(there.mesh):
      seconds, tfx_temp = compile_seconds_and_temp(jitted, *args)
    tfx_times.append(seconds)
    seconds, hf_temp = compile_seconds_and_temp(make_hf_step(model, hf_model, exp.objective, exp.tx), hf_state,
                                                hf_batch)
    hf_times.append(seconds)
  layers, d, heads, ff, seq, b, vocab = SIZES[size]
  result = {"model": model, "size": size, "hf_class": cls.__name__, "device_kind": devices[0].device_kind,
            "shape": f"{layers}L d{d} h{heads} ff{ff}, {b}x{seq}, vocab {vocab}, bf16",
            "compile_s_tfx": statistics.median(tfx_times), "compile_s_hf": statistics.median(hf_times),
            "temp_bytes_tfx": tfx_temp, "temp_bytes_hf": hf_temp}
  log(row(result))
  return result


def row(r: dict) -> str:
  return (f"| {r['model']} ({r['hf_class']}) | {r['shape']} | {r['temp_bytes_tfx'] / 2**20:,.0f} / "
          f"{r['temp_bytes_hf'] / 2**20:,.0f} | {r['temp_bytes_tfx'] / r['temp_bytes_hf']:.2f}x | "
          f"{r['compile_s_tfx']:.1f} / {r['compile_s_hf']:.1f} | {r['compile_s_tfx'] / r['compile_s_hf']:.2f}x |")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--topology", default="h100", help="h100 or h200 (tfx.bench_lower.GPU_PARTS)")
  parser.add_argument("--models", default="gpt2,bert,t5")
  parser.add_argument("--sizes", default="base", help=f"of {', '.join(SIZES)}")
  parser.add_argument("--json", default=None)
  parser.add_argument("--tfx-override", action="append", default=[],
                      help="a tfx config override for the tfx side, e.g. --tfx-override=--config.model.attention=xla")
  args = parser.parse_args(argv)
  if bench_lower.topology_platform(args.topology) != "gpu":
    parser.error(f"--topology {args.topology}: name a GPU ({', '.join(bench_lower.GPU_PARTS)})")
  bench_peer.EXTRA_OVERRIDES.extend(["--config.model.dtype=bfloat16", *args.tfx_override])  # bf16, fp32 weights
  shim_flax_t5()
  devices = bench_lower.topology_devices(args.topology)[:1]
  log = lambda s: print(s, file=sys.stderr, flush=True)
  log(f"jax {jax.__version__}, compiling for {devices[0].device_kind} on a machine without one")
  results, failed = [], []
  for model in args.models.split(","):
    for size in args.sizes.split(","):
      try:
        results.append(run_one(model, size, devices, log))
      except Exception as e:  # noqa: BLE001  (XLA:GPU refusing one side's program: say so, go on)
        failed.append(f"{model}/{size}: {error_line(e)}")
        log(f"FAILED {failed[-1]}")
  print("| model (HF class) | shape | temp MiB tfx / HF | ratio | compile s tfx / HF | ratio |\n"
        "|---|---|---:|---:|---:|---:|")
  print("\n".join(row(r) for r in results))
  print("\n".join(f"FAILED {line}" for line in failed))
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"results": results, "failed": failed}, f, indent=2)
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  main()
