"""Attention, masks, positions and losses against independent float64 references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfx import ops
from tfx.ops import target

jax.config.update("jax_enable_x64", False)


def numpy_attention(q, k, v, mask):
  """float64 numpy reference: softmax over allowed keys only; rows with none give 0."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  b, t, h, d = q.shape
  out = np.zeros_like(q)
  for bi in range(b):
    for hi in range(h):
      s = q[bi, :, hi] @ k[bi, :, hi].T / np.sqrt(d)  # [t, s]
      m = np.broadcast_to(mask[bi, 0], s.shape)
      for ti in range(t):
        allowed = m[ti]
        if not allowed.any():
          continue
        w = np.exp(s[ti, allowed] - s[ti, allowed].max())
        out[bi, ti, hi] = (w / w.sum()) @ v[bi, allowed, hi]
  return out


def random_packed(rng, b, t, max_docs=3, pad=3):
  seg = np.zeros((b, t), np.int32)
  pos = np.zeros((b, t), np.int32)
  for i in range(b):
    n = t - rng.integers(0, pad + 1)
    cuts = np.sort(rng.choice(np.arange(1, n), size=rng.integers(0, max_docs), replace=False))
    bounds = [0, *cuts.tolist(), n]
    for s_i, (a, z) in enumerate(zip(bounds[:-1], bounds[1:])):
      seg[i, a:z] = s_i + 1
      pos[i, a:z] = np.arange(z - a)
  return seg, pos


@pytest.mark.parametrize("impl", ["xla", "reference"])
def test_attention_matches_float64_reference(impl):
  rng = np.random.default_rng(0)
  b, t, h, d = 2, 12, 3, 8
  q, k, v = (rng.normal(size=(b, t, h, d)).astype(np.float32) for _ in range(3))
  seg, _ = random_packed(rng, b, t)
  mask = np.asarray(ops.decoder_mask(jnp.asarray(seg)))
  out = ops.dot_product_attention(q, k, v, mask=mask, implementation=impl)
  np.testing.assert_allclose(np.asarray(out), numpy_attention(q, k, v, mask), atol=2e-5)


def test_fully_masked_rows_are_zero_not_mean_of_values():
  rng = np.random.default_rng(1)
  q, k, v = (rng.normal(size=(1, 4, 2, 8)).astype(np.float32) for _ in range(3))
  seg = np.array([[1, 1, 0, 0]], np.int32)  # two padding queries: no allowed key
  mask = ops.decoder_mask(jnp.asarray(seg))
  out = np.asarray(ops.dot_product_attention(q, k, v, mask=mask, implementation="xla"))
  assert np.all(out[0, 2:] == 0.0)
  assert np.all(np.abs(out[0, :2]) > 0)
  with pytest.raises(ValueError, match="no allowed key"):
    ops.assert_rows_attend(mask)
  ops.assert_rows_attend(mask, query_valid=jnp.asarray(seg > 0))  # padding rows are exempt


@pytest.mark.parametrize("case", ["packed_gqa", "bias_per_head", "bias_per_row_cross", "bias_shared_gqa",
                                  "bias_per_row_shared_heads", "prefix_lm", "bf16"])
def test_xla_attention_gradients_match_autodiff_reference(case):
  """The XLA path's hand-written backward pass (`softmax_attention`) against autodiff through the
  plain reference: values and the gradients of q, k, v and the bias, on padded packed rows
  (padding queries have no allowed key), grouped-query heads, a bias broadcast over the batch
  or given per row, one bias for every row and head (summed over both as contractions with ones:
  `_sum_to_bias`), cross attention (t != s), a prefix-LM mask and bf16 inputs."""
  rng = np.random.default_rng(7)
  b, t, s, h, kh, d = 2, 12, 12, 4, 4, 8
  dtype, tol = jnp.float32, 2e-5
  bias_shape = None
  if case == "packed_gqa":
    kh = 2
  elif case == "bias_per_head":
    bias_shape = (1, h, t, s)
  elif case == "bias_per_row_cross":
    s, bias_shape = 9, (b, h, t, 9)
  elif case == "bias_shared_gqa":
    kh, bias_shape = 2, (1, 1, t, s)
  elif case == "bias_per_row_shared_heads":
    bias_shape = (b, 1, t, s)
  elif case == "bf16":
    dtype, tol = jnp.bfloat16, 3e-2
  q = jnp.asarray(rng.normal(size=(b, t, h, d)), dtype)
  k, v = (jnp.asarray(rng.normal(size=(b, s, kh, d)), dtype) for _ in range(2))
  seg, pos = random_packed(rng, b, max(t, s))
  seg, pos = jnp.asarray(seg), jnp.asarray(pos)
  if case == "prefix_lm":
    mask = ops.prefix_lm_mask(seg, pos, jnp.full(seg.shape, 3))
  elif s != t:
    mask = ops.segment_mask(seg[:, :t], seg[:, :s])
  else:
    mask = ops.decoder_mask(seg)
  bias = None if bias_shape is None else jnp.asarray(rng.normal(size=bias_shape), jnp.float32)
  valid = (seg[:, :t] > 0)[:, :, None, None]  # padding queries: no allowed key
  w = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)

  def loss(impl, weight):
    def f(q, k, v, bias):
      out = ops.dot_product_attention(q, k, v, mask=mask, bias=bias, implementation=impl)
      return jnp.sum(out.astype(jnp.float32) * w * weight), out
    return jax.value_and_grad(f, argnums=(0, 1, 2, 3) if bias is not None else (0, 1, 2), has_aux=True)

  (_, got), got_grads = loss("xla", 1.0)(q, k, v, bias)
  # The reference's padding rows are the mean of V: they carry no loss here (weight 0), so the
  # gradients compare; the xla path gives them exact zeros, output and gradients.
  (_, want), want_grads = loss("reference", valid)(q, k, v, bias)
  f32 = lambda x: np.asarray(x, np.float32)
  np.testing.assert_allclose(f32(got), f32(want) * f32(valid), atol=tol)
  assert np.all(f32(got)[~np.broadcast_to(np.asarray(valid), got.shape)] == 0.0)
  for name, g, r in zip("qkvb", got_grads, want_grads):
    assert g.dtype == r.dtype and g.shape == r.shape, name
    scale = max(1.0, float(np.max(np.abs(f32(r)))))
    np.testing.assert_allclose(f32(g), f32(r), atol=tol * scale, err_msg=f"d{name}")
  # Information flow: the keys one query may not attend get no gradient from its output.
  m = np.asarray(jnp.broadcast_to(mask, (b, 1, t, s)))[:, 0]  # [b, t, s]
  row, query = np.unravel_index(np.argmax((~m).sum(-1) * np.asarray(seg[:, :t] > 0)), (b, t))
  blocked = ~m[row, query]
  assert blocked.any() and not blocked.all()
  one = lambda k: jnp.sum(ops.dot_product_attention(
      q[row:row + 1, query:query + 1], k, v[row:row + 1], mask=mask[row:row + 1, :, query:query + 1],
      bias=None if bias is None else bias[:1, :, query:query + 1], implementation="xla").astype(jnp.float32))
  assert np.all(f32(jax.grad(one)(k[row:row + 1]))[0, blocked] == 0.0)


def test_xla_attention_in_bf16_is_as_close_to_float32_as_autodiffs():
  """The XLA path keeps its probabilities in the compute dtype (autodiff's softmax keeps float32
  ones): in bf16 its output and gradients (q, k, v and a per-head bias, causal) are within 1.25x
  of the error that autodiff through the plain reference makes in bf16, both against float32."""
  rng = np.random.default_rng(0)
  b, t, h, d = 2, 128, 4, 64
  q, k, v = (jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32) for _ in range(3))
  bias = jnp.asarray(rng.normal(size=(1, h, t, t)) * 2, jnp.float32)
  mask = ops.decoder_mask(jnp.ones((b, t), jnp.int32))
  w = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)

  def run(impl, dtype):
    def f(*args):
      out = ops.dot_product_attention(*args[:3], mask=mask, bias=args[3], implementation=impl)
      return jnp.sum(out.astype(jnp.float32) * w), out
    (_, out), grads = jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True)(
        *(x.astype(dtype) for x in (q, k, v, bias)))
    return [np.asarray(x, np.float32) for x in (out, *grads)]

  truth = run("reference", jnp.float32)
  error = lambda got: [np.linalg.norm(g - r) / np.linalg.norm(r) for g, r in zip(got, truth)]
  ours, autodiff = error(run("xla", jnp.bfloat16)), error(run("reference", jnp.bfloat16))
  for name, e, e_ref in zip(["out", "dq", "dk", "dv", "dbias"], ours, autodiff):
    assert 0.0 < e <= 1.25 * e_ref, (name, e, e_ref)


def test_masks_semantics():
  seg = jnp.array([[1, 1, 2, 2, 2, 0]])
  m = np.asarray(ops.decoder_mask(seg))[0, 0]
  for i in range(6):
    for j in range(6):
      expect = j <= i and seg[0, i] == seg[0, j] and seg[0, i] > 0
      assert m[i, j] == expect, (i, j)
  pos = jnp.array([[0, 1, 0, 1, 2, 0]])
  p = np.asarray(ops.prefix_lm_mask(seg, pos, jnp.array([[2, 2, 2, 2, 2, 0]])))[0, 0]
  assert p[0, 1] and p[1, 0]  # document 1 is all prefix: bidirectional
  assert p[2, 3] and not p[2, 4] and p[4, 3]  # document 2: prefix of 2, then causal
  assert not p[0, 2] and not p[5].any()


def test_grouped_query_heads_reference():
  rng = np.random.default_rng(2)
  q = rng.normal(size=(1, 5, 4, 8)).astype(np.float32)
  k, v = (rng.normal(size=(1, 5, 2, 8)).astype(np.float32) for _ in range(2))
  mask = ops.causal_mask(5)
  got = ops.reference_attention(q, k, v, mask=mask)
  full = ops.reference_attention(q, np.repeat(k, 2, axis=2), np.repeat(v, 2, axis=2), mask=mask)
  np.testing.assert_allclose(np.asarray(got), np.asarray(full), atol=1e-6)


def test_rotary_is_relative():
  """q(i).k(j) after RoPE depends only on i - j."""
  rng = np.random.default_rng(3)
  q, k = (rng.normal(size=(1, 1, 1, 16)).astype(np.float32) for _ in range(2))
  def score(i, j):
    qi = ops.rotary(q, jnp.array([[i]]))
    kj = ops.rotary(k, jnp.array([[j]]))
    return float(jnp.sum(qi * kj))
  assert score(5, 2) == pytest.approx(score(13, 10), rel=1e-4)
  assert score(5, 2) != pytest.approx(score(5, 3), rel=1e-3)


def test_sinusoidal_table():
  table = np.asarray(ops.sinusoidal(jnp.arange(4), 8))
  pos, i = 3, 1
  assert table[pos, i] == pytest.approx(np.sin(pos / 10000 ** (2 * i / 8)), rel=1e-5)
  assert table[pos, 4 + i] == pytest.approx(np.cos(pos / 10000 ** (2 * i / 8)), rel=1e-5)


def test_weighted_cross_entropy_matches_numpy():
  rng = np.random.default_rng(4)
  logits = rng.normal(size=(2, 5, 7)).astype(np.float32)
  targets = rng.integers(0, 7, size=(2, 5))
  weights = (rng.random((2, 5)) > 0.3).astype(np.float32)
  loss, m = ops.weighted_cross_entropy(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights))
  l64 = logits.astype(np.float64)
  logp = l64 - np.log(np.exp(l64).sum(-1, keepdims=True))
  ce = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
  assert float(loss) == pytest.approx((ce * weights).sum() / weights.sum(), rel=1e-5)
  assert float(m["num_tokens"]) == weights.sum()
  correct = (l64.argmax(-1) == targets).astype(np.float64)  # no ties in random logits
  assert float(m["accuracy"]) == pytest.approx((correct * weights).sum() / weights.sum(), rel=1e-6)
  # The loss's gradient is softmax - onehot (the max shift inside carries no gradient).
  grad = jax.grad(lambda x: ops.weighted_cross_entropy(x, jnp.asarray(targets), jnp.asarray(weights))[0])(
      jnp.asarray(logits))
  expected = (np.exp(logp) - np.eye(7)[targets]) * weights[..., None] / weights.sum()
  np.testing.assert_allclose(np.asarray(grad), expected, atol=1e-6)
  # Nothing predicted: loss is 0, not NaN.
  loss0, _ = ops.weighted_cross_entropy(jnp.asarray(logits), jnp.asarray(targets), jnp.zeros((2, 5)))
  assert float(loss0) == 0.0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cross_entropy_gradient_is_autodiffs_without_a_scatter(dtype):
  """The gradient of log Z and the target logit is what autodiff of the formulas gives, with the
  z-loss's share too; for bf16 logits it is written by hand (one elementwise pass in their dtype)
  and the compiled gradient scatters nothing into [b, t, v]."""
  rng = np.random.default_rng(5)
  logits = jnp.asarray(rng.normal(size=(2, 6, 11)) * 3, dtype)
  targets = jnp.asarray(rng.integers(0, 11, size=(2, 6)))
  weights = jnp.asarray(rng.random((2, 6)) > 0.3, jnp.float32)

  def by_autodiff(x):
    x = x.astype(jnp.float32)
    log_z = jax.nn.logsumexp(x, axis=-1)
    ce = log_z - jnp.take_along_axis(x, targets[..., None], axis=-1)[..., 0]
    return (jnp.sum(ce * weights) + 1e-2 * jnp.sum(jnp.square(log_z) * weights)) / jnp.sum(weights)

  ours = lambda x: ops.weighted_cross_entropy(x, targets, weights, z_loss=1e-2)[0]
  np.testing.assert_allclose(float(ours(logits)), float(by_autodiff(logits)), rtol=1e-6)
  got, want = jax.grad(ours)(logits), jax.grad(by_autodiff)(logits)
  assert got.dtype == want.dtype == dtype
  tol = dict(rtol=1e-2, atol=1e-4) if dtype == jnp.bfloat16 else dict(rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **tol)
  assert ("scatter" in jax.jit(jax.grad(ours)).lower(logits).as_text()) == (dtype == jnp.float32)


def test_max_and_total_is_one_reduction_giving_the_row_max_and_logsumexp():
  """The narrow-logits loss reads the logits once in its forward pass: the row max and the sum of
  exp(x - max) as one variadic reduction, equal to the two-pass values, -inf logits included."""
  from tfx.ops import losses

  rng = np.random.default_rng(6)
  x = rng.normal(size=(3, 4, 5003)) * 30  # long rows: XLA splits the reduction into partial pairs
  x[0, 0, :4000] = -np.inf
  x[1, 2, 17] = 400.0  # one logit far above the rest
  x = x.astype(np.float32)
  top, total = jax.jit(losses._max_and_total)(jnp.asarray(x))
  np.testing.assert_array_equal(np.asarray(top), x.max(-1))
  x64 = x.astype(np.float64)
  want = np.log(np.exp(x64 - x64.max(-1, keepdims=True)).sum(-1))
  np.testing.assert_allclose(np.log(np.asarray(total, np.float64)), want, rtol=1e-6, atol=1e-6)
  # traced for a GPU, the bf16 loss (the hand-written gradient's path) reduces over the vocabulary
  # once; float32 logits, and any on this CPU (where XLA runs a variadic reduction slower), twice
  targets, weights = jnp.zeros((3, 4), jnp.int32), jnp.ones((3, 4))
  for platform, dtype, passes in (("gpu", jnp.bfloat16, 1), ("gpu", jnp.float32, 2), ("cpu", jnp.bfloat16, 2)):
    loss = lambda l: ops.weighted_cross_entropy(l, targets, weights)[0]
    with target.lowering_for(platform):
      text = jax.jit(loss).lower(jnp.asarray(x, dtype)).as_text()
      value, grad = jax.value_and_grad(loss)(jnp.asarray(x, dtype))  # runs here: plain XLA ops
    assert sum("stablehlo.reduce(" in line and "3x4x5003x" in line for line in text.splitlines()) == passes
    want_value, want_grad = jax.value_and_grad(loss)(jnp.asarray(x, dtype))
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(grad, np.float32), np.asarray(want_grad, np.float32))


FUSED_CASES = {
    "tied": dict(vocab_major=True, bias=False, z_loss=0.0, chunk=4, dtype=jnp.float32),
    "tied_bias_zloss": dict(vocab_major=True, bias=True, z_loss=1e-2, chunk=5, dtype=jnp.float32),
    "untied_zloss_one_chunk": dict(vocab_major=False, bias=False, z_loss=1e-3, chunk=64, dtype=jnp.float32),
    "untied_bias_bf16": dict(vocab_major=False, bias=True, z_loss=0.0, chunk=3, dtype=jnp.bfloat16),
}


@pytest.mark.parametrize("case", list(FUSED_CASES))
def test_linear_cross_entropy_equals_the_loss_of_the_logits(case):
  """The fused projection + loss gives weighted_cross_entropy's loss, metrics and gradients (x,
  kernel, bias) from the materialised logits: a kernel [v, e] or [e, v], an output bias, the z-loss,
  chunks that do not divide the row (padded with weight 0), bf16 hidden states, the weights'
  gradient too, and the same value whether differentiated or not."""
  c = FUSED_CASES[case]
  rng = np.random.default_rng(6)
  b, t, e, v = 2, 13, 8, 37
  x = jnp.asarray(rng.normal(size=(b, t, e)), jnp.float32)
  kernel = jnp.asarray(rng.normal(size=(v, e) if c["vocab_major"] else (e, v)) * 0.5, jnp.float32)
  bias = jnp.asarray(rng.normal(size=(v,)), jnp.float32) if c["bias"] else None
  targets = jnp.asarray(rng.integers(0, v, (b, t)))
  weights = jnp.asarray(rng.random((b, t)) > 0.3, jnp.float32).at[0, 0].set(2.0)  # a weight of 2 too

  def reference(x, kernel, bias, weights):
    xc, kc = x.astype(c["dtype"]), kernel.astype(c["dtype"])
    logits = jnp.einsum("bte,ve->btv" if c["vocab_major"] else "bte,ev->btv", xc, kc,
                        preferred_element_type=jnp.float32)
    logits = logits if bias is None else logits + bias
    return ops.weighted_cross_entropy(logits, targets, weights, z_loss=c["z_loss"])

  def fused(x, kernel, bias, weights):
    head = ops.HeadWeights(kernel, bias, c["vocab_major"])
    return ops.linear_cross_entropy(x.astype(c["dtype"]), head, targets, weights, z_loss=c["z_loss"],
                                    chunk=c["chunk"])

  tol = dict(rtol=2e-2, atol=2e-3) if c["dtype"] == jnp.bfloat16 else dict(rtol=2e-5, atol=2e-6)
  (want, want_m), want_g = jax.value_and_grad(reference, argnums=(0, 1, 2, 3), has_aux=True)(x, kernel, bias, weights)
  (got, got_m), got_g = jax.jit(jax.value_and_grad(fused, argnums=(0, 1, 2, 3), has_aux=True))(x, kernel, bias, weights)
  assert set(got_m) == set(want_m) == ({"loss", "accuracy", "num_tokens"} | ({"z_loss"} if c["z_loss"] else set()))
  np.testing.assert_allclose(float(got), float(want), **tol)
  for name in want_m:
    np.testing.assert_allclose(float(got_m[name]), float(want_m[name]), **tol)
  for got_leaf, want_leaf in zip(got_g, want_g):  # x, kernel, bias (or None), weights
    if want_leaf is not None:
      assert got_leaf.dtype == want_leaf.dtype
      np.testing.assert_allclose(np.asarray(got_leaf, np.float32), np.asarray(want_leaf, np.float32), **tol)
  np.testing.assert_allclose(float(jax.jit(fused)(x, kernel, bias, weights)[0]), float(got), rtol=1e-6)
  # Nothing predicted: 0, not NaN, and zero gradients.
  zero, zero_g = jax.value_and_grad(lambda x: fused(x, kernel, bias, jnp.zeros((b, t)))[0])(x)
  assert float(zero) == 0.0 and not np.any(np.asarray(zero_g))


def test_attention_kernel_choice_and_fallback(monkeypatch, caplog):
  """'auto' picks cuDNN only on a GPU for bf16/fp16 with a supported head dim; an explicit 'cudnn'
  that cannot run falls back to XLA with the same numbers, and the choice is logged once."""
  from tfx.ops import attention as attn

  choose = attn.choose_implementation
  assert choose("auto", jnp.bfloat16, 64)[0] == "xla"  # this CPU
  assert choose("cudnn", jnp.float32, 64)[0] == "xla"
  assert choose("reference", jnp.bfloat16, 64)[0] == "reference"
  with pytest.raises(ValueError, match="model.attention"):
    choose("flash", jnp.bfloat16, 64)
  monkeypatch.setattr(attn, "_on_gpu", lambda: True)
  assert choose("auto", jnp.bfloat16, 64) == ("cudnn", "GPU, bfloat16")
  assert choose("auto", jnp.float16, 128)[0] == "cudnn"
  assert choose("auto", jnp.float32, 64)[0] == "xla"
  assert choose("cudnn", jnp.bfloat16, 256)[0] == "xla"
  assert choose("auto", jnp.bfloat16, 60)[0] == "xla"

  # "On a GPU" here but really on CPU: jax refuses cuDNN at trace time, tfx falls back to XLA.
  rng = np.random.default_rng(5)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 8, 2, 16)), jnp.bfloat16) for _ in range(3))
  mask = ops.decoder_mask(jnp.asarray(random_packed(rng, 2, 8)[0]))
  attn._LOGGED.clear()
  with caplog.at_level("INFO", logger="tfx.attention"):
    out = ops.dot_product_attention(q, k, v, mask=mask, implementation="auto")
    ops.dot_product_attention(q, k, v, mask=mask, implementation="auto")
  lines = [r.getMessage() for r in caplog.records if r.name == "tfx.attention"]
  assert len(lines) == 1 and lines[0].startswith("attention: xla (cuDNN refused"), lines
  expected = ops.dot_product_attention(q, k, v, mask=mask, implementation="xla")
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(expected, np.float32))


def _norm_by_autodiff(x, scale, bias, eps, centre):
  """The textbook LayerNorm / RMSNorm, differentiated by JAX (the mean and variance one by one)."""
  xf = x.astype(jnp.float32)
  if centre:
    xf = xf - jnp.mean(xf, axis=-1, keepdims=True)
  y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps) * scale
  return y if bias is None else y + bias


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
@pytest.mark.parametrize("kind", ["layer_norm", "layer_norm_no_bias", "rms_norm"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_norm_backward_matches_autodiff(kind, dtype, platform):
  """ops.layer_norm / rms_norm (hand-written backward): values and the gradients of x, scale and
  bias equal autodiff through the textbook formula, in float32 and from bf16 inputs, as traced
  here and as traced for a GPU (one-pass statistics; plain XLA ops, so it runs here too)."""
  with target.lowering_for(platform):
    _check_norm_against_autodiff(kind, dtype)


def _check_norm_against_autodiff(kind, dtype):
  k = jax.random.split(jax.random.key(7), 4)
  x = (3.0 * jax.random.normal(k[0], (2, 5, 24)) + 1.5).astype(dtype)
  scale = 1.0 + jax.random.normal(k[1], (24,))
  bias = None if kind != "layer_norm" else jax.random.normal(k[2], (24,))
  cotangent = jax.random.normal(k[3], (2, 5, 24))
  centre = kind != "rms_norm"
  if centre:
    ours = lambda x, s, b: ops.layer_norm(x, s, b, eps=1e-5)
  else:
    ours = lambda x, s, b: ops.rms_norm(x, s, eps=1e-5)
  theirs = lambda x, s, b: _norm_by_autodiff(x, s, b, 1e-5, centre)
  np.testing.assert_allclose(ours(x, scale, bias), theirs(x, scale, bias), rtol=1e-6, atol=1e-6)
  argnums = (0, 1) if bias is None else (0, 1, 2)
  grads = [jax.grad(lambda *a: jnp.sum(f(*a) * cotangent), argnums=argnums)(x, scale, bias) for f in (ours, theirs)]
  for a, b in zip(*grads):
    assert a.dtype == b.dtype and a.shape == b.shape
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=tol)
  # the only [..., e] residual is x itself, in its own dtype (xhat is recomputed, not kept in float32)
  residuals = jax.tree_util.tree_leaves(jax.vjp(ours, x, scale, bias)[1])
  assert [(r.shape, r.dtype) for r in residuals if getattr(r, "shape", None) == x.shape] == [(x.shape, x.dtype)]



@pytest.mark.parametrize("offset", [0.0, 100.0])
def test_layer_norm_one_pass_statistics_match_float64(offset):
  """Traced for a GPU, LayerNorm's mean and variance are one Welford reduction over the row (and
  the row is read once). Its running mean rounds at the mean's magnitude, so its error grows with
  |mean| / std: rows of 4099 with unit spread 100 away from zero (beyond a residual stream's
  usual offset) reduced in XLA:CPU's order, one element after another (the worst order: a GPU
  runs short per-thread runs combined in a tree), give the mean within 5e-4 (1e-4 measured; the
  two-pass mean 7e-6) and 1 / std within 1e-5 relative (1e-6 measured) of float64's."""
  from tfx.ops import norms

  rng = np.random.default_rng(8)
  x = (offset + rng.normal(size=(3, 2, 4099))).astype(np.float32)
  x64 = x.astype(np.float64)
  mean64, var64 = x64.mean(-1, keepdims=True), x64.var(-1, keepdims=True)
  for one_pass in (False, True):
    mean, r = jax.jit(lambda v: norms._row_stats(v, 1e-6, True, one_pass))(jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(mean, np.float64), mean64, rtol=0, atol=5e-4)
    np.testing.assert_allclose(np.asarray(r, np.float64), 1 / np.sqrt(var64 + 1e-6), rtol=1e-5)
  with target.lowering_for("gpu"):
    text = jax.jit(lambda v: ops.layer_norm(v, jnp.ones(4099), jnp.zeros(4099))).lower(jnp.asarray(x)).as_text()
  assert sum("stablehlo.reduce(" in line and "3x2x4099x" in line for line in text.splitlines()) == 1


def _np_activation(name, x):
  """(value, derivative) in float64 numpy: the reference the activations are checked against."""
  from math import erf, pi, sqrt
  if name == "gelu":
    u = sqrt(2 / pi) * (x + 0.044715 * x**3)
    t = np.tanh(u)
    return 0.5 * x * (1 + t), 0.5 * (1 + t) + 0.5 * x * (1 - t**2) * sqrt(2 / pi) * (1 + 3 * 0.044715 * x**2)
  if name == "gelu_exact":
    cdf = 0.5 * (1 + np.vectorize(erf)(x / sqrt(2)))
    return x * cdf, cdf + x * np.exp(-0.5 * x**2) / sqrt(2 * pi)
  s = 1 / (1 + np.exp(-x))
  return x * s, s * (1 + x * (1 - s))


@pytest.mark.parametrize("name", ["gelu", "gelu_exact", "silu"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_activation_backward_matches_float64(name, dtype):
  """tfx.ops.activations (hand-written one-pass backward, float32 inside): value and derivative
  equal float64 numpy's, jax.nn's autodiff agrees, the input's dtype is kept, the VJP is itself
  differentiable, and x is the only [b, t, f] residual the forward pass hands the backward."""
  from tfx.ops import activations
  ours = getattr(activations, f"{name}_one_pass")
  theirs = {"gelu": lambda x: jax.nn.gelu(x, approximate=True),
            "gelu_exact": lambda x: jax.nn.gelu(x, approximate=False), "silu": jax.nn.silu}[name]
  x = jnp.linspace(-9.0, 9.0, 301).reshape(7, 43).astype(dtype)
  cotangent = jnp.cos(jnp.arange(301.0)).reshape(7, 43).astype(dtype)
  x64, c64 = np.asarray(x, np.float64), np.asarray(cotangent, np.float64)
  value, slope = _np_activation(name, x64)
  tol = dict(rtol=1e-6, atol=1e-6) if dtype == jnp.float32 else dict(rtol=1e-2, atol=1e-2)
  y, vjp = jax.vjp(ours, x)
  (got,) = vjp(cotangent)
  assert y.dtype == got.dtype == dtype
  np.testing.assert_allclose(np.asarray(y, np.float64), value, **tol)
  np.testing.assert_allclose(np.asarray(got, np.float64), c64 * slope, **tol)
  x32 = x.astype(jnp.float32)
  np.testing.assert_allclose(jax.grad(lambda z: jnp.sum(ours(z)))(x32), jax.grad(lambda z: jnp.sum(theirs(z)))(x32),
                             rtol=1e-4, atol=1e-5)
  second = jax.grad(lambda z: jnp.sum(jax.grad(lambda y: jnp.sum(ours(y)))(z)))(x32)
  h = 1e-5  # the float64 slope's central difference
  want2 = (_np_activation(name, x64 + h)[1] - _np_activation(name, x64 - h)[1]) / (2 * h)
  np.testing.assert_allclose(second, want2, rtol=1e-3, atol=1e-4)  # 1 - s cancels in float32 where s -> 1
  residuals = jax.tree_util.tree_leaves(jax.vjp(ours, x32)[1])
  assert [r.shape for r in residuals if getattr(r, "shape", None) == x.shape] == [x.shape]
  # the models' entry point: jax.nn's autodiff on this CPU, the one-pass backward traced for a GPU
  from tfx.ops import target
  act = getattr(activations, name)
  plain = str(jax.make_jaxpr(lambda z: act(z))(x32))  # fresh functions: a trace is cached per function
  with target.lowering_for("gpu"):
    fused = str(jax.make_jaxpr(lambda z: act(z))(x32))
  assert "custom_vjp_call" not in plain and "custom_vjp_call" in fused


@pytest.mark.parametrize("name", ["geglu", "swiglu"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gated_activation_is_the_composition_with_the_pair_as_its_only_residual(name, dtype):
  """tfx.ops.activations' gated products (act(gate) * up from the stacked pair [..., f, 2]): value
  and gradient bit for bit those of the composition they replace on an accelerator (act's one-pass
  VJP times up, autodiff of the product), the dtype kept; the pair is the only [..., f, 2] residual
  and no [..., f] one is handed to the backward pass, which recomputes act(gate) behind an
  optimization barrier (so XLA cannot keep the forward pass's act(gate) for it); the entry point
  is jax.nn's autodiff on a CPU, the one-pass product traced for a GPU, and for a TPU the one-pass
  act times up."""
  from tfx.ops import activations, target
  ours = getattr(activations, f"{name}_one_pass")
  act = {"geglu": activations.gelu_one_pass, "swiglu": activations.silu_one_pass}[name]
  composition = lambda pair: act(pair[..., 0]) * pair[..., 1]
  rng = np.random.default_rng(11)
  pair = jnp.asarray(rng.normal(size=(3, 5, 16, 2)) * 3, dtype)
  cotangent = jnp.asarray(rng.normal(size=(3, 5, 16)), dtype)
  results = {}
  for key, fn in (("ours", ours), ("composition", composition)):
    y, vjp = jax.vjp(fn, pair)
    results[key] = (y, vjp(cotangent)[0])
  for got, want in zip(results["ours"], results["composition"]):
    assert got.dtype == want.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  residuals = [r.shape for r in jax.tree_util.tree_leaves(jax.vjp(ours, pair)[1]) if hasattr(r, "shape")]
  assert pair.shape in residuals and pair.shape[:-1] not in residuals
  backward = str(jax.make_jaxpr(lambda p, c: jax.vjp(ours, p)[1](c))(pair, cotangent))
  assert "optimization_barrier" in backward
  entry = getattr(activations, name)
  traced = {}
  for platform in ("cpu", "gpu", "tpu"):
    with target.lowering_for(platform):  # fresh functions: a trace is cached per function
      traced[platform] = str(jax.make_jaxpr(lambda p, c: jax.vjp(lambda q: entry(q), p)[1](c))(pair, cotangent))
  assert "custom_vjp_call" not in traced["cpu"]
  assert "optimization_barrier" in traced["gpu"]
  assert "custom_vjp_call" in traced["tpu"] and "optimization_barrier" not in traced["tpu"]


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_attention_dropout_is_autodiff_through_the_dropped_softmax(kv_heads):
  """XLA's attention with attention dropout (`softmax_attention(..., seed=)`, the keep bits drawn
  inside its forward and again in its own backward pass) against autodiff through softmax, the
  [b, h, t, s] keep mask `tfx.ops.dropout.keep_bits` gives for that seed and the product with V:
  values and the q, k, v and bias gradients, a bias per head, packed rows with padding (rows with
  no key give zeros), grouped-query heads."""
  from tfx.ops import attention as attn
  from tfx.ops import dropout

  rng = np.random.default_rng(7)
  b, t, h, d, rate = 2, 10, 4, 8, 0.3
  q = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(b, t, kv_heads, d)), jnp.float32) for _ in range(2))
  bias = jnp.asarray(rng.normal(size=(1, h, t, t)), jnp.float32)
  mask = ops.segment_mask(jnp.asarray(random_packed(rng, b, t, pad=3)[0]))
  seed = dropout.seed(jax.random.key(3))
  keep = dropout.keep_bits(seed, (b, h, t, t), rate)
  assert 0.5 < float(jnp.mean(keep)) < 0.9
  cot = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)

  def by_autodiff(q, k, v, bias):
    g = h // kv_heads
    kk, vv = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)  # [b, t, h, d]
    scores = jnp.einsum("bthd,bshd->bhts", q, kk) * d**-0.5 + bias
    probs = jax.nn.softmax(jnp.where(mask, scores, ops.MASK_VALUE), axis=-1)
    out = jnp.einsum("bhts,bshd->bthd", jnp.where(keep, probs / dropout.keep_probability(rate), 0.0), vv)
    return jnp.where(jnp.moveaxis(ops.rows_attend(mask), 1, 2)[..., None], out, 0.0)

  def fused(q, k, v, bias):
    return attn.softmax_attention(q, k, v, mask, bias, d**-0.5, dropout_rate=rate, seed=seed)

  def run(f):
    loss = lambda *a: jnp.sum(f(*a) * cot)
    return [np.asarray(x) for x in (f(q, k, v, bias), *jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, bias))]

  got, want = run(jax.jit(fused)), run(jax.jit(by_autodiff))
  assert np.any(got[0] == 0.0) and not np.all(got[0] == 0.0)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
