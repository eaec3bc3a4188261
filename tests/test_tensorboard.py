"""TensorBoard event files (WORKDIR/tb) and Weights & Biases: the same scalars as metrics.jsonl.

Event files are read back with TensorBoard's own EventAccumulator (the `tensorboard` package of
the dev extra), with orphan purging off, so a duplicated or stale step would show.
"""

import collections
import json
import os
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.conftest import ROOT, tiny_config
from tests.gcs_emulator import start_emulator
from tfx import train
from tfx.config import ConfigError, validate
from tfx.metrics import THROUGHPUT_KEYS, MetricsWriter, read_metrics, scalar_name, truncate_events

PERF = ("tokens_per_sec", "mfu")


def quick(tokenizer, *overrides):
  return tiny_config(f"--config.data.tokenizer={tokenizer}", "--config.data.max_documents=60",
                     "--config.train.steps=8", "--config.train.log_every=1", "--config.train.eval_every=4",
                     "--config.train.checkpoint_every=4", *overrides)


def expected_name(split: str, key: str) -> str:
  """The naming table, written out independently of tfx.metrics.scalar_name."""
  if key in PERF or key.startswith("seconds"):
    return f"perf/{key}" if split == "train" else f"perf/{split}/{key}"
  return f"{split}/{key}"


def jsonl_scalars(workdir) -> dict[str, list[tuple[int, float]]]:
  """{tag: [(step, float32 value), ...]} from metrics.jsonl, None / non-finite left out."""
  out: dict[str, list[tuple[int, float]]] = {}
  for r in read_metrics(str(workdir)):
    if r["split"] == "event":
      continue
    for key, value in r.items():
      if key not in ("step", "split") and value is not None and np.isfinite(value):
        out.setdefault(expected_name(r["split"], key), []).append((r["step"], float(np.float32(value))))
  return out


def tb_scalars(tb_dir) -> dict[str, list[tuple[int, float]]]:
  """{tag: [(step, value), ...]} of every event file in `tb_dir`, as TensorBoard reads them."""
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

  acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0}, purge_orphaned_data=False)
  acc.Reload()
  return {tag: [(e.step, float(np.float32(e.value))) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def event_files(tb_dir) -> list[str]:
  return sorted(n for n in os.listdir(tb_dir) if n.startswith("events.out.tfevents."))


# ----------------------------------------------------------------------------- naming


def test_scalar_names():
  assert scalar_name("train", "loss") == "train/loss"
  assert scalar_name("train", "learning_rate") == "train/learning_rate"
  # a naming rule, not a timing check: keys that measure speed are filed under perf/
  for speed_key in (*THROUGHPUT_KEYS, "seconds_per_step"):
    assert scalar_name("train", speed_key) == f"perf/{speed_key}"
  assert scalar_name("eval", "accuracy") == "eval/accuracy"
  assert scalar_name("finetune_eval", "loss") == "finetune_eval/loss"
  assert scalar_name("finetune", "tokens_per_sec") == "perf/finetune/tokens_per_sec"


def test_writer_skips_none_and_non_finite(tmp_path):
  writer = MetricsWriter(str(tmp_path))
  writer.write(1, "train", {"loss": 2.5, "mfu": None, "grad_norm": float("nan"), "accuracy": float("inf")})
  writer.write(1, "test", {"loss": 3.0})
  writer.event(1, "corpus_changed", changes=["x"])
  writer.close()
  assert tb_scalars(tmp_path / "tb") == {"train/loss": [(1, 2.5)], "test/loss": [(1, 3.0)]}
  assert jsonl_scalars(tmp_path) == tb_scalars(tmp_path / "tb")


def test_truncate_events_keeps_steps_up_to_the_checkpoint(tmp_path):
  writer = MetricsWriter(str(tmp_path))
  for step in range(1, 7):
    writer.write(step, "train", {"loss": float(step)})
  writer.close()
  (name,) = event_files(tmp_path / "tb")
  data = (tmp_path / "tb" / name).read_bytes()
  torn = data[:-5]  # a run killed while writing its last record
  assert truncate_events(torn, 10) == data[:len(truncate_events(data, 5))]
  writer = MetricsWriter(str(tmp_path))
  writer.truncate_after(4)
  writer.write(5, "train", {"loss": 50.0})
  writer.close()
  assert len(event_files(tmp_path / "tb")) == 2
  assert tb_scalars(tmp_path / "tb") == {"train/loss": [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 50.0)]}
  assert jsonl_scalars(tmp_path) == tb_scalars(tmp_path / "tb")


def test_tensorboard_can_be_turned_off(tmp_path):
  writer = MetricsWriter(str(tmp_path), config=tiny_config("--config.log.tensorboard=false"))
  writer.write(1, "train", {"loss": 1.0})
  writer.close()
  assert not (tmp_path / "tb").exists() and read_metrics(str(tmp_path))[0]["loss"] == 1.0


# ----------------------------------------------------------------------------- real runs


def test_training_run_writes_the_metrics_as_tensorboard_scalars(tmp_path, shared_tokenizer):
  """Every scalar of metrics.jsonl is in WORKDIR/tb under its name, same steps, same float32 value."""
  workdir = tmp_path / "run"
  train.run(quick(shared_tokenizer), str(workdir))
  tb = tb_scalars(workdir / "tb")
  assert tb == jsonl_scalars(workdir)
  assert {"train/loss", "train/accuracy", "train/learning_rate", "train/grad_norm", "eval/loss", "eval/accuracy",
          "perf/tokens_per_sec"} <= set(tb)
  assert [s for s, _ in tb["train/loss"]] == list(range(1, 9))
  assert [s for s, _ in tb["eval/loss"]] == [0, 4, 8]


def test_resume_leaves_no_stale_or_duplicate_scalars(tmp_path, shared_tokenizer):
  """A run that died after step 6 with its last checkpoint at 4 (steps 5-6 logged twice, once by a
  crashed writer with stale values) resumes at 4: TensorBoard shows exactly metrics.jsonl."""
  workdir = tmp_path / "run"
  train.run(quick(shared_tokenizer, "--config.train.stop_after=6"), str(workdir))  # checkpoints 4 and 6
  import shutil

  shutil.rmtree(workdir / "checkpoints" / "6")  # as if it died before saving 6
  crashed = MetricsWriter(str(workdir))  # ...after logging stale values in another event file
  crashed.write(5, "train", {"loss": 123.0})
  crashed.write(6, "eval", {"loss": 99.0})
  crashed.close()
  assert len(event_files(workdir / "tb")) == 2

  train.run(quick(shared_tokenizer), str(workdir))
  tb = tb_scalars(workdir / "tb")
  assert tb == jsonl_scalars(workdir)
  assert [s for s, _ in tb["train/loss"]] == list(range(1, 9))
  assert [s for s, _ in tb["eval/loss"]] == [0, 4, 8]
  assert 123.0 not in [v for _, v in tb["train/loss"]]
  assert len(event_files(workdir / "tb")) == 3  # the resumed run wrote a new file


# ----------------------------------------------------------------------------- gs://

GS_SCRIPT = """
import sys
from etils import epath
from tfx.metrics import MetricsWriter
w = MetricsWriter("gs://tfx-test/run")
for step in range(1, 5):
  w.write(step, "train", {"loss": step / 10, "tokens_per_sec": 1000.0 * step})
w.flush()  # a checkpoint: the event file is on gs:// now
print(sorted(p.name for p in epath.Path("gs://tfx-test/run/tb").iterdir()))
w.write(5, "train", {"loss": 9.0})  # orphan: dropped by the resume below
w.close()
w = MetricsWriter("gs://tfx-test/run")
w.truncate_after(4)
w.write(5, "train", {"loss": 0.5, "tokens_per_sec": 5000.0})
w.write(5, "eval", {"loss": 0.6})
w.close()
out = epath.Path(sys.argv[1])
for p in epath.Path("gs://tfx-test/run/tb").iterdir():
  (out / p.name).write_bytes(p.read_bytes())
(out / "metrics.jsonl").write_text(epath.Path("gs://tfx-test/run/metrics.jsonl").read_text())
"""


def test_event_files_on_gcs(tmp_path):
  """On gs:// the event file is written locally and copied at each flush; resume truncates it there."""
  with start_emulator("tfx-test") as env:
    proc = subprocess.run([sys.executable, "-c", GS_SCRIPT, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env})
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.count("events.out.tfevents.") == 1  # visible after the first flush
  assert len(event_files(tmp_path)) == 2
  tb = tb_scalars(tmp_path)
  assert tb == jsonl_scalars(tmp_path)
  assert tb["train/loss"] == [(s, float(np.float32(v))) for s, v in [(1, .1), (2, .2), (3, .3), (4, .4), (5, .5)]]
  assert tb["perf/tokens_per_sec"][-1] == (5, 5000.0) and tb["eval/loss"] == [(5, float(np.float32(0.6)))]


# ----------------------------------------------------------------------------- Weights & Biases


class FakeRun:
  def __init__(self, **kwargs):
    self.init, self.logged, self.finished = kwargs, [], False

  def log(self, values, step=None):
    self.logged.append((step, dict(values)))

  def finish(self):
    self.finished = True


def test_wandb_gets_the_same_scalars_and_resumes_by_id(tmp_path, monkeypatch):
  """With a stand-in `wandb` module: name, id, resume, config, the scalars, finish."""
  import types

  runs = []
  fake = types.SimpleNamespace(init=lambda **kw: runs.append(FakeRun(**kw)) or runs[-1])
  monkeypatch.setitem(sys.modules, "wandb", fake)
  monkeypatch.delenv("WANDB_DIR", raising=False)
  config = tiny_config("--config.log.wandb_project=tfx-tests", "--config.log.wandb_entity=me")
  workdir = tmp_path / "my-run"
  writer = MetricsWriter(str(workdir), config=config)
  writer.write(3, "train", {"loss": 1.5, "tokens_per_sec": 10.0, "mfu": None})
  writer.close()
  run_id = (workdir / "wandb_id.txt").read_text().strip()
  init = runs[0].init
  assert init["project"] == "tfx-tests" and init["entity"] == "me" and init["name"] == "my-run"
  assert init["id"] == run_id and init["resume"] == "allow" and init["dir"] == str(workdir)
  assert init["config"]["model"]["family"] == "decoder" and init["config"]["log"]["wandb_project"] == "tfx-tests"
  assert runs[0].logged == [(3, {"train/loss": 1.5, "perf/tokens_per_sec": 10.0})] and runs[0].finished
  MetricsWriter(str(workdir), config=config).close()  # a resume: the same id
  assert runs[1].init["id"] == run_id


def test_wandb_project_without_wandb_is_a_clear_error(tmp_path, monkeypatch, shared_tokenizer):
  monkeypatch.setitem(sys.modules, "wandb", None)  # not importable
  config = quick(shared_tokenizer, "--config.log.wandb_project=tfx-tests")
  with pytest.raises(ConfigError, match=r"needs the wandb package.*pip install wandb"):
    validate(config, num_devices=1)
  with pytest.raises(ConfigError, match="pip install wandb"):
    train.run(config, str(tmp_path / "run"))
  assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "metrics.jsonl").exists()


def wandb_records(run_dir) -> list:
  """The records of an offline run's .wandb file (LevelDB log records of wandb protos), in order."""
  from wandb.proto import wandb_internal_pb2 as pb

  (name,) = [n for n in os.listdir(run_dir) if n.endswith(".wandb")]
  data = (run_dir / name).read_bytes()
  pos, block, buf, records = 7, 32768, b"", []
  while pos + 7 <= len(data):
    if block - pos % block < 7:  # a block's tail too short for a header is padding
      pos += block - pos % block
      continue
    _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
    buf += data[pos + 7:pos + 7 + length]
    pos += 7 + length
    if kind in (1, 4):  # FULL or LAST fragment: a whole record
      records.append(pb.Record.FromString(buf))
      buf = b""
  return records


def wandb_history(records) -> dict[str, list[tuple[int, float]]]:
  """{key: [(step, value)]} of the history records."""
  out = {}
  for record in records:
    if record.HasField("history"):
      for item in record.history.item:
        key = item.key or "/".join(item.nested_key)  # "a/b" keys come as nested_key ["a", "b"]
        if not key.startswith("_"):
          out.setdefault(key, []).append((record.history.step.num, float(json.loads(item.value_json))))
  return out


def finished_wandb_records(run_dir, timeout: float = 60.0) -> list:
  """The run's records once its exit record is on disk: wandb's service process may still be
  writing the file when `finish()` returns on a loaded machine."""
  deadline = time.time() + timeout
  while True:
    records = wandb_records(run_dir)
    if any(r.HasField("exit") for r in records) or time.time() > deadline:
      return records
    time.sleep(0.5)


def test_wandb_offline_run(tmp_path, monkeypatch, shared_tokenizer):
  """A real (offline) W&B run logs the scalars of metrics.jsonl under the same names."""
  pytest.importorskip("wandb")
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
  monkeypatch.setenv("WANDB_SILENT", "true")
  (tmp_path / "wandb").mkdir()
  workdir = tmp_path / "run"
  train.run(quick(shared_tokenizer, "--config.log.wandb_project=tfx-tests", "--config.train.steps=4",
                  "--config.train.eval_every=2"), str(workdir))
  run_id = (workdir / "wandb_id.txt").read_text().strip()
  (run_dir,) = [p for p in (tmp_path / "wandb" / "wandb").iterdir() if p.name.endswith(run_id)]
  records = finished_wandb_records(run_dir)
  logged = wandb_history(records)
  expected = jsonl_scalars(workdir)
  kinds = collections.Counter(r.WhichOneof("record_type") for r in records)
  assert set(logged) == set(expected), f"record types in the .wandb file: {dict(kinds)}"
  for key, points in expected.items():
    assert [s for s, _ in logged[key]] == [s for s, _ in points], key
    np.testing.assert_allclose([v for _, v in logged[key]], [v for _, v in points], rtol=1e-6, err_msg=key)
