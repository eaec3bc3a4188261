"""tfx.compare (table + PNG of runs) and tfx.plots (PNG helpers), on synthetic runs: a
metrics.jsonl and a config.json written by the test, no training."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import ROOT, tiny_config
from tfx import compare, plots
from tfx.config import to_json
from tfx.errors import UserError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def fake_run(workdir, final_eval: float, steps: int = 20, config_overrides=(), with_config: bool = True) -> str:
  """A run directory as tfx.train leaves it: metrics.jsonl (train every 2 steps, eval every 10) and config.json."""
  os.makedirs(workdir, exist_ok=True)
  records = [{"step": 0, "split": "eval", "loss": 8.0, "accuracy": 0.0, "num_tokens": 100.0}]
  for step in range(2, steps + 1, 2):
    records.append({"step": step, "split": "train", "loss": 8.0 - step / steps * 2, "accuracy": step / 100,
                    "learning_rate": 1e-3, "tokens_per_sec": 5000.0, "mfu": None})
    if step % 10 == 0:
      loss = 8.0 + (final_eval - 8.0) * step / steps
      records.append({"step": step, "split": "eval", "loss": loss, "accuracy": step / 50, "num_tokens": 100.0})
  records.insert(3, {"step": 4, "split": "event", "event": "corpus_changed", "changes": ["x"]})
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)
  if with_config:
    config = tiny_config(f"--config.train.steps={steps}", *config_overrides)
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(to_json(config))
  return str(workdir)


def assert_png(path):
  with open(path, "rb") as f:
    assert f.read(8) == PNG_SIGNATURE
  import matplotlib.image

  image = matplotlib.image.imread(path)
  assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
  assert image.std() > 0  # something was drawn


def test_compare_table_and_plot(tmp_path):
  a = fake_run(tmp_path / "sweep" / "a", final_eval=5.0)
  b = fake_run(tmp_path / "sweep" / "b", final_eval=4.5, config_overrides=("--config.model.num_layers=4",))
  out = tmp_path / "plots" / "compare.png"
  text, runs = compare.compare([a, b], out)
  lines = text.splitlines()
  assert lines[0].split() == ["run", "steps", "tokens", "params", "train/loss", "eval/loss", "eval/accuracy"]
  row_a = next(ln for ln in lines if ln.startswith("a ")).split()
  row_b = next(ln for ln in lines if ln.startswith("b ")).split()
  assert row_a[1] == "20" and row_a[5] == "5.0000" and row_a[6] == "0.4000" and row_a[4] == "6.0000"
  assert row_b[5] == "4.5000"
  tokens = 20 * 8 * 64  # steps x batch x seq_len of configs/tiny.py
  c = tiny_config()
  assert (c.train.batch_size, c.data.seq_len) == (8, 64)
  assert runs[0].tokens == tokens and row_a[2] == f"{tokens / 1e3:.3g}K"
  assert runs[0].params and runs[1].params > runs[0].params  # 4 layers instead of 2
  assert text.splitlines()[-1] == f"plot: {out}"
  assert_png(out)


def test_compare_other_metric_unfinished_run_and_no_config(tmp_path):
  a = fake_run(tmp_path / "a", final_eval=5.0, steps=20)
  with open(os.path.join(a, "config.json")) as f:
    config = json.load(f)
  config["train"]["steps"] = 100  # stopped at 20 of 100
  with open(os.path.join(a, "config.json"), "w") as f:
    json.dump(config, f)
  b = fake_run(tmp_path / "b", final_eval=4.0, with_config=False)
  text, runs = compare.compare([a, b], tmp_path / "perf.png", metric="perf/tokens_per_sec", params=False)
  header = text.splitlines()[0].split()
  assert header[-1] == "perf/tokens_per_sec"
  row_a, row_b = [ln.split() for ln in text.splitlines()[2:4]]
  assert row_a[1] == "20/100" and row_a[-1] == "5,000.0"
  assert row_b[1:4] == ["20", "-", "-"]  # no config.json: no tokens or parameters
  assert_png(tmp_path / "perf.png")


def test_compare_errors(tmp_path):
  run = fake_run(tmp_path / "run", final_eval=5.0)
  (tmp_path / "empty").mkdir()
  with pytest.raises(UserError, match=r"empty is not a tfx run: it has no metrics.jsonl"):
    compare.compare([run, str(tmp_path / "empty")], tmp_path / "x.png")
  with pytest.raises(UserError, match="does not exist"):
    compare.compare([str(tmp_path / "nowhere")])
  with pytest.raises(UserError, match=r"no run logged 'eval/perplexity'; --metric may be one of: .*eval/loss"):
    compare.compare([run], metric="eval/perplexity")
  half = tmp_path / "half"
  half.mkdir()
  (half / "config.json").write_text("{}")
  with pytest.raises(UserError, match="no metrics.jsonl yet"):
    compare.compare([str(half)])
  (half / "metrics.jsonl").write_text('{"step": 3, "loss": 1.0}\n{"step": 4, "split": "train", "loss": 0.9}\n')
  with pytest.raises(UserError, match=r"metrics.jsonl line 1 is not a metrics record"):  # no split: not a KeyError
    compare.compare([str(half)])
  assert not (tmp_path / "x.png").exists()


def test_labels_are_the_shortest_unique_suffixes():
  assert compare.labels(["runs/a", "runs/b"]) == ["a", "b"]
  assert compare.labels(["s/x/seed0", "s/y/seed0", "s/y/seed1/"]) == ["x/seed0", "y/seed0", "y/seed1"]
  assert compare.labels(["gs://b/r", "gs://b/r"]) == ["gs://b/r #1", "gs://b/r #2"]


def test_cli(tmp_path):
  """`tfx compare` and `python -m tfx.compare`: the table on stdout, the PNG, and errors without a traceback."""
  a = fake_run(tmp_path / "a", final_eval=5.0)
  b = fake_run(tmp_path / "b", final_eval=4.0)
  out = tmp_path / "c.png"
  proc = subprocess.run([sys.executable, "-m", "tfx.cli", "compare", a, b, "--out", str(out), "--no-params"], cwd=ROOT,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "eval/loss" in proc.stdout and "\na " in proc.stdout and "\nb " in proc.stdout
  assert_png(out)
  proc = subprocess.run([sys.executable, "-m", "tfx.compare", a, str(tmp_path)], cwd=ROOT, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 1 and "is not a tfx run" in proc.stderr and "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------- tfx.plots


def test_seed_band_statistics():
  runs = [([0, 10, 20], [3.0, 2.0, 1.0]), ([0, 10, 20], [5.0, 4.0, np.nan]), ([0, 10], [4.0, 3.0])]
  steps, mean, low, high = plots.seed_band(runs)
  np.testing.assert_array_equal(steps, [0, 10, 20])
  np.testing.assert_allclose(mean, [4.0, 3.0, 1.0])  # step 20: the only finite seed
  np.testing.assert_allclose(low, [3.0, 2.0, 1.0])
  np.testing.assert_allclose(high, [5.0, 4.0, 1.0])
  _, mean, low, high = plots.seed_band(runs, band="std")
  np.testing.assert_allclose(high - mean, [np.std([3, 5, 4]), np.std([2, 4, 3]), 0.0])
  np.testing.assert_allclose(mean - low, high - mean)
  with pytest.raises(ValueError, match="band="):
    plots.seed_band(runs, band="iqr")


def test_plot_helpers_write_pngs(tmp_path):
  rng = np.random.default_rng(0)
  steps = np.arange(0, 100, 10)
  series = {arm: [(steps, 4 - steps / 50 * (1 + i) + rng.normal(0, 0.05, steps.size)) for _ in range(3)]
            for i, arm in enumerate(["baseline", "ablation"])}
  path = plots.curves_with_band(series, tmp_path / "curves.png", "eval loss", "loss")
  assert path == str(tmp_path / "curves.png")
  assert_png(path)
  assert_png(plots.curves_with_band(series, tmp_path / "std.png", "eval loss", "loss", band="std", logy=True))
  assert_png(plots.curve_panels({"eval/loss": series, "train/loss": {"baseline": []}}, tmp_path / "p.png", "two"))
  out = plots.bars_with_errors(["baseline", "ablation", "single"], [3.2, 3.0, 3.1], [3.1, 2.95, None],
                               [3.3, 3.05, None], tmp_path / "sub" / "bars.png", "final eval loss (95% CI)", "loss")
  assert_png(out)


def test_bars_with_errors_rejects_bad_input(tmp_path):
  with pytest.raises(ValueError, match="same length"):
    plots.bars_with_errors(["a", "b"], [1.0], [0.5], [1.5], tmp_path / "x.png", "t", "y")
  with pytest.raises(ValueError, match="absolute bounds, not offsets"):
    plots.bars_with_errors(["a"], [3.0], [0.1], [0.2], tmp_path / "x.png", "t", "y")
  with pytest.raises(ValueError, match="has no mean"):
    plots.bars_with_errors(["a"], [float("nan")], [None], [None], tmp_path / "x.png", "t", "y")
  assert not (tmp_path / "x.png").exists()


def test_tokens_count_the_raw_row_as_sweeps_and_tokens_per_sec_do():
  """A span-corruption row reads more raw tokens than its model positions (and XLNet's fewer):
  compare's token count uses the objective's raw_length, the count tfx.sweep budgets with."""
  from tfx import sweep
  from tfx.config import load_config

  for name in ("t5_tiny.py", "xlnet_tiny.py", "tiny.py"):
    config = load_config(os.path.join(ROOT, "configs", name))
    per_step, _ = sweep._per_step(config)
    assert compare.row_tokens(json.loads(to_json(config))) * config.train.batch_size == per_step
    if name != "tiny.py":
      assert compare.row_tokens(json.loads(to_json(config))) != config.data.seq_len
