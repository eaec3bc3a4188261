"""`Encoder.two_stream` (tfx/models/encoder.py, tfx/nn/blocks.py): XLNet's content / query
streams on the ordinary encoder with absolute or rotary positions. Information flow under a
factorization order, a reference built from the one-stream encoder, slots, parameters, scan vs
unrolled layers. Small dims, float32, dropout off unless stated. Four of the eight
information-flow cases are marked slow (`-m "not slow"` skips them)."""

import functools
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfx import convert
from tfx.models import build_model
from tfx.models.encoder import Encoder
from tfx.nn.layers import ModelConfig

V, E, H, L, F = 32, 16, 2, 2, 32
B, T = 2, 7


def _cfg(position: str = "learned", norm: str = "post", scan: bool = True, remat: str = "none", **kw) -> ModelConfig:
  """post: BERT-like (embedding LayerNorm, token types, exact GELU); pre: final norm, no types."""
  bert = dict(embed_norm=True, type_vocab_size=3, mlp="gelu_exact", norm_eps=1e-12) if norm == "post" else {}
  base = dict(family="encoder", vocab_size=V, max_length=32, num_layers=L, d_model=E, num_heads=H, d_ff=F,
              position=position, norm=norm, scan_layers=scan, remat=remat, **bert)
  base.update(kw)
  return ModelConfig(**base)


@functools.lru_cache(maxsize=None)
def _params(cfg: ModelConfig, seed: int = 0):
  """Params with the structure `init` through `__call__` gives (as training makes them), every
  tensor random (norm scales around 1; biases, output bias and mask_emb included). Built from
  the shapes, so no init is compiled."""
  inputs = Encoder.init_inputs(1, 4)
  shapes = jax.eval_shape(lambda: nn.unbox(Encoder(cfg).init(jax.random.key(seed), **inputs)["params"]))
  rng = np.random.default_rng(seed)
  fill = lambda path, x: (float(path[-1].key == "scale") + 0.3 * rng.standard_normal(x.shape)).astype(np.float32)
  return jax.tree_util.tree_map_with_path(lambda path, x: jnp.asarray(fill(path, x)), shapes)


def _inputs(seed: int = 0, b: int = B, t: int = T):
  """tokens, positions, token types [b, t]; factorization order z [b, t]; masks [b, t, t]."""
  rng = np.random.default_rng(seed)
  tokens = jnp.asarray(rng.integers(0, V, (b, t)), jnp.int32)
  positions = jnp.asarray(np.stack([rng.permutation(16)[:t] for _ in range(b)]), jnp.int32)  # not an arange
  types = jnp.asarray(rng.integers(0, 3, (b, t)), jnp.int32)
  z = np.stack([rng.permutation(t) for _ in range(b)])
  query = z[:, None, :] < z[:, :, None]  # [b, i, j]: i may see j iff z_j < z_i
  content = query | np.eye(t, dtype=bool)
  return tokens, positions, types, z, jnp.asarray(content), jnp.asarray(query)


def _mapping(b: int, t: int, targets, n: int) -> jnp.ndarray:
  """[b, n, t]: slot m one-hot at targets[m], zero rows after."""
  out = np.zeros((b, n, t), np.float32)
  for m, i in enumerate(targets):
    out[:, m, i] = 1.0
  return jnp.asarray(out)


@functools.partial(jax.jit, static_argnums=0, static_argnames="train")
def _two_stream(cfg, params, tokens, positions, content, query, mapping, types=None, perturbations=None, *,
                train=False, rng=None):
  """[b, n, v] query-stream logits (jitted; one compile per config and shapes)."""
  variables = {"params": params} if perturbations is None else {"params": params, "perturbations": perturbations}
  return Encoder(cfg).apply(variables, tokens, positions, content, query, mapping,
                            token_types=types if cfg.type_vocab_size else None, train=train,
                            rngs=None if rng is None else {"dropout": rng}, method="two_stream")


# ============================================================================ information flow


# Every pair of (position, norm, scan) values is covered by the four fast cases; the other
# four of the product are marked slow. remat on one scanned and one unrolled case per position.
FLOW_FAST = {("learned", "post", True), ("learned", "pre", False), ("rotary", "post", False), ("rotary", "pre", True)}
FLOW_CASES = [pytest.param(p, n, s, marks=() if (p, n, s) in FLOW_FAST else pytest.mark.slow)
              for p in ("learned", "rotary") for n in ("post", "pre") for s in (True, False)]


@pytest.mark.parametrize("position,norm,scan", FLOW_CASES)
def test_information_flow_under_a_factorization_order(position, norm, scan):
  cfg = _cfg(position, norm, scan, remat="full" if scan == (position == "rotary") else "none")
  params = _params(cfg)
  tokens, positions, types, z, content, query = _inputs(1)
  mapping = _mapping(B, T, range(T), T + 1)  # slot i = position i, then one padded slot
  proj = jax.random.normal(jax.random.key(4), (V,))

  def out(perturbations):  # [b, n]: a random projection of each slot's logits
    logits = _two_stream(cfg, params, tokens, positions, content, query, mapping, types, perturbations)
    return logits @ proj

  perts = {"embeddings": jnp.zeros((B, T, E))}
  # d out[r, i] / d emb[r', j, :] for every (r, i, r', j): [b, n, b, t, e]
  jac = np.asarray(jax.jit(jax.jacrev(out))(perts)["embeddings"])
  assert np.all(np.isfinite(jac))
  jq = np.abs(jac).max(-1)  # [b, n, b, t]
  for r in range(B):
    for i in range(T):
      for j in range(T):
        if z[r, j] >= z[r, i]:  # itself or later in the order: exactly nothing
          assert jq[r, i, r, j] == 0.0, (r, i, j)
        else:  # earlier: attended directly by the slot
          assert jq[r, i, r, j] > 0.0, (r, i, j)
  assert np.all(jq[:, T] == 0.0)  # the padded slot sees nothing
  assert np.all(jq[0, :, 1] == 0.0) and np.all(jq[1, :, 0] == 0.0)  # rows are independent


# ============================================================================ a one-stream reference


@pytest.mark.parametrize("position,norm", [("learned", "post"), ("rotary", "pre")])
def test_matches_the_one_stream_encoder_on_appended_rows(position, norm):
  """The query stream is the ordinary encoder run on [tokens; slots] where the slot rows have
  the token mask_emb (an extra vocabulary row), the target's position and type, attend the
  content rows under the target's query-mask row, and nothing attends them."""
  cfg = _cfg(position, norm, embed_scale=True)
  params = _params(cfg)
  tokens, positions, types, _, content, query = _inputs(2)
  targets = [4, 0, 6, 2]
  n = len(targets) + 2  # two padded slots
  mapping = _mapping(B, T, targets, n)
  got = _two_stream(cfg, params, tokens, positions, content, query, mapping, types)  # [b, n, v]

  ref_cfg = _cfg(position, norm, embed_scale=True, vocab_size=V + 1)
  ref_params = dict(params)
  ref_params["token_embed"] = {"embedding": jnp.concatenate([params["token_embed"]["embedding"],
                                                             params["mask_emb"][None]])}
  ref_params["output_bias"] = jnp.concatenate([params["output_bias"], jnp.zeros((1,))])
  idx = np.asarray(targets + [0] * (n - len(targets)))
  slot_tokens = jnp.full((B, n), V, jnp.int32)
  slot_positions = positions[:, idx].at[:, len(targets):].set(0)
  slot_types = types[:, idx].at[:, len(targets):].set(0)
  slot_rows = query[:, idx].at[:, len(targets):].set(False)  # [b, n, t]
  mask = jnp.concatenate([jnp.concatenate([content, jnp.zeros((B, T, n), bool)], -1),
                          jnp.concatenate([slot_rows, jnp.zeros((B, n, n), bool)], -1)], 1)[:, None]
  one_stream = jax.jit(lambda p, x, pos, ty, m: Encoder(ref_cfg).apply({"params": p}, x, None, pos, token_types=ty,
                                                                       mask=m))
  want = one_stream(ref_params, jnp.concatenate([tokens, slot_tokens], 1), jnp.concatenate([positions, slot_positions], 1),
                    jnp.concatenate([types, slot_types], 1), mask)[:, T:, :V]
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


# ============================================================================ slots


def test_slots_permute_and_padding_is_inert():
  cfg = _cfg("rotary", "post", dropout=0.1, attention_dropout=0.1)
  params = _params(cfg)
  tokens, positions, types, _, content, query = _inputs(3)
  targets = [5, 1, 3, 2]
  mapping = _mapping(B, T, targets, 5)  # one padded slot
  run = lambda m, **kw: np.asarray(_two_stream(cfg, params, tokens, positions, content, query, m, types, **kw))
  base = run(mapping)
  assert base.shape == (B, 5, V) and base.dtype == np.float32 and np.all(np.isfinite(base))
  # Permuting the slots permutes the logits.
  perm = np.asarray([3, 4, 0, 2, 1])
  np.testing.assert_allclose(run(mapping[:, perm]), base[:, perm], rtol=1e-6, atol=1e-6)
  # More padded slots: finite, and the other slots are unchanged (to float32 rounding: the matmuls
  # over 8 slots instead of 5 may sum in another order; 1.5e-6 at logits of 0.4 was seen).
  more = run(jnp.concatenate([mapping, jnp.zeros((B, 3, T))], 1))
  assert np.all(np.isfinite(more))
  np.testing.assert_allclose(more[:, :5], base, rtol=1e-5, atol=1e-6)
  # Dropout (train=True) runs, stays finite and changes the logits.
  train = run(mapping, train=True, rng=jax.random.key(1))
  assert np.all(np.isfinite(train)) and np.abs(train - base).max() > 1e-4


# ============================================================================ parameters


def test_parameters_are_those_of_call_plus_mask_emb():
  cfg = _cfg("learned", "post", scan=False)
  model = Encoder(cfg)
  tokens, positions, types, _, content, query = _inputs(0, b=1, t=4)
  via_call = jax.eval_shape(lambda: nn.unbox(model.init(jax.random.key(0), **Encoder.init_inputs(1, 4))["params"]))
  via_two = jax.eval_shape(lambda: nn.unbox(model.init(
      jax.random.key(0), tokens, positions, content, query, _mapping(1, 4, [1, 2], 3), token_types=types,
      method="two_stream")["params"]))
  shapes = lambda tree: {k: v.shape for k, v in convert._flatten(tree).items()}
  assert shapes(via_two) == shapes(via_call)  # two_stream creates nothing new
  assert set(via_call) == {"token_embed", "position_embed", "type_embed", "embed_norm", "encoder", "head_dense",
                           "head_norm", "output_bias", "mask_emb"}
  assert set(via_call["encoder"]["layer_0"]) == {"attention", "attention_norm", "mlp", "mlp_norm"}
  assert via_call["mask_emb"].shape == (E,)
  # mask_emb is the only new parameter, and `__call__` does not use it.
  params = _params(cfg)
  seg = jnp.ones((1, 4), jnp.int32)
  call = jax.jit(lambda p: model.apply({"params": p}, tokens, seg, positions, token_types=types))
  moved = dict(params, mask_emb=params["mask_emb"] + 1.0)
  np.testing.assert_array_equal(np.asarray(call(params)), np.asarray(call(moved)))


def test_bert_tiny_config_and_relative_positions_rejected(root):
  from tfx.config import load_config

  config = load_config(os.path.join(root, "configs", "bert_tiny.py"), [])
  model = build_model(config.model, vocab_size=config.data.vocab_size, max_length=config.data.seq_len)
  tokens, positions, types, _, content, query = _inputs(0, b=1, t=6)
  types = jnp.minimum(types, 1)
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens, positions, content, query,
                                             _mapping(1, 6, [1, 2], 3), token_types=types, method="two_stream"))
  logits = jax.eval_shape(lambda v: model.apply(v, tokens, positions, content, query, _mapping(1, 6, [1, 2], 3),
                                                token_types=types, method="two_stream"), shapes)
  assert logits.shape == (1, 3, config.data.vocab_size) and logits.dtype == jnp.float32
  t5 = Encoder(_cfg("relative", "pre"))
  with pytest.raises(ValueError, match="learned, sinusoidal or rotary"):
    t5.init(jax.random.key(0), tokens, positions, content, query, _mapping(1, 6, [1], 2), method="two_stream")


# ============================================================================ scan vs unrolled


@pytest.mark.parametrize("position,remat", [("sinusoidal", "none"), ("rotary", "dots")])
def test_scanned_and_unrolled_layers_agree(position, remat):
  unrolled = _cfg(position, "pre", scan=False, remat=remat)
  scanned = _cfg(position, "pre", scan=True, remat=remat)
  params = _params(unrolled)
  layers = [params["encoder"][f"layer_{i}"] for i in range(L)]
  stacked = dict(params, encoder={"layers": jax.tree_util.tree_map(lambda *x: jnp.stack(x), *layers)})
  tokens, positions, types, _, content, query = _inputs(4)
  mapping = _mapping(B, T, [3, 1, 6], 4)

  a = _two_stream(unrolled, params, tokens, positions, content, query, mapping, types)
  b = _two_stream(scanned, stacked, tokens, positions, content, query, mapping, types)
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
  # (Gradients through remat, scanned and unrolled: test_information_flow_under_a_factorization_order.)


def test_attention_dropout_runs_in_the_kernel_reading_the_dense_masks(monkeypatch):
  """With attention dropout and model.attention=pallas (a GPU faked for the choice) both streams'
  attentions run tfx's Pallas kernel (interpreted here) with the permutation's dense masks read
  beside the scores (the query stream's 5 slots padded to a block inside it); the training-mode
  logits and gradients equal those of XLA's attention, which draws the same keep bits (what runs
  without a GPU)."""
  from tfx.ops import attention as attn

  monkeypatch.setattr(attn, "_on_gpu", lambda: True)
  t = 16
  cfg = _cfg(d_model=32, num_heads=2, attention="pallas", attention_dropout=0.3, dropout=0.1, max_length=t)
  params = _params(cfg)
  tokens, positions, types, _, content, query = _inputs(5, t=t)
  mapping = _mapping(B, t, [3, 9, 0, 14], 5)  # one padded slot

  def run(key):
    loss = lambda p: jnp.sum(jnp.tanh(_two_stream(cfg, p, tokens, positions, content, query, mapping, types,
                                                  train=True, rng=key)))
    return jax.value_and_grad(loss)(params)

  with attn.recorded_choices() as chosen:
    got, got_grads = run(jax.random.key(1))
  assert {impl for impl, _ in chosen} == {"pallas"} and "a dense mask" in chosen[0][1], chosen
  monkeypatch.setattr(attn, "_on_gpu", lambda: False)
  _two_stream.clear_cache()  # traced with the kernel
  with attn.recorded_choices() as chosen:
    want, want_grads = run(jax.random.key(1))
  _two_stream.clear_cache()
  assert {impl for impl, _ in chosen} == {"xla"}, chosen
  np.testing.assert_allclose(got, want, rtol=1e-5)
  # (the key projection's bias has no gradient but float32 rounding: the tolerance is the gradients' scale's)
  scale = max(float(np.abs(w).max()) for w in jax.tree.leaves(want_grads))
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got_grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=2e-5 * scale, err_msg=jax.tree_util.keystr(path))
