"""Throughput, MFU, compile time and memory of a config's training step.

    python -m tfx.bench --config configs/base.py [--config.k=v ...] [--steps 10 --warmup 2 --json out.json]
    python -m tfx.bench --config configs/base.py --sweep model.remat=none,full,dots_saveable
    python -m tfx.bench --config configs/bert_base.py --finetune 2 [--config.finetune.batch_size=32 ...]
    python -m tfx.bench --suite accel [--tiny] [--batch ROWS_PER_DEVICE] [--only gpt2_small,...]
        [--config.k=v ...] [--sweep model.attention=cudnn,pallas,xla]
    python -m tfx.bench (--suite accel | --config FILE) --lower gpu|tpu   # lowered only (tfx/bench_lower.py)
    python -m tfx.bench (--suite accel | --config FILE) --lower tpu --topology v5e:2x2   # + compiled, no TPU
    python -m tfx.bench (--suite accel | --config FILE) --lower gpu --topology h100      # + compiled, no GPU

The model, objective, optimizer, sharded state and jitted train step are built exactly as
`tfx.train` builds them; only the data is synthetic (random token rows of the objective's raw
length, one document per row, or `--documents N` packed ones), so no corpus or tokenizer is needed
and nothing is read.
`--finetune K`: the fine-tuning step of `tfx.finetune` instead (the config's architecture, a
K-class `Classifier` pooled as `finetune.pooling` says, its cross-entropy, the `finetune.*` batch,
length and optimizer), on rows of real tokens filling `finetune.max_length` (default data.seq_len).

Numbers:
  compile_s      tracing + lowering + XLA compilation of the train step
  temp_memory_bytes  XLA's compiled temporary buffers of the step (memory_analysis; any backend)
  step_s         median wall time of the timed steps (each blocked on its results)
  page_faults_per_step  median minor page faults of the process a timed step (`timed`): on a CPU
                 about one per 4 KiB of the step's temporaries, which XLA maps afresh every step
  tokens_per_s   batch_size * raw row length / step_s
  flops_per_token, model_tflops_per_s: model FLOPs (tfx.flops, PaLM appendix B) and their rate
  mfu            model FLOP/s / (peak FLOP/s per device * devices); None where the peak is
                 unknown (CPU)
  attention      the attention kernel(s) the compiled step runs and why (recorded while tracing)
"""

import argparse
import collections
import contextlib
import json
import resource
import statistics
import sys
import time
from typing import Any, Iterator

import jax
import ml_collections
import numpy as np

from tfx import config as config_lib, flops, ops, parallel
from tfx.errors import UserError
from tfx.models import build_model
from tfx.objectives import SpecialIds
from tfx.registry import OBJECTIVES, load_builtins

# jax.monitoring events whose durations add up to the compile time of a jitted call.
COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
NUM_SENTINELS = 100
# The arrays of a synthetic batch, each [batch, row length] int32 (`synthetic_batch`).
BATCH_KEYS = ("tokens", "segment_ids", "positions")


def synthetic_ids(vocab_size: int) -> SpecialIds:
  """Special ids without a tokenizer: pad 0, eos 1, unk 2, bos 3, mask 4, cls 5, sep 6, and
  100 sentinels at the top of the vocabulary (<extra_id_0> = vocab_size - 1, descending)."""
  sentinels = tuple(range(vocab_size - 1, vocab_size - 1 - NUM_SENTINELS, -1))
  return SpecialIds(vocab_size=vocab_size, pad=0, eos=1, unk=2, bos=3, mask=4, cls=5, sep=6,
                    sentinels=sentinels, special=tuple(range(7)) + sentinels)


def synthetic_batch(batch_size: int, length: int, vocab_size: int, seed: int = 0, documents: int = 1
                    ) -> dict[str, np.ndarray]:
  """Random ordinary tokens, `documents` packed documents of (nearly) equal length per row:
  tokens, segment_ids (1, 2, ... along a row), positions (counting from 0 in each document).

  Returns:
    dict of [batch_size, length] int32 arrays.
  """
  rng = np.random.default_rng(seed)
  low, high = (7, vocab_size - NUM_SENTINELS) if vocab_size > 7 + NUM_SENTINELS else (0, vocab_size)
  column = np.arange(length)
  document = column * min(documents, length) // length  # [t]: 0, 0, ..., 1, 1, ...
  first = np.searchsorted(document, document)  # [t]: the column each position's document starts at
  row = lambda x: np.broadcast_to(x.astype(np.int32), (batch_size, length)).copy()
  return {
      "tokens": rng.integers(low, high, (batch_size, length), dtype=np.int32),
      "segment_ids": row(document + 1),
      "positions": row(column - first),
  }


def classification_batch(batch_size: int, length: int, vocab_size: int, num_classes: int, seed: int = 0
                         ) -> dict[str, np.ndarray]:
  """`synthetic_batch` as a fine-tune's rows: one example a row, its token types (all the first
  text's, [b, t]) and a random label ([b, 1] int32)."""
  host = synthetic_batch(batch_size, length, vocab_size, seed=seed)
  host["token_types"] = np.zeros_like(host["tokens"])
  host["labels"] = np.random.default_rng(seed).integers(0, num_classes, (batch_size, 1), dtype=np.int32)
  return host


@contextlib.contextmanager
def compile_timer() -> Iterator[dict[str, float]]:
  """Adds up the JAX compile events (trace, lower, XLA compile) seen inside the block."""
  from jax import monitoring

  totals = {"seconds": 0.0}

  def listen(event: str, duration: float, **kwargs) -> None:
    if event in COMPILE_EVENTS:
      totals["seconds"] += duration

  monitoring.register_event_duration_secs_listener(listen)
  try:
    yield totals
  finally:
    monitoring.unregister_event_duration_listener(listen)


def no_compilation_cache() -> contextlib.AbstractContextManager:
  """Compiles inside the block are real compiles: JAX's persistent cache (JAX_COMPILATION_CACHE_DIR,
  which tfx.launch sets) would otherwise load a program compiled before and time the load."""
  return parallel.compilation_cache(enabled=False)


def peak_memory_bytes() -> int | None:
  """Largest peak bytes in use over the local devices, if the backend reports it (not on CPU)."""
  peaks = []
  for d in jax.local_devices():
    try:
      stats = d.memory_stats()
    except Exception:  # noqa: BLE001  (backends without memory stats)
      stats = None
    if stats and "peak_bytes_in_use" in stats:
      peaks.append(int(stats["peak_bytes_in_use"]))
  return max(peaks) if peaks else None


def build_experiment(config: ml_collections.ConfigDict, devices=None):
  """The training `Experiment` of `config` with synthetic data (no tokenizer, no pipeline), its
  mesh over `devices` (default: all of them; a deviceless topology's for an ahead-of-time compile)."""
  from tfx.train import Experiment, make_optimizer

  load_builtins()
  num_devices = jax.device_count() if devices is None else len(devices)
  config_lib.validate(config, num_devices=num_devices, process_count=jax.process_count())
  ids = synthetic_ids(config.data.vocab_size)
  objective = OBJECTIVES.get(config.objective.name).from_config(config.objective, ids)
  if objective.needs_word_start():  # synthetic text: every other id starts a word
    objective = objective.with_word_start(tuple(i % 2 == 0 for i in range(ids.vocab_size)))
  model = build_model(config.model, vocab_size=ids.vocab_size, max_length=config.data.seq_len)
  tx, schedule = make_optimizer(config)
  mesh = parallel.make_mesh(config.mesh, devices)
  return Experiment(config=config, workdir="", tokenizer=None, objective=objective, model=model, pipeline=None,
                    mesh=mesh, tx=tx, schedule=schedule)


def build_finetune_experiment(config: ml_collections.ConfigDict, num_classes: int):
  """tfx.finetune's `Experiment` for `config`'s architecture: a `num_classes` classifier, its loss and
  the optimizer of the config's finetune.* settings (the config itself is left as it was)."""
  from tfx import finetune
  from tfx.models import build_classifier
  from tfx.train import Experiment, make_optimizer

  load_builtins()
  if num_classes < 2:
    raise UserError(f"--finetune takes the number of classes, at least 2 (got {num_classes})")
  config = ml_collections.ConfigDict(config.to_dict())
  finetune.apply_run_settings(config)
  backbone = build_model(config.model, vocab_size=config.data.vocab_size, max_length=config.data.seq_len)
  model = build_classifier(backbone, num_classes, pooling=config.finetune.pooling, dropout=config.finetune.dropout)
  tx, schedule = make_optimizer(config)
  return Experiment(config=config, workdir="", tokenizer=None,
                    objective=finetune.ClassificationLoss(num_classes, model.last_layer_queries()), model=model,
                    pipeline=None, mesh=parallel.make_mesh(config.mesh), tx=tx, schedule=schedule)


def benchmark(config: ml_collections.ConfigDict, steps: int = 10, warmup: int = 2, extra=None,
              profile: str | None = None, finetune: int = 0, documents: int = 1) -> dict[str, Any]:
  """Builds the train step of `config` as training does and times it on synthetic data.

  Args:
    config: a loaded config (validated here).
    steps: timed steps (after warmup); at least 1.
    warmup: untimed steps after the compiling first call.
    extra: optional `extra(exp, state, batch, frozen) -> dict`, called after the timed steps; its
      entries are added to the result (the accelerator suite times the objective's part with it).
    profile: optional folder: after the timed steps, three more run under `jax.profiler.trace`,
      which writes its trace there (plugins/profile/<time>/<host>.xplane.pb; TensorBoard's
      profiler or `jax.profiler.ProfileData` reads it).
    finetune: the number of classes of a fine-tuning step to time instead (0: the training step).
    documents: packed documents per synthetic row (`synthetic_batch`; not for a fine-tuning step).
  Returns:
    a dict of plain numbers and strings (see the module docstring); `mfu` is None on devices
    of unknown peak (CPU), `peak_memory_bytes` None where the backend does not report it.
  """
  from tfx.train import init_state, make_train_step, state_shardings

  if steps < 1 or warmup < 0:
    raise UserError(f"need --steps >= 1 and --warmup >= 0 (got {steps}, {warmup})")
  exp = build_finetune_experiment(config, finetune) if finetune else build_experiment(config)
  config = exp.config
  if finetune:
    from tfx.finetune import example_length  # noqa: PLC0415  (the task pipeline: only when asked for)

    seq_len = example_length(config)
  else:
    seq_len = config.data.seq_len
  batch_size = config.train.batch_size
  model_cfg = exp.model.backbone.cfg if finetune else exp.model.cfg
  row_length = exp.objective.raw_length(seq_len)
  objective = None if finetune else exp.objective  # a classifier's loss has no parameters or state
  abstract, shardings = state_shardings(exp.model, exp.tx, exp.mesh, seq_len, objective, batch_size)
  state = init_state(exp.model, exp.tx, exp.mesh, seq_len, config.train.seed, shardings, objective, batch_size)
  train_step = make_train_step(exp, shardings)
  local_rows = batch_size // jax.process_count()
  seed = config.train.seed + jax.process_index()
  host = (classification_batch(local_rows, row_length, model_cfg.vocab_size, finetune, seed=seed) if finetune
          else synthetic_batch(local_rows, row_length, model_cfg.vocab_size, seed=seed, documents=documents))
  batch = parallel.global_batch(host, exp.mesh)

  with compile_timer() as compiled, ops.recorded_choices() as chosen, parallel.context(exp.mesh), \
      no_compilation_cache():
    start = time.perf_counter()
    frozen = train_step.frozen  # the objective's frozen inputs (a teacher), None for most
    executable = train_step.jitted.lower(state, batch, frozen).compile()
    compile_wall_s = time.perf_counter() - start
    state, metrics = jax.block_until_ready(executable(state, batch, frozen))
    first_call_s = time.perf_counter() - start
  train_step = lambda s, b: executable(s, b, frozen)
  memory = executable.memory_analysis()
  for _ in range(warmup):
    state, metrics = jax.block_until_ready(train_step(state, batch))
  times, faults = [], []
  for _ in range(steps):
    seconds, touched, (state, metrics) = timed(train_step, state, batch)
    times.append(seconds)
    faults.append(touched)

  if profile:
    with jax.profiler.trace(profile):
      for _ in range(3):
        state, metrics = jax.block_until_ready(train_step(state, batch))
    from etils import epath

    from tfx import bench_profile

    hlo_text = executable.as_text()  # the optimized program, kept beside the trace for a later reading
    if jax.process_index() == 0:
      (epath.Path(profile) / bench_profile.HLO_FILE).write_text(hlo_text)
    summary = bench_profile.summarize(bench_profile.find_trace(profile), hlo_text=hlo_text,
                                      devices=jax.local_device_count())
    if jax.process_index() == 0:
      print(bench_profile.format_summary(summary), file=sys.stderr, flush=True)
  more = extra(exp, state, batch, frozen) if extra is not None else {}
  step_s = statistics.median(times)
  per_row = exp.objective.train_flops_per_row(model_cfg, seq_len)
  per_token = per_row / seq_len  # per model position
  achieved = per_row * batch_size / step_s  # model FLOP/s, all devices
  peak = flops.device_peak_flops()
  device = jax.devices()[0]
  return {
      "config_family": config.model.family,
      "objective": (f"finetune ({finetune} classes, pooling {exp.model.pooling})" if finetune
                    else config.objective.name),
      "parameters": int(sum(np.prod(x.shape) for x in jax.tree.leaves(abstract.params))),
      "batch_size": batch_size,
      "seq_len": seq_len,
      "row_length": row_length,
      "documents": 1 if finetune else documents,  # packed documents per synthetic row
      "device_kind": getattr(device, "device_kind", device.platform),
      "platform": device.platform,
      "device_count": jax.device_count(),
      "mesh": {k: int(v) for k, v in exp.mesh.shape.items()},
      "compile_s": compiled["seconds"] if compiled["seconds"] > 0 else compile_wall_s,
      "first_call_s": first_call_s,
      "step_s": step_s,
      "step_s_all": times,
      "page_faults_per_step": statistics.median(faults),
      "tokens_per_s": batch_size * row_length / step_s,
      "flops_per_token": per_token,
      "model_tflops_per_s": achieved / 1e12,
      "peak_tflops_per_device": peak / 1e12 if peak else None,
      "mfu": achieved / (peak * jax.device_count()) if peak else None,
      "peak_memory_bytes": peak_memory_bytes(),
      "temp_memory_bytes": int(memory.temp_size_in_bytes) if memory is not None else None,
      "loss": float(jax.device_get(metrics["loss"])),
      "attention": attention_summary(chosen),
      **({"profile": summary} if profile else {}),
      **more,
  }


def timed(step, *args) -> tuple[float, int, Any]:
  """(wall seconds, the process's minor page faults, outputs) of one call of `step` run to
  completion. A minor fault is the first touch of a fresh page: on a CPU, XLA allocates each
  execution's temporaries anew, glibc maps an allocation that large with its own mmap, and the
  kernel zero-fills each 4 KiB page as the step first writes it (a fifth of a step at the peer
  benchmark's medium sizes; docs/performance/1-peer-cpu.md, stop 70)."""
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  start = time.perf_counter()
  out = jax.block_until_ready(step(*args))
  seconds = time.perf_counter() - start
  return seconds, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, out


def attention_summary(chosen: list[tuple[str, str]]) -> str:
  """The attention kernels of a compiled step, from `ops.recorded_choices`: 'kernel (why)' when
  every attention call site took the same one, else each with its count of call sites (a scanned
  stack is one site), e.g. 'pallas x1 (GPU, segment ids) + xla x2 (Pallas flash attention
  refused: ...)'; 'none' for a step without attention."""
  counts = collections.Counter(chosen)  # insertion-ordered: the first call site's kernel first
  if len(counts) <= 1:
    return next((f"{impl} ({why})" for impl, why in counts), "none")
  return " + ".join(f"{impl} x{n} ({why})" for (impl, why), n in counts.items())


def format_table(r: dict[str, Any]) -> str:
  """A small two-column table of the benchmark results."""
  mfu = (f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None
         else f"n/a (no known peak FLOP/s for {r['device_kind']})")
  mem = f"{r['peak_memory_bytes'] / 2**30:.2f} GiB" if r["peak_memory_bytes"] is not None else "n/a (not reported)"
  rows = [
      ("model", f"{r['config_family']} + {r['objective']}, {r['parameters']:,} parameters"),
      ("devices", f"{r['device_count']} x {r['device_kind']}, mesh {r['mesh']}"),
      ("batch", f"{r['batch_size']} rows x {r['row_length']} tokens (seq_len {r['seq_len']})"),
      ("attention", r["attention"]),
      ("compile", f"{r['compile_s']:.2f} s (first call {r['first_call_s']:.2f} s)"),
      ("step", f"{1e3 * r['step_s']:.1f} ms (median of {len(r['step_s_all'])})"),
      ("page faults", page_faults_row(r)),
      ("tokens/s", f"{r['tokens_per_s']:,.0f}"),
      ("FLOPs/token", f"{r['flops_per_token']:.4g}"),
      ("achieved", f"{r['model_tflops_per_s']:.4f} TFLOP/s (model FLOPs)"),
      ("MFU", mfu),
      ("peak memory", mem),
      ("temp memory", f"{r['temp_memory_bytes'] / 2**20:.1f} MiB (XLA memory analysis)"
       if r.get("temp_memory_bytes") is not None else "n/a"),
  ]
  width = max(len(k) for k, _ in rows)
  return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


HUGE_PAGES_HINT = "GLIBC_TUNABLES=glibc.malloc.hugetlb=1"


def page_faults_row(r: dict[str, Any]) -> str:
  """The table's page-fault row; on a CPU whose step faults in most of its temporaries 4 KiB at a
  time, how to start the process with huge pages instead (README: Set-up)."""
  text = f"{r['page_faults_per_step']:,.0f} a step (first touches of fresh host memory)"
  temp = r.get("temp_memory_bytes") or 0
  if r["platform"] == "cpu" and temp and r["page_faults_per_step"] * 4096 >= temp / 2:
    text += f"; start with {HUGE_PAGES_HINT} to take them 2 MiB at a time"
  return text


def mib(size: int | None, digits: int) -> str:
  """Bytes as MiB, or n/a where the backend reports no memory analysis."""
  return "n/a" if size is None else f"{size / 2**20:.{digits}f}"


def swept_configs(config_path: str, overrides: list[str], key: str, values: list[str], *,
                  num_devices: int | None = None) -> list[ml_collections.ConfigDict]:
  """The config once per value of one field (e.g. model.remat), the rest unchanged; every value is validated
  for `num_devices` (default: this machine's) before any of them is compiled."""
  configs = [config_lib.load_config(config_path, [*overrides, f"--config.{key}={value}"]) for value in values]
  for config in configs:
    config_lib.validate(config, num_devices=num_devices or jax.device_count(), process_count=jax.process_count())
  return configs


def sweep(config_path: str, overrides: list[str], key: str, values: list[str], *, steps: int, warmup: int,
          finetune: int = 0, documents: int = 1) -> list[dict[str, Any]]:
  """`benchmark` once per value of one config field (e.g. model.remat), the rest unchanged."""
  configs = swept_configs(config_path, overrides, key, values)
  return [dict(benchmark(config, steps=steps, warmup=warmup, finetune=finetune, documents=documents),
               sweep_key=key, sweep_value=value) for config, value in zip(configs, values)]


def format_sweep(results: list[dict[str, Any]]) -> str:
  """One row per swept value: compile, step time, tokens/s, memory."""
  key = results[0]["sweep_key"]
  rows = [(key, "compile s", "step ms", "tokens/s", "temp MiB", "peak MiB")]
  for r in results:
    peak = r["peak_memory_bytes"]
    rows.append((str(r["sweep_value"]), f"{r['compile_s']:.2f}", f"{1e3 * r['step_s']:.1f}",
                 f"{r['tokens_per_s']:,.0f}", mib(r["temp_memory_bytes"], 1),
                 f"{peak / 2**20:.1f}" if peak is not None else "n/a"))
  widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
  return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                   for row in rows)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m tfx.bench", description=__doc__.split("\n")[0])
  parser.add_argument("--config", default=None, help="config file, e.g. configs/base.py")
  parser.add_argument("--suite", choices=["accel"], default=None,
                      help="accel: GPT-2-small, BERT-base, T5-base and XLNet-base in bf16 on whatever device is "
                           "here (tfx/bench_suite.py)")
  parser.add_argument("--tiny", action="store_true", help="with --suite: toy sizes (runs on a CPU in minutes)")
  parser.add_argument("--batch", type=int, default=None,
                      help="with --suite: rows per device (default: the largest that fits, doubling from 4; "
                           "with --lower: 16)")
  parser.add_argument("--only", default="", help="with --suite: comma-separated model names (gpt2_small, ...)")
  parser.add_argument("--skip-depth", action="store_true",
                      help="with --suite: leave out GPT-2's compile time at 12 and 48 layers")
  parser.add_argument("--finetune", type=int, default=0, metavar="CLASSES",
                      help="time tfx.finetune's step (a classifier with this many classes; finetune.* settings) "
                           "instead of the training step")
  parser.add_argument("--documents", type=int, default=1,
                      help="packed documents of equal length in each synthetic row (default 1; training steps only)")
  parser.add_argument("--steps", type=int, default=10, help="timed steps")
  parser.add_argument("--warmup", type=int, default=2, help="untimed steps after the compiling call")
  parser.add_argument("--json", default=None, help="also write the results as JSON to this path (local or gs://)")
  parser.add_argument("--profile", default=None, metavar="DIR",
                      help="trace three more steps with jax.profiler into DIR (with --suite: DIR/<model>)")
  parser.add_argument("--sweep", default=None, metavar="KEY=V1,V2,...",
                      help="benchmark once per value of one config field, e.g. model.remat=none,full,dots_saveable")
  parser.add_argument("--lower", choices=["gpu", "tpu"], default=None,
                      help="trace and lower the train step(s) for this platform instead of running them: checks the "
                           "accelerator path (kernels, cuDNN's argument checks) on a machine without one "
                           "(tfx/bench_lower.py)")
  parser.add_argument("--topology", default=None, metavar="SLICE",
                      help="with --lower: also compile for these devices without them and report compile time and "
                           "memory per device: a TPU slice (v5e:2x2, v5e:16x16; make tpu-libs) or GPUs (h100, h200:8; "
                           "make gpu-libs)")
  args, overrides = parser.parse_known_args(argv)
  if args.topology:
    from tfx.bench_lower import topology_platform

    if args.lower != topology_platform(args.topology):
      parser.error(f"--topology {args.topology} is a {topology_platform(args.topology).upper()}: use it with "
                   f"--lower {topology_platform(args.topology)}")
  if args.finetune and (args.suite or args.lower):
    parser.error("--finetune times one config's fine-tuning step: not with --suite or --lower")
  if args.documents < 1:
    parser.error(f"--documents must be at least 1 (got {args.documents})")
  if args.documents > 1 and (args.finetune or args.lower):
    parser.error("--documents packs the synthetic rows a training step runs on: not with --finetune or --lower "
                 "(a lowered step is the same program for any rows)")
  parallel.initialize_distributed()
  if args.suite:
    suite_main(args, overrides)
    return
  if not args.config:
    parser.error("--config is required (or --suite accel)")
  try:
    config = config_lib.load_config(args.config, overrides)
    from tfx import gcs

    gcs.preflight(args.json)
    if args.sweep:
      key, _, values = args.sweep.partition("=")
      if not values:
        raise UserError(f"--sweep needs KEY=V1,V2,... (e.g. model.remat=none,full), got {args.sweep!r}")
    if args.lower:
      from tfx import bench_lower

      devices = bench_lower.topology_devices(args.topology) if args.topology else None
      count = len(devices) if devices else jax.device_count()
      if args.sweep:
        key = key.removeprefix("config.")
        settings = [f"{key}={v}" for v in values.split(",")]
        configs = swept_configs(args.config, overrides, key, values.split(","), num_devices=count)
      else:
        settings, configs = [None], [config]
        config_lib.validate(config, num_devices=count, process_count=jax.process_count())
      lowered = [dict(bench_lower.lower_step(c, args.lower, devices), overrides=[s] if s else [])
                 for c, s in zip(configs, settings)]
      report(bench_lower.format_lowered(lowered), lowered, args.json)
      sys.exit(1 if any(r["error"] for r in lowered) else 0)
    if args.sweep:
      result = sweep(args.config, overrides, key.removeprefix("config."), values.split(","), steps=args.steps,
                     warmup=args.warmup, finetune=args.finetune, documents=args.documents)
    else:
      result = benchmark(config, steps=args.steps, warmup=args.warmup, profile=args.profile, finetune=args.finetune,
                         documents=args.documents)
  except UserError as e:
    sys.exit(f"tfx.bench: {e}")
  report(format_sweep(result) if args.sweep else format_table(result), result, args.json)


def report(table: str, result, json_path: str | None) -> None:
  """Prints the table and writes the results as JSON to `json_path` (local or gs://), on process 0."""
  if jax.process_index() == 0:
    print(table)
    if json_path:
      from etils import epath

      epath.Path(json_path).write_text(json.dumps(result, indent=2, default=str))


def suite_main(args, overrides: list[str]) -> None:
  """`--suite accel`: the four reference models (tfx/bench_suite.py), a table and optional JSON."""
  import os

  from tfx import bench_suite, gcs

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  try:
    bad = [o for o in overrides if not (o.startswith("--config.") and "=" in o)]
    if bad:
      raise UserError(f"--suite takes config overrides as --config.KEY=VALUE (applied to every model), got "
                      f"{' '.join(bad)}")
    fields = tuple(o.removeprefix("--config.") for o in overrides)
    if not os.path.isdir(os.path.join(root, "configs")):
      raise UserError(f"the suite reads the repository's configs/, not found next to {root}/tfx")
    names = tuple(n for n in args.only.split(",") if n)
    unknown = sorted(set(names) - {e.name for e in bench_suite.SUITE})
    if unknown:
      raise UserError(f"--only: unknown model(s) {', '.join(unknown)}; choose from "
                      f"{', '.join(e.name for e in bench_suite.SUITE)}")
    if args.batch is not None and args.batch < 1:
      raise UserError(f"--batch must be at least 1 (got {args.batch})")
    settings = [fields]  # one run of the suite per setting: the overrides, plus one swept value
    if args.sweep:
      key, _, values = args.sweep.partition("=")
      if not values:
        raise UserError(f"--sweep needs KEY=V1,V2,... (e.g. model.attention=cudnn,pallas,xla), got {args.sweep!r}")
      key = key.removeprefix("config.")
      settings = [(*fields, f"{key}={value}") for value in values.split(",")]
    devices = None
    if args.topology:
      from tfx import bench_lower

      devices = bench_lower.topology_devices(args.topology)
    for setting in settings:  # every setting is checked before the first compile
      bench_suite.check_overrides(root, tiny=args.tiny, overrides=setting, only=names,
                                  num_devices=len(devices) if devices else None)
    gcs.preflight(args.json)
    if args.lower:
      from tfx import bench_lower

      lowered = [r for setting in settings
                 for r in bench_lower.lower_suite(root, args.lower, tiny=args.tiny, batch_per_device=args.batch or 16,
                                                  only=names, overrides=setting, devices=devices,
                                                  depth=not args.skip_depth)]
      report(bench_lower.format_lowered(lowered), lowered, args.json)
      sys.exit(1 if any(r["error"] for r in lowered) else 0)
    runs = [bench_suite.run_suite(root, tiny=args.tiny, steps=args.steps, warmup=args.warmup,
                                  batch_per_device=args.batch, only=names, overrides=setting,
                                  depth=not args.skip_depth, profile=args.profile, documents=args.documents)
            for setting in settings]
    out = runs[0] if not args.sweep else {"sweep": args.sweep, "runs": runs}
  except UserError as e:
    sys.exit(f"tfx.bench: {e}")
  report("\n\n".join(bench_suite.format_suite(run) for run in runs), out, args.json)


if __name__ == "__main__":
  main()
