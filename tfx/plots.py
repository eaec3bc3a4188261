"""PNG plots from data (not from run directories), for tfx.compare and the sweep reports.

Stable signatures (keyword arguments after `*` may be added; nothing else changes):

    curves_with_band(series: dict[str, list[tuple[steps, values]]], path, title, ylabel, *,
                     xlabel="step", band="minmax", logy=False) -> str
        One line per arm (the dict key, in dict order) = the mean over its seeds (the list) at
        each step, with a shaded band: band="minmax" (default) shades min..max over the seeds,
        band="std" shades mean +- 1 standard deviation (population, ddof=0). At each step the
        statistics are over the seeds that logged that step. `steps` and `values` are 1-D
        array-likes of equal length; non-finite values are dropped.

    curve_panels(panels: dict[str, dict[str, list[tuple[steps, values]]]], path, title, *,
                 xlabel="step", band="minmax", logy=False) -> str
        Several such plots side by side, one per panel (key = its y label); an arm keeps its
        colour in every panel.

    bars_with_errors(names, means, lows, highs, path, title, ylabel) -> str
        One bar per name at its mean, with an error bar from low to high (absolute values, e.g.
        the bounds of a 95% confidence interval, not offsets from the mean). A low/high that is
        None or NaN draws that bar without an error bar. Bars start at 0; each is labelled with
        its mean and interval. Means must be finite.

    seed_band(runs: list[tuple[steps, values]], band="minmax") -> (steps, mean, low, high)
        The statistics the curves draw, as numpy arrays (for tables and tests).

Each plotting function writes a PNG to `path` (local or gs://, through etils.epath; a local
parent folder is created) and returns the path as a string. Drawing uses matplotlib's Agg
canvas directly (no pyplot, no display, no global state), so it is safe in scripts and tests.
"""

from __future__ import annotations

import io
from typing import Sequence

import numpy as np
from etils import epath

Points = tuple[Sequence[float], Sequence[float]]  # (steps, values) of one seed
BANDS = ("minmax", "std")


def seed_band(runs: Sequence[Points], band: str = "minmax") -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """(steps, mean, low, high) over the seeds in `runs`, at every step any seed logged.

  band="minmax": low/high are the min/max over the seeds; band="std": mean -+ 1 std (ddof=0).
  """
  if band not in BANDS:
    raise ValueError(f"band={band!r}: choose one of {', '.join(BANDS)}")
  by_step: dict[float, list[float]] = {}
  for steps, values in runs:
    steps, values = np.asarray(steps, dtype=float).ravel(), np.asarray(values, dtype=float).ravel()
    if steps.shape != values.shape:
      raise ValueError(f"steps ({steps.size}) and values ({values.size}) differ in length")
    for s, v in zip(steps, values):
      if np.isfinite(s) and np.isfinite(v):
        by_step.setdefault(float(s), []).append(float(v))
  xs = np.array(sorted(by_step), dtype=float)
  groups = [np.array(by_step[x]) for x in xs]
  mean = np.array([g.mean() for g in groups])
  if band == "minmax":
    low, high = np.array([g.min() for g in groups]), np.array([g.max() for g in groups])
  else:
    std = np.array([g.std() for g in groups])
    low, high = mean - std, mean + std
  return xs, mean, low, high


def _figure(ncols: int = 1):
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  fig = Figure(figsize=(6.4 * ncols, 4.4), layout="constrained")
  FigureCanvasAgg(fig)
  return fig


def _save(fig, path) -> str:
  """Writes `fig` as a PNG to `path` (local or gs://)."""
  buffer = io.BytesIO()
  fig.savefig(buffer, format="png", dpi=110)
  out = epath.Path(path)
  if "://" not in str(out):
    out.parent.mkdir(parents=True, exist_ok=True)
  out.write_bytes(buffer.getvalue())
  return str(out)


def _colour(i: int) -> str:
  return f"C{i % 10}" if i < 10 else _TAB20[i % 20]


_TAB20 = ("#1f77b4", "#aec7e8", "#ff7f0e", "#ffbb78", "#2ca02c", "#98df8a", "#d62728", "#ff9896", "#9467bd", "#c5b0d5",
          "#8c564b", "#c49c94", "#e377c2", "#f7b6d2", "#7f7f7f", "#c7c7c7", "#bcbd22", "#dbdb8d", "#17becf", "#9edae5")


def _draw_curves(ax, series: dict[str, Sequence[Points]], colours: dict[str, str], band: str, ylabel: str,
                 xlabel: str, logy: bool) -> None:
  drawn = 0
  for name, runs in series.items():
    steps, mean, low, high = seed_band(runs, band)
    if not len(steps):
      continue
    drawn += 1
    label = name if len(runs) == 1 else f"{name} (n={len(runs)})"
    marker = "o" if len(steps) <= 30 else None  # few points (evaluations): show where they are
    ax.plot(steps, mean, color=colours[name], label=label, linewidth=1.6, marker=marker, markersize=3)
    if len(runs) > 1:
      ax.fill_between(steps, low, high, color=colours[name], alpha=0.2, linewidth=0)
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  if logy:
    ax.set_yscale("log")
  ax.grid(True, alpha=0.3)
  if drawn:
    ax.legend(fontsize="small")
  else:
    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)


def _band_note(series_list: Sequence[dict[str, Sequence[Points]]], band: str) -> str:
  seeds = any(len(runs) > 1 for series in series_list for runs in series.values())
  if not seeds:
    return ""
  return " (mean over seeds; band: min-max)" if band == "minmax" else " (mean over seeds; band: +-1 std)"


def curve_panels(panels: dict[str, dict[str, Sequence[Points]]], path, title: str, *, xlabel: str = "step",
                 band: str = "minmax", logy: bool = False) -> str:
  """Side-by-side curve plots, one per panel {ylabel: {arm: [(steps, values) per seed]}}; see the module."""
  if not panels:
    raise ValueError("curve_panels needs at least one panel")
  if band not in BANDS:
    raise ValueError(f"band={band!r}: choose one of {', '.join(BANDS)}")
  names = list(dict.fromkeys(name for series in panels.values() for name in series))
  colours = {name: _colour(i) for i, name in enumerate(names)}
  fig = _figure(len(panels))
  axes = fig.subplots(1, len(panels), squeeze=False)[0]
  for ax, (ylabel, series) in zip(axes, panels.items()):
    _draw_curves(ax, series, colours, band, ylabel, xlabel, logy)
  fig.suptitle(title + _band_note(list(panels.values()), band))
  return _save(fig, path)


def curves_with_band(series: dict[str, Sequence[Points]], path, title: str, ylabel: str, *, xlabel: str = "step",
                     band: str = "minmax", logy: bool = False) -> str:
  """One line per arm (mean over its seeds) with a min-max (or +-1 std) band; see the module."""
  return curve_panels({ylabel: series}, path, title, xlabel=xlabel, band=band, logy=logy)


def _missing(x) -> bool:
  return x is None or not np.isfinite(float(x))


def bars_with_errors(names: Sequence[str], means: Sequence[float], lows: Sequence[float | None],
                     highs: Sequence[float | None], path, title: str, ylabel: str) -> str:
  """Bars at `means` with error bars from `lows` to `highs` (absolute bounds); see the module."""
  n = len(names)
  if not (len(means) == len(lows) == len(highs) == n):
    raise ValueError(f"bars_with_errors: names ({n}), means ({len(means)}), lows ({len(lows)}) and highs "
                     f"({len(highs)}) must have the same length")
  below, above = np.full(n, np.nan), np.full(n, np.nan)  # NaN: no error bar
  for i, (name, mean, low, high) in enumerate(zip(names, means, lows, highs)):
    if _missing(mean):
      raise ValueError(f"bars_with_errors: {name!r} has no mean ({mean}); leave it out of the plot")
    if _missing(low) or _missing(high):
      continue
    if not float(low) <= float(mean) <= float(high):
      raise ValueError(f"bars_with_errors: {name!r} has mean {mean} outside its interval [{low}, {high}]; "
                       f"lows and highs are absolute bounds, not offsets")
    below[i], above[i] = float(mean) - float(low), float(high) - float(mean)
  fig = _figure(max(1, min(3, n / 6)))
  ax = fig.subplots()
  xs = np.arange(n)
  ax.bar(xs, [float(m) for m in means], yerr=np.stack([below, above]), capsize=4,
         color=[_colour(i) for i in range(n)], alpha=0.85)
  ax.set_xticks(xs, list(names), rotation=30 if n > 4 else 0, ha="right" if n > 4 else "center")
  ax.set_ylabel(ylabel)
  ax.grid(True, axis="y", alpha=0.3)
  for x, mean, low, high in zip(xs, means, lows, highs):  # the numbers, since bars start at 0
    text, top = f"{float(mean):.4g}", float(mean)
    if not (_missing(low) or _missing(high)):
      text, top = f"{text}\n[{float(low):.4g}, {float(high):.4g}]", float(high)
    ax.annotate(text, (x, top), xytext=(0, 3), textcoords="offset points", ha="center", va="bottom", fontsize="x-small")
  ax.margins(y=0.15)
  ax.set_title(title)
  return _save(fig, path)
