"""The segment-id attention kernels, Pallas flash attention on GPU (`model.attention=pallas`) and
splash attention on TPU (`model.attention=splash`): segment-id masks, each kernel against the
reference attention (in Pallas' interpreter on this CPU), the choice and its fallbacks, a model's
function unchanged by it, and the kernel run per device on a mesh; and, for them and cuDNN's fused
attention, the forward kernel not run again in the backward pass under model.remat=dots_attention."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import tiny_config
from tests.test_ops import random_packed
from tfx import ops
from tfx.models import build_model
from tfx.ops import attention as attn


def _qkv(rng, b, t, h, kh, d, dtype=jnp.float32):
  q = jnp.asarray(rng.normal(size=(b, t, h, d)), dtype)
  k, v = (jnp.asarray(rng.normal(size=(b, t, kh, d)), dtype) for _ in range(2))
  return q, k, v


def test_segment_mask_is_the_family_mask():
  """SegmentMask.dense() is decoder_mask / segment_mask; a family gets it as ids only for pallas and
  splash; for every other kernel its dense array is built once beforehand (bitwise the same output
  as the plain array)."""
  rng = np.random.default_rng(0)
  seg = jnp.asarray(random_packed(rng, 3, 12)[0])
  np.testing.assert_array_equal(ops.SegmentMask(seg, causal=True).dense(), ops.decoder_mask(seg))
  np.testing.assert_array_equal(ops.SegmentMask(seg).dense(), ops.segment_mask(seg))
  for kernel in ("pallas", "splash"):
    assert ops.self_attention_mask(seg, causal=True, implementation=kernel).array is None
  for causal, dense in ((True, ops.decoder_mask(seg)), (False, ops.segment_mask(seg))):
    built = ops.self_attention_mask(seg, causal=causal, implementation="auto")
    assert built.causal is causal
    np.testing.assert_array_equal(built.array, dense)
    np.testing.assert_array_equal(built.dense(), dense)
  q, k, v = _qkv(rng, 3, 12, 4, 2, 8)
  for impl in ("xla", "reference"):
    attend = jax.jit(lambda m, impl=impl: ops.dot_product_attention(q, k, v, mask=m, implementation=impl))
    expected = attend(ops.decoder_mask(seg))
    np.testing.assert_array_equal(attend(ops.SegmentMask(seg, causal=True)), expected)
    np.testing.assert_array_equal(attend(ops.SegmentMask(seg, causal=True).prebuilt()), expected)


CASES = {
    # (b, t, heads, kv heads, causal, max documents, max padding): t = 48 is three of the Pallas
    # kernel's 16-token blocks and 256 two of splash's 128-token ones, so documents straddle
    # block boundaries.
    "pallas": {
        "causal_packed": (2, 48, 2, 2, True, 4, 0),
        "causal_padded": (2, 48, 2, 2, True, 2, 20),
        "bidirectional_packed_padded": (2, 48, 2, 2, False, 3, 9),
        "grouped_query_heads": (2, 32, 4, 2, True, 3, 5),
    },
    "splash": {
        "causal_packed": (2, 256, 2, 2, True, 4, 0),
        "causal_padded": (2, 256, 2, 2, True, 2, 70),
        "bidirectional_packed_padded": (2, 256, 2, 2, False, 3, 30),
        "grouped_query_heads": (2, 128, 4, 2, True, 3, 5),
    },
}
# Splash's interpreted runs at its 128-token blocks take longer: two of its cases, its model and
# mesh runs are slow tests (make test-slow; CI runs both).
SLOW_SPLASH = ("causal_packed", "bidirectional_packed_padded")
KERNEL_CASES = [pytest.param(kernel, case, id=f"{kernel}-{case}",
                             marks=[pytest.mark.slow] if kernel == "splash" and case in SLOW_SPLASH else [])
                for kernel in CASES for case in CASES[kernel]]
KERNELS = ["pallas", pytest.param("splash", marks=pytest.mark.slow)]


@pytest.mark.parametrize("kernel,case", KERNEL_CASES)
def test_segment_kernel_matches_the_reference(kernel, case):
  """Values and gradients (q, k, v) of each kernel equal XLA's attention and the einsum reference
  under the same mask, padding queries give exact zeros, and nothing reaches a padding key."""
  b, t, h, kh, causal, docs, pad = CASES[kernel][case]
  rng = np.random.default_rng(len(case))
  seg = jnp.asarray(random_packed(rng, b, t, max_docs=docs, pad=pad)[0])
  seg = seg.at[0, -pad:].set(0) if pad else seg  # at least one padded row when the case pads
  q, k, v = _qkv(rng, b, t, h, kh, 16)
  cot = jnp.asarray(rng.normal(size=(b, t, h, 16)), jnp.float32)
  mask = ops.SegmentMask(seg, causal).dense()

  def loss(fn):
    return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v) * cot), argnums=(0, 1, 2)))

  attend = attn.SEGMENT_KERNELS[kernel][1]
  flash_fn = lambda q, k, v: attend(q, k, v, seg, causal=causal, scale=0.25)
  out = flash_fn(q, k, v)
  valid = np.asarray(seg > 0)
  assert not np.any(np.asarray(out)[~valid]), "padding queries must give zeros"
  got_loss, got_grads = loss(flash_fn)(q, k, v)
  for impl in ("xla", "reference"):
    ref_fn = lambda q, k, v, impl=impl: ops.dot_product_attention(q, k, v, mask=mask, scale=0.25, implementation=impl)
    np.testing.assert_allclose(out, ref_fn(q, k, v), atol=2e-5, rtol=2e-5)
    want_loss, want_grads = loss(ref_fn)(q, k, v)
    np.testing.assert_allclose(got_loss, want_loss, atol=1e-4)  # a sum of ~3000 terms of either sign
    for got, want in zip(got_grads, want_grads):
      np.testing.assert_allclose(got, want, atol=5e-5, rtol=5e-5)
  dk, dv = (np.asarray(g) for g in got_grads[1:])
  assert not np.any(dk[~valid]) and not np.any(dv[~valid]), "a padding key got a gradient"


def test_pallas_kernel_without_the_named_vjp_is_the_same_function(monkeypatch):
  """A JAX whose private Pallas backward differs from what tfx calls gets the kernel's own VJP:
  the same values and gradients as tfx's VJP with named residuals."""
  from tfx.ops import flash

  rng = np.random.default_rng(5)
  seg = jnp.asarray(random_packed(rng, 2, 32, max_docs=3, pad=5)[0])
  q, k, v = _qkv(rng, 2, 32, 2, 2, 16)
  attend = lambda q, k, v: jnp.sum(flash.flash_attention(q, k, v, seg, causal=True, scale=0.25) ** 2)
  named = jax.jit(jax.value_and_grad(attend, argnums=(0, 1, 2)))(q, k, v)
  assert flash._pallas_backward() is not None
  monkeypatch.setattr(flash, "_pallas_backward", lambda: None)
  plain = jax.jit(jax.value_and_grad(attend, argnums=(0, 1, 2)))(q, k, v)
  for got, want in zip(jax.tree.leaves(plain), jax.tree.leaves(named)):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


# kernel -> (the device it runs on, its patched backend check, its row length here, a row length
# off its block grid, its smallest block)
DEVICES = {"pallas": ("GPU", "_on_gpu", 32, 24, 16), "splash": ("TPU", "_on_tpu", 128, 96, 128)}


@pytest.mark.parametrize("kernel", list(DEVICES))
def test_segment_kernel_choice_and_fallbacks(kernel, monkeypatch, caplog):
  """'pallas' runs its kernel on a GPU and 'splash' on a TPU for a segment-id mask, and XLA's
  attention (the same numbers, one log line with the reason) elsewhere and for what the kernel
  cannot take: a dense mask (prefix LM, two streams, cross attention), a bias, a row length off
  the block grid. 'auto' is unchanged by either."""
  device, on_device, t, odd_t, block = DEVICES[kernel]
  name = attn.SEGMENT_KERNELS[kernel][2]
  choose = attn.choose_implementation
  assert choose(kernel, jnp.float32, 64) == ("xla", f"no {device} (backend {jax.default_backend()})")
  monkeypatch.setattr(attn, on_device, lambda: True)
  assert choose(kernel, jnp.float32, 64) == (kernel, f"{device}, segment ids")
  if kernel == "pallas":
    assert choose("auto", jnp.bfloat16, 64)[0] == "cudnn"
  else:  # on a TPU 'auto' keeps XLA's attention: splash is opt-in until it has run on one
    assert choose("auto", jnp.bfloat16, 64)[0] == "xla"

  rng = np.random.default_rng(3)
  seg, pos = (jnp.asarray(a) for a in random_packed(rng, 2, t))
  q, k, v = _qkv(rng, 2, t, 2, 2, 16)
  run = lambda mask, **kw: ops.dot_product_attention(q, k, v, mask=mask, implementation=kernel, **kw)
  xla = lambda mask, **kw: ops.dot_product_attention(q, k, v, mask=ops.dense_mask(mask), implementation="xla", **kw)
  prefix = ops.prefix_lm_mask(seg, pos, jnp.full((2, 1), 5))
  bias = jnp.asarray(rng.normal(size=(1, 2, t, t)), jnp.float32)
  odd = ops.SegmentMask(seg[:, :odd_t], causal=True)
  q_odd, k_odd, v_odd = q[:, :odd_t], k[:, :odd_t], v[:, :odd_t]
  attn._LOGGED.clear()
  with caplog.at_level("INFO", logger="tfx.attention"):
    np.testing.assert_allclose(run(ops.SegmentMask(seg, causal=True)), xla(ops.SegmentMask(seg, causal=True)),
                               atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(run(prefix), xla(prefix))
    segmask = ops.SegmentMask(seg)
    np.testing.assert_array_equal(run(segmask, bias=bias), xla(segmask, bias=bias))
    np.testing.assert_array_equal(
        ops.dot_product_attention(q_odd, k_odd, v_odd, mask=odd, implementation=kernel),
        ops.dot_product_attention(q_odd, k_odd, v_odd, mask=odd.dense(), implementation="xla"))
  lines = [r.getMessage() for r in caplog.records if r.name == "tfx.attention"]
  assert lines[0] == f"attention: {kernel} ({device}, segment ids)", lines
  refusals = [line for line in lines[1:] if f"{name} refused" in line]
  assert len(refusals) == 3 and all(line.startswith("attention: xla (") for line in refusals), lines
  assert any("dense mask" in line for line in refusals) and any("bias" in line for line in refusals)
  assert any(f"not a multiple of {block}" in line for line in refusals)


def _logits_and_grads(model, params, tokens, seg, pos, cot):
  def f(p):
    out = model.apply({"params": p}, tokens, seg, pos)
    logits = out[0] if isinstance(out, tuple) else out
    return jnp.sum(logits.astype(jnp.float32) * cot)

  return jax.jit(jax.value_and_grad(f))(params)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("family", ["decoder", "encoder"])
def test_model_function_is_unchanged_by_the_segment_kernel(family, kernel, monkeypatch):
  """A GPT-style decoder and a BERT-style encoder (scanned layers, remat) compute the same
  logits and parameter gradients with model.attention=pallas or splash (the kernel, interpreted)
  as with XLA's attention, on packed rows with padding."""
  _, on_device, length, _, _ = DEVICES[kernel]
  monkeypatch.setattr(attn, on_device, lambda: True)
  vocab = 97
  models = {}
  for impl in ("xla", kernel):
    cfg = tiny_config(f"--config.model.family={family}", "--config.model.num_layers=2", "--config.model.d_model=32",
                      "--config.model.d_ff=64", f"--config.model.attention={impl}")
    models[impl] = build_model(cfg.model, vocab_size=vocab, max_length=length)
  params = nn.unbox(models["xla"].init(jax.random.key(0), **type(models["xla"]).init_inputs(1, length))["params"])
  rng = np.random.default_rng(7)
  seg, pos = (jnp.asarray(a) for a in random_packed(rng, 2, length, max_docs=3, pad=6))
  tokens = jnp.asarray(rng.integers(4, vocab, (2, length)), jnp.int32)
  cot = jnp.asarray(rng.normal(size=(2, length, vocab)), jnp.float32) * (seg > 0)[..., None]
  want, want_grads = _logits_and_grads(models["xla"], params, tokens, seg, pos, cot)
  got, got_grads = _logits_and_grads(models[kernel], params, tokens, seg, pos, cot)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got_grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-4, err_msg=jax.tree_util.keystr(path))


_SHARDED_SCRIPT = r"""
import json, os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
import jax, jax.numpy as jnp, ml_collections, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from tfx import parallel
from tfx.ops import SegmentMask, flash
from tfx.ops.attention import SEGMENT_KERNELS

kernel, t = sys.argv[1], int(sys.argv[2])
mesh = parallel.make_mesh(ml_collections.ConfigDict(dict(data=2, fsdp=2, tensor=2)))
rng = np.random.default_rng(0)
q, k, v = (jnp.asarray(rng.normal(size=(4, t, 4, 16)), jnp.float32) for _ in range(3))
seg = jnp.asarray(np.repeat([[1] * (t * 5 // 8) + [2] * (t // 4) + [0] * (t // 8)], 4, 0), jnp.int32)
attend = lambda q, k, v, s: SEGMENT_KERNELS[kernel][1](q, k, v, s, causal=True, scale=0.25)
loss = lambda q, k, v, s: jnp.sum(attend(q, k, v, s) ** 2)
result = {"diff": [], "collectives": []}
# 4 key/value heads, then one (multi-query: fewer key/value heads than the 2 head shards)
for kv in (k, v), (k[:, :, :1], v[:, :, :1]):
  want = [attend(q, *kv, seg), *jax.grad(loss, argnums=(0, 1, 2))(q, *kv, seg)]
  with parallel.context(mesh):
    heads = NamedSharding(mesh, P(parallel.BATCH_AXES, None, "tensor", None))
    rows = NamedSharding(mesh, P(parallel.BATCH_AXES, None, None, None))  # a single head is not cut
    args = [jax.device_put(q, heads)] + [jax.device_put(x, heads if x.shape[2] > 1 else rows) for x in kv]
    args += [jax.device_put(seg, parallel.batch_sharding(mesh))]
    forward, backward = jax.jit(attend), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    got = [forward(*args), *backward(*args)]
    hlo = forward.lower(*args).compile().as_text() + backward.lower(*args).compile().as_text()
  result["diff"] += [float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(got, want)]
  result["collectives"].append({op: hlo.count(op + "(") for op in ("all-gather", "all-reduce", "all-to-all")})
  result["out_sharding"] = str(got[0].sharding.spec)
with parallel.context(mesh):  # 3 heads cannot be cut 2 ways: the kernel refuses (XLA's attention runs)
  result["refused"] = flash.unsupported(q[:, :, :3], k[:, :, :3], SegmentMask(seg, True), None, blocks=(t,))
print(json.dumps(result))
"""


@pytest.mark.parametrize("kernel", KERNELS)
def test_segment_kernel_runs_per_device_on_a_mesh(kernel, tmp_path):
  """On 8 fake devices (2-way data x 2-way FSDP x 2-way tensor), each kernel runs on each device's
  rows and heads: the same output and q/k/v gradients as on one device, no collective in the
  compiled forward or backward (an opaque Pallas call left to XLA's partitioner gathers every
  operand onto every device), and the output keeps the activations' sharding. With a single
  key/value head, fewer than the head shards, each device attends with its copy and only the
  head copies' dK and dV are summed across devices (all-reduces; float32 rounding of a sum in
  another order). Heads that do not divide over the shards are refused (XLA's attention runs)."""
  import json
  import os
  import subprocess
  import sys

  from tests.conftest import ROOT

  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  length = str(DEVICES[kernel][2])
  proc = subprocess.run([sys.executable, "-c", _SHARDED_SCRIPT, kernel, length], env=env, capture_output=True, text=True,
                        timeout=600, cwd=str(tmp_path))
  assert proc.returncode == 0, proc.stderr[-4000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  assert out["diff"][:6] == [0.0] * 6, out  # all of the first, and the single head's output and dQ
  assert max(out["diff"][4:]) < 1e-5, out
  none = {"all-gather": 0, "all-reduce": 0, "all-to-all": 0}
  assert out["collectives"][0] == none, out
  assert out["collectives"][1]["all-reduce"] > 0 and out["collectives"][1]["all-gather"] == 0, out
  assert out["out_sharding"] == "P(('data', 'fsdp'), None, 'tensor', None)", out
  assert out["refused"] == "its 4 rows x 3 heads do not divide over the mesh's 4 row x 2 head shards (it runs on each device's own)", out


@pytest.mark.slow
@pytest.mark.parametrize("kernel", list(DEVICES))
def test_remat_dots_attention_keeps_the_kernel_residuals(kernel, monkeypatch):
  """Under model.remat=dots_attention the backward pass reuses each kernel's named forward
  residuals (output, log-sum-exp) instead of running its forward kernel again, as model.remat=full
  does: the compiled gradient of a scanned decoder (kernels interpreted, each a loop) has as many
  loops as with no remat at all, and full remat has more."""
  import re

  _, on_device, length, _, _ = DEVICES[kernel]
  monkeypatch.setattr(attn, on_device, lambda: True)
  loops = {}
  for remat in ("none", "dots_attention", "full"):
    loss, params = _tiny_loss(length, "--config.model.family=decoder", "--config.model.d_model=32",
                              f"--config.model.attention={kernel}", f"--config.model.remat={remat}")
    hlo = jax.jit(jax.grad(loss)).lower(params).compile().as_text()
    loops[remat] = len(re.findall(r" while\(", hlo))
  assert loops["dots_attention"] == loops["none"] < loops["full"], loops


def _tiny_loss(length: int, *flags: str):
  """(loss(params), abstract params) of a 2-layer model of the tiny config with these overrides
  (d_ff 64) on two rows of `length` dummy tokens (one document each)."""
  cfg = tiny_config("--config.model.num_layers=2", "--config.model.d_ff=64", *flags)
  model = build_model(cfg.model, vocab_size=97, max_length=length)
  params = jax.eval_shape(lambda: nn.unbox(model.init(jax.random.key(0), **type(model).init_inputs(1, length))["params"]))
  inputs = type(model).init_inputs(2, length)
  return (lambda p: jnp.sum(model.apply({"params": p}, **inputs).astype(jnp.float32))), params


def _cudnn_gradient_jaxpr(monkeypatch, *flags: str, length: int = 64) -> str:
  """The jaxpr of a tiny bf16 model's parameter gradient with model.attention=cudnn, a GPU and
  cuDNN faked for the choice (this CPU has no cuDNN to compile for: traced only). flags: the
  model's config overrides."""
  from jax._src.cudnn import fused_attention_stablehlo

  monkeypatch.setattr(attn, "_on_gpu", lambda: True)
  monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda *a, **k: 91000)
  loss, params = _tiny_loss(length, "--config.model.d_model=64", "--config.model.attention=cudnn",
                            "--config.model.dtype=bfloat16", *flags)
  with attn.recorded_choices() as chosen:
    jaxpr = str(jax.make_jaxpr(jax.grad(loss))(params))
  assert {kernel for kernel, _ in chosen} == {"cudnn"}, chosen
  return jaxpr


def test_remat_dots_attention_keeps_the_cudnn_residuals(monkeypatch):
  """cuDNN's fused attention cannot name its residuals; model.remat=dots_attention keeps the
  outputs of its forward kernel (a JAX primitive) all the same, so the backward pass does not run
  it again, as it does under model.remat=full (a scanned decoder's gradient, traced)."""
  import re

  forward_kernels = {}
  for remat in ("none", "dots_attention", "full"):
    jaxpr = _cudnn_gradient_jaxpr(monkeypatch, "--config.model.family=decoder", f"--config.model.remat={remat}")
    forward_kernels[remat] = len(re.findall(r"\bdot_product_attention_fwd_wrapper\[", jaxpr))
  assert forward_kernels["dots_attention"] == forward_kernels["none"] == 1, forward_kernels
  assert forward_kernels["full"] == 2, forward_kernels


@pytest.mark.parametrize(("family", "causal", "full"), [("decoder", 1, 0), ("encoder", 0, 1), ("encoder_decoder", 1, 2)])
def test_cudnn_skips_the_blocks_above_a_causal_diagonal(monkeypatch, family, causal, full):
  """A causal self-attention (GPT's, T5's decoder's) reaches cuDNN with its exact packed mask and
  the is_causal hint (mask type CAUSAL: the key blocks above the diagonal are not computed, forward
  and backward); bidirectional and cross attention with no hint (NO_MASK; their mask is the bias).
  Per scanned stack, in the traced gradient."""
  import re

  jaxpr = _cudnn_gradient_jaxpr(monkeypatch, f"--config.model.family={family}", "--config.model.remat=none")
  for kind in ("fwd", "bwd"):
    types = re.findall(rf"dot_product_attention_{kind}_wrapper\[[^\]]*?mask_type=MaskType\.(\w+)", jaxpr, re.S)
    assert sorted(types) == ["CAUSAL"] * causal + ["NO_MASK"] * full, (kind, types)
