"""The output projection onto the vocabulary computes its kernel's gradient whole over the FSDP-sharded
embed dim (`tfx.nn.layers.head_gradient_axes`), the same function as without."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from tests.conftest import ROOT
from tfx.nn.layers import head_gradient_axes, project


def test_head_gradient_axes_leave_the_embed_dim_whole():
  assert head_gradient_axes(("vocab", "embed")) == ("vocab", None)
  assert head_gradient_axes(("embed", "vocab")) == (None, "vocab")


def test_head_gradient_outside_a_mesh_is_the_plain_gradient():
  """Outside a mesh the layout asks for nothing: the same values and gradients as without it."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(2, 8, 16)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(32, 16)), jnp.float32)
  g = jnp.asarray(rng.normal(size=(2, 8, 32)), jnp.float32)
  runs = [jax.vjp(lambda x, w: project(x, w, True, 1, axes), x, w) for axes in (None, ("vocab", None))]
  for a, b in zip((runs[0][0], *runs[0][1](g)), (runs[1][0], *runs[1][1](g))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


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
g = jnp.asarray(rng.normal(size=(16, 8, 96)), jnp.float32)
tied = Embed(96, 32)
untied = DenseGeneral((32,), (96,), ("embed", "vocab"), use_bias=False, head=True)
heads = {{"tied": (tied, tied.attend, (96, 32)), "untied": (untied, untied.__call__, (32, 96))}}
mesh = Mesh(np.array(jax.devices()).reshape(2, 4, 1), parallel.MESH_AXES)
for name, (module, method, shape) in heads.items():
  boxed = module.init(jax.random.key(0), x, method=method)
  params = nn.unbox(boxed)
  grad = lambda p, x, g: jax.vjp(lambda p: module.apply(p, x, method=method), p)[1](g)[0]
  want = jax.jit(grad)(params, x, g)
  shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, parallel.LOGICAL_AXIS_RULES)
  with jax.set_mesh(mesh), nn.logical_axis_rules(parallel.LOGICAL_AXIS_RULES):
    p = jax.device_put(params, shardings)
    xs, gs = (jax.device_put(a, NamedSharding(mesh, P(("data", "fsdp")))) for a in (x, g))
    step = jax.jit(grad, out_shardings=shardings)
    text = step.lower(p, xs, gs).as_text()
    got = step(p, xs, gs)
  (kernel,) = jax.tree.leaves(got)
  assert kernel.sharding.spec != P(), kernel.sharding  # the gradient leaves sharded as its parameter
  np.testing.assert_allclose(np.asarray(kernel), np.asarray(jax.tree.leaves(want)[0]), rtol=1e-5, atol=1e-5)
  dims = "x".join(str(n) for n in shape)
  constraints = [l for l in text.splitlines() if "sharding_constraint" in l and f"tensor<{{dims}}xf32>" in l]
  assert constraints and all("fsdp" not in l for l in constraints), (name, constraints)
  print(name, "ok", constraints[0].strip())
"""


def test_a_heads_kernel_gradient_is_laid_out_whole_over_embed_under_fsdp():
  """On 8 devices (2-way data, 4-way FSDP), the tied head (`Embed.attend`) and an untied one
  (`DenseGeneral(head=True)`): the kernel's gradient is constrained with no FSDP axis on its
  [vocab, embed] dims as it leaves its matmul, reaches the caller sharded as its parameter, and
  equals one device's to float32 rounding."""
  proc = subprocess.run([sys.executable, "-c", SCRIPT.format(root=str(ROOT))], capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
  assert "tied ok" in proc.stdout and "untied ok" in proc.stdout, proc.stdout
