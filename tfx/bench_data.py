"""Data benchmark: prepare throughput, time to first batch, peak RSS and host time per batch.

    python -m tfx.bench_data --out runs/bench_data --sizes-mb 10,100,1000 [--workers N]

For each size it writes a synthetic corpus of about that many MB of text (.jsonl files of
documents of Zipf-distributed words), prepares it with tfx.prepare, then starts a fresh process
that builds a training run on the store (``prepared:DIR``, configs/tiny.py at 64 x 2048: the model
is small, the data is what is measured) and reports the time from build to the first batch, the
host time per batch and the process's peak RSS (JAX included). ``--step-time`` also times training
steps of configs/tiny.py with batches from the loader and with one batch reused (no data), to
show whether the loader is visible in step time. A benchmark, not a test: nothing asserts speed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time

import numpy as np

ROWS, LENGTH = 64, 2048
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def synthetic_corpus(directory: str, megabytes: float, seed: int = 0) -> str:
  """Writes ~megabytes of English-like text as .jsonl files; returns the ``text:`` source."""
  os.makedirs(directory, exist_ok=True)
  done = os.path.join(directory, "DONE")
  source = f"text:{directory}/*.jsonl"
  if os.path.exists(done):
    return source
  rng = np.random.default_rng(seed)
  letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
  words = np.array(["".join(rng.choice(letters, size=int(n))) for n in rng.integers(1, 11, size=20000)])
  zipf = 1.0 / np.arange(1, len(words) + 1)
  zipf /= zipf.sum()
  target, written, part = int(megabytes * 1e6), 0, 0
  while written < target:
    lines = []
    size = 0
    while size < min(50_000_000, target - written):
      count = int(rng.integers(50, 2000))
      text = " ".join(words[rng.choice(len(words), size=count, p=zipf)])
      text = ". ".join(text[i:i + 120] for i in range(0, len(text), 120))
      lines.append(json.dumps({"text": text}))
      size += len(text)
    with open(os.path.join(directory, f"part-{part:04d}.jsonl"), "w") as f:
      f.write("\n".join(lines) + "\n")
    written += size
    part += 1
  open(done, "w").close()
  return source


def _config(source: str, workers: int, vocab_size: int):
  from tfx import config as config_lib

  return config_lib.load_config(os.path.join(_ROOT, "configs", "tiny.py"), [
      f"--config.data.source={source}", f"--config.data.vocab_size={vocab_size}", "--config.data.max_documents=0",
      f"--config.data.prepare_workers={workers}", f"--config.data.seq_len={LENGTH}",
      f"--config.train.batch_size={ROWS}", "--config.data.shard_mb=16"])


def _peak_rss_bytes() -> int:
  """This process's peak resident set (VmHWM). Not ru_maxrss: that survives exec, so a child
  started by a large parent would report the parent's peak."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmHWM:"):
        return int(line.split()[1]) * 1024
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure_loader(store_dir: str, vocab_size: int, batches: int = 50) -> dict:
  """In this (fresh) process, as tfx.train does it: build the run on ``prepared:DIR`` (a tiny
  model at 64 x 2048), time to its first batch, host ms per batch (no prefetch), peak RSS."""
  import tempfile

  from tfx import config as config_lib, train

  config = config_lib.load_config(os.path.join(_ROOT, "configs", "tiny.py"), [
      f"--config.data.source=prepared:{store_dir}", f"--config.data.seq_len={LENGTH}",
      f"--config.train.batch_size={ROWS}", "--config.data.prefetch=0", f"--config.data.vocab_size={vocab_size}"])
  with tempfile.TemporaryDirectory() as workdir:
    start = time.perf_counter()
    exp = train.build(config, workdir)
    exp.pipeline.next_batch()
    first = time.perf_counter() - start
    exp.pipeline.wait_verified()  # checksums hashed in the background since the store opened
    verified = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(batches):
      exp.pipeline.next_batch()
    per_batch = (time.perf_counter() - start) / batches
  return {"first_batch_s": first, "verified_s": verified, "host_ms_per_batch": per_batch * 1e3,
          "peak_rss_gb": _peak_rss_bytes() / 1e9}


def step_times(store_dir: str, vocab_size: int, steps: int = 30) -> dict:
  """configs/tiny.py train steps fed by the loader (prefetch 2) and by one reused batch."""
  import jax

  from tfx import config as config_lib, parallel, train

  config = config_lib.load_config(os.path.join(_ROOT, "configs", "tiny.py"), [f"--config.data.source=prepared:{store_dir}",
                                                                             f"--config.data.vocab_size={vocab_size}"])
  workdir = os.path.join(os.path.dirname(store_dir), "step-time-run")
  exp = train.build(config, workdir)
  abstract, shardings = train.state_shardings(exp.model, exp.tx, exp.mesh, config.data.seq_len, exp.objective,
                                              config.train.batch_size)
  state = train.init_state(exp.model, exp.tx, exp.mesh, config.data.seq_len, 0, shardings, exp.objective,
                           config.train.batch_size)
  step = train.make_train_step(exp, shardings)
  fixed = exp.pipeline.next_batch()  # host arrays: both sides pay the transfer to the device
  state, m = step(state, parallel.global_batch(fixed, exp.mesh))
  jax.block_until_ready(m)
  out = {}
  for name in ("fixed batch", "loader") * 2:  # interleaved, the second round counts
    start = time.perf_counter()
    for _ in range(steps):
      batch = fixed if name == "fixed batch" else exp.pipeline.next_batch()
      state, m = step(state, parallel.global_batch(batch, exp.mesh))
    jax.block_until_ready(m)
    out[name] = (time.perf_counter() - start) / steps * 1e3
  return {"step_ms_fixed_batch": out["fixed batch"], "step_ms_loader": out["loader"]}


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m tfx.bench_data", description=__doc__.split("\n")[0])
  parser.add_argument("--out", default="runs/bench_data")
  parser.add_argument("--sizes-mb", default="10,100,1000")
  parser.add_argument("--workers", type=int, default=0, help="prepare workers (default: all cores)")
  parser.add_argument("--vocab-size", type=int, default=8000, help="the tokenizer's vocabulary")
  parser.add_argument("--step-time", action="store_true", help="also time tiny.py steps with and without data")
  parser.add_argument("--measure", help=argparse.SUPPRESS)  # internal: the fresh loader process
  args = parser.parse_args(argv)
  if args.measure:
    print(json.dumps(measure_loader(args.measure, args.vocab_size)))
    return
  from etils import epath

  from tfx.data.prepare import Spec, prepare, resolve_tokenizer

  workers = args.workers or os.cpu_count() or 1
  rows = []
  for mb in [float(x) for x in args.sizes_mb.split(",")]:
    base = os.path.join(args.out, f"{mb:g}mb")
    source = synthetic_corpus(os.path.join(base, "text"), mb)
    store_dir = os.path.join(base, "store")
    shutil.rmtree(store_dir, ignore_errors=True)  # time a fresh prepare
    data_cfg = _config(source, workers, args.vocab_size).data
    start = time.perf_counter()
    resolve_tokenizer(data_cfg, epath.Path(store_dir), Spec.from_config(data_cfg))
    tokenizer_s = time.perf_counter() - start
    start = time.perf_counter()
    manifest = prepare(data_cfg, store_dir, workers=workers, progress=False)
    seconds = time.perf_counter() - start
    text_mb = sum(s["text_bytes"] for s in manifest["shards"]) / 1e6
    used = min(workers, len(manifest["shards"]))
    proc = subprocess.run([sys.executable, "-m", "tfx.bench_data", "--measure", store_dir, "--vocab-size",
                           str(args.vocab_size)], capture_output=True,
                          text=True, check=True, cwd=_ROOT)
    row = {"corpus_mb": round(text_mb, 1), "tokens": manifest["splits"]["train"]["tokens"],
           "tokenizer_s": tokenizer_s, "prepare_s": seconds, "workers": used,
           "prepare_mb_s_per_worker": text_mb / seconds / used,
           **json.loads(proc.stdout.strip().splitlines()[-1])}
    if args.step_time and mb == float(args.sizes_mb.split(",")[0]):
      row.update(step_times(os.path.abspath(store_dir), args.vocab_size))
    rows.append(row)
    print(json.dumps(row), flush=True)
  print()
  print("| corpus (MB of text) | train tokens | tokenizer (s) | prepare (s) | workers | MB/s per worker "
        "| first batch (s) | checksums verified (s) | peak RSS (GB) | host ms / 64x2048 batch |")
  print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  for r in rows:
    print(f"| {r['corpus_mb']:,.0f} | {r['tokens']:,} | {r['tokenizer_s']:.1f} | {r['prepare_s']:.1f} | {r['workers']} | "
          f"{r['prepare_mb_s_per_worker']:.1f} | "
          f"{r['first_batch_s']:.2f} | {r['verified_s']:.2f} | {r['peak_rss_gb']:.2f} | {r['host_ms_per_batch']:.2f} |")
  for r in rows:
    if "step_ms_loader" in r:
      print(f"\nconfigs/tiny.py step time: {r['step_ms_loader']:.1f} ms with the loader, "
            f"{r['step_ms_fixed_batch']:.1f} ms with one reused batch")


if __name__ == "__main__":
  main()
