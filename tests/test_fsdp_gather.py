"""Under FSDP every weight is gathered over its sharded embed dim before its matmul or lookup
(`tfx.nn.layers.gathered`), and its gradient is laid out the same way and reduce-scattered: the
same function as one device's."""

import subprocess
import sys

from tests.conftest import ROOT

SCRIPT = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import sys
sys.path.insert(0, {root!r})
import flax.linen as nn
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tfx import parallel
from tfx.nn.layers import DenseGeneral, Embed
rng = np.random.default_rng(1)
x = jnp.asarray(rng.normal(size=(16, 8, 32)), jnp.float32)
ids = jnp.asarray(rng.integers(0, 96, size=(16, 8)), jnp.int32)
tied = Embed(96, 32)
# name: (module, method, input, output cotangent's shape, the kernel's shape)
layers = {{
    "dense": (DenseGeneral((32,), (4, 16), ("embed", "heads", "kv")), None, x, (16, 8, 4, 16), (32, 4, 16)),
    "out": (DenseGeneral((4, 16), (32,), ("heads", "kv", "embed")), None, x.reshape(16, 8, 4, 8).repeat(2, -1),
            (16, 8, 32), (4, 16, 32)),
    "head": (DenseGeneral((32,), (96,), ("embed", "vocab"), use_bias=False), None, x, (16, 8, 96), (32, 96)),
    "tied": (tied, tied.attend, x, (16, 8, 96), (96, 32)),
    "lookup": (tied, None, ids, (16, 8, 32), (96, 32)),
}}
mesh = Mesh(np.array(jax.devices()).reshape(2, 4, 1), parallel.MESH_AXES)
for name, (module, method, inputs, out_shape, shape) in layers.items():
  g = jnp.asarray(rng.normal(size=out_shape), jnp.float32)
  boxed = module.init(jax.random.key(0), inputs, method=method)
  params = nn.unbox(boxed)
  grad = lambda p, a, g: jax.vjp(lambda p: module.apply(p, a, method=method), p)[1](g)[0]
  want = jax.jit(grad)(params, inputs, g)
  shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, parallel.LOGICAL_AXIS_RULES)
  with jax.set_mesh(mesh), nn.logical_axis_rules(parallel.LOGICAL_AXIS_RULES):
    p = jax.device_put(params, shardings)
    a, gs = (jax.device_put(v, NamedSharding(mesh, P(("data", "fsdp")))) for v in (inputs, g))
    step = jax.jit(grad, out_shardings=shardings)
    text = step.lower(p, a, gs).as_text()
    got = step(p, a, gs)
  (kernel,) = [leaf for leaf in jax.tree.leaves(got) if leaf.shape == shape]
  assert "fsdp" in str(kernel.sharding.spec), (name, kernel.sharding)  # the gradient leaves as its parameter
  for g_, w_ in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g_), np.asarray(w_), rtol=1e-5, atol=1e-5)
  dims = "x".join(str(n) for n in shape)
  constraints = [l for l in text.splitlines() if "sharding_constraint" in l and f"tensor<{{dims}}xf32>" in l]
  assert constraints and all("fsdp" not in l for l in constraints), (name, constraints)
  print(name, "ok")
"""


def test_every_weight_is_gathered_over_fsdp_before_its_matmul():
  """On 8 devices (2-way data, 4-way FSDP): a projection into heads, the attention's output
  projection (its embed dim the output), an untied head, the tied head (`Embed.attend`) and the
  embedding lookup. Each kernel is constrained with no FSDP axis in the lowered program (the
  forward pass reads it gathered and the backward pass lays its gradient out so), its gradient
  reaches the caller sharded as its parameter, and every gradient equals one device's to float32
  rounding."""
  proc = subprocess.run([sys.executable, "-c", SCRIPT.format(root=str(ROOT))], capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
  for name in ("dense", "out", "head", "tied", "lookup"):
    assert f"{name} ok" in proc.stdout, proc.stdout
