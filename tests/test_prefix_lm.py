"""Prefix-LM invariants: split points, weights, and information flow through the real decoder."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tests.conftest import tiny_config
from tfx.models import build_model
from tfx.objectives.base import SpecialIds
from tfx.objectives.prefix_lm import PrefixLM, prefix_lm_inputs, random_prefix_lengths
from tfx.registry import OBJECTIVES

IDS = SpecialIds(vocab_size=97, pad=0, eos=1, unk=2, bos=3)


def packed(lengths: list[int], total: int, rng: np.random.Generator):
  """A batch of one row with documents of `lengths`, then padding."""
  tokens = np.zeros((1, total), np.int32)
  seg = np.zeros((1, total), np.int32)
  pos = np.zeros((1, total), np.int32)
  start = 0
  for k, n in enumerate(lengths):
    tokens[0, start:start + n] = rng.integers(4, IDS.vocab_size, n)
    seg[0, start:start + n] = k + 1
    pos[0, start:start + n] = np.arange(n)
    start += n
  return {"tokens": jnp.asarray(tokens), "segment_ids": jnp.asarray(seg), "positions": jnp.asarray(pos)}


def test_registered():
  assert OBJECTIVES.get("prefix_lm") is PrefixLM
  assert PrefixLM.families == ("decoder",)


def test_split_points_weights_and_determinism():
  rng = np.random.default_rng(0)
  lengths = [1, 2, 5, 9, 40]
  rows = [packed(lengths, 64, rng) for _ in range(256)]
  batch = {k: jnp.concatenate([r[k] for r in rows]) for k in rows[0]}
  f = jax.jit(lambda k: prefix_lm_inputs(batch, k, IDS.bos))
  x = {k: np.asarray(v) for k, v in f(jax.random.key(0)).items()}
  seg, pos = np.asarray(batch["segment_ids"]), np.asarray(batch["positions"])
  prefix, weights = x["prefix_length"], x["weights"]
  assert (weights[seg == 0] == 0).all() and (prefix[seg == 0] == 0).all()
  for k, n in enumerate(lengths):
    doc = seg == k + 1
    p = prefix[doc].reshape(256, n)
    assert (p == p[:, :1]).all(), "one split point per document"
    p = p[:, 0]
    if n == 1:
      assert (p == 0).all()
    else:
      assert p.min() >= 1 and p.max() <= n - 1
      counts = np.bincount(p, minlength=n)[1:]
      assert (counts > 0).all() if n <= 9 else len(set(p)) > 20  # all of {1..n-1} drawn
    w = weights[doc].reshape(256, n)
    np.testing.assert_array_equal(w, (pos[doc].reshape(256, n) >= p[:, None]).astype(np.float32))
    np.testing.assert_array_equal(w.sum(1), n - p)  # the prefix has no loss, the suffix all of it
  np.testing.assert_array_equal(x["targets"], np.asarray(batch["tokens"]))
  again = f(jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(again["prefix_length"]), prefix)
  other = np.asarray(f(jax.random.key(1))["prefix_length"])
  assert not np.array_equal(other, prefix)


def test_split_is_uniform():
  seg = jnp.ones((4096, 5), jnp.int32)
  p = np.asarray(jax.jit(random_prefix_lengths)(seg, jax.random.key(2)))[:, 0]
  counts = np.bincount(p, minlength=5)[1:]  # P in {1, 2, 3, 4}, 1/4 each
  sigma = np.sqrt(4096 * 0.25 * 0.75)
  assert (np.abs(counts - 1024) < 3 * sigma).all(), counts


def test_information_flow_through_the_real_decoder():
  """d logits[i] / d input embedding[j] through the real decoder with the objective's mask:
  zero unless j is in i's document and (j <= i or j is in the bidirectional block, input
  positions 0..P); so a suffix target x_k (at input k + 1 > P) never reaches logits <= k. The
  prefix block sees itself both ways. The loss of the objective is the one of this call."""
  t = 24
  cfg = tiny_config("--config.model.num_layers=2", "--config.model.d_model=32", "--config.model.d_ff=64",
                    "--config.model.position=rotary")
  model = build_model(cfg.model, vocab_size=IDS.vocab_size, max_length=t)
  params = nn.unbox(jax.jit(model.init)(jax.random.key(0), **type(model).init_inputs(1, t))["params"])
  batch = packed([6, 9, 1, 5], t, np.random.default_rng(1))  # 3 pad tokens at the end
  objective = PrefixLM(IDS)
  rng = jax.random.key(3)
  x = jax.jit(prefix_lm_inputs, static_argnums=2)(batch, jax.random.split(rng)[0], IDS.bos)
  args = (x["inputs"], batch["segment_ids"], batch["positions"])
  perturb = jax.tree.map(jnp.zeros_like, jax.eval_shape(model.init, jax.random.key(0), *args)["perturbations"])

  @jax.jit
  def jacobian(eps):
    f = lambda e: model.apply({"params": params, "perturbations": e}, *args, mask=x["mask"])[0].sum(-1)  # [t]
    return jax.jacrev(f)(eps)["embeddings"][:, 0]  # [t (logits), t (inputs), e]

  jac = np.abs(np.asarray(jacobian(perturb))).sum(-1)  # [t, t]
  seg, pos = np.asarray(batch["segment_ids"])[0], np.asarray(batch["positions"])[0]
  prefix = np.asarray(x["prefix_length"])[0]
  weights = np.asarray(x["weights"])[0]
  for i in range(t):
    if seg[i] == 0:
      continue
    for j in range(t):
      same = seg[j] == seg[i]
      allowed = same and (pos[j] <= pos[i] or pos[j] <= prefix[i])
      if not allowed:
        assert jac[i, j] == 0.0, (i, j)
      if same and pos[i] <= prefix[i] and pos[j] <= prefix[i]:
        assert jac[i, j] > 0.0, (i, j)  # the prefix block (BOS, x0 .. x_{P-1}) sees itself both ways
      # The target of position j (token x_{pos j}, at input j + 1) never reaches a logit at or before j.
      if weights[j] > 0 and j + 1 < t and seg[j + 1] == seg[j] and pos[i] <= pos[j] and same:
        assert jac[i, j + 1] == 0.0, (i, j)
  # Some document has a non-trivial prefix, so the check above exercised bidirectionality.
  assert any(jac[i, j] > 0 for i in range(t) for j in range(i + 1, t))
  loss, metrics = jax.jit(lambda p: objective.loss(model, p, batch, rng, train=False))(params)
  logits = jax.jit(lambda p: model.apply({"params": p}, *args, mask=x["mask"]))(params)[0]
  ce = -jax.nn.log_softmax(logits, -1)[jnp.arange(t), x["targets"][0]]
  manual = float(jnp.sum(ce * x["weights"][0]) / jnp.sum(x["weights"][0]))
  np.testing.assert_allclose(float(loss), manual, rtol=1e-5)
  assert float(metrics["num_tokens"]) == weights.sum()
