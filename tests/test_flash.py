"""The Pallas flash-attention path (`model.attention=pallas`): segment-id masks, the kernel
against the reference attention (in Pallas' interpreter on this CPU), the choice and its
fallbacks, and a model's function unchanged by it."""

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
from tfx.ops import flash


def _qkv(rng, b, t, h, kh, d, dtype=jnp.float32):
  q = jnp.asarray(rng.normal(size=(b, t, h, d)), dtype)
  k, v = (jnp.asarray(rng.normal(size=(b, t, kh, d)), dtype) for _ in range(2))
  return q, k, v


def test_segment_mask_is_the_family_mask():
  """SegmentMask.dense() is decoder_mask / segment_mask; a family gets it as ids only for pallas;
  every other kernel attends with its dense array (bitwise the same output)."""
  rng = np.random.default_rng(0)
  seg = jnp.asarray(random_packed(rng, 3, 12)[0])
  np.testing.assert_array_equal(ops.SegmentMask(seg, causal=True).dense(), ops.decoder_mask(seg))
  np.testing.assert_array_equal(ops.SegmentMask(seg).dense(), ops.segment_mask(seg))
  assert isinstance(ops.self_attention_mask(seg, causal=True, implementation="pallas"), ops.SegmentMask)
  dense = ops.self_attention_mask(seg, causal=True, implementation="auto")
  np.testing.assert_array_equal(dense, ops.decoder_mask(seg))
  q, k, v = _qkv(rng, 3, 12, 4, 2, 8)
  for impl in ("xla", "reference"):
    attend = jax.jit(lambda m, impl=impl: ops.dot_product_attention(q, k, v, mask=m, implementation=impl))
    np.testing.assert_array_equal(attend(ops.SegmentMask(seg, causal=True)), attend(dense))


CASES = {
    # (b, t, heads, kv heads, causal, max documents, max padding): t = 48 is three 16-token blocks,
    # so documents straddle block boundaries.
    "causal_packed": (2, 48, 2, 2, True, 4, 0),
    "causal_padded": (2, 48, 2, 2, True, 2, 20),
    "bidirectional_packed_padded": (2, 48, 2, 2, False, 3, 9),
    "grouped_query_heads": (2, 32, 4, 2, True, 3, 5),
}


@pytest.mark.parametrize("case", list(CASES))
def test_flash_attention_matches_the_reference(case):
  """Values and gradients (q, k, v) of the kernel equal XLA's attention and the einsum reference
  under the same mask, padding queries give exact zeros, and nothing reaches a padding key."""
  b, t, h, kh, causal, docs, pad = CASES[case]
  rng = np.random.default_rng(len(case))
  seg = jnp.asarray(random_packed(rng, b, t, max_docs=docs, pad=pad)[0])
  seg = seg.at[0, -pad:].set(0) if pad else seg  # at least one padded row when the case pads
  q, k, v = _qkv(rng, b, t, h, kh, 16)
  cot = jnp.asarray(rng.normal(size=(b, t, h, 16)), jnp.float32)
  mask = ops.SegmentMask(seg, causal).dense()

  def loss(fn):
    return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v) * cot), argnums=(0, 1, 2)))

  flash_fn = lambda q, k, v: flash.flash_attention(q, k, v, seg, causal=causal, scale=0.25)
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


def test_pallas_choice_and_fallbacks(monkeypatch, caplog):
  """'pallas' runs the kernel on a GPU for a segment-id mask, and XLA's attention (the same
  numbers, one log line with the reason) off a GPU and for what the kernel cannot take: a dense
  mask (prefix LM, two streams, cross attention), a bias, a row length off the block grid."""
  choose = attn.choose_implementation
  assert choose("pallas", jnp.float32, 64) == ("xla", f"no GPU (backend {jax.default_backend()})")
  monkeypatch.setattr(attn, "_on_gpu", lambda: True)
  assert choose("pallas", jnp.float32, 64) == ("pallas", "GPU, segment ids")
  assert choose("auto", jnp.bfloat16, 64)[0] == "cudnn"  # 'auto' is unchanged

  rng = np.random.default_rng(3)
  seg, pos = (jnp.asarray(a) for a in random_packed(rng, 2, 32))
  q, k, v = _qkv(rng, 2, 32, 2, 2, 16)
  run = lambda mask, **kw: ops.dot_product_attention(q, k, v, mask=mask, implementation="pallas", **kw)
  xla = lambda mask, **kw: ops.dot_product_attention(q, k, v, mask=ops.dense_mask(mask), implementation="xla", **kw)
  prefix = ops.prefix_lm_mask(seg, pos, jnp.full((2, 1), 5))
  bias = jnp.asarray(rng.normal(size=(1, 2, 32, 32)), jnp.float32)
  odd = ops.SegmentMask(seg[:, :24], causal=True)
  q24, k24, v24 = q[:, :24], k[:, :24], v[:, :24]
  attn._LOGGED.clear()
  with caplog.at_level("INFO", logger="tfx.attention"):
    np.testing.assert_allclose(run(ops.SegmentMask(seg, causal=True)), xla(ops.SegmentMask(seg, causal=True)),
                               atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(run(prefix), xla(prefix))
    segmask = ops.SegmentMask(seg)
    np.testing.assert_array_equal(run(segmask, bias=bias), xla(segmask, bias=bias))
    np.testing.assert_array_equal(
        ops.dot_product_attention(q24, k24, v24, mask=odd, implementation="pallas"),
        ops.dot_product_attention(q24, k24, v24, mask=odd.dense(), implementation="xla"))
  lines = [r.getMessage() for r in caplog.records if r.name == "tfx.attention"]
  assert lines[0] == "attention: pallas (GPU, segment ids)", lines
  refusals = [line for line in lines[1:] if "Pallas flash attention refused" in line]
  assert len(refusals) == 3 and all(line.startswith("attention: xla (") for line in refusals), lines
  assert any("dense mask" in line for line in refusals) and any("bias" in line for line in refusals)
  assert any("not a multiple of 16" in line for line in refusals)


def _logits_and_grads(model, params, tokens, seg, pos, cot):
  def f(p):
    out = model.apply({"params": p}, tokens, seg, pos)
    logits = out[0] if isinstance(out, tuple) else out
    return jnp.sum(logits.astype(jnp.float32) * cot)

  return jax.jit(jax.value_and_grad(f))(params)


@pytest.mark.parametrize("family", ["decoder", "encoder"])
def test_model_function_is_unchanged_by_the_pallas_path(family, monkeypatch):
  """A GPT-style decoder and a BERT-style encoder (scanned layers, remat) compute the same
  logits and parameter gradients with model.attention=pallas (the kernel, interpreted) as with
  XLA's attention, on packed rows with padding."""
  monkeypatch.setattr(attn, "_on_gpu", lambda: True)
  length, vocab = 32, 97
  models = {}
  for impl in ("xla", "pallas"):
    cfg = tiny_config(f"--config.model.family={family}", "--config.model.num_layers=2", "--config.model.d_model=32",
                      "--config.model.d_ff=64", f"--config.model.attention={impl}")
    models[impl] = build_model(cfg.model, vocab_size=vocab, max_length=length)
  params = nn.unbox(models["xla"].init(jax.random.key(0), **type(models["xla"]).init_inputs(1, length))["params"])
  rng = np.random.default_rng(7)
  seg, pos = (jnp.asarray(a) for a in random_packed(rng, 2, length, max_docs=3, pad=6))
  tokens = jnp.asarray(rng.integers(4, vocab, (2, length)), jnp.int32)
  cot = jnp.asarray(rng.normal(size=(2, length, vocab)), jnp.float32) * (seg > 0)[..., None]
  want, want_grads = _logits_and_grads(models["xla"], params, tokens, seg, pos, cot)
  got, got_grads = _logits_and_grads(models["pallas"], params, tokens, seg, pos, cot)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got_grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-4, err_msg=jax.tree_util.keystr(path))


_SHARDED_SCRIPT = r"""
import json, os
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
import jax, jax.numpy as jnp, ml_collections, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from tfx import parallel
from tfx.ops import flash

mesh = parallel.make_mesh(ml_collections.ConfigDict(dict(data=2, fsdp=2, tensor=2)))
rng = np.random.default_rng(0)
q, k, v = (jnp.asarray(rng.normal(size=(4, 32, 4, 16)), jnp.float32) for _ in range(3))
seg = jnp.asarray(np.repeat([[1] * 20 + [2] * 8 + [0] * 4], 4, 0), jnp.int32)
attend = lambda q, k, v, s: flash.flash_attention(q, k, v, s, causal=True, scale=0.25)
loss = lambda q, k, v, s: jnp.sum(attend(q, k, v, s) ** 2)
want = [attend(q, k, v, seg), *jax.grad(loss, argnums=(0, 1, 2))(q, k, v, seg)]
with parallel.context(mesh):
  heads = NamedSharding(mesh, P(parallel.BATCH_AXES, None, "tensor", None))
  args = [jax.device_put(x, heads) for x in (q, k, v)] + [jax.device_put(seg, parallel.batch_sharding(mesh))]
  forward, backward = jax.jit(attend), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  got = [forward(*args), *backward(*args)]
  hlo = forward.lower(*args).compile().as_text() + backward.lower(*args).compile().as_text()
print(json.dumps({"diff": [float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(got, want)],
                  "collectives": sum(hlo.count(op) for op in ("all-gather", "all-reduce", "all-to-all")),
                  "out_sharding": str(got[0].sharding.spec)}))
"""


def test_flash_attention_runs_per_device_on_a_mesh(tmp_path):
  """On 8 fake devices (2-way data x 2-way FSDP x 2-way tensor), the kernel runs on each device's
  rows and heads: the same output and q/k/v gradients as on one device, no collective in the
  compiled forward or backward (an opaque Pallas call left to XLA's partitioner gathers every
  operand onto every device), and the output keeps the activations' sharding."""
  import json
  import os
  import subprocess
  import sys

  from tests.conftest import ROOT

  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  proc = subprocess.run([sys.executable, "-c", _SHARDED_SCRIPT], env=env, capture_output=True, text=True,
                        timeout=600, cwd=str(tmp_path))
  assert proc.returncode == 0, proc.stderr[-4000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  assert out["diff"] == [0.0, 0.0, 0.0, 0.0], out
  assert out["collectives"] == 0, out
  assert out["out_sharding"] == "P(('data', 'fsdp'), None, 'tensor', None)", out
