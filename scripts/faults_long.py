"""The long fault run (issue 13): SIGKILLs at random moments, damaged checkpoints, NaN under each
policy, two runs on one workdir, a full disk, a read-only workdir and a list of bad inputs, all
through the command line as a user would meet them. Prints the counts for the README.

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python scripts/faults_long.py [--kills 10] [--out /tmp/faults]

Every fault must end in either a run that finishes with exactly the metrics and parameters of the
uninterrupted run (kills, damaged checkpoints) or a non-zero exit with one line and no traceback
(bad inputs, divergence under `stop`, a second writer, a full or read-only disk). A real tmpfs is
used for the full and read-only disks when this process may mount one (root); otherwise those two
cases are reported as skipped (tests/test_faults.py injects the write error instead).
"""

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMING = ("tokens_per_sec", "mfu")


def flags(workdir, tokenizer, *extra, steps=60):
  return ["--config", os.path.join(ROOT, "configs", "tiny.py"), "--workdir", workdir,
          "--config.data.max_documents=60", f"--config.train.steps={steps}", "--config.train.log_every=1",
          "--config.train.eval_every=20", "--config.train.checkpoint_every=5", "--config.model.dropout=0.1",
          *( [f"--config.data.tokenizer={tokenizer}"] if tokenizer else []), *extra]


def tfx(*args, timeout=900, **kw):
  return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, **kw)


def records(workdir):
  from tfx.metrics import read_metrics

  return [{k: v for k, v in r.items() if k not in TIMING} for r in read_metrics(workdir)
          if r["split"] in ("train", "eval")]


def final_params(workdir):
  import jax

  from tfx.runs import load_trained

  return [np.asarray(x) for x in jax.tree.leaves(load_trained(workdir)[3])]


def same_run(a, b) -> bool:
  if records(a) != records(b):
    return False
  return all(np.array_equal(x, y) for x, y in zip(final_params(a), final_params(b)))


def one_line_error(proc) -> bool:
  """Exited non-zero with a message and no traceback."""
  lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith(("warning", "tfx.prepare"))]
  return proc.returncode != 0 and "Traceback" not in proc.stderr and len(lines) >= 1


class Tally:

  def __init__(self):
    self.faults = self.survived = self.bad_inputs = self.one_line = self.tracebacks = 0
    self.failures, self.skipped = [], []

  def fault(self, name, ok, detail=""):
    self.faults += 1
    self.survived += bool(ok)
    print(f"[fault] {name}: {'survived' if ok else 'FAILED'} {detail}", flush=True)
    if not ok:
      self.failures.append(f"{name} {detail}")

  def bad_input(self, name, proc):
    self.bad_inputs += 1
    ok = one_line_error(proc)
    self.one_line += ok
    self.tracebacks += "Traceback" in proc.stderr
    last = (proc.stderr.strip().splitlines() or [""])[-1]
    print(f"[input] {name}: exit {proc.returncode}: {last[:200]}", flush=True)
    if not ok:
      self.failures.append(f"bad input {name}: {proc.stderr[-1500:]}")


def _last_train_step(workdir):
  try:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      lines = f.read().splitlines()
  except FileNotFoundError:
    return None
  for line in reversed(lines):
    try:
      record = json.loads(line)
    except ValueError:
      continue
    if record.get("split") == "train":
      return record["step"]
  return None


def kill_run(workdir, tokenizer, kills, rng, tally):
  """Starts the run and SIGKILLs it `kills` times, alternately a random fraction of a second after a
  random training step (1-8 steps after the first it logs) and as soon as orbax starts writing a
  checkpoint (a new temporary directory); then lets it finish."""
  done = 0
  ckpt = os.path.join(workdir, "checkpoints")
  while True:
    proc = subprocess.Popen([sys.executable, "-m", "tfx.train", *flags(workdir, tokenizer)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done >= kills:
      out = proc.communicate(timeout=900)[0]
      return proc.returncode == 0, out
    during_save = done % 2 == 1
    before = set(os.listdir(ckpt)) if os.path.isdir(ckpt) else set()
    first, target = None, None
    while proc.poll() is None:
      names = set(os.listdir(ckpt)) if os.path.isdir(ckpt) else set()
      before &= names  # a stale temporary directory that orbax removed counts as new when it returns
      if during_save:
        if any("tmp" in n for n in names - before):
          break
      else:
        last = _last_train_step(workdir)
        if first is None and last is not None:
          first, target = last, last + rng.randint(1, 8)
        if target is not None and last is not None and last >= target:
          time.sleep(rng.uniform(0.0, 0.3))
          break
      time.sleep(0.01)
    if proc.poll() is None:
      os.kill(proc.pid, signal.SIGKILL)
      proc.wait()
      proc.stdout.close()
      done += 1
      listing = sorted(os.listdir(ckpt)) if os.path.isdir(ckpt) else []
      print(f"  SIGKILL {done} ({'as an async checkpoint write began' if during_save else 'after a random step'}); "
            f"checkpoints now {listing}", flush=True)
    else:
      proc.stdout.read()
      return proc.returncode == 0 and done >= kills, f"finished after {done} kills"


def flip_latest(workdir, truncate=False):
  ckpts = os.path.join(workdir, "checkpoints")
  latest = max(int(n) for n in os.listdir(ckpts) if n.isdigit())
  files = [os.path.join(r, n) for r, _, names in os.walk(os.path.join(ckpts, str(latest))) for n in names
           if n != "tfx_manifest.json"]
  path = max(files, key=os.path.getsize)
  data = bytearray(open(path, "rb").read())
  if truncate:
    data = data[:len(data) // 3]
  else:
    data[len(data) // 2] ^= 0x01
  open(path, "wb").write(bytes(data))
  return latest


def mount_tmpfs(path, size, readonly=False):
  os.makedirs(path, exist_ok=True)
  opts = f"size={size}" + (",ro" if readonly else "")
  return subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", path], capture_output=True).returncode == 0


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--kills", type=int, default=10)
  parser.add_argument("--out", default="/tmp/tfx_faults")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  rng = random.Random(args.seed)
  shutil.rmtree(args.out, ignore_errors=True)
  os.makedirs(args.out)
  tally = Tally()
  t0 = time.time()
  w = lambda name: os.path.join(args.out, name)

  # the reference: uninterrupted
  ref = tfx("tfx.train", *flags(w("reference"), ""))
  assert ref.returncode == 0, ref.stderr[-3000:]
  tokenizer = w("reference/tokenizer.model")

  # SIGKILL at random moments and during async checkpoint writes; the finished run equals the reference
  ok, detail = kill_run(w("killed"), tokenizer, args.kills, rng, tally)
  same = ok and same_run(w("reference"), w("killed"))
  for i in range(args.kills):
    tally.fault(f"SIGKILL {i + 1}", same, "" if same else detail[-2000:])

  # a flipped bit, then a truncated file, in the latest checkpoint: fallback, and the result still exact
  for name, truncate in (("bit flip in the latest checkpoint", False), ("truncated latest checkpoint", True)):
    shutil.rmtree(w("damaged"), ignore_errors=True)
    shutil.copytree(w("reference"), w("damaged"))
    flip_latest(w("damaged"), truncate)
    proc = tfx("tfx.checkpoints", "--workdir", w("damaged"))
    listed = proc.returncode == 1 and "damaged" in proc.stdout
    proc = tfx("tfx.train", *flags(w("damaged"), ""))  # the reference's own settings
    fell_back = proc.returncode == 0 and "is damaged" in proc.stdout and "Traceback" not in proc.stderr
    tally.fault(name, listed and fell_back and same_run(w("reference"), w("damaged")), proc.stderr[-1500:])

  # NaN at step 12 under each policy
  for policy in ("stop", "skip", "rewind"):
    proc = tfx("tfx.train", *flags(w(f"nan_{policy}"), tokenizer, "--config.train.poison_step=12",
                                   f"--config.train.on_nonfinite={policy}", steps=20))
    ckpts = sorted(int(n) for n in os.listdir(w(f"nan_{policy}/checkpoints")) if n.isdigit())
    if policy == "stop":
      ok = one_line_error(proc) and "diverged" in proc.stderr and ckpts == [5, 10]
    else:
      ok = proc.returncode == 0 and ckpts[-1] == 20
    tally.fault(f"NaN at step 12, on_nonfinite={policy}", ok, proc.stderr[-1500:])

  # two runs on one workdir: the second fails at once naming the first; after a SIGKILL of the first,
  # a new launch takes over at once and finishes
  first = subprocess.Popen([sys.executable, "-m", "tfx.train", *flags(w("two"), tokenizer, steps=400)], cwd=ROOT,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  while not os.path.exists(w("two/tfx.lock")) and first.poll() is None:
    time.sleep(0.05)
  second = tfx("tfx.train", *flags(w("two"), tokenizer, steps=400))
  refused = one_line_error(second) and "in use by another run" in second.stderr and f"pid {first.pid}" in second.stderr
  first.kill(); first.wait()
  third = tfx("tfx.train", *flags(w("two"), tokenizer, "--config.train.allow_config_change=true", steps=30))
  tally.fault("a second run on the same workdir", refused, second.stderr[-800:])
  tally.fault("a new run after the holder was SIGKILLed", third.returncode == 0 and "took over" in third.stdout,
              third.stderr[-800:])

  # a full disk (a real tmpfs) and a read-only workdir
  size = sum(os.path.getsize(os.path.join(r, n)) for r, _, ns in os.walk(w("reference")) for n in ns)
  if mount_tmpfs(w("small"), f"{int(size * 0.6) // 1024}k"):
    proc = tfx("tfx.train", *flags(w("small/run"), tokenizer))
    full = one_line_error(proc) and "is full" in proc.stderr
    subprocess.run(["mount", "-o", f"remount,size={size * 4 // 1024}k", w("small")], check=True)
    proc2 = tfx("tfx.train", *flags(w("small/run"), tokenizer))
    tally.fault("disk full, then space freed", full and proc2.returncode == 0 and same_run(w("reference"),
                                                                                          w("small/run")),
                proc.stderr[-1500:] + proc2.stderr[-1500:])
    subprocess.run(["umount", w("small")])
  else:
    tally.skipped.append("disk full (no tmpfs)")
  if mount_tmpfs(w("readonly"), "1m", readonly=True):
    tally.bad_input("read-only workdir", tfx("tfx.train", *flags(w("readonly/run"), tokenizer)))
    subprocess.run(["umount", w("readonly")])
  else:
    tally.skipped.append("read-only workdir (no tmpfs)")

  # bad inputs: each one line, no traceback, no workdir left behind
  bad = w("bad.py")
  for name, extra in [("batch_size=0", ["--config.train.batch_size=0"]), ("seed=-1", ["--config.train.seed=-1"]),
                      ("num_decoder_layers=-2", ["--config.model.num_decoder_layers=-2"]),
                      ("attention_dropout=2.0", ["--config.model.attention_dropout=2.0"]),
                      ("keep_checkpoints=0", ["--config.train.keep_checkpoints=0"]),
                      ("unknown key", ["--config.train.setps=3"]), ("bad type", ["--config.train.steps=ten"]),
                      ("on_nonfinite=maybe", ["--config.train.on_nonfinite=maybe"]),
                      ("learning_rate=nan", ["--config.optim.learning_rate=nan"]),
                      ("missing text files", [f"--config.data.source=text:{w('nothing')}/*.txt"]),
                      ("num_heads=5", ["--config.model.num_heads=5"])]:
    proc = tfx("tfx.train", *flags(w("bad_run"), tokenizer, *extra))
    tally.bad_input(name, proc)
    if os.path.exists(w("bad_run")):
      tally.failures.append(f"{name} left {w('bad_run')} behind")
      shutil.rmtree(w("bad_run"))
  for name, text in [("config syntax error", "def get_config(:\n"),
                     ("misspelt key in a config file", "from configs import tiny\ndef get_config():\n"
                      "  c = tiny.get_config()\n  c.train.setps = 5\n  return c\n"),
                     ("wrong type in a config file", "from configs import tiny\ndef get_config():\n"
                      "  c = tiny.get_config()\n  c.train.steps = 'ten'\n  return c\n")]:
    open(bad, "w").write(text)
    tally.bad_input(name, tfx("tfx.train", "--config", bad, "--workdir", w("bad_run")))
  tally.bad_input("resume with another MLP", tfx("tfx.train", *flags(w("reference"), "",
                                                                     "--config.model.mlp=relu")))
  tally.bad_input("resume with another batch size", tfx("tfx.train", *flags(w("reference"), "",
                                                                            "--config.train.batch_size=16")))
  tally.bad_input("restore_step that does not exist", tfx("tfx.train", *flags(w("reference"), "",
                                                                              "--config.train.restore_step=7")))
  for name, extra in [("generate --temperature nan", ["--temperature", "nan"]),
                      ("generate --top-p 0", ["--top-p", "0"]),
                      ("generate with a prompt longer than the context", ["--prompt", "x = 1\n" * 400]),
                      ("generate on a workdir that is not a run", ["--workdir", w("nothing_here")])]:
    cmd = ["tfx.generate", "--workdir", w("reference"), "--prompt", "def f(", *extra]
    tally.bad_input(name, tfx(*cmd))
  tally.bad_input("tfx.checkpoints on a missing workdir", tfx("tfx.checkpoints", "--workdir", w("nothing_here")))

  summary = {"faults": tally.faults, "faults_survived": tally.survived, "bad_inputs": tally.bad_inputs,
             "bad_inputs_one_line": tally.one_line, "tracebacks_left": tally.tracebacks,
             "skipped": tally.skipped, "failures": tally.failures, "minutes": round((time.time() - t0) / 60, 1)}
  with open(os.path.join(args.out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  print(json.dumps(summary, indent=2))
  sys.exit(0 if not tally.failures and tally.survived == tally.faults else 1)


if __name__ == "__main__":
  main()
