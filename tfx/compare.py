"""Compare runs side by side: a table of their final metrics and a PNG of their curves.

    python -m tfx.compare runs/a runs/b gs://bucket/runs/c [--out compare.png] [--metric eval/loss]
    tfx compare runs/a runs/b

Each RUN is a workdir of `python -m tfx.train` (local or gs://): its metrics.jsonl is read (and
its config.json when there is one). The table has, per run: the last logged step (`/total` when
the run has not reached train.steps), tokens = step x train.batch_size x the raw tokens a row
reads (the objective's raw_length of data.seq_len, as perf/tokens_per_sec and tfx.sweep count), the
parameter count of config.json's model (traced, nothing computed; embedding rows from the run's
tokenizer, else data.vocab_size), the last train/loss, eval/loss and eval/accuracy, and the last
value of --metric. Metric names are those of TensorBoard (tfx.metrics.scalar_name): train/loss,
eval/accuracy, perf/tokens_per_sec, finetune_eval/accuracy, ...

The plot (matplotlib, Agg; tfx.plots.curve_panels) has --metric against step, and train/loss
beside it. --out may be gs:// too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Sequence

from etils import epath

from tfx.errors import UserError

DEFAULT_METRIC = "eval/loss"
TABLE_METRICS = ("train/loss", "eval/loss", "eval/accuracy")

Series = dict[str, tuple[list[int], list[float]]]


@dataclasses.dataclass
class Run:
  """One run's curves and what is known about it."""

  path: str
  label: str
  series: Series  # tfx.metrics.metric_series of its metrics.jsonl
  last_step: int | None
  total_steps: int | None = None  # config train.steps
  tokens: int | None = None
  params: int | None = None

  def last(self, name: str) -> float | None:
    """The value of metric `name` at its last logged step, or None."""
    points = self.series.get(name)
    return points[1][-1] if points and points[1] else None


# ----------------------------------------------------------------------------- reading


def read_run(path: str) -> tuple[list[dict], dict | None]:
  """(metrics.jsonl records, config.json as a dict or None); UserError if `path` is not a run."""
  from tfx.metrics import read_metrics

  root = epath.Path(path)
  if not root.exists():
    raise UserError(f"{path} does not exist; give the workdir of a run (python -m tfx.train --workdir ...)")
  if not root.is_dir():
    raise UserError(f"{path} is a file; give the workdir of a run, the folder that holds metrics.jsonl")
  has_config = (root / "config.json").exists()
  if not (root / "metrics.jsonl").exists():
    if has_config:
      raise UserError(f"{path} has a config.json but no metrics.jsonl yet: the run has not logged a step")
    raise UserError(f"{path} is not a tfx run: it has no metrics.jsonl (runs are the workdirs written by "
                    f"python -m tfx.train)")
  try:
    records = read_metrics(path)
  except json.JSONDecodeError as e:
    raise UserError(f"{path}/metrics.jsonl is not JSON lines ({e}); is this a tfx run?") from None
  if not records:
    raise UserError(f"{path}/metrics.jsonl is empty: the run has not logged a step")
  config = json.loads((root / "config.json").read_text()) if has_config else None
  return records, config


def _vocab_size(config, path: str) -> int:
  """Embedding rows: the run's tokenizer (as training fits it), else data.vocab_size."""
  try:
    from tfx.data.tokenizer import fit_vocab_size, load_tokenizer, saved_tokenizer

    tok = config.data.tokenizer or saved_tokenizer(path)
    if tok:
      return fit_vocab_size(load_tokenizer(str(tok)), config.data.vocab_size).vocab_size
  except Exception:  # noqa: BLE001  (a moved or unreadable tokenizer: fall back to the config)
    pass
  return int(config.data.vocab_size)


_PARAMS: dict[str, int | None] = {}  # param counts by (model config, vocab, length)


def param_count(config_dict: dict, path: str = "") -> int | None:
  """Parameters of the model in `config_dict` (a config.json), from shapes only; None if it
  cannot be built (e.g. a config from an older tfx)."""
  import ml_collections

  try:
    config = ml_collections.ConfigDict(config_dict)
    vocab = _vocab_size(config, path)
    key = json.dumps([config_dict["model"], vocab, config.data.seq_len], sort_keys=True)
    if key not in _PARAMS:
      _PARAMS[key] = _count_params(config, vocab)
    return _PARAMS[key]
  except Exception:  # noqa: BLE001  (unknown family, missing field, ...: the table shows '-')
    return None


def _count_params(config, vocab_size: int) -> int:
  import jax
  import numpy as np

  from tfx.models import build_model
  from tfx.registry import load_builtins

  load_builtins()
  model = build_model(config.model, vocab_size=vocab_size, max_length=config.data.seq_len)
  inputs = type(model).init_inputs(1, config.data.seq_len)
  shapes = jax.eval_shape(lambda r: model.init({"params": r, "dropout": r}, **inputs)["params"], jax.random.key(0))
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))


def row_tokens(config: dict) -> int:
  """Raw tokens one row of the run reads: its objective's raw_length of data.seq_len (T5's span
  corruption reads 568 for 512 model positions); data.seq_len when the objective cannot be loaded
  any more (a file that moved)."""
  import ml_collections

  from tfx.objectives.base import placeholder_ids
  from tfx.registry import OBJECTIVES, load_builtins

  seq_len = int(config["data"]["seq_len"])
  try:
    load_builtins()
    c = ml_collections.ConfigDict(config)
    objective = OBJECTIVES.get(c.objective.name).from_config(c.objective, placeholder_ids(int(c.data.vocab_size)))
    return int(objective.raw_length(seq_len))
  except (ValueError, KeyError, AttributeError, TypeError, ImportError, OSError):
    return seq_len


def summarize(path: str, label: str, records: list[dict], config: dict | None, *, params: bool = True) -> Run:
  """A `Run` from its records and config."""
  from tfx.metrics import metric_series

  train_steps = [r["step"] for r in records if r.get("split") == "train"]
  all_steps = [r["step"] for r in records if r.get("split") != "event"]
  last = max(train_steps or all_steps) if (train_steps or all_steps) else None
  run = Run(path=path, label=label, series=metric_series(records), last_step=last)
  if config:
    train, data = config.get("train", {}), config.get("data", {})
    run.total_steps = train.get("steps")
    if last is not None and train.get("batch_size") and data.get("seq_len"):
      run.tokens = int(last) * int(train["batch_size"]) * row_tokens(config)
    if params:
      run.params = param_count(config, path)
  return run


def labels(paths: Sequence[str]) -> list[str]:
  """Short unique names: the fewest trailing path components that tell the runs apart."""
  parts = [str(p).rstrip("/").split("/") for p in paths]
  for k in range(1, max(len(p) for p in parts) + 1):
    names = ["/".join(p[-k:]) for p in parts]
    if len(set(names)) == len(names):
      return names
  return [f"{p} #{i + 1}" for i, p in enumerate(paths)]  # the same run given twice


# ----------------------------------------------------------------------------- output


def _human(n: int | None) -> str:
  if n is None:
    return "-"
  for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
    if n >= size:
      return f"{n / size:.3g}{unit}"
  return str(n)


def _value(v: float | None) -> str:
  return "-" if v is None else f"{v:.4f}" if abs(v) < 100 else f"{v:,.1f}"


def _steps(run: Run) -> str:
  if run.last_step is None:
    return "-"
  unfinished = run.total_steps and run.last_step < run.total_steps
  return f"{run.last_step}/{run.total_steps}" if unfinished else str(run.last_step)


def table(runs: Sequence[Run], metric: str = DEFAULT_METRIC) -> str:
  """The side-by-side table, one row per run (plain text, aligned)."""
  metrics = list(TABLE_METRICS) + ([metric] if metric not in TABLE_METRICS else [])
  header = ["run", "steps", "tokens", "params", *metrics]
  rows = [[r.label, _steps(r), _human(r.tokens), _human(r.params), *[_value(r.last(m)) for m in metrics]] for r in runs]
  widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
  fmt = lambda row: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
  return "\n".join([fmt(header), "  ".join("-" * w for w in widths), *map(fmt, rows)])


def plot(runs: Sequence[Run], out, metric: str = DEFAULT_METRIC) -> str:
  """PNG of `metric` (and train/loss beside it) against step, one line per run."""
  from tfx import plots

  names = [metric] + (["train/loss"] if metric != "train/loss" else [])
  panels = {}
  for name in names:
    series = {r.label: [r.series[name]] for r in runs if name in r.series}
    if series or name == metric:
      panels[name] = series
  title = f"{len(runs)} run{'s' if len(runs) != 1 else ''}: {metric}"
  return plots.curve_panels(panels, out, title)


def compare(paths: Sequence[str], out=None, metric: str = DEFAULT_METRIC, *, params: bool = True) -> tuple[str, list[Run]]:
  """Reads the runs, writes the plot to `out` (if given); returns (the report text, the runs).

  Raises:
    UserError: a path that is not a run, or a metric that no run logged.
  """
  from tfx import gcs

  if not paths:
    raise UserError("give at least one run directory")
  gcs.preflight(*paths, *([out] if out else []))
  names = labels(paths)
  runs = [summarize(p, name, *read_run(p), params=params) for p, name in zip(paths, names)]
  missing = [r.label for r in runs if metric not in r.series]
  if len(missing) == len(runs):
    known = sorted({name for r in runs for name in r.series})
    raise UserError(f"no run logged {metric!r}; --metric may be one of: {', '.join(known)}")
  lines = [table(runs, metric)]
  if missing:
    lines.append(f"{metric} was not logged by: {', '.join(missing)}")
  if out:
    lines.append(f"plot: {plot(runs, out, metric)}")
  return "\n".join(lines), runs


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m tfx.compare", description=__doc__.split("\n")[0])
  parser.add_argument("runs", nargs="+", metavar="RUN", help="run directories (workdirs), local or gs://")
  parser.add_argument("--out", default="compare.png", help="PNG to write (local or gs://; default compare.png)")
  parser.add_argument("--metric", default=DEFAULT_METRIC,
                      help="metric to plot and tabulate, e.g. eval/loss, eval/accuracy, train/loss (default eval/loss)")
  parser.add_argument("--no-params", action="store_true", help="skip counting parameters (it traces each model)")
  args = parser.parse_args(argv)
  try:
    text, _ = compare(args.runs, args.out, args.metric, params=not args.no_params)
  except UserError as e:
    sys.exit(f"tfx.compare: {e}")
  print(text)


if __name__ == "__main__":
  main()
