"""tfx's train step against itself with one function swapped or one setting changed, in one process.

    python benchmarks/hf_flax/ab_step.py --models t5 --sizes medium --reps 15 \\
        --swap tfx.ops.attention._sum_to_bias=variants.py:old_sum
    python benchmarks/hf_flax/ab_step.py --models gpt2 --sizes medium --override=--config.model.loss_chunk=32
    python benchmarks/hf_flax/ab_step.py --models gpt2 --sizes medium \\
        --compiler-option xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_REDUCE
    python benchmarks/hf_flax/ab_step.py --models configs/electra_base.py --sizes medium \\
        --swap tfx.nn.attention._reference_with_dropout=variants.py:old

Between processes this 2-core machine drifts by 5-10%, more than most single changes move a
step; here both steps (A: the code and config as they are, B: with MODULE.ATTR replaced by the
function ATTR2 of FILE while the step is traced, and/or built from the config with the
`--override`s added, and/or compiled with the XLA `--compiler-option`s) are compiled from the same
initial parameters and batch, run interleaved, and the median of the per-step ratios B / A is
printed with its interquartile range, with each side's loss after the first step (the same
function should give the same loss). The models and sizes are the peer benchmark's (bench_peer.py's
tfx side, its own venv: `make bench-peer` builds it), or a config file at a size's shape (layers,
width, heads, rows, vocabulary) with the rest of it, dropout and objective, as it is. A compiler
option is passed as XLA's compile option proto takes it (true/false, an integer, or an enum's name;
a list of enum names with commas: the flags' '+'/'-' syntax is refused there).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_peer  # noqa: E402  (the peer benchmark's tfx side: models, sizes, batches)

from tfx import bench, parallel  # noqa: E402
from tfx.steps import make_train_step  # noqa: E402


def load_swap(spec: str):
  """'pkg.module.attr=FILE.py:function' -> (module, attr, the function)."""
  target, _, source = spec.partition("=")
  path, _, name = source.partition(":")
  module_name, _, attr = target.rpartition(".")
  if not (module_name and attr and path and name):
    raise SystemExit(f"--swap {spec!r}: expected MODULE.ATTR=FILE.py:FUNCTION")
  module = importlib.import_module(module_name)
  if not hasattr(module, attr):
    raise SystemExit(f"--swap: {module_name} has no {attr}")
  file_spec = importlib.util.spec_from_file_location("ab_variant", path)
  variant = importlib.util.module_from_spec(file_spec)
  file_spec.loader.exec_module(variant)
  return module, attr, getattr(variant, name)


def compiler_option(text: str) -> tuple[str, bool | int | str]:
  """'KEY=VALUE' -> (KEY, VALUE as XLA's option wants it: true/false a bool, digits an int, else the
  string, e.g. an enum's name)."""
  key, sep, value = text.partition("=")
  if not (key and sep and value):
    raise SystemExit(f"--compiler-option {text!r}: expected KEY=VALUE")
  if value.lower() in ("true", "false"):
    return key, value.lower() == "true"
  return key, int(value) if value.lstrip("-").isdigit() else value


def setups(model: str, size: str, overrides: list[str]) -> dict:
  """{side: bench_peer.tfx_setup(...)}: A the peer benchmark's config, B the same with `overrides`
  (the same experiment when there are none)."""
  a = bench_peer.tfx_setup(model, size)
  if not overrides:
    return {"A": a, "B": a}
  bench_peer.EXTRA_OVERRIDES[:] = overrides
  try:
    b = bench_peer.tfx_setup(model, size)
  finally:
    bench_peer.EXTRA_OVERRIDES[:] = []
  return {"A": a, "B": b}


def run(model: str, size: str, reps: int, swap, overrides: list[str], options: dict | None = None) -> None:
  module, attr, replacement = swap or (None, None, None)
  sides = setups(model, size, overrides)
  original = None if module is None else getattr(module, attr)
  steps, states, times = {}, {}, {"A": [], "B": []}
  for side in ("A", "B"):
    exp, _, shardings, new_state, batch = sides[side]
    if module is not None:
      setattr(module, attr, original if side == "A" else replacement)
    try:
      with parallel.context(exp.mesh):
        state = new_state()
        start = time.perf_counter()
        lowered = make_train_step(exp, shardings).jitted.lower(state, batch, None)
        steps[side] = lowered.compile(compiler_options=options if side == "B" else None)
        seconds = time.perf_counter() - start
        states[side], metrics = steps[side](state, batch, None)
    finally:
      if module is not None:
        setattr(module, attr, original)
    print(f"{model}/{size} {side}: compiled in {seconds:.2f} s, loss {float(metrics['loss']):.6f}", flush=True)
  for _ in range(reps):
    for side in ("A", "B"):
      exp, *_, batch = sides[side]
      with parallel.context(exp.mesh):
        seconds, _, (states[side], _) = bench.timed(steps[side], states[side], batch, None)
        times[side].append(seconds)
  ratio = np.asarray(times["B"]) / np.asarray(times["A"])
  low, high = np.percentile(ratio, [25, 75])
  print(f"{model}/{size}: A {np.median(times['A']) * 1e3:.1f} ms, B {np.median(times['B']) * 1e3:.1f} ms, "
        f"B / A {np.median(ratio):.3f}x (IQR {low:.3f}-{high:.3f}, {reps} steps each)", flush=True)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--models", default="t5",
                      help="comma-separated: gpt2, bert, t5 (the peer benchmark's, no dropout), or a config "
                           "file (e.g. configs/electra_base.py: at the size's shape, its own dropout and objective)")
  parser.add_argument("--sizes", default="medium", help="comma-separated: " + ", ".join(bench_peer.SIZES))
  parser.add_argument("--reps", type=int, default=15, help="timed steps per side (interleaved)")
  parser.add_argument("--swap", help="MODULE.ATTR=FILE.py:FUNCTION: B's replacement of MODULE.ATTR")
  parser.add_argument("--override", action="append", default=[],
                      help="a config override for B only, e.g. --override=--config.model.loss_chunk=32 (repeatable)")
  parser.add_argument("--compiler-option", action="append", default=[], metavar="KEY=VALUE",
                      help="an XLA option for B's compile only, e.g. --compiler-option xla_cpu_prefer_vector_width=512 "
                           "(repeatable; per executable, so A is untouched)")
  args = parser.parse_args(argv)
  options = dict(compiler_option(option) for option in args.compiler_option) or None
  if not args.swap and not args.override and not options:
    raise SystemExit("nothing to compare: give --swap MODULE.ATTR=FILE.py:FUNCTION, --override=--config.KEY=VALUE "
                     "and/or --compiler-option KEY=VALUE")
  swap = load_swap(args.swap) if args.swap else None
  for model in args.models.split(","):
    if model.endswith(".py"):
      if not os.path.isfile(os.path.join(bench_peer.ROOT, model)):
        raise SystemExit(f"--models {model!r}: no such config file (a path from the repository's root)")
    elif model not in bench_peer.MODELS or model == "bert_cls":
      raise SystemExit(f"unknown model {model!r}: one of gpt2, bert, t5, or a config file's path")
    for size in args.sizes.split(","):
      bench_peer.size_spec(size)  # refuses an unknown size
      run(model, size, args.reps, swap, args.override, options)


if __name__ == "__main__":
  main()
