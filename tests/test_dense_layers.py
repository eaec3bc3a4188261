"""The dense layers and what each platform's trace does with them: DenseGeneral as a flattened
matmul, bias and weight gradients summed in float32 whatever the compute dtype (and on 8 devices),
the row-major weight gradients of a CPU, projections that share an input fused into one matmul, a
TPU trace's matmul dims, the gated MLP's fused product and the stored gradient of a dropping MLP
on a GPU: the same function in every form."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import ROOT
from tests.test_model import make_model

@pytest.mark.parametrize("x_shape,in_shape,out_shape", [
    ((2, 5, 8), (8,), (12,)),  # [b, t, e] -> [b, t, f]
    ((2, 5, 8), (8,), (3, 4)),  # query/key/value: [b, t, e] -> [b, t, h, d]
    ((2, 5, 3, 4), (3, 4), (8,)),  # attention output: [b, t, h, d] -> [b, t, e]
    ((7, 8), (8,), (6,)),  # no batch dim
])
def test_dense_general_is_the_contraction_of_its_trailing_dims(x_shape, in_shape, out_shape):
  """DenseGeneral runs as one flattened 2-D matmul; its output and both gradients equal the plain
  contraction of x's trailing dims with the kernel's leading ones (einsum, autodiff)."""
  from tfx.nn.layers import DenseGeneral
  layer = DenseGeneral(in_shape, out_shape, ("a",) * len(in_shape) + ("b",) * len(out_shape))
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.normal(size=x_shape), jnp.float32)
  params = nn.meta.unbox(layer.init(jax.random.key(0), x))["params"]
  params["bias"] = jnp.asarray(rng.normal(size=out_shape), jnp.float32)
  cotangent = jnp.asarray(rng.normal(size=x_shape[: len(x_shape) - len(in_shape)] + out_shape), jnp.float32)
  n_in = len(in_shape)

  def reference(x, p):
    contract = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
    return jax.lax.dot_general(x, p["kernel"], (contract, ((), ())), precision="highest") + p["bias"]

  def layer_fn(x, p):
    return layer.apply({"params": p}, x)

  for fn in (layer_fn, reference):
    assert fn(x, params).shape == cotangent.shape
  np.testing.assert_allclose(layer_fn(x, params), reference(x, params), rtol=1e-5, atol=1e-5)
  got = jax.grad(lambda x, p: jnp.sum(layer_fn(x, p) * cotangent), argnums=(0, 1))(x, params)
  want = jax.grad(lambda x, p: jnp.sum(reference(x, p) * cotangent), argnums=(0, 1))(x, params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), got, want)


@pytest.mark.parametrize("wide", [False, True])
def test_bias_gradient_is_summed_in_float32_whatever_the_compute_dtype(wide):
  """`add_bias` (every DenseGeneral's bias, the fused projections', XLNet's r_w / r_r / r_s; `wide`:
  the output layer's vocabulary bias): the value is autodiff's `y + bias.astype(y.dtype)` and so
  is the gradient of y; the bias's gradient is the float32 sum of the incoming one, where
  autodiff's bf16 sum is percents off. A wide bias's is summed as a product with ones on a CPU
  (`ops.sum_rows`; XLA:CPU's reduce of [680, 32000] took 18x as long)."""
  from tfx.nn.layers import add_bias

  rng = np.random.default_rng(11)
  bias = jnp.asarray(rng.normal(size=(4, 6)), jnp.float32)
  for dtype in (jnp.float32, jnp.bfloat16):
    y = jnp.asarray(rng.normal(size=(16, 512, 4, 6)), dtype)
    g = jnp.asarray(rng.normal(size=y.shape) + 0.01, dtype)  # many rows of unit-scale gradients
    autodiff = lambda y, b: y + b.astype(y.dtype)
    ours = lambda y, b: add_bias(y, b, wide)
    np.testing.assert_array_equal(np.asarray(ours(y, bias), np.float32), np.asarray(autodiff(y, bias), np.float32))
    (dy, db), (dy_ad, db_ad) = (jax.vjp(f, y, bias)[1](g) for f in (ours, autodiff))
    np.testing.assert_array_equal(np.asarray(dy, np.float32), np.asarray(dy_ad, np.float32))
    assert db.dtype == jnp.float32 and db.shape == bias.shape
    exact = np.asarray(g, np.float64).sum(axis=(0, 1))
    error = lambda d: np.abs(np.asarray(d, np.float64) - exact).max() / np.abs(exact).max()
    assert error(db) < 1e-5
    if dtype == jnp.float32 and not wide:  # the same sum (a product's is in another order: 3e-6 off)
      np.testing.assert_allclose(db, db_ad, rtol=1e-6, atol=1e-6)
    elif dtype == jnp.bfloat16:
      assert error(db_ad) > 1e-3  # what this replaces: the sum in bf16
    gradient = jax.make_jaxpr(lambda g: jax.vjp(lambda b: ours(y, b), bias)[1](g))(g)
    assert ("dot_general" in str(gradient)) == wide  # tests run on a CPU: the product form


@pytest.mark.parametrize("kernel_major", [False, True])
def test_weight_gradient_is_the_float32_product_whatever_the_compute_dtype(kernel_major):
  """`project` (every DenseGeneral, the fused projections, the tied output projection): value and
  input gradient are autodiff's of the matmul with the kernel cast to x's dtype; the kernel's
  gradient is that matmul's float32 product, where autodiff rounds it to bf16 first (and on a
  sharded batch each device's partial sum: `test_sharded_weight_gradient_is_one_devices`)."""
  from tfx.nn.layers import project

  rng = np.random.default_rng(12)
  lead, k, m = ((8, 256) if kernel_major else (2048,)), 48, 40  # the tied output projection: [b, t, e]
  kernel = jnp.asarray(rng.normal(size=(m, k) if kernel_major else (k, m)), jnp.float32)
  dims = (((len(lead),), (1 if kernel_major else 0,)), ((), ()))
  autodiff = lambda x, w: jax.lax.dot_general(x, w.astype(x.dtype), dims)
  for dtype in (jnp.float32, jnp.bfloat16):
    x = jnp.asarray(rng.normal(size=lead + (k,)), dtype)
    g = jnp.asarray(rng.normal(size=lead + (m,)), dtype)
    mine = lambda x, w: project(x, w, kernel_major)
    np.testing.assert_array_equal(np.asarray(mine(x, kernel), np.float32), np.asarray(autodiff(x, kernel), np.float32))
    (dx, dw), (dx_ad, dw_ad) = (jax.vjp(f, x, kernel)[1](g) for f in (mine, autodiff))
    np.testing.assert_array_equal(np.asarray(dx, np.float32), np.asarray(dx_ad, np.float32))
    assert dw.dtype == jnp.float32 and dw.shape == kernel.shape
    exact = np.asarray(g, np.float64).reshape(-1, m).T @ np.asarray(x, np.float64).reshape(-1, k)  # [m, k]
    exact = exact if kernel_major else exact.T
    error = lambda d: np.abs(np.asarray(d, np.float64) - exact).max() / np.abs(exact).max()
    assert error(dw) < 1e-5
    if dtype == jnp.float32:
      assert error(dw_ad) < 1e-5  # the same products (summed in another order on a CPU)
    else:
      assert error(dw_ad) > 1e-3  # what this replaces: the product rounded to bf16


@pytest.mark.parametrize("kernel_major", [False, True])
@pytest.mark.parametrize("k, m", [(48, 80), (80, 48)])  # either operand the narrower
def test_weight_gradient_on_a_cpu_is_a_row_major_matmul_and_elsewhere_autodiffs(kernel_major, k, m):
  """`weight_gradient` (the kernel's gradient in `project`), traced for a CPU, compiles to matmuls
  that contract the left operand's last dim and the right's first (XLA:CPU's YNNPACK form; no
  `lhs_contracting_dims={0}` left: the transposed copy was not folded back), traced for a GPU to
  autodiff's single contraction of both operands' rows, without the barriers; both give x^T . g
  to float32 rounding, and the GPU's trace (run here) autodiff's product to float32 rounding (its
  bits depend on which kernel this CPU picks for either operand order)."""
  from tfx.nn.layers import weight_gradient
  from tfx.ops import target

  rng = np.random.default_rng(14)
  x = jnp.asarray(rng.normal(size=(4, 64, k)), jnp.float32)
  g = jnp.asarray(rng.normal(size=(4, 64, m)), jnp.float32)
  exact = np.asarray(x, np.float64).reshape(-1, k).T @ np.asarray(g, np.float64).reshape(-1, m)  # [k, m]
  exact = exact.T if kernel_major else exact
  autodiff = jax.vjp(lambda w: jnp.einsum("btk,km->btm", x, w), jnp.zeros((k, m)))[1](g)[0]
  autodiff = autodiff.T if kernel_major else autodiff
  for platform in ("cpu", "gpu"):
    with target.lowering_for(platform):
      lowered = jax.jit(lambda x, g: weight_gradient(x, g, jnp.float32, kernel_major)).lower(x, g)
    assert ("optimization_barrier" in lowered.as_text()) == (platform == "cpu")
    compiled = lowered.compile()
    got = compiled(x, g)
    assert got.shape == exact.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-4)
    if platform == "cpu":
      dots = [line for line in compiled.as_text().splitlines() if " dot(" in line]
      assert dots and not any("lhs_contracting_dims={0}" in line for line in dots), dots
    else:  # one contraction of the operands as they are: no copy, nothing for XLA to keep apart
      assert lowered.as_text().count("stablehlo.dot_general") == 1
      np.testing.assert_allclose(got, autodiff, rtol=1e-5, atol=1e-4)


def test_small_parameters_gradients_are_float32_sums_whatever_the_compute_dtype():
  """The parameters that are not a matmul's kernel: XLNet's segment embeddings (`segment_scores`)
  and mask_emb broadcast to every slot (`broadcast_param`): values and input gradients are
  autodiff's; the parameter's gradient is the float32 product or sum, where autodiff's bf16 one is
  rounded."""
  from tfx.nn.layers import broadcast_param
  from tfx.nn.xlnet import segment_scores

  rng = np.random.default_rng(13)
  seg_embed = jnp.asarray(rng.normal(size=(2, 4, 16)), jnp.float32)
  mask_emb = jnp.asarray(rng.normal(size=(16,)), jnp.float32)
  cases = [  # (tfx, autodiff, x shape, param, exact gradient from (x, g))
      (segment_scores, lambda q, s: jnp.einsum("bthd,khd->bhtk", q, s.astype(q.dtype)), (8, 256, 4, 16), seg_embed,
       lambda q, g: np.einsum("bhtk,bthd->khd", g, q)),
      (lambda x, p: x + broadcast_param(p, x.shape, x.dtype), lambda x, p: x + jnp.broadcast_to(p.astype(x.dtype), x.shape),
       (16, 512, 16), mask_emb, lambda x, g: g.sum(axis=(0, 1))),
  ]
  for mine, autodiff, shape, param, exact_of in cases:
    for dtype in (jnp.float32, jnp.bfloat16):
      x = jnp.asarray(rng.normal(size=shape), dtype)
      out = mine(x, param)
      np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(autodiff(x, param), np.float32), rtol=1e-6)
      g = jnp.asarray(rng.normal(size=out.shape) + 0.01, dtype)
      (dx, dp), (dx_ad, dp_ad) = (jax.vjp(f, x, param)[1](g) for f in (mine, autodiff))
      np.testing.assert_allclose(np.asarray(dx, np.float32), np.asarray(dx_ad, np.float32), rtol=1e-6, atol=1e-6)
      assert dp.dtype == jnp.float32
      exact = exact_of(np.asarray(x, np.float64), np.asarray(g, np.float64))
      error = lambda d: np.abs(np.asarray(d, np.float64) - exact).max() / np.abs(exact).max()
      assert error(dp) < 1e-5
      if dtype == jnp.bfloat16:
        assert error(dp_ad) > 1e-3  # what this replaces


def test_sharded_weight_gradient_is_one_devices():
  """On 8 devices with the batch sharded (data or FSDP parallelism), a bf16 DenseGeneral's kernel
  gradient is one device's to float32 precision: each device's partial product stays float32 and
  so does their sum. Autodiff's partial products are bf16, each rounded before the sum (and XLA:GPU
  sums them in bf16), a rounding one device does not make."""
  import subprocess
  import sys

  script = f"""
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import sys
sys.path.insert(0, {str(ROOT)!r})
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tfx.nn.layers import DenseGeneral
layer = DenseGeneral((64,), (4, 16), ("embed", "heads", "kv"), use_bias=False, dtype=jnp.bfloat16)
rng = np.random.default_rng(3)
x = jnp.asarray(rng.normal(size=(64, 128, 64)), jnp.bfloat16)
g = jnp.asarray(rng.normal(size=(64, 128, 4, 16)), jnp.bfloat16)
params = {{"kernel": jnp.asarray(rng.normal(size=(64, 4, 16)), jnp.float32)}}
def grads(fn, devices):
  mesh = Mesh(np.array(devices), ("data",))
  xs, gs = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, g))
  step = jax.jit(lambda p, x, g: jax.vjp(lambda p: fn(p, x), p)[1](g)[0],
                 out_shardings=NamedSharding(mesh, P()))
  return np.asarray(step(params, xs, gs)["kernel"], np.float64)
tfx_fn = lambda p, x: layer.apply({{"params": p}}, x)
autodiff = lambda p, x: jnp.einsum("bte,ehd->bthd", x, p["kernel"].astype(jnp.bfloat16))
for name, fn in (("tfx", tfx_fn), ("autodiff", autodiff)):
  one, eight = grads(fn, jax.devices()[:1]), grads(fn, jax.devices())
  print(name, np.abs(eight - one).max() / np.abs(one).max())
"""
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  differences = dict(line.split() for line in out.stdout.splitlines())
  assert float(differences["tfx"]) < 1e-5, differences
  assert float(differences["autodiff"]) > 1e-4, differences  # the rounding this removes


@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("cross, fuse", [(False, True), (True, True), (False, False)])
def test_attention_projects_what_shares_an_input_in_one_matmul_with_the_same_result(use_bias, cross, fuse):
  """A self-attention runs its query, key and value projections as one matmul over their stacked
  kernels, a cross-attention its key and value (`fuse=False`, a two-stream block's: each on its
  own); the parameters stay separate DenseGenerals, and the output and every gradient equal the
  projections written out one by one (einsums around `ops.dot_product_attention`)."""
  import dataclasses

  from tfx import ops
  from tfx.nn.attention import Attention

  cfg = dataclasses.replace(make_model(f"--config.model.use_bias={use_bias}", shapes_only=True)[0].cfg, remat="none")
  attention = Attention(cfg)
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(size=(2, 8, cfg.d_model)), jnp.float32)
  y = jnp.asarray(rng.normal(size=(2, 6, cfg.d_model)), jnp.float32) if cross else x
  mask = jnp.ones((1, 1, 8, 6), bool) if cross else jnp.tril(jnp.ones((8, 8), bool))[None, None]
  params = nn.meta.unbox(attention.init(jax.random.key(0), x, y, mask))["params"]
  assert sorted(params) == ["key", "out", "query", "value"] and ("bias" in params["query"]) == use_bias
  params = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)
  cotangent = jnp.asarray(rng.normal(size=x.shape), jnp.float32)

  def by_hand(x, y, p):
    proj = lambda z, name: jnp.einsum("bte,ehd->bthd", z, p[name]["kernel"]) + p[name].get("bias", 0.0)
    y = y if cross else x
    out = ops.dot_product_attention(proj(x, "query"), proj(y, "key"), proj(y, "value"), mask=mask,
                                    scale=cfg.head_dim**-0.5 if cfg.scale_attention else 1.0, implementation="xla")
    return jnp.einsum("bthd,hde->bte", out, p["out"]["kernel"]) + p["out"].get("bias", 0.0)

  module = lambda x, y, p: attention.apply({"params": p}, x, y if cross else x, mask, fuse=fuse)
  loss = lambda f: lambda x, y, p: jnp.sum(f(x, y, p) * cotangent)
  got_loss, got = jax.value_and_grad(loss(module), argnums=(0, 1, 2))(x, y, params)
  want_loss, want = jax.value_and_grad(loss(by_hand), argnums=(0, 1, 2))(x, y, params)
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
  # float32 sums in other orders: errors of a few ulps of the largest gradient entry (~1e2 here),
  # also in the key bias's gradient, which is 0 but for that rounding (softmax ignores q . b_k)
  scale = max(float(np.abs(leaf).max()) for leaf in jax.tree.leaves(want))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=max(1e-4, 2e-5 * scale)), got, want)
  jaxpr = str(jax.make_jaxpr(lambda x, y: module(x, y, params))(x, y))
  # the fused projections, q.k, p.v and the output projection (+ the query's own, across)
  assert jaxpr.count("dot_general") == (6 if not fuse else 5 if cross else 4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_tpu_trace_keeps_each_matmuls_dims_and_computes_the_same_function(dtype):
  """`flat_matmul` traced for a TPU (`target.flattened_matmuls`) contracts the layer's own dims,
  without the reshapes of the 2-D form a CPU or GPU gets: a DenseGeneral into several output dims
  (a cross-attention's queries, [e] -> [h, d]), out of several (the attention's output, [h, d] ->
  [e]), a plain [e] -> [f], and the fused q, k, v projection ([e] -> [h, 3, d]), with and without
  biases. Output and every gradient agree with the CPU's trace (run here in float32, both plain
  XLA), the kernels' gradients float32 in bf16 too."""
  from tfx.nn.layers import DenseGeneral, fused_projections
  from tfx.ops import target

  rng = np.random.default_rng(21)
  b, t, e, h, d, f = 2, 8, 32, 4, 8, 48
  layers = {
      "into heads": (DenseGeneral((e,), (h, d), ("embed", "heads", "kv"), dtype=dtype), (b, t, e)),
      "out of heads": (DenseGeneral((h, d), (e,), ("heads", "kv", "embed"), use_bias=False, dtype=dtype), (b, t, h, d)),
      "plain": (DenseGeneral((e,), (f,), ("embed", "mlp"), dtype=dtype), (b, t, e)),
  }

  class Fused(nn.Module):
    @nn.compact
    def __call__(self, x):
      qkv = [DenseGeneral((e,), (h, d), ("embed", "heads", "kv"), dtype=dtype, name=n) for n in "qkv"]
      return jnp.stack(fused_projections(qkv, x, dtype), axis=-1)  # [b, t, h, d, 3]

  layers["fused"] = (Fused(), (b, t, e))
  for name, (layer, shape) in layers.items():
    x = jnp.asarray(rng.normal(size=shape), dtype)
    params = nn.meta.unbox(layer.init(jax.random.key(0), x))["params"]
    params = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)
    out_shape = jax.eval_shape(lambda x: layer.apply({"params": params}, x), x).shape
    cotangent = jnp.asarray(rng.normal(size=out_shape), dtype)
    loss = lambda x, p: jnp.sum((layer.apply({"params": p}, x) * cotangent).astype(jnp.float32))
    step = jax.value_and_grad(loss, argnums=(0, 1))
    results, reshapes = {}, {}
    for platform in ("cpu", "tpu"):
      with target.lowering_for(platform):
        jaxpr = str(jax.make_jaxpr(lambda x: layer.apply({"params": params}, x))(x))
        grads = jax.eval_shape(step, x, params)[1][1]
        assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads)), (name, platform)
        if dtype == "float32":  # XLA:CPU runs no bf16 x bf16 -> float32 product with several contracted dims
          results[platform] = jax.jit(step)(x, params)
      reshapes[platform] = jaxpr.count("reshape[")
    assert reshapes["tpu"] == 0 and reshapes["cpu"] >= 2, (name, reshapes)
    if results:
      jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), results["tpu"], results["cpu"])


@pytest.mark.parametrize("use_bias,mlp,remat", [(True, "swiglu", "none"), (False, "swiglu", "none"),
                                                (False, "geglu", "dots_attention")])
def test_gated_mlp_fused_off_a_cpu_is_the_same_function(use_bias, mlp, remat):
  """A gated MLP's two input projections: traced for a GPU or TPU (`target.fused_gated_projections`)
  one matmul over their stacked kernels, for a CPU two; the parameters are the same DenseGenerals,
  and the output and every gradient agree (the GPU's and TPU's traces run here: plain XLA), GEGLU
  and SwiGLU, rematerialised or not (on a GPU the gated product is one op on the stacked pair:
  `activations.geglu`; on a TPU no matmul is flattened: `target.flattened_matmuls`)."""
  import dataclasses

  from tfx.nn.blocks import rematted
  from tfx.nn.layers import Mlp
  from tfx.ops import target

  cfg = dataclasses.replace(make_model(f"--config.model.use_bias={use_bias}", f"--config.model.mlp={mlp}",
                                       shapes_only=True)[0].cfg, remat=remat)
  mlp = rematted(Mlp, cfg, in_scan=False)(cfg)
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.normal(size=(2, 8, cfg.d_model)), jnp.float32)
  params = nn.meta.unbox(mlp.init(jax.random.key(0), x))["params"]
  assert sorted(params) == ["wi_0", "wi_1", "wo"] and ("bias" in params["wi_1"]) == use_bias
  params = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)
  cotangent = jnp.asarray(rng.normal(size=x.shape), jnp.float32)
  loss = lambda x, p: jnp.sum(mlp.apply({"params": p}, x) * cotangent)
  results, matmuls = {}, {}
  for platform in ("cpu", "gpu", "tpu"):
    with target.lowering_for(platform):
      results[platform] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, params)
      matmuls[platform] = str(jax.make_jaxpr(lambda x: mlp.apply({"params": params}, x))(x)).count("dot_general")
  assert matmuls == {"cpu": 3, "gpu": 2, "tpu": 2}
  # float32 rounding of sums over d_ff of products up to ~1e3 (the GPU's GELU derivative is also
  # written another way: `activations`), so the absolute tolerance follows each leaf's scale
  for platform in ("gpu", "tpu"):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=max(1e-4, 1e-5 * float(np.abs(b).max()))),
                 results[platform], results["cpu"])


def test_a_dropping_mlp_stores_its_pre_activation_gradient_on_a_gpu_only():
  """An MLP that drops its hidden layer (BART's, XLNet's), traced for a GPU, writes the gradient at
  its pre-activation out before the bias's sum reads it (`tfx.ops.dropout.stored_gradient`: one
  optimization barrier in the gradient's program, none in the forward pass, none without dropout
  or for a CPU), and it is the same function: the CPU's output and gradients under the same
  dropout key."""
  import dataclasses

  from tfx.nn.layers import Mlp
  from tfx.ops import target

  cfg = dataclasses.replace(make_model("--config.model.mlp=gelu_exact", shapes_only=True)[0].cfg, dropout=0.3)
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.normal(size=(2, 8, cfg.d_model)), jnp.float32)
  cotangent = jnp.asarray(rng.normal(size=x.shape), jnp.float32)
  params = nn.meta.unbox(Mlp(cfg).init(jax.random.key(0), x))["params"]
  params = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)
  results, barriers = {}, {}
  for platform in ("cpu", "gpu"):
    for deterministic in (False, True):
      mlp = Mlp(cfg, deterministic=deterministic)
      loss = lambda x, p, mlp=mlp: jnp.sum(mlp.apply({"params": p}, x, rngs={"dropout": jax.random.key(5)}) * cotangent)
      with target.lowering_for(platform):
        grads = jax.value_and_grad(loss, argnums=(0, 1))
        barriers[platform, deterministic] = (str(jax.make_jaxpr(loss)(x, params)).count("optimization_barrier"),
                                             str(jax.make_jaxpr(grads)(x, params)).count("optimization_barrier"))
        if not deterministic:
          results[platform] = jax.jit(grads)(x, params)
  # dropping adds the dropout's own backward (its bits redrawn behind a barrier) and on a GPU the
  # stored gradient; the forward pass has none either way (XLA:CPU's weight gradients have their own)
  added = {p: tuple(a - b for a, b in zip(barriers[p, False], barriers[p, True])) for p in ("cpu", "gpu")}
  assert added == {"cpu": (0, 1), "gpu": (0, 2)} and barriers["gpu", True] == (0, 0), barriers
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(b).max()))),
               results["gpu"], results["cpu"])
