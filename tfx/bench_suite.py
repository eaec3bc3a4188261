"""The accelerator suite of `python -m tfx.bench --suite accel [--tiny]`.

Four reference models, each trained by its own objective at the size the papers used, in bf16
(fp32 master weights, fp32 softmax and loss), with a batch that fills the device:

  gpt2_small   GPT-2 124M (12 x 768, vocabulary 50304 = 50257 padded to a multiple of 64),
               causal LM on rows of 1024
  bert_base    BERT-base, masked LM (15%) on rows of 512
  t5_base      T5 v1.1 base, span corruption: 512 input tokens -> 114 targets
  xlnet_base   XLNet-base, permutation LM on rows of 512 (memory 384, 85 predictions)

Dropout is off (as in the usual throughput comparisons; the fused attention kernels have none),
and the layer loop is unrolled (`UNROLLED`).
For each it reports what `tfx.bench` reports (compile time, step time, tokens/s, MFU from
`tfx.flops` and the device's peak, peak and temporary device memory) and the share of the step
spent in the objective's own work: the part of the loss that depends on the batch and the key
but not on the parameters (masking, corruption, permutation sampling, the attention masks built
from them), cut out of the loss's jaxpr and timed alone (`transform_ms`). Then GPT-2's compile
time with 12 and with 48 scanned layers.

`--tiny` runs the same code at toy sizes (2 layers of 64, rows of 64) so that the suite runs on a
CPU in a couple of minutes; its numbers mean nothing about speed.
"""

import dataclasses
import statistics
import sys
import time
from typing import Any, Callable

import jax
import jax.extend.core as jcore
import numpy as np

from tfx import config as config_lib, parallel

GPT2_SMALL = ("model.family=decoder", "model.num_layers=12", "model.d_model=768", "model.num_heads=12",
              "model.d_ff=3072", "model.position=learned", "model.norm=pre", "model.norm_type=layernorm",
              "model.mlp=gelu", "model.use_bias=true", "model.tie_embeddings=true", "objective.name=causal_lm",
              "data.seq_len=1024", "data.vocab_size=50304")
NO_DROPOUT = ("model.dropout=0.0", "model.attention_dropout=0.0")
# The layer loop unrolled (parameters still stacked): a scanned loop copies each layer's saved
# activations into the loop's stacked buffers and back, which a GPU pays in memory bandwidth.
# Compiled for an H100 (`--lower gpu --topology h100`, 32 rows; `tfx.bench_traffic`), the kernels'
# bytes a step fall from 145 to 110 GB (GPT-2), 69 to 50 (BERT), 132 to 111 (T5), 594 to 394
# (XLNet), for 1.4-8 GiB more memory; unrolled, remat saves nothing more than `none` (XLA merges
# the recomputation into the forward pass). The compile-time-by-depth runs keep the scan: `SCANNED`.
UNROLLED = ("model.scan_unroll=0",)
SCANNED = ("model.scan_unroll=1",)
TINY = ("model.num_layers=2", "model.d_model=64", "model.num_heads=2", "model.d_ff=128", "data.seq_len=64",
        "data.vocab_size=1024")


@dataclasses.dataclass(frozen=True)
class Entry:
  name: str
  config: str
  overrides: tuple[str, ...]
  tiny: tuple[str, ...] = ()  # extra overrides at --tiny, after TINY


SUITE = (
    Entry("gpt2_small", "configs/base.py", GPT2_SMALL),
    Entry("bert_base", "configs/bert_base.py", ("data.seq_len=512",)),
    Entry("t5_base", "configs/t5_base.py", ("data.seq_len=512", "model.num_decoder_layers=12"),
          tiny=("model.num_decoder_layers=2",)),
    Entry("xlnet_base", "configs/xlnet_base.py", ("data.seq_len=512",),
          tiny=("model.mem_len=16", "model.reuse_len=32", "objective.reuse_len=32", "objective.perm_size=32",
                "objective.num_predict=10")),
)


def entry_config(entry: Entry, root: str, *, tiny: bool, batch_size: int, extra: tuple[str, ...] = ()):
  """The loaded config of one suite entry (bf16, no dropout, layers unrolled, the given batch)."""
  overrides = [*entry.overrides, *NO_DROPOUT, *UNROLLED, "model.dtype=bfloat16", f"train.batch_size={batch_size}",
               "mesh.data=-1"]
  if tiny:
    overrides += [*TINY, *entry.tiny]
  return config_lib.load_config(f"{root}/{entry.config}", [f"--config.{o}" for o in (*overrides, *extra)])


# ---------------------------------------------------------------------------- objective's share


def data_only_part(fn: Callable, model_args, data_args) -> tuple[Callable, int]:
  """The part of `fn(model_args, data_args)` that depends on `data_args` only, as a function.

  Traces fn to a jaxpr and keeps the equations none of whose inputs depend on `model_args`
  (parameters, carried state); their values that the rest of the computation reads are the
  outputs of the returned `part(data_args) -> list of arrays`. Also returns how many equations
  were kept. Nested computations (a scanned layer stack, a jitted call) count as one equation:
  if any input of one depends on the parameters, all of it belongs to the model.
  """
  closed = jax.make_jaxpr(fn)(model_args, data_args)
  jaxpr = closed.jaxpr
  n_model = len(jax.tree.leaves(model_args))
  model_vars = set(jaxpr.invars[:n_model])
  kept, boundary = [], []
  for eqn in jaxpr.eqns:
    if any(isinstance(v, jcore.Var) and v in model_vars for v in eqn.invars):
      model_vars.update(eqn.outvars)
      boundary.extend(v for v in eqn.invars if isinstance(v, jcore.Var) and v not in model_vars)
    else:
      kept.append(eqn)
  boundary.extend(v for v in jaxpr.outvars if isinstance(v, jcore.Var) and v not in model_vars)
  data_invars = set(jaxpr.invars[n_model:]) | set(jaxpr.constvars)
  outvars = list(dict.fromkeys(v for v in boundary if v not in data_invars))  # computed, not passed through
  part = jcore.Jaxpr(jaxpr.constvars, jaxpr.invars[n_model:], outvars, kept)
  run = jcore.jaxpr_as_fun(jcore.ClosedJaxpr(part, closed.consts))
  return (lambda data_args: run(*jax.tree.leaves(data_args))), len(kept)


def time_objective_part(exp, state, batch, frozen, *, steps: int) -> dict[str, Any]:
  """Median time of the loss's data-only part (see `data_only_part`) on `batch`, jitted alone."""
  from tfx.steps import objective_kwargs

  def loss(model_args, data_args):
    params, objective_state, frozen_inputs = model_args
    b, rng = data_args
    extra = objective_kwargs(exp.objective, objective_state, frozen_inputs)
    return exp.objective.loss(exp.model, params, b, rng, train=True, **extra)[0]

  rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
  with parallel.context(exp.mesh):
    part, n_eqns = data_only_part(loss, (state.params, state.objective_state, frozen), (batch, rng))
    jitted = jax.jit(part)
    jax.block_until_ready(jitted((batch, rng)))
    times = []
    for _ in range(steps):
      start = time.perf_counter()
      jax.block_until_ready(jitted((batch, rng)))
      times.append(time.perf_counter() - start)
  return {"transform_ms": 1e3 * statistics.median(times), "transform_equations": n_eqns}


# ---------------------------------------------------------------------------- the suite


def _abstract_step(config, devices=None):
  """(jitted train step, its abstract arguments) of `config` on a mesh over `devices` (default:
  all of them): nothing is allocated or run."""
  from tfx import bench
  from tfx.train import make_train_step, state_shardings

  exp = bench.build_experiment(config, devices)
  if getattr(exp.objective, "frozen_inputs", False) and exp.frozen is None:  # a teacher: its shapes only
    exp.frozen = exp.objective.abstract_frozen(exp.model, exp.mesh)
  seq_len, batch_size = config.data.seq_len, config.train.batch_size
  abstract, shardings = state_shardings(exp.model, exp.tx, exp.mesh, seq_len, exp.objective, batch_size)
  rows = jax.ShapeDtypeStruct((batch_size, exp.objective.raw_length(seq_len)), np.int32,
                              sharding=parallel.batch_sharding(exp.mesh))
  step = make_train_step(exp, shardings)
  return exp, step.jitted, (abstract, {key: rows for key in bench.BATCH_KEYS}, step.frozen)


def compile_seconds(config) -> float:
  """Lower + compile of the train step of `config` (abstract state; nothing runs)."""
  from tfx import bench

  exp, jitted, args = _abstract_step(config)
  with parallel.context(exp.mesh), bench.no_compilation_cache():
    start = time.perf_counter()
    jitted.lower(*args).compile()
    return time.perf_counter() - start


def fill_device(entry: Entry, root: str, start: int, *, fraction: float = 0.85, max_doublings: int = 6,
                extra: tuple[str, ...] = ()) -> int:
  """The largest per-device batch (`start` doubled) whose compiled step fits `fraction` of the
  device's memory by XLA's memory analysis (arguments + outputs + temporaries, the donated state
  counted once); `start` where the backend reports no memory limit (CPU)."""
  limit = (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")
  if not limit:
    return start
  best, batch = None, start
  for _ in range(max_doublings + 1):
    exp, jitted, args = _abstract_step(entry_config(entry, root, tiny=False, batch_size=batch * jax.device_count(),
                                                    extra=extra))
    with parallel.context(exp.mesh):
      try:
        memory = jitted.lower(*args).compile().memory_analysis()
      except Exception:  # noqa: BLE001  (XLA refuses a program that cannot fit)
        break
    used = (memory.argument_size_in_bytes + memory.temp_size_in_bytes + memory.output_size_in_bytes
            - memory.alias_size_in_bytes)
    if used > fraction * limit:
      break
    best, batch = batch, batch * 2
  return best or start


def check_overrides(root: str, *, tiny: bool, overrides: tuple[str, ...], only: tuple[str, ...] = (),
                    num_devices: int | None = None) -> None:
  """Loads and validates every entry's config with `overrides` (model.attention=pallas, ...) for
  `num_devices` (default: this machine's), so that a bad key or value stops the suite before the
  first compile."""
  count = num_devices or jax.device_count()
  for entry in SUITE:
    if not only or entry.name in only:
      config = entry_config(entry, root, tiny=tiny, batch_size=2 * count, extra=overrides)
      config_lib.validate(config, num_devices=count, process_count=jax.process_count())


def run_suite(root: str, *, tiny: bool, steps: int, warmup: int, batch_per_device: int | None = None,
              only: tuple[str, ...] = (), overrides: tuple[str, ...] = (), depth: bool = True,
              profile: str | None = None, documents: int = 1) -> dict[str, Any]:
  """Runs the suite with `overrides` (config fields without the --config. prefix) applied to every
  entry, after its own; returns {"overrides": [...], "models": [result per entry],
  "compile_layers": {...}} (GPT-2's compile time by depth, unless `depth` is False). Each model's
  result is also printed to stderr as soon as it is measured. `profile`: a folder for each model's
  trace of three steps (`profile`/<model>, see `bench.benchmark`); `documents`: packed documents
  per synthetic row."""
  from tfx import bench

  results = []
  for entry in SUITE:
    if only and entry.name not in only:
      continue
    per_device = batch_per_device or (2 if tiny else fill_device(entry, root, start=4, extra=overrides))
    config = entry_config(entry, root, tiny=tiny, batch_size=per_device * jax.device_count(), extra=overrides)
    result = bench.benchmark(config, steps=steps, warmup=warmup,
                             extra=lambda exp, state, batch, frozen: time_objective_part(
                                 exp, state, batch, frozen, steps=steps),
                             profile=f"{profile}/{entry.name}" if profile else None, documents=documents)
    result["name"] = entry.name
    result["transform_share"] = result["transform_ms"] / (1e3 * result["step_s"])
    results.append(result)
    if jax.process_index() == 0:
      print(format_suite({"overrides": list(overrides), "models": [result], "compile_layers": {}}).splitlines()[-1],
            file=sys.stderr, flush=True)
  layers = {}
  if depth and (not only or "gpt2_small" in only):
    gpt2 = SUITE[0]
    per_device = batch_per_device or (2 if tiny else 4)
    for n in ((2, 8) if tiny else (12, 48)):
      config = entry_config(gpt2, root, tiny=tiny, batch_size=per_device * jax.device_count(),
                            extra=(*overrides, f"model.num_layers={n}", *SCANNED))
      layers[n] = compile_seconds(config)
  return {"overrides": list(overrides), "models": results, "compile_layers": layers}


def format_suite(out: dict[str, Any]) -> str:
  """The suite's table, then GPT-2's compile time by depth."""
  from tfx import bench

  rows = [("model", "batch x row", "step ms", "tokens/s", "MFU", "peak mem GiB", "temp MiB", "compile s",
           "objective ms", "objective share", "attention")]
  for r in out["models"]:
    peak = r["peak_memory_bytes"]
    rows.append((r["name"], f"{r['batch_size']} x {r['row_length']}", f"{1e3 * r['step_s']:.1f}",
                 f"{r['tokens_per_s']:,.0f}", f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a",
                 f"{peak / 2**30:.2f}" if peak is not None else "n/a", bench.mib(r["temp_memory_bytes"], 0),
                 f"{r['compile_s']:.1f}", f"{r['transform_ms']:.2f}", f"{100 * r['transform_share']:.1f}%",
                 r["attention"]))
  widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
  last = len(widths) - 1  # the attention column, left-aligned and not padded
  lines = ["  ".join(c.ljust(w) if i == 0 else c if i == last else c.rjust(w)
                     for i, (c, w) in enumerate(zip(row, widths))) for row in rows]
  if out["models"]:
    first = out["models"][0]
    settings = ", ".join(out.get("overrides", ())) or "the configs' defaults"
    lines.insert(0, f"{first['device_count']} x {first['device_kind']}, bf16, jax {jax.__version__}; {settings}")
  layers = out["compile_layers"]
  if layers:
    (a, ta), (b, tb) = sorted(layers.items())
    lines.append(f"gpt2_small compile: {a} layers {ta:.1f} s, {b} layers {tb:.1f} s ({tb / ta:.2f}x, scanned layers)")
  return "\n".join(lines)
