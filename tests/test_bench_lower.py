"""`python -m tfx.bench --lower gpu|tpu`: train steps lowered for an accelerator this CPU does not have.

The lowered modules are the programs the accelerator would compile; what these tests read off
them is which attention kernels the step calls and how often: the forward kernel once when the
rematerialisation policy keeps its outputs (`dots_attention`, the default), twice when the
backward pass recomputes it (`full`).
"""

import importlib.util
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from tfx import bench, bench_lower
from tfx.ops import attention, cudnn, masks, target

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def lower_gpt2(platform: str, *overrides: str) -> dict:
  (result,) = bench_lower.lower_suite(ROOT, platform, tiny=True, batch_per_device=2, only=("gpt2_small",),
                                      overrides=overrides)
  assert result["error"] is None, result["error"]
  return result


def test_lowering_for_names_the_platform_only_inside_the_block():
  assert target.backend() == "cpu"
  assert attention.choose_implementation("auto", jnp.bfloat16, 64)[0] == "xla"
  with target.lowering_for("gpu"):
    assert target.backend() == "gpu"
    assert attention.choose_implementation("auto", jnp.bfloat16, 64) == ("cudnn", "GPU, bfloat16")
    assert attention.choose_implementation("pallas", jnp.bfloat16, 64)[0] == "pallas"
    with target.lowering_for("tpu"):
      assert attention.choose_implementation("splash", jnp.bfloat16, 64)[0] == "splash"
    assert target.backend() == "gpu"
  assert target.backend() == "cpu"
  assert attention.choose_implementation("pallas", jnp.bfloat16, 64)[0] == "xla"
  with pytest.raises(ValueError, match="unknown platform"):
    with target.lowering_for("metal"):
      pass


def test_assumed_cudnn_version_is_undone_after_the_block():
  fused = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")  # JAX's private module

  if fused.cuda_versions is not None:
    pytest.skip("cuDNN is installed here: its own version is used")
  with pytest.raises(RuntimeError, match="cuDNN"):
    fused.check_cudnn_version()
  capability = fused.check_compute_capability
  with target.lowering_for("gpu"):
    assert fused.check_cudnn_version() == target.CUDNN_ASSUMED
    # an H100's: Hopper's packed layout lowers, Blackwell's checks do not apply
    assert fused.check_compute_capability("9.0") and not fused.check_compute_capability("10.0")
  with pytest.raises(RuntimeError, match="cuDNN"):
    fused.check_cudnn_version()
  assert fused.check_compute_capability is capability and not capability("9.0")  # no GPU here
  with pytest.raises(ZeroDivisionError):  # a failure inside the block undoes it too
    with target.lowering_for("gpu"):
      assert target.backend() == "gpu"
      1 / 0
  assert target.backend() == "cpu"
  with pytest.raises(RuntimeError, match="cuDNN"):
    fused.check_cudnn_version()


@pytest.mark.parametrize("remat, forward_sites", [("dots_attention", 1), ("full", 2)])
def test_cudnn_forward_kernel_runs_again_only_when_the_policy_drops_its_outputs(remat, forward_sites):
  result = lower_gpt2("gpu", "model.attention=auto", f"model.remat={remat}")
  assert result["attention"] == ["cudnn (GPU, bfloat16)"]
  assert result["kernel_calls"] == {"cudnn backward": 1, "cudnn forward": forward_sites}


@pytest.mark.parametrize("remat, sites", [("dots_attention", 3), ("full", 4)])
def test_pallas_kernels_lower_to_triton(remat, sites):
  # forward, dq and dk/dv kernels; with `full` the forward kernel a second time
  result = lower_gpt2("gpu", "model.attention=pallas", f"model.remat={remat}")
  assert result["attention"] == ["pallas (GPU, segment ids)"]
  assert result["kernel_calls"] == {"triton (Pallas)": sites}


def test_splash_kernels_lower_to_mosaic():
  result = lower_gpt2("tpu", "model.attention=splash", "data.seq_len=128")  # splash's smallest block is 128
  assert result["attention"] == ["splash (TPU, segment ids)"]
  assert result["kernel_calls"] == {"mosaic (Pallas)": 3}


def test_xla_attention_calls_no_kernel():
  result = lower_gpt2("gpu", "model.attention=xla")
  assert result["kernel_calls"] == {} and result["module_bytes"] > 0
  assert result["attention"] == ["xla (model.attention)"]
  assert target.backend() == "cpu"


@pytest.mark.parametrize("length, kind", [(29, "segments"), (29, "causal segments"), (29, "lengths"), (29, "dense"),
                                          (30, "segments")])
def test_cudnn_takes_odd_lengths_that_its_backward_pass_refuses(length, kind):
  # JAX's cuDNN wrapper accepts the forward call at an odd length with a mask and refuses only
  # when the gradient is traced; tfx pads a dense mask, lengths or segment ids to an even length
  # (cudnn.even_lengths: T5 at rows of 128 has 29 targets, a packed row may be odd)
  q = jnp.zeros((2, length, 4, 64), jnp.bfloat16)
  n = jnp.asarray([length, length - 3])
  mask = {"lengths": lambda: masks.LengthMask(n, n, (length, length)),
          "dense": lambda: jnp.ones((2, 1, length, length), bool),
          "segments": lambda: masks.SegmentMask(jnp.ones((2, length), jnp.int32).at[1, -3:].set(0)),
          "causal segments": lambda: masks.SegmentMask(jnp.ones((2, length), jnp.int32).at[1, -3:].set(0),
                                                       causal=True).prebuilt()}[kind]()

  def loss(q):
    return attention.dot_product_attention(q, q, q, mask=mask).astype(jnp.float32).sum()

  with target.lowering_for("gpu"), attention.recorded_choices() as chosen:
    lowered = jax.jit(jax.grad(loss)).trace(q).lower(lowering_platforms=("cuda",))
  assert [impl for impl, _ in chosen] == ["cudnn"]
  assert bench_lower.kernel_calls(lowered.as_text()) == {"cudnn forward": 1, "cudnn backward": 1}


def _backward_results(lowered_text: str) -> list[str]:
  """The result types of the cuDNN backward call in a lowered module (one call expected)."""
  (line,) = [l for l in lowered_text.splitlines() if "fmha" in l and "Backward" in l]
  return re.findall(r"tensor<([^>]*)>", line.rsplit("->", 1)[1])


@pytest.mark.parametrize("kind", ["segments", "causal segments", "dense", "bias", "bias and segments"])
def test_cudnn_backward_writes_a_bias_gradient_only_for_a_bias(kind):
  # JAX folds a mask into a bias and (jax >= 0.8) asks cuDNN's backward kernel for that bias's
  # gradient, a [b, 1, t, s] tensor nobody reads: a mask alone goes without it
  # (target.cudnn_without_bias_gradient); the model's own bias (T5's relative positions, XLNet's
  # relative scores) keeps its gradient, the mask folded into it or not
  fused = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")  # JAX's private module
  original = fused.should_export_dbias
  q = jnp.zeros((2, 16, 4, 64), jnp.bfloat16)
  ids = jnp.ones((2, 16), jnp.int32).at[1, -3:].set(0)
  mask = {"segments": masks.SegmentMask(ids), "causal segments": masks.SegmentMask(ids, causal=True),
          "dense": jnp.ones((2, 1, 16, 16), bool).at[0, 0, 3, 5].set(False), "bias": None,
          "bias and segments": masks.SegmentMask(ids, causal=True)}[kind]
  bias = jnp.zeros((1, 4, 16, 16), jnp.bfloat16) if kind.startswith("bias") else None

  def loss(q, bias):
    return attention.dot_product_attention(q, q, q, mask=mask, bias=bias).astype(jnp.float32).sum()

  with target.lowering_for("gpu"), attention.recorded_choices() as chosen:
    lowered = jax.jit(jax.grad(loss, argnums=(0, 1) if bias is not None else 0)).trace(q, bias).lower(
        lowering_platforms=("cuda",))
  assert [impl for impl, _ in chosen] == ["cudnn"]
  results = _backward_results(lowered.as_text())
  gradients = ["2x4x16x64xbf16"] * 3  # dq, dk, dv
  if bias is None:
    assert results == gradients + ["0xui8"]
  else:  # the bias's gradient, [b|1, h, t, s] as the bias cuDNN gets (the mask folded in)
    assert results[:3] == gradients and len(results) == 5 and results[3].endswith("x4x16x16xbf16")
  assert fused.should_export_dbias is original  # undone after the call


@pytest.mark.parametrize("t, s, masked", [(5, 7, True), (5, 8, True), (6, 7, False), (7, 7, True), (5, 7, "lengths"),
                                          (7, 7, "causal lengths"), (7, 7, "segments"), (7, 7, "causal segments"),
                                          (7, 7, "prebuilt segments")])
def test_attention_padded_to_even_lengths_is_the_same_function(t, s, masked):
  """What cuDNN gets at odd lengths (`even_lengths`: one zero query row dropped afterwards, one zero
  key no query attends) computes the same outputs and gradients (q, k, v, bias), here with the
  reference attention as the kernel (a packed row's mask as cuDNN gets it, `padding_attends_padding`);
  a row with no key stays one (the guard's business)."""
  import numpy as np

  kq, kk, kv, kb, km, kc = jax.random.split(jax.random.key(3), 6)
  q, k, v = (jax.random.normal(key, (2, n, 4, 8)) for key, n in ((kq, t), (kk, s), (kv, s)))
  bias = jax.random.normal(kb, (2, 4, t, s))
  if isinstance(masked, str) and "segments" in masked:  # two segments and padding, in the middle too
    ids = jnp.asarray([[1, 1, 1, 2, 2, 0, 0], [1, 0, 2, 2, 2, 2, 3]])
    mask = masks.SegmentMask(ids, causal=masked.startswith("c"))
    mask = mask.prebuilt() if masked.startswith("p") else mask
  elif isinstance(masked, str):
    mask = masks.LengthMask(jnp.asarray([t, t - 2]), jnp.asarray([s, s - 3]), (t, s), causal=masked.startswith("c"))
  else:
    mask = jax.random.bernoulli(km, 0.7, (2, 1, t, s)).at[0, 0, 1].set(False) if masked else None
  cot = jax.random.normal(kc, (2, t, 4, 8))
  dense = lambda m: m.dense() if isinstance(m, (masks.LengthMask, masks.SegmentMask)) else m

  def plain(q, k, v, bias):
    return attention.reference_attention(q, k, v, mask=dense(mask), bias=bias)

  def padded(q, k, v, bias):
    q2, k2, v2, mask2, bias2 = cudnn.even_lengths(q, k, v, mask, bias)
    assert q2.shape[1] % 2 == 0 and k2.shape[1] % 2 == 0
    if isinstance(mask2, masks.SegmentMask):  # the padding queries give zeros themselves
      v2, kernel_mask = cudnn.padding_attends_padding(v2, mask2)
      return attention.reference_attention(q2, k2, v2, mask=kernel_mask, bias=bias2)[:, :t]
    return attention.reference_attention(q2, k2, v2, mask=cudnn.kernel_mask(dense(mask2)), bias=bias2)[:, :t]

  keep = np.ones((2, t, 1, 1), bool) if mask is None else np.asarray(dense(mask).any(-1))[:, 0, :, None, None]
  if isinstance(mask, masks.SegmentMask):  # its padding queries' zeros need no guard
    np.testing.assert_array_equal(np.where(keep, 0.0, padded(q, k, v, bias)), 0.0)
  for f in (plain, padded):  # the rows with keys (the guard zeroes the others after any kernel)
    out, pull = jax.vjp(lambda *a, f=f: jnp.where(keep, f(*a), 0.0), q, k, v, bias)
    if f is plain:
      want = (out, *pull(cot))
  for got, exp in zip((out, *pull(cot)), want):
    np.testing.assert_allclose(got, exp, rtol=1e-5, atol=1e-5)


def test_cudnn_gets_every_key_for_a_query_row_that_has_none(monkeypatch):
  # On an H200 (jax 0.11.2) cuDNN's backward pass gave NaN in dq for a row whose scores are all
  # the large negative bias a mask becomes (cross attention, more queries than keys): such a row
  # attends every key in the kernel, and the guard zeroes its output (and with it its gradient)
  handed = []

  def fake_cudnn(q, k, v, *, mask, **kwargs):
    handed.append(mask)
    return jnp.ones(q.shape, q.dtype)

  monkeypatch.setattr(jax.nn, "dot_product_attention", fake_cudnn)
  decoder = jnp.asarray([[1, 1, 2, 2, 0, 0, 0, 0]])  # [b, t]: the last four queries are padding
  encoder = jnp.asarray([[1, 1, 2, 0]])  # [b, s]
  mask = masks.segment_mask(decoder, encoder)  # [b, 1, t, s]
  q = jnp.zeros((1, 8, 2, 64), jnp.bfloat16)
  kv = jnp.zeros((1, 4, 2, 64), jnp.bfloat16)
  with target.lowering_for("gpu"), attention.recorded_choices() as chosen:
    out = attention.dot_product_attention(q, kv, kv, mask=mask)
  assert [impl for impl, _ in chosen] == ["cudnn"]
  (given,) = handed
  rows = jnp.any(mask, axis=-1)  # [b, 1, t]
  assert bool(jnp.all(jnp.any(given, axis=-1)))  # every row has a key in the kernel
  assert bool(jnp.all(jnp.where(rows[..., None], given == mask, given)))  # the others' keys unchanged
  assert not bool(jnp.any(out[:, 4:])) and bool(jnp.all(out[:, :4] == 1))  # padding rows zeroed after


def _computing_cudnn(q, k, v, *, mask, scale, is_causal=False, **unused):
  """What cuDNN computes, here in float32: the softmax over the allowed keys (`is_causal` on top of
  the mask). A row with no allowed key gives NaN: nothing rescues it."""
  t, s = q.shape[1], k.shape[1]
  scores = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
  allowed = jnp.broadcast_to(mask, scores.shape) & (masks.causal_mask(t, s) if is_causal else True)
  p = jax.nn.softmax(jnp.where(allowed, scores, -jnp.inf), axis=-1)  # [b, h, t, s]
  return jnp.einsum("bhts,bshd->bthd", p, v.astype(jnp.float32)).astype(q.dtype)


@pytest.mark.parametrize("causal", [True, False])
def test_cudnn_gives_a_packed_rows_padding_queries_zeros_itself(monkeypatch, causal):
  # A packed row's padding queries attend the padding keys, whose values are zeroed, so that the
  # kernel's own output is 0 there (no select after it) and nothing reaches a weight through them
  returned = []

  def fake_cudnn(q, k, v, **kwargs):
    returned.append(_computing_cudnn(q, k, v, **kwargs))
    return returned[-1]

  monkeypatch.setattr(jax.nn, "dot_product_attention", fake_cudnn)
  seg = jnp.asarray([[1, 1, 1, 2, 2, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1], [0] * 8])  # [b, t]
  mask = masks.SegmentMask(seg, causal).prebuilt()
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v = (jax.random.normal(key, (3, 8, 2, 64), jnp.bfloat16) for key in keys[:3])
  cotangent = jax.random.normal(keys[3], (3, 8, 2, 64))

  def run(q, k, v):
    return attention.dot_product_attention(q, k, v, mask=mask)

  def loss(q, k, v):
    return jnp.sum(run(q, k, v).astype(jnp.float32) * cotangent)

  with target.lowering_for("gpu"), attention.recorded_choices() as chosen:
    out = run(q, k, v)
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  assert {impl for impl, _ in chosen} == {"cudnn"}
  pad = seg == 0
  assert not bool(jnp.any(jnp.isnan(returned[0])))  # every row had a key in the kernel
  assert not bool(jnp.any(returned[0][pad]))  # the kernel's own output is 0 on the padding rows
  assert not bool(jnp.any(out[pad])) and not any(bool(jnp.any(g[pad])) for g in grads)

  def reference(q, k, v):  # float32, the padding rows zeroed
    out = attention.reference_attention(q, k, v, mask=mask.dense(), scale=64 ** -0.5)
    return jnp.where(pad[:, :, None, None], 0.0, out)

  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  want_out, pull = jax.vjp(reference, *f32)
  want = (want_out, *pull(cotangent))
  for got, exp in zip((out, *grads), want):
    err = jnp.max(jnp.abs(got.astype(jnp.float32) - exp)) / jnp.max(jnp.abs(exp))
    assert float(err) < 2e-2, float(err)


def test_t5_with_an_odd_target_length_lowers_for_gpu():
  (result,) = bench_lower.lower_suite(ROOT, "gpu", tiny=True, batch_per_device=2, only=("t5_base",),
                                      overrides=("data.seq_len=128",))  # 128 -> 29 targets
  assert result["error"] is None, result["error"]
  # the encoder's, the decoder's and the cross attention: the 29 targets padded to 30 for cuDNN
  assert result["kernel_calls"] == {"cudnn backward": 3, "cudnn forward": 3}, result["kernel_calls"]
  assert not any("needs even lengths" in a for a in result["attention"])


def test_attention_dropout_names_the_path_it_takes():
  """With attention dropout, 'auto' runs XLA's attention on a GPU (cuDNN's kernel through JAX has
  no per-step seed); 'pallas' runs tfx's Pallas kernels, which draw the dropout themselves."""
  result = lower_gpt2("gpu", "model.attention=auto", "model.attention_dropout=0.1")
  assert result["attention"] == ["xla (model.attention_dropout=0.1: of the fused kernels only Pallas' applies dropout "
                                 "(model.attention=pallas))"]
  assert result["kernel_calls"] == {}


@pytest.mark.parametrize("remat, sites", [("dots_attention", 3), ("full", 4)])
def test_pallas_dropout_kernels_lower_to_triton(remat, sites):
  # forward, dK/dV and dQ kernels; with `full` the forward kernel a second time
  result = lower_gpt2("gpu", "model.attention=pallas", "model.attention_dropout=0.1", f"model.remat={remat}")
  assert result["attention"] == ["pallas (GPU, segment ids; dropout 0.1 drawn in the kernel)"]
  assert result["kernel_calls"] == {"triton (Pallas)": sites}, result["kernel_calls"]


def test_kernel_calls_counts_call_sites_by_kernel():
  text = "\n".join([
      '%0 = stablehlo.custom_call @"__cudnn$fmhaScaleBiasSoftmax"(%a)',
      "%1 = stablehlo.custom_call @__cudnn$fmhaScaleBiasSoftmax(%a)",
      "%2 = stablehlo.custom_call @__cudnn$fmhaScaleBiasSoftmaxBackward(%b)",
      "%3 = stablehlo.custom_call @Sharding(%c)",
      "%4 = stablehlo.custom_call @tpu_custom_call(%d)",
  ])
  assert bench_lower.kernel_calls(text) == {"cudnn backward": 1, "cudnn forward": 2, "mosaic (Pallas)": 1}


def test_cli_reports_a_failed_lowering_and_exits_1(monkeypatch, tmp_path, capsys):
  from tfx import bench_suite

  def broken(config, devices=None):
    raise NotImplementedError("the kernel does not exist there\nsecond line")

  monkeypatch.setattr(bench_suite, "_abstract_step", broken)
  out = tmp_path / "lowered.json"
  with pytest.raises(SystemExit) as exit_info:
    bench.main(["--suite", "accel", "--tiny", "--lower", "tpu", "--only", "bert_base", "--json", str(out)])
  assert exit_info.value.code == 1
  printed = capsys.readouterr().out
  assert "bert_base [16 x 64, defaults] for tpu: FAILED NotImplementedError: the kernel does not exist there" in printed
  (record,) = json.loads(out.read_text())
  assert record["name"] == "bert_base" and record["error"].startswith("NotImplementedError")
  assert target.backend() == jax.default_backend()  # the failure left no platform behind


def test_cli_lowers_one_config_per_swept_value(capsys):
  with pytest.raises(SystemExit) as exit_info:
    bench.main(["--config", os.path.join(ROOT, "configs", "tiny.py"), "--config.model.dtype=bfloat16",
                "--lower", "gpu", "--sweep", "model.attention=pallas,xla"])
  assert exit_info.value.code == 0
  lines = capsys.readouterr().out.strip().splitlines()
  assert len(lines) == 2
  assert lines[0].startswith("config [model.attention=pallas] for gpu: lowered") and "triton (Pallas) x" in lines[0]
  assert "no attention kernel called" in lines[1]


TPU_LIBS = os.path.join(ROOT, ".tpu-libs")


GPU_LIBS = os.path.join(ROOT, ".gpu-libs")


def test_topology_names_pick_the_platform_and_a_missing_library_says_what_to_install():
  assert [bench_lower.topology_platform(n) for n in ("h100", "H200:8", "v5e:2x2", "v4:2x2x1")] == [
      "gpu", "gpu", "tpu", "tpu"]
  from tfx.errors import UserError

  if importlib.util.find_spec("jax_plugins") and importlib.util.find_spec("jax_plugins.xla_cuda12"):
    pytest.skip("JAX's CUDA plugin is importable here")  # this test wants a process without it
  with pytest.raises(UserError, match="make gpu-libs"):
    bench_lower.topology_devices("h100")
  with pytest.raises(SystemExit) as exit_info:  # a GPU named with --lower tpu: an argument error
    bench.main(["--config", os.path.join(ROOT, "configs", "tiny.py"), "--lower", "tpu", "--topology", "h100"])
  assert exit_info.value.code == 2
  with pytest.raises(UserError, match="positive whole number"):
    bench_lower.topology_devices("h100:x")


def run_with_libtpu(*args: str) -> subprocess.CompletedProcess:
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join([TPU_LIBS, ROOT]),
         # no TPU VM metadata to probe for (as `make tpu-compile` runs it)
         "TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_HOSTNAMES": "localhost", "TPU_ACCELERATOR_TYPE": "v5litepod-4",
         "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}  # and no lock on a TPU that is not there
  return subprocess.run([sys.executable, "-m", "tfx.bench", *args], env=env, cwd=ROOT, capture_output=True,
                        text=True, timeout=900)


@pytest.mark.skipif(not os.path.isdir(os.path.join(TPU_LIBS, "libtpu")),
                    reason="libtpu is not installed beside the venv (make tpu-libs; make test installs it)")
def test_tiny_suite_compiles_for_a_tpu_slice_on_a_cpu(tmp_path):
  out = tmp_path / "v5e.json"
  proc = run_with_libtpu("--suite", "accel", "--tiny", "--lower", "tpu", "--topology", "v5e:2x2", "--batch", "2",
                         "--only", "gpt2_small", "--config.model.attention=splash", "--config.data.seq_len=128",
                         "--json", str(out))
  assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
  results = json.loads(out.read_text())
  assert [r["name"] for r in results] == ["gpt2_small", "gpt2_small@2", "gpt2_small@8"]  # + compile by depth
  for r in results:
    assert r["error"] is None
    assert (r["device_count"], r["device_kind"], r["batch_size"]) == (4, "TPU v5 lite", 8)
    assert r["attention"] == ["splash (TPU, segment ids)"]
    # Mosaic compiled the splash kernels for a v5e; the suite's unrolled layers call the one lowered
    # body, as the depth runs' scanned loop does: 3 sites either way
    assert r["kernel_calls"] == {"mosaic (Pallas)": 3}
    assert r["compile_s"] > 0
    assert 0 <= r["temp_bytes"] < r["device_bytes"] < 2**30  # a tiny model's step, arguments included
    assert r["traffic"]["total"] > 0
  assert "compiled for 4 x TPU v5 lite" in proc.stdout and "kernels move" in proc.stdout

  bad = run_with_libtpu("--config", os.path.join(ROOT, "configs", "tiny.py"), "--lower", "tpu", "--topology", "v5e")
  assert bad.returncode != 0
  assert "--topology v5e:" in bad.stderr and "GENERATION:SHAPE" in bad.stderr

  # An objective with a frozen teacher (distillation) lowers with the teacher's shapes alone: nothing
  # is loaded onto devices that are not this machine's
  distil = run_with_libtpu("--config", os.path.join(ROOT, "configs", "distilbert_tiny.py"),
                           "--config.objective.teacher=init", "--lower", "tpu", "--topology", "v5e:2x2")
  assert distil.returncode == 0, distil.stdout + distil.stderr[-3000:]
  assert "compiled for 4 x TPU v5 lite" in distil.stdout


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir(os.path.join(TPU_LIBS, "libtpu")),
                    reason="libtpu is not installed beside the venv (make tpu-libs; make test installs it)")
def test_every_family_compiles_for_tpu_on_a_three_axis_mesh_without_involuntary_remat(tmp_path):
  # 8 chips of a v4 slice as 2-way data x 2-way FSDP x 2-way tensor parallel: XLA:TPU's own SPMD
  # partitioner, the splash kernels on each device's rows and heads
  out = tmp_path / "v4.json"
  proc = run_with_libtpu("--suite", "accel", "--tiny", "--lower", "tpu", "--topology", "v4:2x2x1", "--batch", "2",
                         "--skip-depth", "--config.model.attention=splash", "--config.data.seq_len=128",
                         "--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2", "--json", str(out))
  assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
  results = {r["name"]: r for r in json.loads(out.read_text())}
  assert sorted(results) == ["bert_base", "gpt2_small", "t5_base", "xlnet_base"]
  assert all(r["error"] is None and r["device_count"] == 8 for r in results.values())
  assert results["gpt2_small"]["kernel_calls"] == results["bert_base"]["kernel_calls"] == {"mosaic (Pallas)": 3}
  assert "Involuntary full rematerialization" not in proc.stderr


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir(os.path.join(TPU_LIBS, "libtpu")),
                    reason="libtpu is not installed beside the venv (make tpu-libs; make test installs it)")
def test_attention_dropout_compiles_for_a_tpu_in_a_scanned_rematerialised_stack():
  # XLA:TPU (this jax's libtpu) crashed with a segmentation fault in its convolution emitter compiling
  # autodiff's backward pass of the einsum attention with dropout at BERT-base's head dim 64, 12
  # heads and 512 tokens, in a scanned loop of two or more layers under the default remat: 8 of the
  # 11 configs/*_base.py (BERT's, RoBERTa's, ELECTRA's, BART's, ...) could not compile for a TPU. A TPU
  # trace runs XLA's attention with its own backward pass there (tfx.ops.target.autodiff_attention_dropout).
  proc = run_with_libtpu("--config", os.path.join(ROOT, "configs", "bert_tiny.py"), "--lower", "tpu",
                         "--topology", "v5e:2x2", "--config.model.attention_dropout=0.1", "--config.model.num_layers=3",
                         "--config.data.seq_len=512", "--config.model.num_heads=12", "--config.model.d_model=768",
                         "--config.model.d_ff=256")
  assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
  assert "compiled for 4 x TPU v5 lite" in proc.stdout and "model.attention_dropout=0.1" in proc.stdout


@pytest.mark.skipif(not os.path.isdir(os.path.join(GPU_LIBS, "jax_plugins")),
                    reason="no CUDA plugin beside the venv (make gpu-libs, 1.7 GB; make test installs it)")
def test_tiny_gpt2_compiles_for_an_h100_on_a_cpu(tmp_path):
  out = tmp_path / "h100.json"
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join([GPU_LIBS, ROOT])}
  proc = subprocess.run([sys.executable, "-m", "tfx.bench", "--suite", "accel", "--tiny", "--lower", "gpu",
                         "--topology", "h100", "--batch", "2", "--only", "gpt2_small", "--skip-depth",
                         "--sweep", "model.attention=auto,pallas", "--json", str(out)],
                        env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
  auto, pallas = json.loads(out.read_text())
  for r in (auto, pallas):
    assert r["error"] is None and r["device_kind"] == "NVIDIA H100 80GB HBM3" and r["compile_s"] > 0
  assert auto["kernel_calls"] == {"cudnn backward": 1, "cudnn forward": 1}  # cuDNN's own version check passed
  assert pallas["kernel_calls"] == {"triton (Pallas)": 3}  # and XLA:GPU compiled the Triton kernels
  assert auto["traffic"]["attention"] > 0 and auto["traffic"]["matmul"] > 0 and "kernels move" in proc.stdout
