"""The xlnet family (tfx/models/xlnet.py, tfx/nn/xlnet.py): information flow under a permutation,
memory, padded prediction rows, scan and remat (its relative positions: test_xlnet_positions.py).
Small dims, float32, dropout off."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import compare_with_float32_logits_loss
from tfx import ops
from tfx.models.xlnet import XLNet
from tfx.nn.layers import ModelConfig
from tfx.nn import xlnet as X

V, E, H, L, F = 32, 16, 2, 2, 32


def _cfg(**kw) -> ModelConfig:
  base = dict(family="xlnet", vocab_size=V, max_length=64, num_layers=L, d_model=E, num_heads=H, d_ff=F,
              mlp="gelu_exact", norm="post", norm_eps=1e-12, mem_len=6, reuse_len=0, clamp_len=-1, untie_r=True,
              scan_layers=False)
  base.update(kw)
  return ModelConfig(**base)


@functools.lru_cache(maxsize=None)
def _init(cfg: ModelConfig, seed: int = 0):
  """Params with every tensor random (norm scales / biases and r_*_bias included)."""
  init = jax.jit(lambda key: nn.unbox(XLNet(cfg).init(key, **XLNet.init_inputs(1, 4))["params"]))  # one compile
  params = init(jax.random.key(seed))
  leaves, tree = jax.tree_util.tree_flatten(params)
  noise = np.random.default_rng(seed).standard_normal(sum(x.size for x in leaves)).astype(np.float32)
  out, k = [], 0
  for x in leaves:
    out.append(x + 0.3 * noise[k:k + x.size].reshape(x.shape))
    k += x.size
  return jax.tree_util.tree_unflatten(tree, out)


def _perm_masks(z: np.ndarray, mlen: int):
  """Masks of a factorization order z [b, t]: query z_j < z_i, content z_j <= z_i; memory visible."""
  b, t = z.shape
  query = z[:, None, :] < z[:, :, None]  # [b, i, j]
  content = z[:, None, :] <= z[:, :, None]
  mem = np.ones((b, t, mlen), bool)
  return jnp.asarray(np.concatenate([mem, content], -1)), jnp.asarray(np.concatenate([mem, query], -1))


# ============================================================================ information flow


def test_information_flow_under_a_permutation():
  cfg = _cfg()
  model = XLNet(cfg)
  params = _init(cfg)
  b, t, m = 2, 8, 3
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, V, (b, t)))
  types = jnp.asarray(rng.integers(0, 2, (b, t)))
  z = np.stack([rng.permutation(t) for _ in range(b)])
  content, query = _perm_masks(z, m)
  mems = jax.random.normal(jax.random.key(3), (L, b, m, E))
  shapes = jax.eval_shape(model.init, jax.random.key(0), tokens, types, content, query,
                          jnp.eye(t)[None].repeat(b, 0), mems)  # traced only: no compile
  perts = jax.tree.map(jnp.zeros_like, nn.unbox(shapes["perturbations"]))
  mapping = jnp.broadcast_to(jnp.eye(t), (b, t, t))  # prediction slot i = position i
  proj = jax.random.normal(jax.random.key(4), (V,))

  def out(perturbations, stream):  # [b, t]: a random projection of each slot's logits
    tm = mapping if stream == "query" else None
    logits, _ = model.apply({"params": params, "perturbations": perturbations}, tokens, types, content,
                            query if stream == "query" else None, tm, mems)
    return logits @ proj

  # d out[r, i] / d emb[r', j, :] for every (r, i, r', j): [b, t, b, t, e]
  jac = jax.jit(jax.jacrev(out), static_argnums=1)
  jq = np.abs(np.asarray(jac(perts, "query")["embeddings"])).max(-1)
  jc = np.abs(np.asarray(jac(perts, "content")["embeddings"])).max(-1)
  for r in range(b):
    for i in range(t):
      for j in range(t):
        if z[r, j] >= z[r, i]:  # itself or later in the order: exactly nothing
          assert jq[r, i, r, j] == 0.0, (r, i, j)
        else:
          assert jq[r, i, r, j] > 0.0, (r, i, j)
        if z[r, j] > z[r, i]:
          assert jc[r, i, r, j] == 0.0, (r, i, j)
      assert jc[r, i, r, i] > 0.0  # the content stream sees its own token
  assert np.all(jq[0, :, 1] == 0.0) and np.all(jq[1, :, 0] == 0.0)  # rows are independent


def test_no_gradient_into_memory():
  cfg = _cfg()
  model = XLNet(cfg)
  params = _init(cfg)
  b, t, m = 2, 6, 4
  rng = np.random.default_rng(1)
  tokens = jnp.asarray(rng.integers(0, V, (b, t)))
  content, query = _perm_masks(np.stack([rng.permutation(t) for _ in range(b)]), m)
  mapping = jnp.broadcast_to(jnp.eye(t), (b, t, t))
  mems = jax.random.normal(jax.random.key(2), (L, b, m, E))

  def loss(mems):
    logits, new_mems = model.apply({"params": params}, tokens, None, content, query, mapping, mems)
    return jnp.sum(logits**2) + jnp.sum(new_mems**2)

  g = jax.grad(loss)(mems)
  assert np.all(np.asarray(g) == 0.0)
  # ... while the memory does change the outputs.
  a, _ = model.apply({"params": params}, tokens, None, content, query, mapping, mems)
  c, _ = model.apply({"params": params}, tokens, None, content, query, mapping, mems * 2)
  assert np.abs(np.asarray(a - c)).max() > 1e-4


# ============================================================================ memory


@pytest.mark.parametrize("reuse_len,with_mems", [(4, True), (0, True), (0, False), (3, False)])
def test_new_memory_is_the_tail_of_old_memory_and_layer_inputs(reuse_len, with_mems):
  mem_len = 6
  cfg = _cfg(mem_len=mem_len, reuse_len=reuse_len)
  model = XLNet(cfg)
  params = _init(cfg)
  b, t = 2, 8
  m = mem_len if with_mems else 0
  rng = np.random.default_rng(2)
  tokens = jnp.asarray(rng.integers(0, V, (b, t)))
  types = jnp.asarray(rng.integers(0, 2, (b, t)))
  content, query = _perm_masks(np.stack([rng.permutation(t) for _ in range(b)]), m)
  mems = jax.random.normal(jax.random.key(5), (L, b, m, E)) if with_mems else None
  (_, new_mems), state = model.apply({"params": params}, tokens, types, content, None, None, mems,
                                     capture_intermediates=True, mutable=["intermediates"])
  inter = state["intermediates"]
  # A layer returns ((h, g), new_mem): layer k's input is layer k - 1's h.
  inputs = [inter["token_embed"]["__call__"][0]] + [inter[f"layer_{k}"]["__call__"][0][0][0] for k in range(L - 1)]
  assert new_mems.shape == (L, b, mem_len, E)
  for k in range(L):
    cur = np.asarray(inputs[k])[:, :reuse_len or t]
    old = np.asarray(mems[k]) if with_mems else np.zeros((b, mem_len, E), np.float32)
    want = np.concatenate([old, cur], axis=1)[:, -mem_len:]
    np.testing.assert_array_equal(np.asarray(new_mems[k]), want)


def test_no_memory_when_mem_len_is_zero():
  cfg = _cfg(mem_len=0)
  params = _init(cfg)
  inputs = XLNet.init_inputs(2, 5)
  logits, new_mems = XLNet(cfg).apply({"params": params}, **inputs)
  assert new_mems is None and logits.shape == (2, 5, V)


def test_bi_sign_plus_one_is_the_default_and_minus_one_differs():
  cfg = _cfg()
  params = _init(cfg)
  inputs = XLNet.init_inputs(2, 5)
  inputs["tokens"] = jnp.asarray(np.random.default_rng(4).integers(0, V, (2, 5)))  # distinct keys
  a, _ = XLNet(cfg).apply({"params": params}, **inputs)
  p, _ = XLNet(cfg).apply({"params": params}, **inputs, bi_sign=jnp.ones(2))
  n, _ = XLNet(cfg).apply({"params": params}, **inputs, bi_sign=jnp.asarray([1.0, -1.0]))
  np.testing.assert_array_equal(a, p)
  np.testing.assert_array_equal(a[0], n[0])
  assert np.abs(np.asarray(a[1] - n[1])).max() > 1e-4


@pytest.mark.parametrize("scan", [False, True])
def test_bi_data_halves_project_two_encodings_and_compute_the_rows_signs(scan):
  """bi_sign=HALVES (what bi_data hands the model) is bi_sign = +1 on the first half of the batch and
  -1 on the second, computed with one encoding per half (W_r projects 2 x p distances, not b x p):
  the same logits, memories and parameter gradients, with memory, segments and a query stream; with
  dropout on the encodings in training the rows' own signs are used (the same draws either way)."""
  cfg = _cfg(scan_layers=scan, untie_r=False)
  model = XLNet(cfg)
  params = _init(cfg)
  b, t, mlen = 4, 6, cfg.mem_len
  rng = np.random.default_rng(11)
  tokens = jnp.asarray(rng.integers(0, V, (b, t)))
  types = jnp.asarray(rng.integers(0, 2, (b, t)))
  content, query = _perm_masks(np.stack([rng.permutation(t) for _ in range(b)]), mlen)
  mapping = jnp.asarray(np.eye(t, dtype=np.float32)[rng.choice(t, (b, 3))])  # [b, 3, t]
  mems = jnp.asarray(rng.standard_normal((L, b, mlen, E)), jnp.float32)
  signs = jnp.asarray([1.0, 1.0, -1.0, -1.0])

  def run(params, bi_sign, model=model, train=False):
    out, new_mems = model.apply({"params": params}, tokens, types, content, query, mapping, mems, bi_sign, train=train,
                                rngs={"dropout": jax.random.key(5)})
    return jnp.sum(jnp.sin(out)), (out, new_mems)

  grad = jax.grad(run, has_aux=True)
  g_halves, (out_halves, mems_halves) = grad(params, X.HALVES)
  g_rows, (out_rows, mems_rows) = grad(params, signs)
  np.testing.assert_allclose(out_halves, out_rows, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(mems_halves, mems_rows, rtol=1e-5, atol=1e-5)
  jax.tree_util.tree_map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5), g_halves, g_rows)
  def projected(model, bi_sign, train=False):  # the rows of W_r R(d) ([g, p, h, d], scanned [l, g, p, h, d])
    _, captured = model.apply({"params": params}, tokens, types, content, query, mapping, mems, bi_sign, train=train,
                              rngs={"dropout": jax.random.key(5)}, capture_intermediates=True,
                              mutable=["intermediates"])
    return {x.shape[-4] for x in jax.tree_util.tree_leaves(captured) if x.shape[-3:] == (mlen + 2 * t - 1, H, E // H)}

  assert projected(model, X.HALVES) == {2} and projected(model, signs) == {b}
  with pytest.raises(ValueError, match="even batch"):
    X.encoding_signs(X.HALVES, 3)
  dropped = XLNet(_cfg(scan_layers=scan, untie_r=False, dropout=0.2))  # dropout on the encodings: per row
  assert projected(dropped, X.HALVES, train=True) == {b} and projected(dropped, X.HALVES) == {2}
  _, (out_halves, _) = run(params, X.HALVES, dropped, train=True)
  _, (out_rows, _) = run(params, signs, dropped, train=True)
  np.testing.assert_array_equal(out_halves, out_rows)  # the same draws


# ============================================================================ padded prediction rows


def test_padded_prediction_rows_change_nothing():
  cfg = _cfg(untie_r=False)
  model = XLNet(cfg)
  params = _init(cfg)
  b, t = 2, 8
  rng = np.random.default_rng(3)
  tokens = jnp.asarray(rng.integers(0, V, (b, t)))
  types = jnp.asarray(rng.integers(0, 2, (b, t)))
  content, query = _perm_masks(np.stack([rng.permutation(t) for _ in range(b)]), 0)
  positions = np.stack([rng.choice(t, 4, replace=False) for _ in range(b)])
  real = np.zeros((b, 4, t), np.float32)
  real[np.arange(b)[:, None], np.arange(4)[None], positions] = 1.0
  slots = np.array([0, 2, 3, 5])  # real rows inside a 7-row mapping; rows 1, 4, 6 are padding
  padded = np.zeros((b, 7, t), np.float32)
  padded[:, slots] = real
  labels = jnp.asarray(rng.integers(0, V, (b, 4)))

  def loss(params, mapping, rows):
    logits, _ = model.apply({"params": params}, tokens, types, content, query, jnp.asarray(mapping))
    logits = logits[:, np.asarray(rows)]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1)), logits

  step = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=2)
  (la, logits_a), ga = step(params, real, (0, 1, 2, 3))
  (lb, logits_b), gb = step(params, padded, tuple(slots.tolist()))
  np.testing.assert_allclose(logits_a, logits_b, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(la, lb, rtol=1e-6)
  jax.tree_util.tree_map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6), ga, gb)


@pytest.mark.parametrize("mlen", [0, 3])
def test_the_query_stream_at_its_slots_is_the_query_stream_at_every_position_read_there(mlen):
  """A query stream of n slots (target_mapping: each attends from its own position alone, with that
  position's mask, segment and distance terms) gives what the stream at all t positions in order
  (no target_mapping) gives at those positions; an empty slot gives the attention output 0; and
  the gradients of the slots' queries are the full stream's rows."""
  cfg = _cfg()
  b, t, n = 2, 8, 4
  rng = np.random.default_rng(5)
  h = jnp.asarray(rng.standard_normal((b, t, E)), jnp.float32)
  g = jnp.asarray(rng.standard_normal((b, t, E)), jnp.float32)
  mem = jnp.asarray(rng.standard_normal((b, mlen, E)), jnp.float32) if mlen else None
  distances, _ = X.distance_table(t, mlen)
  r = X.relative_encoding(distances, E)
  seg_diff = X.segment_difference(jnp.asarray(rng.integers(0, 2, (b, t))), mlen)
  _, query = _perm_masks(np.stack([rng.permutation(t) for _ in range(b)]), mlen)
  rows = np.stack([rng.choice(t, n - 1, replace=False) for _ in range(b)])  # the last slot is empty
  mapping = np.zeros((b, n, t), np.float32)
  mapping[np.arange(b)[:, None], np.arange(n - 1)[None], rows] = 1.0
  layer = X.TwoStreamAttention(cfg)
  params = layer.init(jax.random.key(0), h, g, mem, r, seg_diff, query, query, None)["params"]

  def stream(g, mapping):
    return layer.apply({"params": params}, h, g, mem, r, seg_diff, query, query, mapping)[1]

  full = stream(g, None)  # [b, t, e]
  slots = jnp.concatenate([jnp.take_along_axis(g, jnp.asarray(rows)[..., None], 1), g[:, :1]], axis=1)
  ours = stream(slots, jnp.asarray(mapping))  # [b, n, e]
  np.testing.assert_allclose(ours[:, :n - 1], jnp.take_along_axis(full, jnp.asarray(rows)[..., None], 1),
                             rtol=1e-5, atol=1e-5)
  norm = nn.LayerNorm(1e-12)  # the empty slot: LayerNorm(g + out(0)), out has no bias
  np.testing.assert_allclose(ours[:, -1], norm.apply({"params": params["attention_norm"]}, slots[:, -1]),
                             rtol=1e-5, atol=1e-5)
  cot = jnp.asarray(rng.standard_normal((b, t, E)), jnp.float32)
  d_full = jax.grad(lambda g: jnp.sum(stream(g, None) * cot))(g)
  picked = jnp.take_along_axis(cot, jnp.asarray(rows)[..., None], 1)
  d_slots = jax.grad(lambda s: jnp.sum(stream(s, jnp.asarray(mapping))[:, :n - 1] * picked))(slots)
  np.testing.assert_allclose(d_slots[:, :n - 1], jnp.take_along_axis(d_full, jnp.asarray(rows)[..., None], 1),
                             rtol=1e-4, atol=1e-5)


def test_shared_biases_when_untie_r_is_false():
  tied = nn.unbox(XLNet(_cfg(untie_r=False)).init(jax.random.key(0), **XLNet.init_inputs(1, 4))["params"])
  untied = nn.unbox(XLNet(_cfg(untie_r=True)).init(jax.random.key(0), **XLNet.init_inputs(1, 4))["params"])
  assert tied["r_w_bias"].shape == (H, E // H) and "r_w_bias" not in tied["layer_0"]["attention"]
  assert "r_w_bias" not in untied and untied["layer_1"]["attention"]["r_s_bias"].shape == (H, E // H)


def test_every_parameter_has_logical_axes():
  variables = XLNet(_cfg()).init(jax.random.key(0), **XLNet.init_inputs(1, 4))
  boxed = jax.tree_util.tree_leaves(variables["params"], is_leaf=lambda x: isinstance(x, nn.Partitioned))
  assert boxed and all(isinstance(x, nn.Partitioned) for x in boxed)
  names = {n for x in boxed for n in x.names if n is not None}
  assert names <= {"vocab", "embed", "heads", "kv", "mlp", "norm"}


# ============================================================================ scan and remat


def _stacked(params: dict) -> dict:
  """Unrolled params (`layer_{i}`) -> the scanned layout (`layers`, stacked on axis 0)."""
  out = {k: v for k, v in params.items() if not k.startswith("layer_")}
  out["layers"] = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *[params[f"layer_{i}"] for i in range(L)])
  return out


def _compiled(f, *args):
  """jit(f) compiled for `args` at XLA backend optimisation level 0: these tiny programs then
  compile ~3x faster (seconds matter on a 2-core CI box) and still run in milliseconds."""
  return jax.jit(f).lower(*args).compile({"xla_backend_optimization_level": 0})


def _two_stream_inputs(m: int, seed: int = 6):
  b, t = 2, 8
  rng = np.random.default_rng(seed)
  tokens = jnp.asarray(rng.integers(0, V, (b, t)))
  types = jnp.asarray(rng.integers(0, 2, (b, t)))
  content, query = _perm_masks(np.stack([rng.permutation(t) for _ in range(b)]), m)
  mapping = jnp.asarray(np.eye(t, dtype=np.float32)[None, :5].repeat(b, 0))  # [b, 5, t]
  mems = jax.random.normal(jax.random.key(seed), (L, b, m, E)) if m else None
  return tokens, types, content, query, mapping, mems, jnp.asarray([1.0, -1.0])


@pytest.mark.parametrize("untie_r,m", [(True, 6), (False, 0)])
def test_scanned_and_unrolled_agree(untie_r, m):
  """Same weights (re-stacked) give the same logits and new memory, query and content streams;
  the scanned params have exactly the re-stacked tree, with a leading `layers` logical axis."""
  unrolled = _cfg(untie_r=untie_r, reuse_len=5)
  scanned = _cfg(untie_r=untie_r, reuse_len=5, scan_layers=True)
  params = _init(_cfg(untie_r=untie_r))  # reuse_len has no parameters: shares the cached init
  stacked = _stacked(params)
  boxed = jax.eval_shape(lambda: XLNet(scanned).init(jax.random.key(0), **XLNet.init_inputs(1, 4)))["params"]
  assert jax.tree_util.tree_map(np.shape, stacked) == jax.tree_util.tree_map(np.shape, nn.unbox(boxed))
  layer_boxes = jax.tree_util.tree_leaves(boxed["layers"], is_leaf=lambda x: isinstance(x, nn.Partitioned))
  assert layer_boxes and all(x.names[0] == "layers" for x in layer_boxes)
  assert stacked["layers"]["attention"]["seg_embed"].shape == (L, 2, H, E // H)
  if untie_r:
    assert stacked["layers"]["attention"]["r_s_bias"].shape == (L, H, E // H)
  else:
    assert stacked["r_w_bias"].shape == (H, E // H) and "r_w_bias" not in stacked["layers"]["attention"]

  tokens, types, content, query, mapping, mems, sign = _two_stream_inputs(m)

  def both_streams(cfg, p):  # query stream with memory, content stream without
    q = XLNet(cfg).apply({"params": p}, tokens, types, content, query, mapping, mems, sign)
    c = XLNet(cfg).apply({"params": p}, tokens, types, content[..., m:], None, None, None, sign)
    # The query stream's gradients: scanned, its last layer runs outside the loop on parameters
    # cut from the stack (and without its content stream), and they must land in the stack.
    grads = jax.grad(lambda p: jnp.sum(jnp.tanh(XLNet(cfg).apply({"params": p}, tokens, types, content, query,
                                                                  mapping, mems, sign)[0])))(p)
    return q, c, grads

  run = lambda cfg, p: _compiled(functools.partial(both_streams, cfg), p)(p)
  *out_u, grads_u = run(unrolled, params)
  *out_s, grads_s = run(scanned, stacked)
  for (lu, mu), (ls, ms) in zip(out_u, out_s):
    np.testing.assert_allclose(ls, lu, rtol=1e-5, atol=1e-5)
    assert ms.shape == (L, 2, 6, E)
    np.testing.assert_allclose(ms, mu, rtol=1e-6, atol=1e-6)
  close = lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5 * float(np.abs(y).max()))
  jax.tree_util.tree_map(close, grads_s, _stacked(grads_u))


@pytest.mark.parametrize("scan_layers,remat", [(True, "full")])  # (False, "dots") passes too; ~9 s more
def test_remat_gives_the_same_outputs_and_gradients(scan_layers, remat):
  """Dropout on (so the recomputed masks must be the same ones), memory in and out."""
  params = _init(_cfg())
  params = _stacked(params) if scan_layers else params
  inputs = _two_stream_inputs(6, seed=7)

  def loss(cfg, p):
    logits, new_mems = XLNet(cfg).apply({"params": p}, *inputs, train=True, rngs={"dropout": jax.random.key(1)})
    return jnp.sum(jnp.tanh(logits)) + jnp.sum(new_mems), (logits, new_mems)

  def run(**kw):
    cfg = _cfg(scan_layers=scan_layers, dropout=0.1, attention_dropout=0.1, **kw)
    return _compiled(jax.value_and_grad(functools.partial(loss, cfg), has_aux=True), params)(params)

  (la, (logits_a, mems_a)), ga = run()
  (lb, (logits_b, mems_b)), gb = run(remat=remat)
  np.testing.assert_allclose(logits_b, logits_a, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(mems_b, mems_a, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(lb, la, rtol=1e-6)
  close = lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5 * float(np.abs(y).max()))
  jax.tree_util.tree_map(close, gb, ga)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_relative_attention_is_the_softmax_of_the_three_terms(dropout):
  """`relative_attention` (the content term in the kernel, the position and segment terms as its
  bias; attention dropout inside XLA's attention) against softmax(where(mask, relative_scores *
  scale)) . v by autodiff, with the same [b, h, t, s] dropout draw: values and the gradients of q,
  k, v, the encodings, the three biases and the segment embedding; memory, a position encoding per
  row (bi_data) and a query row with no key, which gets the mean of V (without dropout; with it,
  XLNet's softmax would drop part of that mean, and the row is left out)."""
  from tfx.ops import dropout as dropout_ops

  rng = np.random.default_rng(11)
  b, t, m, h, d = 2, 6, 3, 2, 4
  s = m + t
  f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  q, k, v, k_r = f32(b, t, h, d), f32(b, s, h, d), f32(b, s, h, d), f32(b, s + t - 1, h, d)
  biases, seg_embed = X.RelBiases(f32(h, d), f32(h, d), f32(h, d)), f32(2, h, d)
  seg_diff = jnp.asarray(rng.integers(0, 2, (b, t, s)).astype(bool))
  mask = jnp.asarray(rng.random((b, t, s)) < 0.6).at[0, 2].set(False)  # [b, t, s]; row 2 of row 0: no key
  key, scale = jax.random.key(5), d**-0.5
  rows = jnp.any(mask, axis=-1) if dropout else jnp.ones((b, t), bool)  # the rows compared
  cot = f32(b, t, h, d) * rows[:, :, None, None]

  def by_autodiff(q, k, v, k_r, biases, seg_embed):
    score = X.relative_scores(q, k, k_r, biases, seg_embed, seg_diff) * scale  # [b, h, t, s]
    probs = jax.nn.softmax(jnp.where(mask[:, None], score, -1e30), axis=-1)
    if dropout:
      keep = dropout_ops.keep_bits(dropout_ops.seed(key), probs.shape, dropout)  # [b, h, t, s]
      probs = jnp.where(keep, probs / dropout_ops.keep_probability(dropout), 0.0)
    return jnp.einsum("bhts,bshd->bthd", probs, v)

  fused = functools.partial(X.relative_attention, seg_diff=seg_diff, mask=mask, scale=scale, dropout_rate=dropout,
                            dropout_rng=key)

  def run(f):
    args = (q, k, v, k_r, biases, seg_embed)
    loss = lambda *a: jnp.sum(f(*a) * cot)
    out, grads = jax.jit(f)(*args), jax.jit(jax.grad(loss, argnums=tuple(range(6))))(*args)
    return [np.asarray(out) * np.asarray(rows)[:, :, None, None]] + [np.asarray(g) for g in jax.tree.leaves(grads)]

  for got, want in zip(run(fused), run(by_autodiff)):
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_the_heads_loss_keeps_bf16_logits_and_gives_the_float32_logits_loss():
  """With `loss` the model's head computes the token loss (what permutation LM passes): in bf16 the
  same loss and metrics as the float32 logits it returns without, the same gradients within bf16's
  rounding, and no scatter of the targets' gradient into a float32 [b, n, v] buffer (bf16 logits
  get the loss's one-pass gradient; float32 ones that scatter and a kept exp)."""
  cfg = _cfg(dtype="bfloat16", mem_len=0)
  model, params, b, t, n = XLNet(cfg), _init(cfg), 2, 6, 3
  inputs = dict(XLNet.init_inputs(b, t))
  inputs["target_mapping"] = jax.nn.one_hot(jnp.asarray([[0, 2, 5], [1, 3, 4]]), t)  # [b, n, t]
  rng = np.random.default_rng(5)
  inputs["tokens"] = jnp.asarray(rng.integers(0, V, (b, t)), jnp.int32)
  targets = ops.TokenTargets(jnp.asarray(rng.integers(0, V, (b, n)), jnp.int32),
                             jnp.asarray([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]), 1e-4)

  def head_loss(p):
    return model.apply({"params": p}, **inputs, loss=targets)[0]

  def logits_loss(p):
    logits = model.apply({"params": p}, **inputs)[0]  # [b, n, v] float32
    assert logits.dtype == jnp.float32
    return ops.weighted_cross_entropy(logits, targets.targets, targets.weights, z_loss=targets.z_loss)

  # the embedding table's scatter; + the targets' logits' for the float32 logits
  assert compare_with_float32_logits_loss(head_loss, logits_loss, params) == (1, 2)


def test_attention_dropout_runs_in_the_kernel_drawing_xlas_bits(monkeypatch):
  """With attention dropout and model.attention=pallas (a GPU faked for the choice) every attention
  of both streams runs tfx's Pallas kernel (`tfx.ops.flash_dropout`, interpreted here), the
  relative terms its bias carrying the permutation's masks (the query stream's 5 slots padded to a
  block inside it), with memory and bi_data's signs: the training-mode logits, new memory and
  gradients equal those of XLA's attention, which draws the same keep bits (what runs without a
  GPU), and another dropout key gives other logits."""
  from tfx.ops import attention as attn

  monkeypatch.setattr(attn, "_on_gpu", lambda: True)
  b, t, m, e = 2, 16, 16, 32  # head dim 16; 32 keys
  cfg = _cfg(d_model=e, num_heads=2, mem_len=m, attention="pallas", attention_dropout=0.3, dropout=0.1)
  params = _init(cfg)
  rng = np.random.default_rng(12)
  content, query = _perm_masks(np.stack([rng.permutation(t) for _ in range(b)]), m)
  mapping = jnp.asarray(np.eye(t, dtype=np.float32)[None, 3:8].repeat(b, 0))  # [b, 5, t]
  inputs = (jnp.asarray(rng.integers(0, V, (b, t))), jnp.asarray(rng.integers(0, 2, (b, t))), content, query,
            mapping, jax.random.normal(jax.random.key(3), (L, b, m, e)), jnp.asarray([1.0, -1.0]))

  def run(key):
    def loss(p):
      logits, new_mems = XLNet(cfg).apply({"params": p}, *inputs, train=True, rngs={"dropout": key})
      return jnp.sum(jnp.tanh(logits)) + jnp.sum(new_mems), (logits, new_mems)

    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

  with attn.recorded_choices() as chosen:
    (_, (logits, mems)), grads = run(jax.random.key(1))
  assert set(chosen) == {("pallas", "GPU, a bias of every row and head carrying the mask; dropout 0.3 drawn in the "
                                    "kernel")} and len(chosen) == 2 * L - 1, chosen  # (the last: the query stream)
  (_, (other, _)), _ = run(jax.random.key(2))
  assert np.mean(np.abs(np.asarray(logits - other))) > 1e-3
  monkeypatch.setattr(attn, "_on_gpu", lambda: False)
  with attn.recorded_choices() as chosen:
    (_, (want, want_mems)), want_grads = run(jax.random.key(1))
  assert {impl for impl, _ in chosen} == {"xla"}, chosen
  np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(mems, want_mems, rtol=1e-6, atol=1e-6)
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=2e-5 * float(np.abs(w).max()), err_msg=jax.tree_util.keystr(path))
