"""The non-finite guard and the loss-spike detector: what the loop does with the step's flags.

The train step computes, on device, `metrics["nonfinite"]` (1.0 when the loss or the gradient
norm is NaN/Inf; tfx/steps.py). The loop reads the flags only where it reads metrics anyway (each
log step) and where it must know (each checkpoint: a bad state is never saved). `Guard.check`
looks at the steps read since the last check and applies `train.on_nonfinite`:

  stop    (default) an `nonfinite` event record, then NonFiniteError: the run exits non-zero and
          nothing after the last good checkpoint is saved.
  skip    the step already left the state unchanged (inside jit); a `nonfinite_skipped` event
          counts it; more than `train.max_skipped` bad steps in a row stop the run as above.
  rewind  Guard.check returns REWIND: the loop restores the last good checkpoint and continues
          with the next batches (never the ones that diverged); more than `train.max_skipped`
          rewinds without a good checkpoint in between stop the run.

The spike detector writes a `loss_spike` event (a warning, nothing else) when a step's loss
exceeds `train.spike_factor` times the median of the last SPIKE_WINDOW finite losses.
"""

import collections
import math
import statistics

import jax

from tfx.errors import UserError

REWIND = "rewind"
SPIKE_WINDOW = 100  # finite losses in the running median
SPIKE_MIN = 10  # losses seen before the detector speaks


class NonFiniteError(UserError):
  """Training diverged (NaN/Inf loss or gradient) and the policy says stop."""


class Guard:

  def __init__(self, train_cfg, writer, progress, *, policy: str | None = None, advice: str | None = None):
    self.policy = policy or train_cfg.on_nonfinite
    self.advice = advice or ("Lower optim.learning_rate or raise optim.warmup_steps, or set "
                             "--config.train.on_nonfinite=skip (drop such steps) or =rewind (go back to the last "
                             "checkpoint), and run the same command to resume")
    self.max_skipped = train_cfg.max_skipped
    self.spike_factor = train_cfg.spike_factor
    self.poison_step = train_cfg.poison_step
    self.writer, self.progress = writer, progress
    self.in_a_row = 0  # consecutive non-finite steps (skip) or rewinds without progress (rewind)
    self.skipped = 0
    self.good_checkpoint = None  # step of the last checkpoint saved (finite by construction)
    self._losses = collections.deque(maxlen=SPIKE_WINDOW)
    self._poisoned = False

  def poison(self, step: int):
    """The test hook `train.poison_step`: NaN for the first attempt at that step, else None."""
    if self.poison_step and step == self.poison_step and not self._poisoned:
      self._poisoned = True
      return float("nan")
    return None

  def check(self, metrics: list, last_step: int):
    """Reads the flags of the steps `last_step - len(metrics) + 1 .. last_step` (the train step's
    metrics, already on the host: the loop reads them once for the guard and the log);
    returns None (go on) or REWIND; raises NonFiniteError when the policy says stop."""
    if not metrics:
      return None
    host = jax.device_get(metrics)  # a no-op on host values
    first = last_step - len(host) + 1
    bad = []
    for i, m in enumerate(host):
      step = first + i
      if float(m["nonfinite"]) > 0:
        bad.append(step)
        self.in_a_row += 1 if self.policy == "skip" else 0
        if self.policy != "skip":
          return self._diverged(step, m)
        if self.in_a_row > self.max_skipped:
          return self._diverged(step, m, f"{self.in_a_row} non-finite steps in a row (train.max_skipped="
                                              f"{self.max_skipped})")
        continue
      if self.policy == "skip":
        self.in_a_row = 0
      self._spike(step, float(m["loss"]))
    if bad:
      self.skipped += len(bad)
      self.writer.event(last_step, "nonfinite_skipped", steps=bad, total_skipped=self.skipped)
      self.progress.note(f"warning: skipped {len(bad)} non-finite step(s) {bad} (train.on_nonfinite=skip; "
                         f"{self.skipped} in all)")
    return None

  def _diverged(self, step: int, m: dict, why: str = ""):
    loss, grad_norm = float(m["loss"]), float(m["grad_norm"])
    why = why or f"loss {loss} / gradient norm {grad_norm} at step {step}"
    if self.policy == "rewind":
      self.in_a_row += 1
      if self.in_a_row <= self.max_skipped:
        self.progress.note(f"warning: non-finite {why}; rewinding to the last good checkpoint "
                           f"(step {self.good_checkpoint or 0}) and continuing with the next batches")
        self.bad_step, self.bad_values = step, (_num(loss), _num(grad_norm))
        return REWIND
      why += f"; {self.in_a_row - 1} rewinds did not get past it (train.max_skipped={self.max_skipped})"
    self.writer.event(step, "nonfinite", loss=_num(loss), grad_norm=_num(grad_norm), policy=self.policy,
                      last_good_checkpoint=self.good_checkpoint)
    self.writer.flush()
    where = (f"the last good checkpoint is step {self.good_checkpoint}" if self.good_checkpoint is not None
             else "no checkpoint was saved")
    raise NonFiniteError(
        f"training diverged: non-finite {why}; nothing after it was saved ({where}). {self.advice}")

  def rewound(self, step: int) -> None:
    """The loop went back to `step`: a record saying so (metrics after it were dropped)."""
    self.writer.event(step, "rewind", bad_step=self.bad_step, loss=self.bad_values[0],
                      grad_norm=self.bad_values[1], rewinds_in_a_row=self.in_a_row)
    self._losses.clear()

  def saved(self, step: int) -> None:
    """A checkpoint of a finite state was saved at `step`: rewinds now start from there."""
    if self.policy == "rewind" and step > (self.good_checkpoint or 0):  # past the rewinds' start (0: the initial state)
      self.in_a_row = 0
    self.good_checkpoint = step

  def _spike(self, step: int, loss: float) -> None:
    if self.spike_factor > 0 and len(self._losses) >= SPIKE_MIN:
      median = statistics.median(self._losses)
      if median > 0 and loss > self.spike_factor * median:
        self.writer.event(step, "loss_spike", loss=loss, running_median=median, factor=self.spike_factor)
        self.progress.note(f"warning: loss spike at step {step}: {loss:.4f} > {self.spike_factor:g} x running "
                           f"median {median:.4f}")
    self._losses.append(loss)


def _num(x: float):
  return x if math.isfinite(x) else str(x)  # JSON has no NaN: "nan" / "inf"
