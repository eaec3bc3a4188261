"""tfx against Hugging Face's Flax models, side by side in one process on one device.

    make bench-peer                                  # creates benchmarks/.venv-peer and runs this (CPU)
    benchmarks/.venv-peer/bin/python benchmarks/hf_flax/bench_peer.py [--models gpt2,bert,t5,bert_cls]
        [--sizes small,medium,deep,base] [--layers 2,4,8] [--dtype float32|bfloat16] [--reps 10]
        [--compiles 3] [--json out.json] [--profile DIR]

It runs on the first device JAX finds: `make bench-peer` pins it to the CPU (float32, the README's
table); on a GPU, `--dtype bfloat16 --sizes base` (bf16 compute, float32 weights and optimizer on
both sides; `benchmarks/gpu/session.sh`'s `peer` step).

For each model and size it builds the model in tfx from a config, exports tfx's initial weights
with tfx's own converter (`tfx.convert.to_hf`: config.json + model.safetensors) and loads them into
the HF Flax class (`from_pretrained(..., from_pt=True)` reads the safetensors without torch), so
both sides compute the same function: the first step's losses must agree (it stops otherwise;
in bfloat16 to 0.5%: the two sides round differently, in float32 to 1e-4).

Both sides run a full training step, jitted with the state donated: the objective's input
transform (tfx's own, on both sides, with the same key: causal-LM shift, BERT masking at 15%, T5
span corruption), forward, backward and the same optax AdamW chain (`tfx.steps.make_optimizer`).
The tfx step is `tfx.steps.make_train_step`, exactly what `tfx.train` runs (its metrics: loss,
accuracy, grad norm, learning rate); the HF step computes the loss only.

`bert_cls` is fine-tuning instead: a two-class sequence classifier on BERT ([CLS] pooled through a
tanh dense layer, then the classifier), tfx's `tfx.finetune` step (`Classifier`, its cross-entropy;
`tfx.bench.build_finetune_experiment`) against `FlaxBertForSequenceClassification` with the same
weights (the backbone through `to_hf`, the pooler and classifier copied), on rows of real tokens
with a random label each.

Reported per model and size (ratio = tfx / HF; < 1 means tfx is faster or smaller):
  step      median wall time of `--reps` steps, tfx and HF interleaved step by step; the ratio is
            the median of the per-step ratios, with a 95% bootstrap interval of it
  temp      XLA's compiled temporary memory (memory_analysis().temp_size_in_bytes)
  compile   lower + compile of a fresh jit (median of `--compiles`, interleaved)
  faults    minor page faults a step (median, `tfx.bench.timed`; the JSON's page_faults_*): first
            touches of fresh memory. On a CPU each step's temporaries are mapped anew, so a side
            pays about one fault per 4 KiB of its temporary memory, a fifth of GPT-2 medium's step
            on both sides here (2026-12-07; docs/performance/1-peer-cpu.md, stop 70)
  GFLOP     XLA's cost analysis of the compiled step. It counts a while loop's body once, so for
            a step with a loop (scanned layers) tfx's is taken from the same step with
            model.scan_layers=False.

`--profile DIR` traces three more steps a side after the timed ones (DIR/<model>_<size>/tfx and
.../hf, each with its optimized HLO) and prints both sides' kernel time by kind
(`tfx.bench_profile`). On a CPU with two or more cores those times overlap and Eigen's matmuls show
their hand-off only; `XLA_FLAGS=--xla_cpu_multi_thread_eigen=false taskset -c 0` gives every
kernel's own time (2026-11-29, T5 medium: tfx 2466 against HF 2573 ms of kernels a step, matmuls
1838 / 1979).

The machine these numbers come from may be shared: timings are interleaved and medians, and a
run repeated later can move by 10-20 %.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax

from tfx import bench, config as config_lib, parallel
from tfx.convert import to_hf
from tfx.objectives.causal_lm import causal_lm_inputs, shift_right_by_segment
from tfx.steps import init_state, make_train_step, state_shardings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# model -> (tfx config file, overrides that make it the HF architecture)
MODELS = {
    "gpt2": ("configs/base.py", ["--config.model.norm_eps=1e-5"]),
    "bert": ("configs/bert_base.py", []),
    "t5": ("configs/t5_base.py", []),
    "bert_cls": ("configs/bert_base.py", []),  # fine-tuning: a two-class sequence classifier
}
CLASSES = 2  # bert_cls's labels
# size -> (layers, d_model, heads, d_ff, seq_len, batch, vocab). `deep` is `medium` at GPT-2-small's
# depth: what a scanned stack (tfx) and unrolled layers (HF) do to compile time and memory as
# layers are added. `base` is GPT-2-small / BERT-base / T5-base's width at rows of 512: a GPU's size.
SIZES = {
    "small": (2, 128, 4, 512, 128, 8, 8192),
    "medium": (4, 256, 4, 1024, 256, 8, 8192),
    "deep": (12, 256, 4, 1024, 256, 8, 8192),
    "base": (12, 768, 12, 3072, 512, 16, 32768),
}
# dtype -> the loss agreement the first step must reach (relative): bf16 compute rounds each
# side's matmuls and norms in its own order.
LOSS_RTOL = {"float32": 1e-4, "bfloat16": 5e-3}


def shim_flax_t5() -> None:
  """HF's Flax T5 calls jnp.clip(x, a_max=...), which jax 0.10 removed: give that module a jnp
  whose clip accepts the old keywords (the benchmark only; tfx is not touched)."""
  from transformers.models.t5 import modeling_flax_t5 as t5

  def clip(x, a_min=None, a_max=None, **kw):
    return jnp.clip(x, kw.pop("min", a_min), kw.pop("max", a_max), **kw)

  shim = types.SimpleNamespace(**{k: getattr(jnp, k) for k in dir(jnp) if not k.startswith("__")})
  shim.clip = clip
  t5.jnp = shim


EXTRA_OVERRIDES: list[str] = []  # --tfx-override: extra tfx config overrides (e.g. to compare settings)


def size_spec(size: str, layers: int | None = None) -> tuple[int, ...]:
  """SIZES[size], with its number of layers replaced by `layers` when given (`--layers`)."""
  if size not in SIZES:
    raise SystemExit(f"unknown size {size!r}: one of {', '.join(SIZES)}")
  spec = SIZES[size]
  if layers is None:
    return spec
  if layers < 1:
    raise SystemExit(f"--layers needs counts >= 1 (got {layers})")
  return (layers, *spec[1:])


def tfx_config(model: str, size: str, *, scan: bool = True, layers: int | None = None):
  """The tfx config of a peer `model` at `size` (the HF architecture, no dropout), or, where `model`
  is a config file's path (ab_step.py's `--models configs/electra_base.py`), that config at the
  size's shape with its own dropout."""
  own = model.endswith(".py")
  path, extra = (model, []) if own else MODELS[model]
  layers, d, heads, ff, seq, batch, vocab = size_spec(size, layers)
  no_dropout = [] if own else ["--config.model.dropout=0.0", "--config.model.attention_dropout=0.0"]
  overrides = extra + no_dropout + [
      f"--config.model.num_layers={layers}", f"--config.model.d_model={d}", f"--config.model.num_heads={heads}",
      f"--config.model.d_ff={ff}", f"--config.data.seq_len={seq}", f"--config.train.batch_size={batch}",
      f"--config.data.vocab_size={vocab}", f"--config.model.scan_layers={scan}", "--config.mesh.data=1",
  ]
  overrides += [o for o in EXTRA_OVERRIDES if scan or "scan_layers" not in o]
  if model == "t5":
    overrides.append(f"--config.model.num_decoder_layers={layers}")
  return config_lib.load_config(os.path.join(ROOT, path), overrides)


def tfx_experiment(model: str, size: str, *, scan: bool = True, layers: int | None = None):
  """(the tfx Experiment, the objective its state is built with): the training step's, or for
  bert_cls tfx.finetune's (finetune.* at the size's batch and rows, no dropout; no objective state)."""
  config = tfx_config(model, size, scan=scan, layers=layers)
  if model != "bert_cls":
    exp = bench.build_experiment(config)
    return exp, exp.objective
  config.finetune.batch_size, config.finetune.max_length = config.train.batch_size, config.data.seq_len
  config.finetune.dropout = 0.0
  return bench.build_finetune_experiment(config, CLASSES), None


def tfx_setup(model: str, size: str, *, layers: int | None = None):
  """(experiment, objective, state shardings, a function giving a fresh initial state, the batch on
  the experiment's mesh) for tfx's side of `model` at `size` (also ab_step.py's two steps)."""
  exp, objective = tfx_experiment(model, size, layers=layers)
  config = exp.config
  seq_len, batch_size = config.data.seq_len, config.train.batch_size
  _, shardings = state_shardings(exp.model, exp.tx, exp.mesh, seq_len, objective, batch_size)
  length = exp.objective.raw_length(seq_len)
  host = (bench.classification_batch(batch_size, length, config.data.vocab_size, CLASSES) if model == "bert_cls"
          else bench.synthetic_batch(batch_size, length, config.data.vocab_size))

  def new_state():
    return init_state(exp.model, exp.tx, exp.mesh, seq_len, config.train.seed, shardings, objective, batch_size)

  return exp, objective, shardings, new_state, parallel.global_batch(host, exp.mesh)


def export_classifier(exp, params, path: str, dtype: str):
  """HF's FlaxBertForSequenceClassification holding tfx's classifier weights: the backbone through
  `to_hf` (completed with a pretraining model's MLM head, which HF's class then drops), the pooler
  and classifier copied."""
  import flax.linen as nn
  import transformers

  from tfx.models import build_model

  config = exp.config
  seq = config.data.seq_len
  backbone = build_model(config.model, vocab_size=config.data.vocab_size, max_length=seq)
  full = nn.unbox(backbone.init(jax.random.key(0), **type(backbone).init_inputs(1, seq))["params"])
  full = {**jax.device_get(full), **params["backbone"]}  # the classifier's backbone is a subset, by top-level key
  to_hf(config, full, path)
  hf_model = transformers.FlaxBertForSequenceClassification.from_pretrained(
      path, from_pt=True, num_labels=CLASSES, dtype=jnp.dtype(dtype))
  hf = jax.tree.map(np.asarray, hf_model.params)
  head = params["head"]
  hf["bert"]["pooler"]["dense"] = {k: np.asarray(head["pooler"][k]) for k in ("kernel", "bias")}
  hf["classifier"] = {k: np.asarray(head["classifier"][k]) for k in ("kernel", "bias")}
  hf_model.params = hf
  return hf_model


def check_logits(exp, params, hf_model, hf_params, batch, dtype: str) -> None:
  """Stops unless both classifiers give the same logits on `batch` (relative to their spread)."""
  with parallel.context(exp.mesh):
    ours = exp.model.apply({"params": params}, batch["tokens"], batch["segment_ids"], batch["positions"],
                           batch["token_types"])
  kwargs, _, _ = hf_inputs("bert_cls", None, batch, None)
  theirs = hf_model.module.apply({"params": hf_params}, **kwargs, deterministic=True).logits
  ours, theirs = np.asarray(ours, np.float32), np.asarray(theirs, np.float32)
  scale = float(np.abs(ours).max())
  if scale == 0 or np.abs(ours - theirs).max() > 10 * LOSS_RTOL[dtype] * scale:
    raise SystemExit(f"bert_cls: tfx and HF logits differ (max |difference| {np.abs(ours - theirs).max():.3g}, "
                     f"max |logit| {scale:.3g}): not the same function")


def hf_inputs(model: str, objective, batch, rng):
  """The HF model's inputs and the loss targets/weights, from tfx's own objective transform with
  the key the tfx step uses (so both see the same masked / corrupted rows)."""
  if model == "bert_cls":  # one example a row: its label, weight 1
    kwargs = dict(input_ids=batch["tokens"], attention_mask=(batch["segment_ids"] > 0).astype(jnp.int32),
                  token_type_ids=batch["token_types"], position_ids=batch["positions"], head_mask=None)
    return kwargs, batch["labels"][:, 0], jnp.ones(batch["labels"].shape[:1], jnp.float32)
  if model == "gpt2":
    x = causal_lm_inputs(batch, objective.bos_id)
    kwargs = dict(input_ids=x["inputs"], attention_mask=(batch["segment_ids"] > 0).astype(jnp.int32),
                  position_ids=batch["positions"])
    return kwargs, x["targets"], x["weights"]
  if model == "bert":
    mask_rng, _ = jax.random.split(rng)
    inputs, targets, weights = objective.mask(batch, mask_rng)
    kwargs = dict(input_ids=inputs, attention_mask=(batch["segment_ids"] > 0).astype(jnp.int32),
                  token_type_ids=jnp.zeros_like(inputs), position_ids=batch["positions"], head_mask=None)
    return kwargs, targets, weights
  corrupt_rng, _ = jax.random.split(rng)
  x = objective.corrupt(batch, corrupt_rng)
  decoder_inputs = shift_right_by_segment(x["targets"], x["target_segment_ids"], objective.ids.pad)
  kwargs = dict(input_ids=x["inputs"], attention_mask=(x["input_segment_ids"] > 0).astype(jnp.int32),
                decoder_input_ids=decoder_inputs,
                decoder_attention_mask=(x["target_segment_ids"] > 0).astype(jnp.int32))
  return kwargs, x["targets"], x["target_segment_ids"].astype(jnp.float32)


def make_hf_step(model: str, hf_model, objective, tx):
  """A fresh jitted HF train step (state, batch) -> (state, loss), state donated."""

  def loss_fn(params, batch, rng):
    kwargs, targets, weights = hf_inputs(model, objective, batch, rng)
    logits = hf_model.module.apply({"params": params}, **kwargs, deterministic=True).logits
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    return jnp.sum(ce * weights) / jnp.maximum(jnp.sum(weights), 1.0)

  def step(state, batch):
    params, opt_state, rng_data, count = state
    rng = jax.random.fold_in(jax.random.wrap_key_data(rng_data), count)
    loss, grads = jax.value_and_grad(loss_fn)(params, batch, rng)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state, rng_data, count + 1), loss

  return jax.jit(step, donate_argnums=(0,))


def compile_stats(jitted, *args):
  start = time.perf_counter()
  compiled = jitted.lower(*args).compile()
  seconds = time.perf_counter() - start
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return compiled, seconds, float(cost.get("flops", 0.0)), int(compiled.memory_analysis().temp_size_in_bytes)


def has_loop(compiled) -> bool:
  """Whether the compiled program has a while loop, whose body XLA's cost analysis counts once."""
  return any(" while(" in line for line in compiled.as_text().splitlines())


def run_one(model: str, size: str, reps: int, log, *, dtype: str = "float32", compiles: int = 3,
            layers: int | None = None, profile: str | None = None) -> dict:
  import transformers

  exp, objective, shardings, new_state, batch = tfx_setup(model, size, layers=layers)
  config = exp.config
  seq_len, batch_size = config.data.seq_len, config.train.batch_size
  state = new_state()

  with tempfile.TemporaryDirectory() as tmp:
    if model == "bert_cls":
      hf_model = export_classifier(exp, jax.device_get(state.params), tmp, dtype)
    else:
      arch = to_hf(config, jax.device_get(state.params), tmp)
      hf_model = getattr(transformers, "Flax" + arch).from_pretrained(tmp, from_pt=True, dtype=jnp.dtype(dtype))
    cls = type(hf_model)  # compute dtype; fp32 weights
  hf_params = jax.tree.map(jnp.asarray, hf_model.params)
  copy = lambda x: jnp.array(x, copy=True)  # both states are donated: share no buffer
  hf_state = (hf_params, exp.tx.init(hf_params), copy(state.rng), copy(state.step))

  # Compile times: fresh jits, interleaved; keep the last compiled ones.
  tfx_compile, hf_compile = [], []
  for _ in range(compiles):
    with parallel.context(exp.mesh):
      tfx_step = make_train_step(exp, shardings).jitted  # (state, batch, frozen inputs: None here)
      tfx_c, s, tfx_flops, tfx_temp = compile_stats(tfx_step, state, batch, None)
    tfx_compile.append(s)
    hf_step = make_hf_step(model, hf_model, exp.objective, exp.tx)
    hf_c, s, hf_flops, hf_temp = compile_stats(hf_step, hf_state, batch)
    hf_compile.append(s)
  if has_loop(tfx_c):  # the layers' loop: count them from the same step unscanned
    unrolled, unrolled_objective = tfx_experiment(model, size, scan=False, layers=layers)
    abstract, unrolled_shardings = state_shardings(unrolled.model, unrolled.tx, unrolled.mesh, seq_len,
                                                   unrolled_objective, batch_size)
    with parallel.context(unrolled.mesh):
      _, _, tfx_flops, _ = compile_stats(make_train_step(unrolled, unrolled_shardings).jitted, abstract, batch, None)

  if model == "bert_cls":  # a two-class loss is near log 2 whatever the weights: compare the logits too
    check_logits(exp, state.params, hf_model, hf_state[0], batch, dtype)
  # Same function: the first step's losses (before any update).
  with parallel.context(exp.mesh):
    state, metrics = tfx_c(state, batch, None)
  hf_state, hf_loss = hf_c(hf_state, batch)
  tfx_loss, hf_loss = float(metrics["loss"]), float(hf_loss)
  if not np.isclose(tfx_loss, hf_loss, rtol=LOSS_RTOL[dtype], atol=1e-5):
    raise SystemExit(f"{model}/{size}: tfx loss {tfx_loss} != HF loss {hf_loss}: not the same function")
  log(f"  {model}/{size}: losses agree (tfx {tfx_loss:.6f}, HF {hf_loss:.6f}); timing {reps} interleaved steps")

  tfx_times, hf_times, tfx_faults, hf_faults = [], [], [], []
  for _ in range(reps):
    with parallel.context(exp.mesh):
      seconds, faults, (state, metrics) = bench.timed(tfx_c, state, batch, None)
    tfx_times.append(seconds)
    tfx_faults.append(faults)
    seconds, faults, (hf_state, _) = bench.timed(hf_c, hf_state, batch)
    hf_times.append(seconds)
    hf_faults.append(faults)
  faults = {"tfx": statistics.median(tfx_faults), "hf": statistics.median(hf_faults)}
  log(f"  {model}/{size}: first touches of fresh memory a step (minor page faults, median): "
      f"tfx {faults['tfx']:.0f}, HF {faults['hf']:.0f}")

  profiles = {}
  if profile:  # three more steps a side, each under its own trace
    folder = os.path.join(profile, f"{model}_{size}" + ("" if layers is None else f"_{layers}l"))
    with parallel.context(exp.mesh):
      profiles["tfx"], (state, _) = profile_steps(tfx_c, (state, batch, None), os.path.join(folder, "tfx"))
    profiles["hf"], (hf_state, _) = profile_steps(hf_c, (hf_state, batch), os.path.join(folder, "hf"))
    log(compare_profiles(f"{model}/{size}", profiles["tfx"], profiles["hf"]))

  layers, d, heads, ff, seq, b, vocab = size_spec(size, layers)
  ratio, low, high = paired_ratio(tfx_times, hf_times)
  return {
      "model": model, "size": size, "layers": layers, "hf_class": cls.__name__,
      "objective": "finetune" if model == "bert_cls" else config.objective.name,
      "shape": f"{layers}L d{d} h{heads} ff{ff}, {b}x{seq}, vocab {vocab}" + ("" if dtype == "float32" else f", {dtype}"),
      "device_kind": jax.devices()[0].device_kind, "dtype": dtype,
      "loss_tfx": tfx_loss, "loss_hf": hf_loss,
      "step_s_tfx": statistics.median(tfx_times), "step_s_hf": statistics.median(hf_times),
      "step_ratio": ratio, "step_ratio_ci95": [low, high], "step_s_all_tfx": tfx_times, "step_s_all_hf": hf_times,
      "compile_s_tfx": statistics.median(tfx_compile), "compile_s_hf": statistics.median(hf_compile),
      "temp_bytes_tfx": tfx_temp, "temp_bytes_hf": hf_temp,
      "page_faults_tfx": faults["tfx"], "page_faults_hf": faults["hf"],
      "gflop_tfx": tfx_flops / 1e9, "gflop_hf": hf_flops / 1e9,
      **({"profile": profiles} if profiles else {}),
  }


def profile_steps(compiled, args: tuple, folder: str, steps: int = 3):
  """Run `steps` steps of `compiled` (its state first in `args`, donated and handed on) under
  `jax.profiler.trace(folder)`, write its optimized HLO beside the trace, and return
  (`tfx.bench_profile.summarize` of the trace, the last step's outputs)."""
  from tfx import bench_profile

  state, rest = args[0], args[1:]
  with jax.profiler.trace(folder):
    for _ in range(steps):
      out = jax.block_until_ready(compiled(state, *rest))
      state = out[0]
  hlo_text = compiled.as_text()
  with open(os.path.join(folder, bench_profile.HLO_FILE), "w") as f:
    f.write(hlo_text)
  return bench_profile.summarize(bench_profile.find_trace(folder), steps=steps, hlo_text=hlo_text), out


def compare_profiles(name: str, tfx_summary: dict, hf_summary: dict) -> str:
  """Both sides' kernel time a step by kind (`tfx.bench_profile`'s), as lines of text. On a CPU
  with more than one intra-op thread the kernels overlap and Eigen's matmuls are undercounted:
  pin the process to one core with Eigen on one thread for per-kernel times (see --profile)."""
  from tfx import bench_profile

  lines = [f"{name}: kernel ms a step by kind, tfx / HF"
           + (f" ({tfx_summary['intra_op_threads']} intra-op threads: the times overlap)"
              if tfx_summary.get("intra_op_threads", 0) > 1 else "")]
  kinds = [k for k in bench_profile.KINDS if k in tfx_summary["kinds"] or k in hf_summary["kinds"]]
  for kind in kinds + ["all"]:
    ms = [s["busy_ms_per_step"] if kind == "all" else s["kinds"].get(kind, {}).get("ms_per_step", 0.0)
          for s in (tfx_summary, hf_summary)]
    lines.append(f"  {kind:12s} {ms[0]:9.1f} / {ms[1]:9.1f}" + (f"  {ms[0] / ms[1]:.2f}x" if ms[1] else ""))
  return "\n".join(lines)


def paired_ratio(tfx_times: list[float], hf_times: list[float], resamples: int = 2000) -> tuple[float, float, float]:
  """The median of the per-step ratios tfx / HF (step i of each side ran back to back, so a slow
  spell of the machine hits both) and a 95% bootstrap interval of that median (resampling the
  pairs; seeded, so the same times give the same interval)."""
  pairs = np.asarray(tfx_times) / np.asarray(hf_times)
  draws = np.random.default_rng(0).choice(pairs, size=(resamples, len(pairs)))
  low, high = np.percentile(np.median(draws, axis=1), [2.5, 97.5])
  return float(np.median(pairs)), float(low), float(high)


def table(results: list[dict]) -> str:
  lines = ["| model (HF class) | shape | step ms tfx / HF | ratio (95% CI) | temp MiB tfx / HF | ratio | compile s tfx / HF "
           "| ratio | GFLOP tfx / HF |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
  for r in results:
    ratio = lambda a, b: f"{a / b:.2f}x" if b else "n/a"
    lines.append(
        f"| {r['model']} ({r['hf_class']}) | {r['shape']} "
        f"| {1e3 * r['step_s_tfx']:.0f} / {1e3 * r['step_s_hf']:.0f} "
        f"| {r['step_ratio']:.2f}x ({r['step_ratio_ci95'][0]:.2f}-{r['step_ratio_ci95'][1]:.2f}) "
        f"| {r['temp_bytes_tfx'] / 2**20:.1f} / {r['temp_bytes_hf'] / 2**20:.1f} "
        f"| {ratio(r['temp_bytes_tfx'], r['temp_bytes_hf'])} "
        f"| {r['compile_s_tfx']:.2f} / {r['compile_s_hf']:.2f} | {ratio(r['compile_s_tfx'], r['compile_s_hf'])} "
        f"| {r['gflop_tfx']:.2f} / {r['gflop_hf']:.2f} |")
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--models", default="gpt2,bert,t5")
  parser.add_argument("--sizes", default="small,medium,deep")
  parser.add_argument("--reps", type=int, default=10, help="timed steps per side (interleaved)")
  parser.add_argument("--compiles", type=int, default=3, help="fresh compiles per side (interleaved; median)")
  parser.add_argument("--dtype", default="float32", choices=sorted(LOSS_RTOL),
                      help="compute dtype of both sides (weights and optimizer stay float32)")
  parser.add_argument("--layers", default=None,
                      help="comma-separated layer counts run at each size in place of its own (e.g. 2,4,8: how "
                           "compile time grows with depth); T5's encoder and decoder both")
  parser.add_argument("--json", default=None)
  parser.add_argument("--profile", default=None, metavar="DIR",
                      help="after the timed steps, trace three more a side into DIR/<model>_<size>/{tfx,hf} and "
                           "print both sides' kernel time by kind; for per-kernel times on a CPU run it as "
                           "XLA_FLAGS=--xla_cpu_multi_thread_eigen=false taskset -c 0 ...")
  parser.add_argument("--tfx-override", action="append", default=[],
                      help="a tfx config override for the tfx side, e.g. --tfx-override=--config.model.scan_layers=False")
  args = parser.parse_args(argv)
  try:
    depths = [None] if args.layers is None else [int(n) for n in args.layers.split(",")]
  except ValueError:
    raise SystemExit(f"--layers takes comma-separated layer counts, e.g. 2,4,8 (got {args.layers!r})") from None
  for model in args.models.split(","):  # unknown names and bad depths stop here, before any model is built
    if model not in MODELS:
      raise SystemExit(f"unknown model {model!r}: one of {', '.join(MODELS)}")
  for size in args.sizes.split(","):
    for layers in depths:
      size_spec(size, layers)
  if args.dtype != "float32":
    EXTRA_OVERRIDES.append(f"--config.model.dtype={args.dtype}")
  EXTRA_OVERRIDES.extend(args.tfx_override)
  shim_flax_t5()
  import transformers

  log = lambda s: print(s, file=sys.stderr, flush=True)
  log(f"jax {jax.__version__} on {jax.devices()[0].device_kind}, {os.cpu_count()} CPUs; "
      f"transformers {transformers.__version__} from {os.path.dirname(transformers.__file__)}")
  results = []
  for model in args.models.split(","):
    for size in args.sizes.split(","):
      for layers in depths:
        results.append(run_one(model, size, args.reps, log, dtype=args.dtype, compiles=args.compiles, layers=layers,
                               profile=args.profile))
        log(table(results[-1:]).splitlines()[-1])
        if args.json:  # after every row: a run stopped at a time limit keeps the finished ones
          with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
  print(table(results))


if __name__ == "__main__":
  main()
