"""The report of a sweep: results.csv (one row per run), results.md (per arm: mean and 95%
confidence interval over seeds, n, and a p-value against the baseline arm) and PNG plots
(eval-loss curves with a band over seeds; downstream scores with confidence-interval bars).

Statistics, per arm and metric over its n seeds: mean; 95% CI = mean +- t(0.975, n-1) * s / sqrt(n)
(Student's t, s the sample standard deviation); p-value of the difference to the baseline arm by
Welch's two-sided t-test (unequal variances, scipy.stats.ttest_ind with equal_var=False). Seeds
are not paired across arms: an arm's seed k and the baseline's seed k share the data order and
initialisation seed but not the model, so the unpaired test is the honest (conservative) one.
"""

from __future__ import annotations

import csv
import io
import math
import os
from typing import Any, Sequence

import numpy as np
from etils import epath

# The metrics a report shows, in order, when runs have them: (key in the run record, label, higher is better).
PRETRAIN_METRICS = (("pretrain/eval/loss", "pretrain eval loss", False),
                    ("pretrain/eval/accuracy", "pretrain eval accuracy", True))


def mean_ci(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
  """(mean, half-width of the `confidence` interval, Student's t); half-width nan for n < 2."""
  from scipy import stats  # noqa: PLC0415

  x = np.asarray(values, np.float64)
  if len(x) == 0:
    return math.nan, math.nan
  if len(x) < 2:
    return float(x.mean()), math.nan
  half = stats.t.ppf(0.5 + confidence / 2, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x))
  return float(x.mean()), float(half)


def p_value(values: Sequence[float], baseline: Sequence[float]) -> float:
  """Welch's two-sided t-test of mean(values) != mean(baseline); nan when it is undefined."""
  from scipy import stats  # noqa: PLC0415

  a, b = np.asarray(values, np.float64), np.asarray(baseline, np.float64)
  if len(a) < 2 or len(b) < 2 or (a.std() == 0 and b.std() == 0):
    return math.nan
  return float(stats.ttest_ind(a, b, equal_var=False).pvalue)


def flatten(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
  """{"pretrain/eval/loss": 3.1, "finetune/test/accuracy": 0.8, ...}: the numbers of a run.json."""
  out: dict[str, float] = {}
  for k, v in record.items():
    if k in ("provenance", "overrides", "fingerprint"):
      continue
    key = f"{prefix}{k}"
    if isinstance(v, dict):
      out.update(flatten(v, f"{key}/"))
    elif isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None and math.isfinite(v):
      out[key] = float(v)
  return out


def downstream_metrics(rows: list[dict[str, float]]) -> list[tuple[str, str, bool]]:
  """The fine-tuning test metrics the runs have: (key, label, higher is better)."""
  shown = ("accuracy", "macro_f1", "mcc")  # the test loss is in results.csv
  keys = [f"finetune/test/{m}" for m in shown if any(f"finetune/test/{m}" in r for r in rows)]
  return [(k, "downstream " + k.split("/", 2)[2].replace("_", " "), True) for k in keys]


def _fmt(mean: float, half: float) -> str:
  if math.isnan(mean):
    return ""
  return f"{mean:.4f}" if math.isnan(half) else f"{mean:.4f} ± {half:.4f}"


def _fmt_p(p: float) -> str:
  return "" if math.isnan(p) else (f"{p:.1e}" if p < 1e-3 else f"{p:.3f}")


def summarize(records: list[dict[str, Any]], arms: Sequence[str], baseline: str
              ) -> tuple[list[tuple[str, str, bool]], list[dict[str, Any]]]:
  """(metrics shown, one row per arm: n, steps, tokens, flops, {metric: (mean, half, p)})."""
  rows = [flatten(r) | {"arm": r["arm"]} for r in records]
  metrics = [m for m in (*PRETRAIN_METRICS, *downstream_metrics(rows)) if any(m[0] in r for r in rows)]
  by_arm = {a: [r for r in rows if r["arm"] == a] for a in arms}
  table = []
  for arm in arms:
    runs = by_arm[arm]
    if not runs:
      continue
    entry: dict[str, Any] = {"arm": arm, "n": len(runs), "steps": runs[0].get("steps", 0),
                             "tokens": runs[0].get("tokens", 0), "flops": runs[0].get("flops", 0), "metrics": {}}
    for key, _, _ in metrics:
      values = [r[key] for r in runs if key in r]
      base = [r[key] for r in by_arm.get(baseline, []) if key in r]
      mean, half = mean_ci(values)
      entry["metrics"][key] = (mean, half, p_value(values, base) if arm != baseline else math.nan)
    table.append(entry)
  majority = _majority_row(rows, metrics)
  if majority:
    table.append(majority)
  return metrics, table


MAJORITY = "majority class (baseline)"


def _majority_row(rows: list[dict[str, float]], metrics) -> dict[str, Any] | None:
  """The majority-class baseline on the test split, beside the downstream columns."""
  out = {"arm": MAJORITY, "n": 0, "steps": 0, "tokens": 0, "flops": 0, "metrics": {}}
  for key, _, _ in metrics:
    base = key.replace("finetune/test/", "finetune/baselines/majority/") if key.startswith("finetune/test/") else ""
    values = [r[base] for r in rows if base and base in r]
    out["metrics"][key] = (float(np.mean(values)) if values else math.nan, math.nan, math.nan)
    out["n"] = max(out["n"], len(values))
  return out if out["n"] else None


def markdown(title: str, question: str, metrics, table, baseline: str, provenance: dict | None) -> str:
  lines = [f"# {title}", ""]
  if question:
    lines += [question, ""]
  if provenance:
    dev = provenance.get("devices", {})
    lines += [f"commit {provenance.get('git_commit', '?')[:10]}{' (with local changes)' if provenance.get('git_dirty') else ''}"
              f", {dev.get('count', '?')} x {dev.get('kind') or dev.get('platform', '?')}, "
              f"jax {provenance.get('versions', {}).get('jax', '?')}", ""]
  head = ["arm", "n", "steps", "tokens", "train FLOPs"]
  for key, label, _ in metrics:
    head += [f"{label} (mean ± 95% CI)", f"p vs {baseline}"]
  lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for e in table:
    trained = e["steps"] > 0
    cells = [e["arm"], str(e["n"]), f"{int(e['steps']):,}" if trained else "", f"{e['tokens']:.3g}" if trained else "",
             f"{e['flops']:.3g}" if trained else ""]
    for key, _, _ in metrics:
      mean, half, p = e["metrics"][key]
      cells += [_fmt(mean, half), _fmt_p(p)]
    lines.append("| " + " | ".join(cells) + " |")
  lines += ["", "Mean over seeds ± the half-width of the 95% Student-t confidence interval; p: Welch's "
            "two-sided t-test against the baseline arm. Pretraining losses of different objectives measure "
            "different things: compare arms by the downstream columns."]
  return "\n".join(lines) + "\n"


def csv_text(records: list[dict[str, Any]]) -> str:
  rows = [{**flatten(r), "arm": r["arm"], "seed": r["seed"]} for r in records]
  columns = ["arm", "seed"] + sorted({k for r in rows for k in r} - {"arm", "seed"})
  buf = io.StringIO()
  writer = csv.DictWriter(buf, fieldnames=columns)
  writer.writeheader()
  for row in rows:
    writer.writerow(row)
  return buf.getvalue()


def _curves(runs, records_by_key) -> dict[str, list[tuple[np.ndarray, np.ndarray]]]:
  from tfx.metrics import read_metrics  # noqa: PLC0415

  series: dict[str, list] = {}
  for run in runs:
    if run.key not in records_by_key or run.scratch:
      continue
    evals = [r for r in read_metrics(os.path.join(run.directory, "pretrain")) if r.get("split") == "eval"
             and r.get("loss") is not None]
    if evals:
      series.setdefault(run.arm, []).append((np.array([r["step"] for r in evals]),
                                             np.array([r["loss"] for r in evals])))
  return series


def write_report(sweep, runs, workdir: str) -> list[str]:
  """Writes results.csv, results.md and the plots for the complete runs; returns their paths."""
  from tfx import plots  # noqa: PLC0415
  from tfx.sweep import RUN_FILE, SCRATCH  # noqa: PLC0415

  import json  # noqa: PLC0415

  out = epath.Path(workdir)
  out.mkdir(parents=True, exist_ok=True)
  records, by_key = [], {}
  for run in runs:
    path = epath.Path(run.directory) / RUN_FILE
    if path.exists():
      record = json.loads(path.read_text())
      records.append(record)
      by_key[run.key] = record
  arms = [a.name for a in sweep.arms] + ([SCRATCH] if any(r.scratch for r in runs) else [])
  baseline = sweep.baseline_arm()
  metrics, table = summarize(records, arms, baseline)
  provenance = records[0].get("provenance") if records else None
  title = f"{sweep.name}: {len(records)} of {len(runs)} runs complete"
  (out / "results.md").write_text(markdown(title, sweep.question, metrics, table, baseline, provenance))
  (out / "results.csv").write_text(csv_text(records))
  paths = [str(out / "results.md"), str(out / "results.csv")]
  series = _curves(runs, by_key)
  if series:
    plots.curves_with_band(series, str(out / "eval_loss.png"), f"{sweep.name}: pretraining eval loss",
                           "eval loss")
    paths.append(str(out / "eval_loss.png"))
  for key, label, _ in metrics:
    if not key.startswith("finetune/"):
      continue
    shown = [e for e in table if not math.isnan(e["metrics"][key][0])]
    means = [e["metrics"][key][0] for e in shown]
    halves = [e["metrics"][key][1] for e in shown]  # nan: one seed, no interval (no error bar drawn)
    name = key.replace("/", "_") + ".png"
    plots.bars_with_errors([e["arm"] for e in shown], means, [m - h for m, h in zip(means, halves)],
                           [m + h for m, h in zip(means, halves)], str(out / name), f"{sweep.name}: {label}", label)
    paths.append(str(out / name))
  return paths
