"""The reductions a GPU's program takes in one pass, checked on the device that runs them.

    python benchmarks/gpu/check_reductions.py [--json out.json]

Traced for a GPU (`tfx.ops.target.one_pass_reductions()`), LayerNorm's statistics are one
Welford reduction and the bf16 loss's max and sum of exp(x - max) one reduction over the
vocabulary; everywhere else each statistic is its own reduction. Both forms are plain XLA ops,
so both run on any device: here each is traced as for a GPU and as for a CPU (`lowering_for`) and
run on this machine's default device, values and gradients compared with each other and the
statistics with float64 (numpy). A bias's gradient (`tfx.nn.layers.add_bias`, summed in float32)
is compared with float64 too. The unit tests check the same on a CPU, where XLA:CPU reduces a row
one element after another; this is the device's own reduction order and code generation. Exit
status 1 when an error is over its tolerance.
"""

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from tfx import ops
from tfx.nn.layers import add_bias
from tfx.ops import norms, target

# Largest error relative to the largest reference value: one form against the other in the compute
# dtype (a bf16 gradient is rounded to 8 bits), and any float32 statistic against float64.
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2}
EXACT = TOLERANCE["float32"]


def _relative(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _traced_for(platform: str, fn, *args):
  """fn(*args) traced (and run here) as for `platform`: a fresh jit, since jit's cache of traces
  does not know the platform a trace chose its reductions for."""
  with target.lowering_for(platform):
    return jax.jit(lambda *a: fn(*a))(*args)


def check_layer_norm(dtype, rng, rows: tuple[int, int]) -> list[tuple[str, float, float]]:
  x = jnp.asarray(3.0 + rng.normal(size=rows + (768,)), dtype)  # an offset: the running mean's hard case
  scale = jnp.asarray(1.0 + 0.1 * rng.normal(size=(768,)), jnp.float32)
  bias = jnp.asarray(0.1 * rng.normal(size=(768,)), jnp.float32)
  cotangent = jnp.asarray(rng.normal(size=x.shape), jnp.float32)

  def value_and_grads(x, scale, bias):
    y, vjp = jax.vjp(lambda *a: ops.layer_norm(*a, eps=1e-5), x, scale, bias)
    return (y,) + vjp(cotangent)

  gpu, cpu = (_traced_for(p, value_and_grads, x, scale, bias) for p in ("gpu", "cpu"))
  name = jnp.dtype(dtype).name
  checks = [(f"{name} layer_norm {n} (one pass vs two)", _relative(a, b), TOLERANCE[name])
            for n, a, b in zip(("y", "dx", "dscale", "dbias"), gpu, cpu)]
  x64 = np.asarray(x, np.float64)
  for one_pass in (True, False):
    mean, r = jax.jit(lambda v: norms._row_stats(v, 1e-5, True, one_pass))(x.astype(jnp.float32))
    how = "one pass" if one_pass else "two passes"
    checks.append((f"{name} layer_norm mean, {how} (vs float64)", _relative(mean, x64.mean(-1, keepdims=True)), EXACT))
    checks.append((f"{name} layer_norm 1/std, {how} (vs float64)",
                   _relative(r, 1 / np.sqrt(x64.var(-1, keepdims=True) + 1e-5)), EXACT))
  return checks


def check_loss(rng, rows: tuple[int, int]) -> list[tuple[str, float, float]]:
  logits = jnp.asarray(3.0 * rng.normal(size=rows + (32128,)), jnp.bfloat16)  # the one-pass path is bf16's
  targets = jnp.asarray(rng.integers(0, 32128, size=rows), jnp.int32)
  weights = jnp.asarray(rng.random(rows) > 0.2, jnp.float32)
  fn = jax.value_and_grad(lambda l: ops.weighted_cross_entropy(l, targets, weights)[0])
  (loss_gpu, grad_gpu), (loss_cpu, grad_cpu) = (_traced_for(p, fn, logits) for p in ("gpu", "cpu"))
  l64 = np.asarray(logits, np.float64)
  top = l64.max(-1, keepdims=True)
  log_z = (top + np.log(np.exp(l64 - top).sum(-1, keepdims=True)))[..., 0]
  ce = log_z - np.take_along_axis(l64, np.asarray(targets)[..., None], -1)[..., 0]
  exact = float((ce * np.asarray(weights)).sum() / np.asarray(weights).sum())
  return [("bfloat16 loss, one pass (vs float64)", abs(float(loss_gpu) - exact) / abs(exact), EXACT),
          ("bfloat16 loss, two passes (vs float64)", abs(float(loss_cpu) - exact) / abs(exact), EXACT),
          ("bfloat16 loss gradient (one pass vs two)", _relative(grad_gpu, grad_cpu), TOLERANCE["bfloat16"])]


def check_bias_gradient(rng, rows: tuple[int, int]) -> list[tuple[str, float, float]]:
  y = jnp.asarray(rng.normal(size=rows + (12, 64)), jnp.bfloat16)
  g = jnp.asarray(rng.normal(size=y.shape) + 0.01, jnp.bfloat16)
  bias = jnp.zeros((12, 64), jnp.float32)
  db = jax.jit(lambda y, b, g: jax.vjp(add_bias, y, b)[1](g)[1])(y, bias, g)
  return [("bfloat16 bias gradient, float32 sum (vs float64)", _relative(db, np.asarray(g, np.float64).sum((0, 1))),
           EXACT)]


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--json", default=None)
  parser.add_argument("--tiny", action="store_true", help="4 x 64 rows instead of 8 x 512 (a test on a CPU)")
  args = parser.parse_args(argv)
  shape = (4, 64) if args.tiny else (8, 512)
  rng = np.random.default_rng(0)
  print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()})")
  rows = []
  checks = (check_layer_norm(jnp.float32, rng, shape) + check_layer_norm(jnp.bfloat16, rng, shape)
            + check_loss(rng, shape) + check_bias_gradient(rng, shape))
  for name, error, tolerance in checks:
    rows.append({"check": name, "error": error, "tolerance": tolerance, "ok": error <= tolerance})
    print(f"  {'ok  ' if error <= tolerance else 'FAIL'} {name:55s} {error:.2e} (<= {tolerance:.0e})")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"device_kind": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)
  if not all(r["ok"] for r in rows):
    sys.exit(1)


if __name__ == "__main__":
  main()
