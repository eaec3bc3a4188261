"""tfx's dropout (`tfx.ops.dropout`, the `Dropout` module, XLA's attention dropout): keep bits from a
counter hash of the seed and the element's global coordinates, drawn again in the backward pass."""

import json
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals

from tfx.nn.layers import Dropout
from tfx.ops import dropout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("rate", [0.1, 0.5])
def test_hidden_keep_bits_are_fair_and_independent(rate):
  """Over 2**20 hidden entries [b, t, e]: the kept share is P(keep) within 5 standard errors, so
  is the share of pairs kept together at neighbouring columns, positions, rows and seeds
  (independent draws: P(keep)**2), and every column's kept share is P(keep) within 6 standard
  errors (no column favoured); one seed's bits are the same array again."""
  p = dropout.keep_probability(rate)
  shape = (8, 128, 1024)
  keep = np.asarray(dropout.keep_bits(jnp.uint32(5), shape, rate))
  assert keep.shape == shape and abs(keep.mean() - p) < 5 * np.sqrt(p * (1 - p) / keep.size), keep.mean()
  other = np.asarray(dropout.keep_bits(jnp.uint32(6), shape, rate))
  pairs = {"column": (keep[..., 1:], keep[..., :-1]), "position": (keep[:, 1:], keep[:, :-1]),
           "row": (keep[1:], keep[:-1]), "seed": (keep, other)}
  for name, (a, b) in pairs.items():
    both = np.mean(a & b)
    assert abs(both - p * p) < 5 * np.sqrt(p * p * (1 - p * p) / a.size), (name, both, p * p)
  per_column = keep.reshape(-1, shape[-1]).mean(axis=0)
  assert np.max(np.abs(per_column - p)) < 6 * np.sqrt(p * (1 - p) / (keep.size // shape[-1])), per_column
  np.testing.assert_array_equal(keep, dropout.keep_bits(jnp.uint32(5), shape, rate))


def test_attention_bits_are_the_kernels_coordinates():
  """A [b, h, t, s] array's bits are a stream per (row, head) counting t * s + s, with a shard's
  first row and head as offsets: the bits of rows 2.. and heads 1.. of a whole array are those of
  the part drawn with those offsets (how the Pallas kernel's shards draw)."""
  whole = np.asarray(dropout.keep_bits(jnp.uint32(9), (4, 3, 16, 16), 0.3))
  part = np.asarray(dropout.keep_bits(jnp.uint32(9), (2, 2, 16, 16), 0.3, first_row=2, first_head=1))
  np.testing.assert_array_equal(part, whole[2:, 1:])
  assert not np.array_equal(whole[0, 0], whole[0, 1]) and not np.array_equal(whole[0, 0], whole[1, 0])


def test_dropout_keeps_only_its_seed_for_the_gradient():
  """dropout(x) zeroes the entries `keep_bits` drops and scales the others by 1 / P(keep), in x's
  dtype; its gradient drops the same entries (drawn again from the seed), and the only value it
  saves for the backward pass is the uint32 seed (no mask of x's shape)."""
  rate = 0.3
  x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 32, 48)), jnp.bfloat16)
  seed = jnp.uint32(17)
  keep = dropout.keep_bits(seed, x.shape, rate)
  got = dropout.dropout(x, seed, rate)
  assert got.dtype == jnp.bfloat16
  want = jnp.where(keep, x * (1 / dropout.keep_probability(rate)), 0)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  cot = jnp.asarray(np.random.default_rng(1).normal(size=x.shape), jnp.bfloat16)
  grad = jax.jit(jax.grad(lambda x: jnp.sum((dropout.dropout(x, seed, rate) * cot).astype(jnp.float32))))(x)
  np.testing.assert_array_equal(np.asarray(grad, np.float32),
                                np.asarray(jnp.where(keep, cot * (1 / dropout.keep_probability(rate)), 0), np.float32))
  saved = saved_residuals(lambda x: dropout.dropout(x, seed, rate), x)
  assert [str(aval) for aval, _ in saved] == ["uint32[]"], saved


@pytest.mark.parametrize("rate", [0.0, 0.2, 1.0])
def test_the_module_draws_per_key_and_per_site(rate):
  """The `Dropout` module: rate 0 is the identity, rate 1 zeros with zero (not NaN) gradients; in
  between each kept entry is x / P(keep), the dropped share is near the rate, the gradient drops
  what the forward pass dropped, two keys draw different bits and so do two modules of one key."""

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return Dropout(rate)(x, deterministic=False), Dropout(rate)(x, deterministic=False)

  x = jnp.asarray(np.random.default_rng(2).normal(size=(4, 64, 32)), jnp.float32) + 5.0  # no zeros of its own
  run = lambda key: Net().apply({}, x, rngs={"dropout": jax.random.key(key)})
  (a, b), (c, _) = run(0), run(1)
  grad = jax.grad(lambda x: jnp.sum(Net().apply({}, x, rngs={"dropout": jax.random.key(0)})[0]))(x)
  assert np.all(np.isfinite(np.asarray(grad)))
  if rate == 0.0:
    np.testing.assert_array_equal(a, x)
    return
  if rate == 1.0:
    assert not np.any(np.asarray(a)) and not np.any(np.asarray(grad))
    return
  p = dropout.keep_probability(rate)
  dropped = np.asarray(a) == 0
  assert abs(dropped.mean() - rate) < 0.03, dropped.mean()
  np.testing.assert_allclose(np.asarray(a)[~dropped], np.asarray(x)[~dropped] / p, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(grad), np.where(dropped, 0.0, 1 / p), rtol=1e-6)
  assert np.mean((np.asarray(b) == 0) != dropped) > 0.2 and np.mean((np.asarray(c) == 0) != dropped) > 0.2


_SHARDED_SCRIPT = r"""
import json, os
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tfx.ops import dropout

mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 16, 32)), jnp.float32)
seed = jnp.uint32(3)
f = jax.jit(lambda x: dropout.dropout(x, seed, 0.4))
g = jax.jit(jax.grad(lambda x: jnp.sum(dropout.dropout(x, seed, 0.4) * jnp.arange(32.0))))
want = [f(x), g(x)]
sharded = jax.device_put(x, NamedSharding(mesh, P("data", None, "model")))
got = [f(sharded), g(sharded)]
print(json.dumps({"equal": [bool(np.array_equal(np.asarray(a), np.asarray(b))) for a, b in zip(got, want)],
                  "sharding": str(got[0].sharding.spec)}))
"""


def test_a_mesh_draws_the_one_device_bits(tmp_path):
  """On 8 fake devices (rows over 4, the embedding over 2) each shard draws the bits of its global
  coordinates: output and gradient equal one device's bitwise, the output sharded as its input."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  proc = subprocess.run([sys.executable, "-c", _SHARDED_SCRIPT], env=env, capture_output=True, text=True, timeout=300,
                        cwd=str(tmp_path))
  assert proc.returncode == 0, proc.stderr[-4000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  assert out == {"equal": [True, True], "sharding": "P('data', None, 'model')"}, out
