"""Run outputs: metrics.jsonl (one JSON object per logged step) and the console progress line."""

import json
import math
import sys
import time

import jax
from etils import epath


class MetricsWriter:
  """Appends `{"step", "split", ...}` records to WORKDIR/metrics.jsonl (process 0 only).

  WORKDIR may be local or gs://. A local file is appended to, as before. An object cannot be
  appended to, so on gs:// the file is kept in memory and rewritten whole at most every
  ``flush_seconds`` and at every :meth:`flush` (the loop flushes with each checkpoint and at the
  end): records after the last checkpoint are dropped on resume anyway.
  """

  def __init__(self, workdir, flush_seconds: float = 30.0):
    self.path = epath.Path(workdir) / "metrics.jsonl"
    self.enabled = jax.process_index() == 0
    self.remote = "://" in str(self.path)
    self.flush_seconds = flush_seconds
    self._text: str | None = None  # gs://: the file's content
    self._dirty = False
    self._flushed = time.time()

  def _append(self, record: dict) -> None:
    if not self.enabled:
      return
    line = json.dumps(record) + "\n"
    if not self.remote:
      with self.path.open("a") as f:
        f.write(line)
      return
    if self._text is None:
      self._text = self.path.read_text() if self.path.exists() else ""
    self._text += line
    self._dirty = True
    if time.time() - self._flushed > self.flush_seconds:
      self.flush()

  def flush(self) -> None:
    """Writes buffered records (gs:// only; local records are written at once)."""
    if self.enabled and self.remote and self._dirty:
      self.path.write_text(self._text)
      self._dirty, self._flushed = False, time.time()

  def write(self, step: int, split: str, values: dict) -> dict:
    record = {"step": int(step), "split": split}
    for k, v in values.items():
      v = float(v) if v is not None else None
      record[k] = None if v is not None and not math.isfinite(v) else v
    self._append(record)
    return record

  def event(self, step: int, name: str, **fields) -> dict:
    """A `{"step", "split": "event", "event": name, ...}` record (not a metric: JSON fields as given)."""
    record = {"step": int(step), "split": "event", "event": name, **fields}
    self._append(record)
    return record

  def truncate_after(self, step: int) -> None:
    """Drops records after `step` (written by a run that died before its next checkpoint)."""
    self.flush()
    if not self.enabled or not self.path.exists():
      return
    lines = [ln for ln in self.path.read_text().splitlines(keepends=True) if ln.strip()]
    kept = [ln for ln in lines if json.loads(ln)["step"] <= step]
    if kept != lines:
      self.path.write_text("".join(kept))
    self._text = None  # gs://: read again on the next record


def read_metrics(workdir) -> list[dict]:
  text = (epath.Path(workdir) / "metrics.jsonl").read_text()
  return [json.loads(line) for line in text.splitlines() if line.strip()]


def _duration(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class Progress:
  """One console line per log step: step, loss, tokens/s, ETA."""

  def __init__(self, total_steps: int, stream=sys.stdout):
    self.total = total_steps
    self.stream = stream
    self.enabled = jax.process_index() == 0
    self.start = time.time()

  def train(self, step: int, loss: float, tokens_per_sec, seconds_per_step, mfu=None) -> None:
    if not self.enabled:
      return
    speed = f"{tokens_per_sec:,.0f} tok/s" if tokens_per_sec else "compiling"
    eta = _duration((self.total - step) * seconds_per_step) if seconds_per_step else "?"
    extra = f" | mfu {mfu:.1%}" if mfu is not None else ""
    print(f"step {step:>6}/{self.total} | loss {loss:.4f} | {speed}{extra} | ETA {eta}", file=self.stream, flush=True)

  def eval(self, step: int, loss: float, accuracy: float) -> None:
    if self.enabled:
      print(f"step {step:>6}/{self.total} | eval loss {loss:.4f} | eval accuracy {accuracy:.3f}",
            file=self.stream, flush=True)

  def note(self, text: str) -> None:
    if self.enabled:
      print(text, file=self.stream, flush=True)
