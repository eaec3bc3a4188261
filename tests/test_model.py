"""Decoder invariants: information flow, packing isolation, variants, causal-LM targets."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import os

from tests.conftest import ROOT, tiny_config
from tfx.models import build_model
from tfx.objectives import SpecialIds
from tfx.objectives.causal_lm import CausalLM, causal_lm_inputs, shift_right_by_segment

IDS = SpecialIds(vocab_size=97, pad=0, eos=1, unk=2, bos=3)


def make_model(*overrides, length=16, shapes_only=False):
  """(model, params); with shapes_only the params are their shapes (jax.ShapeDtypeStruct) without an init."""
  cfg = tiny_config("--config.model.num_layers=2", "--config.model.d_model=32", "--config.model.d_ff=64",
                    *overrides)
  model = build_model(cfg.model, vocab_size=IDS.vocab_size, max_length=length)
  init = functools.partial(model.init, jax.random.key(0), **type(model).init_inputs(1, length))
  params = nn.unbox((jax.eval_shape(init) if shapes_only else jax.jit(init)())["params"])  # one compile, not op by op
  return model, params


def packed_row(rng, lengths, total):
  """A row with documents of `lengths` packed, then padding: (tokens, segment_ids, positions)."""
  tokens = np.zeros(total, np.int32)
  seg = np.zeros(total, np.int32)
  pos = np.zeros(total, np.int32)
  start = 0
  for i, n in enumerate(lengths):
    tokens[start:start + n] = rng.integers(4, IDS.vocab_size, n)
    seg[start:start + n] = i + 1
    pos[start:start + n] = np.arange(n)
    start += n
  return tokens, seg, pos


VARIANTS = [
    ("--config.model.position=learned", "--config.model.norm=pre"),
    ("--config.model.position=rotary", "--config.model.norm=post", "--config.model.mlp=swiglu"),
    ("--config.model.position=sinusoidal", "--config.model.scan_layers=false", "--config.model.norm_type=rmsnorm",
     "--config.model.tie_embeddings=false", "--config.model.remat=full"),
    ("--config.model.position=rotary", "--config.model.causal_blocks=4"),  # the queries in blocks (16 rows: 2)
]


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_depend_only_on_the_past_of_the_same_document(variant):
  """d logits[i] / d embedding[j] is exactly zero for j > i and for j in another document."""
  model, params = make_model(*variant)
  rng = np.random.default_rng(0)
  tokens, seg, pos = (a[None] for a in packed_row(rng, [5, 7, 2], 16))  # 2 pad tokens at the end
  shapes = jax.eval_shape(model.init, jax.random.key(0), tokens, seg, pos)  # traced only: no compile
  perturb = jax.tree.map(jnp.zeros_like, shapes["perturbations"])

  @jax.jit
  def jacobian(eps):
    f = lambda e: model.apply({"params": params, "perturbations": e}, tokens, seg, pos)[0].sum(-1)  # [t]
    return jax.jacrev(f)(eps)["embeddings"][:, 0]  # [t (logits), t (inputs), e]

  jac = np.abs(np.asarray(jacobian(perturb))).sum(-1)  # [t, t]
  for i in range(14):
    influence = jac[i]
    for j in range(16):
      allowed = j <= i and seg[0, j] == seg[0, i]
      if not allowed:
        assert influence[j] == 0.0, (variant, i, j)
      elif j == i:
        assert influence[j] > 0.0


@pytest.mark.parametrize("variant", VARIANTS[:2] + VARIANTS[3:])
def test_packed_equals_unpacked(variant):
  """Per-document loss of a packed row equals the loss of each document run alone."""
  model, params = make_model(*variant, length=24)
  objective = CausalLM(IDS)
  rng = np.random.default_rng(1)
  lengths = [6, 9, 5]
  tokens, seg, pos = packed_row(rng, lengths, 24)

  def per_doc_losses(tokens, seg, pos):
    batch = {k: jnp.asarray(v)[None] for k, v in (("tokens", tokens), ("segment_ids", seg), ("positions", pos))}
    x = causal_lm_inputs(batch, objective.bos_id)
    logits = model.apply({"params": params}, x["inputs"], batch["segment_ids"], batch["positions"])
    logp = jax.nn.log_softmax(logits)[0]
    ce = -jnp.take_along_axis(logp, x["targets"][0][:, None], -1)[:, 0]
    return [float(jnp.mean(ce[seg == d])) for d in range(1, int(seg.max()) + 1)]

  packed = per_doc_losses(tokens, seg, pos)
  start = 0
  for d, n in enumerate(lengths):
    alone_tokens = np.zeros(24, np.int32)
    alone_tokens[:n] = tokens[start:start + n]
    alone_seg = (np.arange(24) < n).astype(np.int32)
    alone_pos = np.where(alone_seg > 0, np.arange(24), 0).astype(np.int32)
    (alone,) = per_doc_losses(alone_tokens, alone_seg, alone_pos)
    assert packed[d] == pytest.approx(alone, abs=1e-5)
    start += n


def test_causal_lm_targets_convention():
  tokens = jnp.array([[10, 11, 12, 1, 20, 21, 1, 0]])
  seg = jnp.array([[1, 1, 1, 1, 2, 2, 2, 0]])
  x = causal_lm_inputs({"tokens": tokens, "segment_ids": seg}, bos_id=3)
  np.testing.assert_array_equal(x["inputs"], [[3, 10, 11, 12, 3, 20, 21, 3]])
  np.testing.assert_array_equal(x["targets"], tokens)
  np.testing.assert_array_equal(x["weights"], [[1, 1, 1, 1, 1, 1, 1, 0]])
  # The first token of a segment sees only BOS: no token of the previous document leaks in.
  assert int(shift_right_by_segment(tokens, seg, 3)[0, 4]) == 3


def test_target_never_in_its_own_input():
  """Through the objective: the loss at position i gets no gradient from the input embedding
  rows of tokens that enter the model only at or after i (untied, so the output layer does not
  touch the embedding table)."""
  model, params = make_model("--config.model.tie_embeddings=false")
  rng = np.random.default_rng(2)
  tokens, seg, pos = (jnp.asarray(a)[None] for a in packed_row(rng, [8, 8], 16))
  x = causal_lm_inputs({"tokens": tokens, "segment_ids": seg}, 3)

  @jax.jit
  def grads(table):
    def losses(table):
      p = dict(params, token_embed={"embedding": table})
      logp = jax.nn.log_softmax(model.apply({"params": p}, x["inputs"], seg, pos))[0]  # [t, v]
      return -jnp.take_along_axis(logp, tokens[0][:, None], -1)[:, 0]  # [t]
    return jax.jacrev(losses)(table)  # [t, v, e]

  g = np.abs(np.asarray(grads(params["token_embed"]["embedding"]))).sum(-1)  # [t, v]
  inputs = np.asarray(x["inputs"][0])
  for i in range(16):
    seen = set(inputs[seg[0] == seg[0, i]][: int(pos[0, i]) + 1].tolist())
    for tok in range(IDS.vocab_size):
      assert (g[i, tok] > 0) == (tok in seen), (i, tok)


def test_scan_and_unrolled_agree():
  """The scanned stack computes the same function as the unrolled one (same weights)."""
  model_s, params_s = make_model("--config.model.scan_layers=true")
  model_u, _ = make_model("--config.model.scan_layers=false")
  layers = params_s["decoder"]["layers"]
  params_u = {k: v for k, v in params_s.items() if k != "decoder"}
  params_u["decoder"] = {f"layer_{i}": jax.tree.map(lambda a: a[i], layers) for i in range(2)}
  rng = np.random.default_rng(3)
  tokens, seg, pos = (jnp.asarray(a)[None] for a in packed_row(rng, [10, 6], 16))
  a = model_s.apply({"params": params_s}, tokens, seg, pos)
  b = model_u.apply({"params": params_u}, tokens, seg, pos)
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


@pytest.mark.parametrize("unroll", [0, 2])
def test_scan_unroll_keeps_parameters_and_function(unroll):
  """model.scan_unroll unrolls the scanned loop (all layers, or 2 per iteration) without changing the
  parameter tree (a checkpoint of either restores into the other) or the function."""
  model_1, params = make_model("--config.model.num_layers=4")
  model_u, params_u = make_model("--config.model.num_layers=4", f"--config.model.scan_unroll={unroll}",
                                 shapes_only=True)
  assert jax.tree.structure(params) == jax.tree.structure(params_u)
  assert [x.shape for x in jax.tree.leaves(params)] == [x.shape for x in jax.tree.leaves(params_u)]
  rng = np.random.default_rng(4)
  tokens, seg, pos = (jnp.asarray(a)[None] for a in packed_row(rng, [9, 7], 16))
  loss_and_grad = lambda model: jax.jit(jax.value_and_grad(
      lambda p: jnp.mean(model.apply({"params": p}, tokens, seg, pos) ** 2)))
  (loss_1, grads_1), (loss_u, grads_u) = loss_and_grad(model_1)(params), loss_and_grad(model_u)(params)
  np.testing.assert_allclose(float(loss_1), float(loss_u), rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8), grads_1, grads_u)


def test_scan_unroll_by_platform_unrolls_the_layers_for_a_gpu_alone():
  """model.scan_unroll=-1 (the configs' default) runs the scanned layers as one unrolled loop where
  the step is traced for a GPU (`target.unrolled_layers`) and one layer an iteration elsewhere: the
  GPU's trace has no loop, the CPU's and the TPU's have one, and each computes the same loss and
  gradients as an explicit scan_unroll=1 (each compiled here, on the CPU)."""
  from tfx.ops import target

  model, params = make_model("--config.model.num_layers=3")
  assert model.cfg.scan_unroll == -1
  scanned, _ = make_model("--config.model.num_layers=3", "--config.model.scan_unroll=1", shapes_only=True)
  rng = np.random.default_rng(5)
  tokens, seg, pos = (jnp.asarray(a)[None] for a in packed_row(rng, [9, 7], 16))
  loss = lambda m: jax.value_and_grad(lambda p: jnp.mean(m.apply({"params": p}, tokens, seg, pos) ** 2))
  want_loss, want_grads = jax.jit(loss(scanned))(params)
  for platform in ("cpu", "gpu", "tpu"):
    with target.lowering_for(platform):  # a fresh function: a trace is cached per function
      lowered = jax.jit(loss(model)).lower(params)
    assert ("stablehlo.while" in lowered.as_text()) == (platform != "gpu"), platform
    got_loss, got_grads = lowered.compile()(params)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8), got_grads, want_grads)


RELATIVE_CASES = {
    "t5_span_corruption": ("t5_tiny.py", ()),
    "ul2_mixture": ("ul2_tiny.py", ()),
    "encoder_mlm_relative": ("bert_tiny.py", ("--config.model.position=relative",)),
}


# UL2's rows (its slowest case, 19 s) run with the slow tests.
@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.slow] if c == "ul2_mixture" else [])
                                  for c in RELATIVE_CASES])
def test_relative_bias_from_columns_is_the_position_bias(case, shared_tokenizer, tmp_path):
  """model.relative_distance='columns' (one [1, h, t, s] bias per batch, as HF's T5) computes the
  same loss and gradients as the bias from the position ids ([b, h, t, s]) on the rows tfx's
  pipeline and objectives build (packed documents, positions restarting per segment)."""
  import dataclasses

  from tfx import train
  from tfx.config import load_config

  name, extra = RELATIVE_CASES[case]
  config = load_config(os.path.join(ROOT, "configs", name), [
      f"--config.data.tokenizer={shared_tokenizer}", "--config.data.max_documents=60", "--config.train.batch_size=4",
      "--config.model.dropout=0.0", *extra])
  exp = train.build(config, str(tmp_path))
  assert exp.model.cfg.position == "relative" and exp.model.cfg.relative_distance == "columns"
  by_position = exp.model.clone(cfg=dataclasses.replace(exp.model.cfg, relative_distance="positions"))
  _, shardings = train.state_shardings(exp.model, exp.tx, exp.mesh, config.data.seq_len, exp.objective,
                                       config.train.batch_size)
  params = train.init_state(exp.model, exp.tx, exp.mesh, config.data.seq_len, 0, shardings, exp.objective,
                            config.train.batch_size).params
  loss_and_grad = [jax.jit(jax.value_and_grad(
      lambda p, batch, model=model: exp.objective.loss(model, p, batch, jax.random.key(1), train=True)[0]))
      for model in (exp.model, by_position)]
  for cut in (None, 11):
    batch = dict(exp.pipeline.next_batch())
    if cut:  # a document boundary at column `cut` of every row: positions restart there
      n = batch["tokens"].shape[1]
      batch["segment_ids"] = np.where(np.arange(n) < cut, 1, 2)[None].repeat(len(batch["tokens"]), 0)
      batch["positions"] = np.where(np.arange(n) < cut, np.arange(n), np.arange(n) - cut)[None].repeat(
          len(batch["tokens"]), 0)
    batch = {k: jnp.asarray(v, jnp.int32) for k, v in batch.items()}
    (a, grads_a), (b, grads_b) = [f(params, batch) for f in loss_and_grad]
    np.testing.assert_allclose(float(a), float(b), rtol=1e-6)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7), grads_a, grads_b)


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


FUSED_LOSS_CASES = {
    "gpt2_tied": ("configs/tiny.py", ()),
    "decoder_untied_bf16": ("configs/tiny.py", ("--config.model.tie_embeddings=false", "--config.model.dtype=bfloat16")),
    "t5_untied_zloss": ("configs/t5_tiny.py", ("--config.objective.z_loss=1e-3",)),
    "t5_v1_0_scaled_tied": ("configs/t5_tiny.py", ("--config.model.tie_embeddings=true",
                                                   "--config.model.scale_tied_logits=true")),
}


# The z-loss case (14 s; t5_v1_0_scaled_tied keeps the encoder-decoder in make test) runs with the
# slow tests.
@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.slow] if c == "t5_untied_zloss" else [])
                                  for c in FUSED_LOSS_CASES])
def test_fused_head_loss_equals_the_loss_of_the_logits(case, shared_tokenizer, tmp_path):
  """model.loss_chunk > 0 (the output projection fused with the token loss, chunks that do not divide
  the row) gives the objective the loss, metrics and gradients of the materialised logits
  (loss_chunk 0), on the rows tfx's pipeline and objectives build: tied (GPT-2), untied, bf16,
  T5 v1.1 (untied, z-loss) and v1.0 (tied, scaled)."""
  import dataclasses

  from tfx import train
  from tfx.config import load_config

  name, extra = FUSED_LOSS_CASES[case]
  config = load_config(os.path.join(ROOT, name), [
      f"--config.data.tokenizer={shared_tokenizer}", "--config.data.max_documents=60", "--config.train.batch_size=4",
      "--config.model.num_layers=2", "--config.model.dropout=0.0", *extra])
  exp = train.build(config, str(tmp_path))
  assert exp.model.cfg.loss_chunk == 0
  fused = exp.model.clone(cfg=dataclasses.replace(exp.model.cfg, loss_chunk=5))
  _, shardings = train.state_shardings(exp.model, exp.tx, exp.mesh, config.data.seq_len, exp.objective,
                                       config.train.batch_size)
  params = train.init_state(exp.model, exp.tx, exp.mesh, config.data.seq_len, 0, shardings, exp.objective,
                            config.train.batch_size).params
  batch = {k: jnp.asarray(v, jnp.int32) for k, v in exp.pipeline.next_batch().items()}
  loss = lambda model: jax.jit(jax.value_and_grad(
      lambda p: exp.objective.loss(model, p, batch, jax.random.key(1), train=True), has_aux=True))
  (want, want_m), want_g = loss(exp.model)(params)
  (got, got_m), got_g = loss(fused)(params)
  bf16 = exp.model.cfg.dtype == "bfloat16"
  tol = dict(rtol=1e-2, atol=1e-3) if bf16 else dict(rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(float(got), float(want), **tol)
  assert set(got_m) == set(want_m)
  for key in want_m:
    np.testing.assert_allclose(float(got_m[key]), float(want_m[key]), **tol)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **(dict(rtol=5e-2, atol=2e-3) if bf16 else tol)),
               got_g, want_g)


def test_mlp_hidden_dropout_is_model_mlp_dropout():
  """The MLP's hidden layer drops at model.mlp_dropout, at model.dropout where that is -1 (T5's
  and XLNet's placement); at 0 (BERT's, RoBERTa's, ELECTRA's, DistilBERT's and GPT-2's: their
  dropout is on the MLP's output, in the block) the MLP in training mode is the deterministic MLP.
  The configs say which: the BERT family 0, T5, XLNet and BART -1; an HF BERT or GPT-2 import 0."""
  from configs import bart_base, bert_base, distilbert_base, electra_base, roberta_base, t5_base, xlnet_base
  from tfx.convert import bert as bert_convert, gpt2 as gpt2_convert
  from tfx.nn.layers import Mlp, ModelConfig

  x = jax.random.normal(jax.random.key(0), (2, 8, 16))

  def run(**kw):
    cfg = ModelConfig(family="encoder", vocab_size=8, max_length=8, num_layers=1, d_model=16, num_heads=2, d_ff=64,
                      **kw)
    mlp = Mlp(cfg, deterministic=False)
    params = Mlp(cfg).init(jax.random.key(1), x)
    return mlp.apply(params, x, rngs={"dropout": jax.random.key(2)}), Mlp(cfg).apply(params, x)

  trained, plain = run(dropout=0.5, mlp_dropout=0.0)
  np.testing.assert_array_equal(trained, plain)
  for kw in (dict(dropout=0.5), dict(dropout=0.0, mlp_dropout=0.5)):  # -1: model.dropout; or its own rate
    trained, plain = run(**kw)
    assert float(jnp.max(jnp.abs(trained - plain))) > 0.1 * float(jnp.max(jnp.abs(plain))), kw
  assert ModelConfig(family="encoder", vocab_size=8, max_length=8, num_layers=1, d_model=16, num_heads=2, d_ff=64,
                     dropout=0.3).hidden_dropout == 0.3
  for config in (bert_base, roberta_base, electra_base, distilbert_base):
    assert config.get_config().model.mlp_dropout == 0.0, config.__name__
  for config in (t5_base, xlnet_base, bart_base):
    assert config.get_config().model.mlp_dropout == -1.0, config.__name__
  bert = dict(num_hidden_layers=2, hidden_size=16, num_attention_heads=2, intermediate_size=64, hidden_act="gelu",
              hidden_dropout_prob=0.1)
  gpt2 = dict(n_layer=2, n_embd=16, n_head=2, resid_pdrop=0.1)
  for convert, arch, hf in ((bert_convert, "BertForMaskedLM", bert), (gpt2_convert, "GPT2LMHeadModel", gpt2)):
    c = tiny_config()
    convert.config_from_hf(c, arch, hf)
    assert c.model.mlp_dropout == 0.0 and c.model.dropout == 0.1, arch
