"""An objective written in a folder outside the package is trained by `python -m tfx.train`,
resumed exactly, flagged when its source changes, and passes `tfx.check_objective`."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.test_objective_config import MY_OBJECTIVE
from tfx.metrics import read_metrics

TIMING = ("tokens_per_sec", "mfu")


def _cli(module: str, *args: str) -> subprocess.CompletedProcess:
  proc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=900)
  return proc


def _train(objective: str, tokenizer: str, workdir, *extra: str) -> subprocess.CompletedProcess:
  proc = _cli("tfx.train", "--config", os.path.join(ROOT, "configs", "tiny.py"), "--workdir", str(workdir),
              f"--config.objective.name={objective}", "--config.objective.weight=0.5",
              f"--config.data.tokenizer={tokenizer}", "--config.data.max_documents=60", "--config.train.steps=8",
              "--config.train.log_every=1", "--config.train.eval_every=4", "--config.train.checkpoint_every=4",
              "--config.model.dropout=0.1", *extra)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return proc


def _metrics(workdir):
  return [{k: v for k, v in r.items() if k not in TIMING} for r in read_metrics(str(workdir))
          if r.get("split") != "event"]


@pytest.mark.slow
def test_outside_objective_trains_resumes_exactly_and_passes_the_checker(tmp_path, shared_tokenizer):
  folder = tmp_path / "my_experiment"
  folder.mkdir()
  source = folder / "my_objective.py"
  source.write_text(MY_OBJECTIVE)
  objective = f"{source}:MyObjective"

  _train(objective, shared_tokenizer, tmp_path / "full")
  part = tmp_path / "part"
  _train(objective, shared_tokenizer, part, "--config.train.stop_after=4")
  _train(objective, shared_tokenizer, part)
  full_records, part_records = _metrics(tmp_path / "full"), _metrics(part)
  assert [r["step"] for r in full_records if r["split"] == "train"] == list(range(1, 9))
  assert part_records == full_records  # every loss of the resumed run, bitwise

  config = json.loads((part / "config.json").read_text())
  assert config["objective"] == {"name": objective, "z_loss": 0.0, "weight": 0.5, "label": "x"}
  recorded = json.loads((part / "objective.json").read_text())
  assert recorded["file"] == str(source) and len(recorded["sha256"]) == 64
  assert recorded["class"].endswith(".MyObjective")

  # The objective's source changes between two invocations: the resume says so.
  source.write_text(MY_OBJECTIVE + "\n# tuned\n")
  proc = _train(objective, shared_tokenizer, part, "--config.train.steps=9")
  assert "the objective's source changed" in proc.stdout + proc.stderr
  events = [r for r in read_metrics(str(part)) if r.get("event") == "objective_changed"]
  assert len(events) == 1 and events[0]["before"]["sha256"] == recorded["sha256"]
  assert events[0]["now"]["sha256"] != recorded["sha256"]

  check = _cli("tfx.check_objective", "--config", os.path.join(ROOT, "configs", "tiny.py"),
               f"--config.objective.name={objective}")
  assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-2000:]
  assert "0 failed" in check.stdout and "mesh invariance 1 vs 2x2x2" in check.stdout
