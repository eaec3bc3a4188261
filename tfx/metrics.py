"""Run outputs: metrics.jsonl, TensorBoard event files, optional Weights & Biases, the console line.

Every `MetricsWriter.write(step, split, values)` appends one record to WORKDIR/metrics.jsonl and,
on process 0, the same numbers as scalars to TensorBoard (WORKDIR/tb/, via tensorboardX, no
TensorFlow) and to W&B when `config.log.wandb_project` is set. Scalar names (TensorBoard tags,
W&B keys, `tfx.compare --metric`) come from :func:`scalar_name`:

    split "train", key k          -> train/k          (train/loss, train/learning_rate, ...)
    split "eval", key k           -> eval/k           (eval/loss, eval/accuracy, ...)
    any other split S, key k      -> S/k              (finetune/loss, finetune_eval/accuracy, ...)
    tokens_per_sec, mfu, seconds* -> perf/k for "train", perf/S/k for any other split S

None and non-finite values are left out (metrics.jsonl keeps them as null). Records of split
"event" are not metrics and go to metrics.jsonl only.

Event files are written synchronously (one Event per `write`, ~15 us on a CPU; tensorboardX's
async SummaryWriter costs more on the caller's thread and its flush() does not drain its queue).
On gs:// the file is written in a local temporary folder and copied to WORKDIR/tb/ at every
`flush()` (checkpoints, the end, and every `flush_seconds` with metrics.jsonl). On resume,
`truncate_after(step)` rewrites the existing event files without the events after `step`, as it
does metrics.jsonl, and the next record opens a new event file: every reader (TensorBoard,
EventAccumulator, tbparse) then sees each step once, with the value of the run that continued.
"""

import json
import math
import os
import re
import shutil
import struct
import sys
import tempfile
import time
import uuid
from typing import Any, Iterable

import jax
from etils import epath

from tfx.data import store
from tfx.errors import UserError

# Keys that measure speed, not the model: logged under perf/.
THROUGHPUT_KEYS = ("tokens_per_sec", "mfu")
TB_DIR = "tb"  # WORKDIR/tb: the TensorBoard event files
WANDB_ID_FILE = "wandb_id.txt"
_EVENT_FILES = "events.out.tfevents.*"
_TAG_CHARS = re.compile(r"[^A-Za-z0-9_.\-/]")


def scalar_name(split: str, key: str) -> str:
  """The TensorBoard / W&B name of metric `key` of `split` (table in the module docstring)."""
  if key in THROUGHPUT_KEYS or key.startswith("seconds"):
    return f"perf/{key}" if split == "train" else f"perf/{split}/{key}"
  return f"{split}/{key}"


def scalars(record: dict) -> dict[str, float]:
  """{name: value} of a metrics.jsonl record: finite numbers only; {} for an "event" record."""
  if record.get("split") == "event":
    return {}
  out = {}
  for key, value in record.items():
    if key in ("step", "split") or isinstance(value, bool) or not isinstance(value, (int, float)):
      continue
    if math.isfinite(value):
      out[scalar_name(record["split"], key)] = float(value)
  return out


def metric_series(records: Iterable[dict]) -> dict[str, tuple[list[int], list[float]]]:
  """{scalar name: (steps, values)} in step order; a step logged twice keeps its last value."""
  by_name: dict[str, dict[int, float]] = {}
  for record in records:
    for name, value in scalars(record).items():
      by_name.setdefault(name, {})[int(record["step"])] = value
  return {name: (sorted(points), [points[s] for s in sorted(points)]) for name, points in by_name.items()}


# ----------------------------------------------------------------------------- TensorBoard


def event_records(data: bytes) -> list[tuple[int, bytes]]:
  """(step, framed record bytes) of each complete record of an event file (a torn tail is dropped).

  The framing is TFRecord: uint64 length, uint32 CRC of it, the serialized Event, uint32 CRC.
  """
  from tensorboardX.proto import event_pb2

  out, pos = [], 0
  while pos + 12 <= len(data):
    (length,) = struct.unpack("<Q", data[pos:pos + 8])
    end = pos + 12 + length + 4
    if end > len(data):
      break
    try:
      event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
    except Exception:  # noqa: BLE001  (a damaged record: keep what came before it)
      break
    out.append((int(event.step), data[pos:end]))
    pos = end
  return out


def truncate_events(data: bytes, step: int) -> bytes:
  """The event file `data` without the events of steps after `step` (its header is at step 0)."""
  return b"".join(chunk for s, chunk in event_records(data) if s <= step)


class _EventLog:
  """Scalars into a TensorBoard event file in `directory` (local or gs://), written with tensorboardX."""

  def __init__(self, directory: epath.Path):
    self.dir = directory
    self.remote = "://" in str(directory)
    self._writer = None  # tensorboardX EventsWriter, opened at the first scalar
    self._folder: str | None = None  # where it writes: self.dir, or a local temporary folder
    self._copied: dict[str, int] = {}  # gs://: bytes of each local file already copied

  def add(self, step: int, values: dict[str, float]) -> None:
    from tensorboardX.proto import event_pb2
    from tensorboardX.proto.summary_pb2 import Summary

    if self._writer is None:
      self._open()
    summary = Summary(value=[Summary.Value(tag=_TAG_CHARS.sub("_", k), simple_value=v) for k, v in values.items()])
    self._writer.write_event(event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary))

  def _open(self) -> None:
    from tensorboardX.event_file_writer import EventsWriter

    if self.remote:
      self._folder = tempfile.mkdtemp(prefix="tfx-tb-")
    else:
      self.dir.mkdir(parents=True, exist_ok=True)
      self._folder = str(self.dir)
    # tensorboardX names files by the second and the host only: two writers in one second (a
    # resume in the same process) would write the same file. The nanosecond suffix keeps them
    # apart and in time order: readers read the files in name order, and TensorBoard takes a
    # step that goes back (a later file with earlier steps) for a restart and drops the rest.
    suffix = f".{time.time_ns()}.{os.getpid()}"
    self._writer = EventsWriter(os.path.join(self._folder, "events"), suffix)

  def flush(self) -> None:
    """Writes the open file to disk; on gs://, copies what changed to the workdir."""
    if self._writer is None:
      return
    self._writer.flush()
    if self.remote:
      for name in sorted(os.listdir(self._folder)):
        size = os.path.getsize(os.path.join(self._folder, name))
        if self._copied.get(name) != size:
          with open(os.path.join(self._folder, name), "rb") as f:
            (self.dir / name).write_bytes(f.read())
          self._copied[name] = size

  def close(self) -> None:
    """Flushes and closes the open file; the next scalar opens a new one."""
    if self._writer is None:
      return
    self.flush()
    self._writer.close()
    self._writer = None
    if self.remote:
      shutil.rmtree(self._folder, ignore_errors=True)
      self._copied = {}

  def truncate_after(self, step: int) -> None:
    """Rewrites every event file in the folder without its events after `step`."""
    self.close()
    if not self.dir.exists():
      return
    for path in sorted(self.dir.glob(_EVENT_FILES)):
      data = path.read_bytes()
      kept = truncate_events(data, step)
      if kept != data:
        path.write_bytes(kept)


# ----------------------------------------------------------------------------- Weights & Biases


class _Wandb:
  """The same scalars to a W&B run named after the workdir, resumed by the id in WORKDIR/wandb_id.txt."""

  def __init__(self, workdir, config, project: str, entity: str = ""):
    try:
      import wandb
    except ImportError:
      raise UserError(f"log.wandb_project={project!r} needs the wandb package: `pip install wandb`, or set "
                      f"--config.log.wandb_project='' to log to TensorBoard and metrics.jsonl only") from None
    root = epath.Path(workdir)
    local = "://" not in str(root)
    if local:
      root.mkdir(parents=True, exist_ok=True)
    id_path = root / WANDB_ID_FILE
    run_id = id_path.read_text().strip() if id_path.exists() else ""
    if not run_id:
      run_id = uuid.uuid4().hex[:12]
      id_path.write_text(run_id + "\n")
    folder = os.environ.get("WANDB_DIR") or (str(root) if local else None)
    values = config.to_dict() if hasattr(config, "to_dict") else dict(config or {})
    try:
      self.run = wandb.init(project=project, entity=entity or None, name=root.name, id=run_id, resume="allow",
                            config=values, dir=folder)
    except Exception as e:  # noqa: BLE001  (not logged in, no network, bad project: many types)
      raise UserError(f"Weights & Biases could not start run {run_id} in project {project!r} "
                      f"({type(e).__name__}: {str(e)[:300]}); run `wandb login`, set WANDB_MODE=offline, or "
                      f"set --config.log.wandb_project='' to turn it off") from e

  def log(self, step: int, values: dict[str, float]) -> None:
    self.run.log(values, step=int(step))

  def close(self) -> None:
    self.run.finish()


def _log_settings(config) -> tuple[bool, str, str]:
  """(tensorboard, wandb_project, wandb_entity) from `config.log`; defaults without a config."""
  log = config.get("log") if config is not None else None
  if log is None:
    return True, "", ""
  return bool(log.get("tensorboard", True)), log.get("wandb_project", ""), log.get("wandb_entity", "")


# ----------------------------------------------------------------------------- the writer


class MetricsWriter:
  """Appends `{"step", "split", ...}` records to WORKDIR/metrics.jsonl (process 0 only), and the
  same scalars to TensorBoard (WORKDIR/tb/) and, if configured, to Weights & Biases.

  WORKDIR may be local or gs://. A local file is appended to, as before. An object cannot be
  appended to, so on gs:// the file is kept in memory and rewritten whole at most every
  ``flush_seconds`` and at every :meth:`flush` (the loop flushes with each checkpoint and at the
  end): records after the last checkpoint are dropped on resume anyway. The event file follows
  the same rhythm (module docstring). `config` (the run's, optional) supplies `config.log`;
  without it TensorBoard is on and W&B off. Call :meth:`close` at the end.
  """

  def __init__(self, workdir, flush_seconds: float = 30.0, config: Any = None):
    self.path = epath.Path(workdir) / "metrics.jsonl"
    self.enabled = jax.process_index() == 0
    self.remote = "://" in str(self.path)
    self.flush_seconds = flush_seconds
    self._text: str | None = None  # gs://: the file's content
    self._dirty = False
    self._flushed = time.time()
    tensorboard, project, entity = _log_settings(config)
    self._tb = _EventLog(epath.Path(workdir) / TB_DIR) if self.enabled and tensorboard else None
    self._wandb = _Wandb(workdir, config, project, entity) if self.enabled and project else None

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
    """Writes buffered records (gs://; local records are written at once) and the event file."""
    if not self.enabled:
      return
    if self.remote and self._dirty:
      self.path.write_text(self._text)  # a gs:// object is replaced whole
      self._dirty, self._flushed = False, time.time()
    if self._tb is not None:
      self._tb.flush()

  def close(self) -> None:
    """Flushes everything and closes the event file and the W&B run (the writer can still write:
    a later record opens a new event file)."""
    self.flush()
    if self._tb is not None:
      self._tb.close()
    if self._wandb is not None:
      self._wandb.close()
      self._wandb = None

  def write(self, step: int, split: str, values: dict) -> dict:
    record = {"step": int(step), "split": split}
    for k, v in values.items():
      v = float(v) if v is not None else None
      record[k] = None if v is not None and not math.isfinite(v) else v
    if self.enabled:
      named = scalars(record)
      if named and self._tb is not None:
        self._tb.add(step, named)
      if named and self._wandb is not None:
        self._wandb.log(step, named)
    self._append(record)
    return record

  def event(self, step: int, name: str, **fields) -> dict:
    """A `{"step", "split": "event", "event": name, ...}` record (not a metric: JSON fields as given)."""
    record = {"step": int(step), "split": "event", "event": name, **fields}
    self._append(record)
    return record

  def truncate_after(self, step: int) -> None:
    """Drops records and TensorBoard events after `step` (written by a run that died before its
    next checkpoint). W&B history cannot be rewritten: it keeps the first values of such steps."""
    self.flush()
    if not self.enabled:
      return
    if self._tb is not None:
      self._tb.truncate_after(step)
    if not self.path.exists():
      return
    text = self.path.read_text()
    records = parse_records(text, str(self.path))
    kept = "".join(json.dumps(r) + "\n" for r in records if r["step"] <= step)
    if kept != text:  # a whole file or the old one: a kill mid-rewrite must not lose the kept records
      store.write_atomic(self.path, kept.encode())
    self._text = None  # gs://: read again on the next record


def parse_records(text: str, name: str = "metrics.jsonl") -> list[dict]:
  """The records of a metrics.jsonl text (JSON objects with at least `step` and `split`). A torn last
  line (a write cut by a kill or a full disk) is dropped with a warning on stderr; a damaged line
  elsewhere is a UserError naming it."""
  lines = text.splitlines()
  out = []
  for i, line in enumerate(lines):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
      if not isinstance(record, dict) or "step" not in record or "split" not in record:
        raise ValueError("not a record")
    except ValueError:
      if i == len(lines) - 1:
        print(f"warning: {name}: dropped a torn last line ({line[:60]!r}...)", file=sys.stderr)
        break
      raise UserError(f"{name} line {i + 1} is not a metrics record ({line[:60]!r}); fix or delete that line")
    out.append(record)
  return out


def read_metrics(workdir) -> list[dict]:
  path = epath.Path(workdir) / "metrics.jsonl"
  return parse_records(path.read_text(), str(path))


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
