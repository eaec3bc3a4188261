"""Nothing a layer computes from constants alone leaves the scanned layer loop grown to full size
(`tfx.ops.hoisting`): under jax.grad, JAX's scan moves such values out of its loop and stores them
whole, and every layer then reads them back (a fill of the scores' shape, a mask broadcast over
the heads, the dropout's zeros of every activation)."""

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfx import bench_suite, parallel
from tfx import config as config_lib
from tfx.ops import hoisting

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32, jnp.bool_])
def test_tied_is_the_value_itself_bitwise(dtype):
  data = jnp.asarray([[np.nan, 1.0], [2.0, 3.0]], jnp.float32)  # its first element is NaN
  if dtype == jnp.bool_:
    x = jnp.asarray([True, False, True])
  elif dtype == jnp.int32:
    x = jnp.asarray([-7, 0, 2**31 - 1], dtype)
  else:
    x = jnp.asarray([-0.0, np.nan, -np.inf, 1.5, -3.25e-3], dtype)
  got = jax.jit(hoisting.tied)(x, data)
  assert got.dtype == x.dtype and got.shape == x.shape
  bits = lambda a: np.asarray(a).view(np.uint8)
  np.testing.assert_array_equal(bits(got), bits(x))


def test_where_is_jnp_where_and_compiles_to_it():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(2, 3, 4, 5)), jnp.float32)
  cond = jnp.asarray(rng.random((2, 1, 4, 5)) < 0.5)  # broadcast over an axis, as a mask over heads
  got = jax.jit(lambda c, x: hoisting.where(c, x, -1e30))(cond, x)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.where(cond, x, -1e30)))
  # XLA folds the tie away: no bit operations left in the compiled program.
  text = jax.jit(lambda c, x: hoisting.where(c, x, -1e30)).lower(cond, x).compile().as_text()
  assert " and(" not in text and "bitcast-convert" not in text, text


def _scan_consts(jaxpr):
  """(scan equation, the jaxpr holding it) for every scan, nested ones included."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "scan":
      yield eqn, jaxpr
    for param in eqn.params.values():
      inner = getattr(param, "jaxpr", param)
      if hasattr(inner, "eqns"):
        yield from _scan_consts(inner)


def _size(var) -> int:
  return math.prod(getattr(var.aval, "shape", ()))


def grown_in_layers(config_path: str, *overrides: str) -> list[str]:
  """The constants of the train step's scans that JAX computed from that scan's other constants
  (or from nothing) by growing them to at least one value per token: broadcasts of a fill or of
  a shared mask (the objectives' small loops may keep their iotas)."""
  cfg = config_lib.load_config(config_path, overrides)
  exp, jitted, args = bench_suite._abstract_step(cfg)
  tokens = cfg.train.batch_size * cfg.data.seq_len
  with parallel.context(exp.mesh):
    closed = jax.make_jaxpr(jitted)(*args)
  found = []
  for scan, holder in _scan_consts(closed.jaxpr):
    consts = {v for v in scan.invars[:scan.params["num_consts"]] if not isinstance(v, jax.extend.core.Literal)}
    producer = {out: eqn for eqn in holder.eqns for out in eqn.outvars}

    def from_consts(var, seen=()):  # computed from this scan's constants and literals alone
      eqn = producer.get(var)
      if eqn is None or var in seen:
        return False
      inputs = [v for v in eqn.invars if not isinstance(v, jax.extend.core.Literal)]
      return all(v in consts or from_consts(v, seen + (var,)) for v in inputs)

    for var in consts:
      eqn = producer.get(var)
      if eqn is None or not from_consts(var):
        continue
      largest_input = max((_size(v) for v in eqn.invars), default=1)
      if _size(var) > max(largest_input, 1) and _size(var) >= tokens:
        found.append(f"{var.aval.str_short()} from {eqn.primitive.name} in {getattr(eqn.source_info, 'name_stack', '')}")
  return found


DROPOUT = ("--config.model.dropout=0.1", "--config.model.attention_dropout=0.1")


@pytest.mark.parametrize("config", ["tiny", "bert_tiny", "t5_tiny", "xlnet_tiny", "xlnet_encoder_tiny", "electra_tiny"])
@pytest.mark.parametrize("dropout", [False, True], ids=["no_dropout", "dropout"])
def test_scanned_layers_keep_their_broadcasts_inside_the_loop(config, dropout):
  overrides = ("--config.train.batch_size=2", "--config.model.scan_layers=True") + (DROPOUT if dropout else ())
  assert grown_in_layers(os.path.join(ROOT, "configs", f"{config}.py"), *overrides) == []


def test_the_check_finds_a_grown_constant(monkeypatch):
  """The check above can fail: with `hoisting.where` a plain jnp.where again, it names the
  dropout's zeros of the activations ([b, t, ...]) and the scores' fills."""
  monkeypatch.setattr(hoisting, "where", lambda cond, x, fill: jnp.where(cond, x, fill))
  found = grown_in_layers(os.path.join(ROOT, "configs", "bert_tiny.py"), "--config.train.batch_size=2", *DROPOUT)
  assert any(f.startswith("float32[2,64,") for f in found), found
