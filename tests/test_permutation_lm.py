"""XLNet permutation LM invariants (OBJECTIVES.md §4, §5 PLM): perm_mask rules over many random
draws, target mapping, the span sampler, the "last" mode, and information flow through a small
two-stream fake model with exactly-zero gradients."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfx import ops
from tfx.nn import xlnet as xlnet_nn
from tfx.objectives.base import SpecialIds
from tfx.objectives.permutation_lm import (
    PermutationLM, half_goals, local_permutation, permutation_masks, resolve_lengths, row_order, sample_targets,
    span_phase, span_targets, target_mapping, xlnet_perm_mask, xlnet_rows)
from tfx.registry import OBJECTIVES

VOCAB = 64
IDS = SpecialIds(vocab_size=VOCAB, pad=5, eos=2, unk=0, bos=1, mask=6, cls=3, sep=4, special=tuple(range(9)))
DRAWS = 384


# ----------------------------------------------------------------------------- fake two-stream model


@dataclasses.dataclass(frozen=True)
class FakeXLNet:
  """A plain-jnp two-stream attention model with the `xlnet` family's call signature.

  Layer l: h' = h + tanh(attn(q=h, kv=h, content_mask) W_o); g' = g + tanh(attn(q=g, kv=h,
  query_mask) W_o); g⁰ = mask_emb at every position, h⁰ = emb(x) + type_emb(token_type).
  Masked scores are -1e30 (via `where`, so their gradient is exactly 0). Logits = (T g) Eᵀ.
  """

  vocab: int = VOCAB
  d: int = 8
  layers: int = 2

  def init(self, rng: jax.Array) -> dict:
    keys = jax.random.split(rng, 7)
    normal = lambda k, shape, s=1.0: s * jax.random.normal(k, shape)
    return {"params": {
        "emb": normal(keys[0], (self.vocab, self.d)), "type": normal(keys[1], (3, self.d)),
        "mask_emb": normal(keys[2], (self.d,)),
        "wq": normal(keys[3], (self.layers, self.d, self.d), self.d ** -0.5),
        "wk": normal(keys[4], (self.layers, self.d, self.d), self.d ** -0.5),
        "wv": normal(keys[5], (self.layers, self.d, self.d), self.d ** -0.5),
        "wo": normal(keys[6], (self.layers, self.d, self.d), self.d ** -0.5)}}

  def streams(self, p: dict, h: jax.Array, content_mask: jax.Array, query_mask: jax.Array
              ) -> tuple[jax.Array, jax.Array]:
    """One row: h [t, d] embeddings, masks [t, t] -> (h, g) [t, d] after all layers."""
    g = jnp.broadcast_to(p["mask_emb"], h.shape)

    def attend(x, kv, mask, l):
      scores = (x @ p["wq"][l]) @ (kv @ p["wk"][l]).T / np.sqrt(self.d)  # [t, t]
      probs = jax.nn.softmax(jnp.where(mask, scores, -1e30), axis=-1)
      return x + jnp.tanh((probs @ (kv @ p["wv"][l])) @ p["wo"][l])

    for l in range(self.layers):
      h, g = attend(h, h, content_mask, l), attend(g, h, query_mask, l)
    return h, g

  def apply(self, variables, tokens, token_types, content_mask, query_mask, target_mapping, mems, bi_sign, *,
            train=False, rngs=None, loss=None):
    del train, rngs, bi_sign
    assert mems is None and query_mask is not None and target_mapping is not None
    p = variables["params"]
    h = p["emb"][tokens] + p["type"][token_types]  # [b, t, d]
    _, g = jax.vmap(lambda e, c, q: self.streams(p, e, c, q))(h, content_mask, query_mask)  # [b, t, d]
    g = jnp.einsum("bnt,btd->bnd", target_mapping, g)
    logits = g @ p["emb"].T  # [b, n, v]
    if loss is not None:  # as the family's head: the token loss and its metrics
      return ops.weighted_cross_entropy(logits, loss.targets, loss.weights, z_loss=loss.z_loss), None
    return logits, None


# ----------------------------------------------------------------------------- helpers


def plm(**kwargs) -> PermutationLM:
  """The objective on packed rows as they are (func tokens wherever SEP/CLS occur)."""
  return PermutationLM(IDS, row_layout="plain", **kwargs)


def random_rows(rng: jax.Array, b: int, t: int, func_rate: float = 0.08, pad_from: int | None = None):
  """Tokens [b, t] with SEP/CLS sprinkled in at `func_rate`, segment_ids (padding from `pad_from`)."""
  tok_rng, func_rng, kind_rng = jax.random.split(rng, 3)
  tokens = jax.random.randint(tok_rng, (b, t), 9, VOCAB)
  func = jax.random.bernoulli(func_rng, func_rate, (b, t))
  kind = jnp.where(jax.random.bernoulli(kind_rng, 0.5, (b, t)), IDS.sep, IDS.cls)
  tokens = jnp.where(func, kind, tokens).astype(jnp.int32)
  segment_ids = jnp.ones((b, t), jnp.int32)
  if pad_from is not None:
    segment_ids = jnp.where(jnp.arange(t) < pad_from, segment_ids, 0)
    tokens = jnp.where(segment_ids > 0, tokens, IDS.pad)
  return {"tokens": tokens, "segment_ids": segment_ids, "positions": jnp.cumsum(segment_ids, 1) - 1}


_FEATURES = {}


def features(objective: PermutationLM, batch: dict, rng: jax.Array) -> dict[str, np.ndarray]:
  """objective.features, jitted once per objective, as numpy."""
  if objective not in _FEATURES:
    _FEATURES[objective] = jax.jit(objective.features)
  return {k: np.asarray(v) for k, v in _FEATURES[objective](batch, rng).items()}


def bool_power(m: np.ndarray, k: int) -> np.ndarray:
  """Boolean matrix power of m [..., t, t] (k >= 0)."""
  out = np.broadcast_to(np.eye(m.shape[-1], dtype=bool), m.shape)
  for _ in range(k):
    out = np.einsum("...ij,...jk->...ik", out.astype(np.int32), m.astype(np.int32)) > 0
  return out


# ----------------------------------------------------------------------------- config and lengths


def test_registered_and_lengths():
  assert OBJECTIVES.get("permutation_lm") is PermutationLM
  assert PermutationLM.families == ("xlnet", "encoder")
  objective = PermutationLM(IDS)
  assert objective.raw_length(512) == 509  # + SEP, SEP, CLS
  assert plm().raw_length(512) == 512
  assert objective.lengths(512) == (85, 256, 256)
  assert half_goals(85) == (43, 42) and half_goals(11) == (6, 5)
  assert resolve_lengths(64, perm_size=8) == (11, 32, 8)  # round(64/6) = round(10.67) = 11
  assert resolve_lengths(30) == (5, 15, 15)  # round(5.0) = 5
  assert resolve_lengths(27, perm_size=1) == (4, 13, 1)  # round(4.5) = 4 (half to even)
  with pytest.raises(ValueError, match="perm_size"):
    resolve_lengths(64, reuse_len=24, perm_size=16)
  with pytest.raises(ValueError, match="row_layout"):
    PermutationLM(IDS, row_layout="bert")
  with pytest.raises(ValueError, match="target_mode"):
    PermutationLM(IDS, target_mode="first")


def test_local_permutation_blocks():
  z = np.asarray(jax.vmap(lambda k: local_permutation(k, 32, 8))(jax.random.split(jax.random.PRNGKey(0), 64)))
  for row in z:
    assert sorted(row) == list(range(32))
    blocks = row.reshape(4, 8) - 8 * np.arange(4)[:, None]  # offsets within each block
    assert (blocks == blocks[0]).all()  # one offset permutation shared by all blocks, blocks in order
  assert len({tuple(r) for r in z}) > 60
  order = np.asarray(row_order(jax.random.PRNGKey(1), 32, 16, 16))
  assert sorted(order[:16]) == list(range(16)) and sorted(order[16:]) == list(range(16, 32))


# ----------------------------------------------------------------------------- masks


@pytest.mark.parametrize("t, reuse_len, perm_size, num_predict", [(24, 12, 12, 8), (32, 16, 8, 12)])
def test_perm_mask_rules_many_draws(t, reuse_len, perm_size, num_predict):
  @jax.jit
  def draw(rng):
    data_rng, order_rng, target_rng = jax.random.split(rng, 3)
    batch = random_rows(data_rng, DRAWS, t, func_rate=0.1)
    is_func = (batch["tokens"] == IDS.sep) | (batch["tokens"] == IDS.cls)
    z = jax.vmap(lambda k: row_order(k, t, reuse_len, perm_size))(jax.random.split(order_rng, DRAWS))
    targets = sample_targets(batch["tokens"], target_rng, eligible=~is_func, num_predict=num_predict,
                             reuse_len=reuse_len, z=z, max_span=3)
    pm = jax.vmap(lambda g, f, o: xlnet_perm_mask(g, f, o, reuse_len))(targets, is_func, z)
    content, query = jax.vmap(lambda g, f, o: permutation_masks(g, f, o, reuse_len))(targets, is_func, z)
    return targets, is_func, z, pm, content, query

  targets, is_func, z, pm, content, query = map(np.asarray, draw(jax.random.PRNGKey(t)))
  assert not (targets & is_func).any()

  nonmask = ~targets & ~is_func  # [D, t]
  second = np.arange(t) >= reuse_len
  same_half = second[:, None] == second[None, :]  # [t, t]
  diag = np.eye(t, dtype=bool)
  # pm[i, i] = 1 for targets; 0 for everything else.
  assert (np.diagonal(pm, axis1=1, axis2=2) == targets).all()
  # Non-masked rows: pm[i, j] = 1 iff j is masked or func (within the half).
  masked_or_func = ~nonmask
  expect = np.broadcast_to(masked_or_func[:, None, :], pm.shape)
  rows = nonmask[:, :, None] & same_half[None]
  assert (pm[rows] == expect[rows]).all()
  # Targets: see j iff j is non-masked or earlier in the order; func: iff non-masked or z_j <= z_i.
  earlier = z[:, None, :] < z[:, :, None]  # [D, i, j]: z_j < z_i
  t_rows = targets[:, :, None] & same_half[None]
  assert (~pm[t_rows] == (nonmask[:, None, :] | earlier)[t_rows]).all()
  f_rows = is_func[:, :, None] & same_half[None]
  assert (~pm[f_rows] == (nonmask[:, None, :] | earlier | diag)[f_rows]).all()
  # Distinct targets of one half: a strict total order.
  pairs = targets[:, :, None] & targets[:, None, :] & same_half[None] & ~diag[None]
  assert ((pm ^ pm.transpose(0, 2, 1))[pairs]).all()
  # Across halves.
  assert pm[:, :reuse_len, reuse_len:].all() and not pm[:, reuse_len:, :reuse_len].any()
  # tfx convention.
  assert (query == ~pm).all() and (content == (query | diag)).all()
  # Targets in each half: exactly the goals (enough eligible positions here) or all eligible.
  for (lo, hi), goal in zip(((0, reuse_len), (reuse_len, t)), half_goals(num_predict)):
    count = targets[:, lo:hi].sum(1)
    assert (count == np.minimum(goal, (~is_func[:, lo:hi]).sum(1))).all()


def test_documents_and_padding_are_isolated():
  t = 16
  targets = jnp.zeros(t, bool).at[jnp.array([1, 5, 9])].set(True)
  is_func = jnp.zeros(t, bool).at[3].set(True)
  z = row_order(jax.random.PRNGKey(0), t, 8, 8)
  segment_ids = jnp.array([1] * 6 + [2] * 7 + [0] * 3)
  content, query = map(np.asarray, permutation_masks(targets, is_func, z, 8, segment_ids))
  seg = np.asarray(segment_ids)
  other = ((seg[:, None] != seg[None, :]) | (seg[None, :] == 0)) & ~np.eye(t, dtype=bool)
  assert not (query & other).any() and not (content & other).any()
  assert content.any(-1).all()  # every content row has a key (its own)
  pad = seg == 0
  assert (query[pad] == np.eye(t, dtype=bool)[pad]).all()


# ----------------------------------------------------------------------------- targets and mapping


def test_target_mapping_rows():
  t, n = 40, 10
  rng = jax.random.PRNGKey(3)
  tokens = jax.random.randint(rng, (DRAWS, t), 9, VOCAB)
  targets = jax.random.bernoulli(jax.random.PRNGKey(4), 0.25, (DRAWS, t))  # 0..40 targets, often > n
  mapping, ids, mask = map(np.asarray, jax.vmap(lambda g, x: target_mapping(g, x, n))(targets, tokens))
  targets, tokens = np.asarray(targets), np.asarray(tokens)
  assert mapping.shape == (DRAWS, n, t) and ids.shape == mask.shape == (DRAWS, n)
  assert ((mapping == 0) | (mapping == 1)).all()
  row_sum = mapping.sum(-1)
  assert ((row_sum == 0) | (row_sum == 1)).all() and (row_sum == mask).all()
  assert (mask.sum(1) == np.minimum(targets.sum(1), n)).all() and (mask.sum(1) <= n).all()
  assert (mapping.sum(1) <= 1).all()  # no position twice
  where = mapping.argmax(-1)
  assert (ids == np.where(mask > 0, np.take_along_axis(tokens, where, 1), 0)).all()
  assert np.take_along_axis(targets, where, 1)[mask > 0].all()
  for r in range(DRAWS):  # position order, the first n targets
    k = int(mask[r].sum())
    assert (where[r, :k] == np.flatnonzero(targets[r])[:k]).all()
    assert (mask[r, :k] == 1).all() and (mask[r, k:] == 0).all()


def test_span_sampler_statistics():
  keys = jax.random.split(jax.random.PRNGKey(0), DRAWS)
  eligible = jnp.ones(256, bool)
  spans, count = map(np.asarray, jax.jit(jax.vmap(lambda k: span_phase(eligible, k, goal=43)))(keys))
  assert (spans.sum(1) == count).all() and (count <= 43).all()
  lengths = []
  for row in spans:
    edges = np.diff(np.concatenate([[0], row.astype(int), [0]]))
    lengths += list(np.flatnonzero(edges == -1) - np.flatnonzero(edges == 1))
  lengths = np.array(lengths)
  assert lengths.min() >= 1 and lengths.max() <= 5
  freq = np.bincount(lengths, minlength=6)[1:] / len(lengths)
  theory = (1 / np.arange(1, 6)) / (1 / np.arange(1, 6)).sum()  # mean 2.19
  assert np.abs(freq - theory).max() < 0.04, freq
  assert 2.0 < lengths.mean() < 2.3
  # ~ 256 / (n + 6n) spans of mean n: about 36 of the 43 targets come from spans, the rest are singles.
  assert 30 < count.mean() < 42 and 12 < len(lengths) / DRAWS < 22
  full = np.asarray(jax.jit(jax.vmap(lambda k: span_targets(eligible, k, goal=43)))(keys))
  inner, _ = jax.jit(jax.vmap(lambda k: span_phase(eligible, jax.random.split(k)[0], goal=43)))(keys)
  assert (full.sum(1) == 43).all() and (full >= np.asarray(inner)).all()  # spans, then random singles


def test_spans_avoid_func_and_padding():
  t = 64
  batch = random_rows(jax.random.PRNGKey(5), DRAWS, t, func_rate=0.15, pad_from=50)
  is_func = (batch["tokens"] == IDS.sep) | (batch["tokens"] == IDS.cls)
  eligible = ~is_func & (batch["segment_ids"] > 0)
  starts = jax.random.bernoulli(jax.random.PRNGKey(6), 0.6, (DRAWS, t))
  for word_start in (None, starts):
    sample = jax.jit(lambda s=word_start: sample_targets(batch["tokens"], jax.random.PRNGKey(7), eligible=eligible,
                                                         num_predict=11, reuse_len=32, word_start=s))
    targets = np.asarray(sample())
    assert not (targets & ~np.asarray(eligible)).any()
    first, second = targets[:, :32].sum(1), targets[:, 32:].sum(1)
    assert (first == np.minimum(6, np.asarray(eligible)[:, :32].sum(1))).all()
    assert (second == np.minimum(5, np.asarray(eligible)[:, 32:].sum(1))).all()
  # Word starts: every span of the span loop starts at an eligible word start.
  spans, _ = jax.jit(jax.vmap(lambda e, k, s: span_phase(e, k, goal=6, word_start=s)))(
      eligible[:, :32], jax.random.split(jax.random.PRNGKey(8), DRAWS), starts[:, :32])
  spans = np.asarray(spans)
  begins = spans & ~np.pad(spans[:, :-1], ((0, 0), (1, 0)))
  assert np.asarray(starts[:, :32])[begins].all()


def test_last_mode_picks_the_end_of_the_order():
  t = 32
  objective = plm(target_mode="last", num_predict=8)
  batch = random_rows(jax.random.PRNGKey(9), DRAWS, t, func_rate=0.1)
  x = features(objective, batch, jax.random.PRNGKey(10))
  eligible = ~x["is_func"]
  for lo, hi, goal in ((0, 16, 4), (16, 32, 4)):
    tg, el, z = x["targets"][:, lo:hi], eligible[:, lo:hi], x["z"][:, lo:hi]
    assert (tg.sum(1) == np.minimum(goal, el.sum(1))).all()
    last_target = np.where(tg, z, 10 ** 6).min(1)
    latest_other = np.where(el & ~tg, z, -1).max(1)
    assert (latest_other < last_target).all()


# ----------------------------------------------------------------------------- the objective


def test_features_counts_and_determinism():
  t = 48
  objective = plm(perm_size=8)
  batch = random_rows(jax.random.PRNGKey(11), 64, t, func_rate=0.1)
  x = features(objective, batch, jax.random.PRNGKey(12))
  assert x["target_mapping"].shape == (64, 8, t) and x["content_mask"].shape == (64, t, t)
  assert (x["token_types"] == 0).all()
  assert (x["target_mask"].sum(1) == 8).all()  # round(48/6) = 8, enough non-func positions
  again = features(objective, batch, jax.random.PRNGKey(12))
  assert all((x[k] == again[k]).all() for k in x)
  other = features(objective, batch, jax.random.PRNGKey(13))
  assert (x["targets"] != other["targets"]).any(1).mean() > 0.95 and (x["z"] != other["z"]).any(1).all()
  # Padding: never a target, and with padding the count is min(goal, eligible).
  padded = random_rows(jax.random.PRNGKey(14), 64, t, pad_from=20)
  y = features(objective, padded, jax.random.PRNGKey(12))
  assert not (y["targets"] & (np.asarray(padded["segment_ids"]) == 0)).any()
  assert (y["target_mask"].sum(1) <= 8).all()
  # Every predicted slot's query row has at least one key (no uniform softmax over masked keys).
  slot_rows = np.einsum("bnt,btj->bnj", y["target_mapping"], y["query_mask"].astype(np.float32))
  assert (slot_rows.sum(-1)[y["target_mask"] > 0] > 0).all()


def test_row_with_all_targets_drops_keyless_predictions():
  objective = plm(num_predict=8, reuse_len=4)  # 4 + 4 targets: every position of a row of 8
  batch = random_rows(jax.random.PRNGKey(15), 16, 8, func_rate=0.0)
  x = features(objective, batch, jax.random.PRNGKey(16))
  assert x["targets"].all()
  # The first target of each first half sees nothing and is dropped; the second half sees the first half.
  assert (x["target_mask"].sum(1) == 7).all()


def test_information_flow_gradients():
  """∂g_i/∂h⁰_k is exactly 0 where §5 says, and nonzero exactly where the masks connect."""
  model = FakeXLNet(layers=3)
  p = model.init(jax.random.PRNGKey(0))["params"]
  t, draws = 16, 48
  objective = plm(num_predict=6, perm_size=4)
  batch = random_rows(jax.random.PRNGKey(17), draws, t, func_rate=0.12)
  x = features(objective, batch, jax.random.PRNGKey(18))
  e = jax.random.normal(jax.random.PRNGKey(19), (draws, t, model.d))

  def dependence(e, c, q):  # [t, t] each: does h_i / g_i depend on e_k?
    jh, jg = jax.jacrev(lambda e: model.streams(p, e, c, q))(e)  # [t, d, t, d]
    return jnp.any(jh != 0, axis=(1, 3)), jnp.any(jg != 0, axis=(1, 3))

  dep_h, dep_g = map(np.asarray, jax.jit(jax.vmap(dependence))(e, x["content_mask"], x["query_mask"]))
  targets, z, func = x["targets"], x["z"], x["is_func"]
  second = np.arange(t) >= 8
  same_half = second[:, None] == second[None, :]
  later_masked = (targets | func)[:, None, :] & (z[:, None, :] >= z[:, :, None]) & same_half[None]  # [D, i, k]
  assert not dep_g[np.broadcast_to(targets[:, :, None], dep_g.shape) & later_masked].any()
  assert not np.diagonal(dep_g, axis1=1, axis2=2)[targets].any()  # g_i never sees x_i
  assert not dep_g[:, ~second][:, :, second].any()  # first half never sees the second half
  assert np.diagonal(dep_h, axis1=1, axis2=2).all()  # h_i does see x_i
  # Exactly the graph reachability of the masks over the layers (g: Q C^{L-1}; h: C^L).
  c, q = x["content_mask"], x["query_mask"]
  assert (dep_h == bool_power(c, model.layers)).all()
  reach_g = np.einsum("dij,djk->dik", q.astype(np.int32), bool_power(c, model.layers - 1).astype(np.int32)) > 0
  assert (dep_g == reach_g).all()


def test_information_flow_reachability_many_draws():
  """§5 flow rules as graph reachability over 4 layers and DRAWS random masks."""
  t, layers = 24, 4
  objective = plm(num_predict=8, perm_size=6)
  batch = random_rows(jax.random.PRNGKey(20), DRAWS, t, func_rate=0.1)
  x = features(objective, batch, jax.random.PRNGKey(21))
  c, q = x["content_mask"], x["query_mask"]
  reach_g = np.einsum("dij,djk->dik", q.astype(np.int32), bool_power(c, layers - 1).astype(np.int32)) > 0
  reach_h = bool_power(c, layers)
  targets, z, func = x["targets"], x["z"], x["is_func"]
  second = np.arange(t) >= 12
  same_half = second[:, None] == second[None, :]
  later_masked = (targets | func)[:, None, :] & (z[:, None, :] >= z[:, :, None]) & same_half[None]
  assert not reach_g[np.broadcast_to(targets[:, :, None], reach_g.shape) & later_masked].any()
  assert not reach_g[:, ~second][:, :, second].any()
  assert np.diagonal(reach_h, axis1=1, axis2=2).all()
  # And the targets do see every non-masked token of their half.
  nonmask = ~targets & ~func
  sees = reach_g[np.broadcast_to(targets[:, :, None], reach_g.shape) & nonmask[:, None, :] & same_half[None]]
  assert sees.all()


def test_loss_end_to_end_and_padded_prediction_rows():
  model = FakeXLNet()
  params = model.init(jax.random.PRNGKey(0))["params"]
  objective = plm(perm_size=8)
  batch = random_rows(jax.random.PRNGKey(22), 4, 32, func_rate=0.1)
  rng = jax.random.PRNGKey(23)

  loss_fn = jax.jit(lambda p, batch: objective.loss(model, p, batch, rng, train=True))
  (loss, metrics) = loss_fn(params, batch)
  assert np.isfinite(loss) and set(metrics) >= {"loss", "accuracy", "num_tokens"}
  assert float(metrics["num_tokens"]) == 4 * 5  # round(32/6) = 5

  x = jax.jit(objective.features)(batch, rng)
  extra = 7
  padded = dict(x)
  padded["target_mapping"] = jnp.pad(x["target_mapping"], ((0, 0), (0, extra), (0, 0)))
  padded["target_ids"] = jnp.concatenate([x["target_ids"], jnp.full((4, extra), 17, jnp.int32)], 1)
  padded["target_mask"] = jnp.pad(x["target_mask"], ((0, 0), (0, extra)))

  @jax.jit
  def value_and_grad(features):
    return jax.value_and_grad(lambda p: objective.loss_on_features(model, p, features, rng, train=False)[0])(params)

  (l1, g1), (l2, g2) = value_and_grad(x), value_and_grad(padded)
  np.testing.assert_allclose(l1, l2, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_padding_tokens_do_not_matter():
  model = FakeXLNet()
  params = model.init(jax.random.PRNGKey(0))["params"]
  objective = plm(perm_size=8)
  batch = random_rows(jax.random.PRNGKey(24), 4, 32, pad_from=22)
  changed = dict(batch, tokens=jnp.where(batch["segment_ids"] > 0, batch["tokens"], 40))
  loss_fn = jax.jit(lambda batch: objective.loss(model, params, batch, jax.random.PRNGKey(25), train=False)[0])
  assert float(loss_fn(batch)) == float(loss_fn(changed))


@pytest.mark.slow  # long: make test-slow runs it
def test_real_xlnet_model():
  """The objective drives the `xlnet` family; query logits never depend on their own token's embedding."""
  xlnet = pytest.importorskip("tfx.models.xlnet")
  import flax.linen as nn

  from tests.conftest import tiny_config
  from tfx.nn.layers import ModelConfig

  t, b = 32, 2
  cfg = tiny_config("--config.model.family=xlnet", "--config.model.dropout=0.0")
  model = xlnet.XLNet(ModelConfig.from_config(cfg.model, vocab_size=VOCAB, max_length=t))
  variables = model.init(jax.random.PRNGKey(0), **xlnet.XLNet.init_inputs(b, t))
  params = nn.unbox(variables["params"])
  objective = plm(perm_size=8)
  batch = random_rows(jax.random.PRNGKey(1), b, t, func_rate=0.1)
  rng = jax.random.PRNGKey(2)
  loss, metrics = jax.jit(lambda p: objective.loss(model, p, batch, rng, train=False))(params)
  assert np.isfinite(loss) and float(metrics["num_tokens"]) == b * 5

  x = features(objective, batch, jax.random.PRNGKey(3))
  perturb = jnp.zeros(nn.unbox(variables["perturbations"])["embeddings"].shape)

  def slot_logits(delta):  # [b, n] summed logits of each prediction slot
    logits, _ = model.apply(
        {"params": params, "perturbations": {"embeddings": delta}}, x["tokens"], x["token_types"],
        x["content_mask"], x["query_mask"], x["target_mapping"], None, None, train=False)
    return logits.sum(-1)

  jac = np.asarray(jax.jit(jax.jacrev(slot_logits))(perturb))  # [b, n, b, t, e]
  dep = np.stack([np.any(jac[r, :, r] != 0, axis=-1) for r in range(b)])  # [b, n, t]
  where = x["target_mapping"].argmax(-1)  # [b, n]
  for r in range(b):
    for m in np.flatnonzero(x["target_mask"][r]):
      i = where[r, m]
      later = (x["targets"][r] | x["is_func"][r]) & (x["z"][r] >= x["z"][r, i]) & ((np.arange(t) >= 16) == (i >= 16))
      assert not dep[r, m, i] and not dep[r, m, later].any()
      if i < 16:
        assert not dep[r, m, 16:].any()
      assert dep[r, m].any()


# ----------------------------------------------------------------------------- XLNet row layout, bi_data


def test_xlnet_row_layout():
  """[reuse, A, SEP, B, SEP, CLS] from raw stream rows: A follows the reuse part, B continues A
  or is a contiguous stretch of another row of the same group, token types 0/1/2."""
  b, raw, reuse = 256, 29, 12
  t, n = raw + 3, raw - reuse
  tokens = 9 + jnp.arange(b * raw, dtype=jnp.int32).reshape(b, raw)  # every raw token unique
  segment_ids = jnp.ones((b, raw), jnp.int32)
  rows = jax.jit(lambda k: xlnet_rows(tokens, segment_ids, k, reuse_len=reuse, sep=IDS.sep, cls=IDS.cls,
                                      pad=IDS.pad, groups=2))(jax.random.PRNGKey(30))
  rows = {k: np.asarray(v) for k, v in rows.items()}
  raw_np = np.asarray(tokens)
  continued = 0
  for r in range(b):
    x, types = rows["tokens"][r], rows["token_types"][r]
    seps = np.flatnonzero(x == IDS.sep)
    assert len(seps) == 2 and seps[1] == t - 2 and x[t - 1] == IDS.cls
    a_end = seps[0]
    assert reuse + 1 <= a_end <= reuse + n - 1  # 1 <= len(A) <= n - 1
    np.testing.assert_array_equal(x[:a_end], raw_np[r, :a_end])  # reuse part, then A
    b_part = x[a_end + 1:t - 2]
    assert len(b_part) == n - (a_end - reuse)
    if (b_part == raw_np[r, a_end:raw]).all():
      continued += 1
    else:  # random B: a contiguous stretch of one other row, in the same half of the batch
      source = (b_part[0] - 9) // raw
      assert source != r and (source < b // 2) == (r < b // 2)
      np.testing.assert_array_equal(np.diff(b_part), 1)
      assert (b_part[-1] - 9) // raw == source
    np.testing.assert_array_equal(types, np.where(np.arange(t) <= a_end, 0, np.where(np.arange(t) == t - 1, 2, 1)))
    np.testing.assert_array_equal(np.flatnonzero(rows["is_func"][r]), [a_end, t - 2, t - 1])
  assert (rows["segment_ids"] == 1).all()
  assert abs(continued / b - 0.5) < 4 * np.sqrt(0.25 / b)
  # Padding stays padding (segment 0, pad id); a row without text has no real SEP/CLS either.
  padded = jnp.where(jnp.arange(raw) < 20, segment_ids, 0).at[0].set(0)
  rows = xlnet_rows(tokens, padded, jax.random.PRNGKey(31), reuse_len=reuse, sep=IDS.sep, cls=IDS.cls, pad=IDS.pad,
                    random_b_rate=0.0)
  real, x = np.asarray(rows["segment_ids"]) > 0, np.asarray(rows["tokens"])
  assert not real[0].any() and (x[~real & ~np.asarray(rows["is_func"])] == IDS.pad).all()
  assert real[1:, -1].all() and (real[1:, :20]).all()


def test_xlnet_layout_features():
  objective = PermutationLM(IDS, perm_size=8)
  raw = objective.raw_length(32)
  batch = random_rows(jax.random.PRNGKey(32), 64, raw, func_rate=0.0)
  x = features(objective, batch, jax.random.PRNGKey(33))
  assert x["tokens"].shape == (64, 32) and objective.lengths(32) == (5, 16, 8)
  assert not (x["targets"] & x["is_func"]).any()
  assert (x["target_mask"].sum(1) == 5).all()
  assert set(np.unique(x["token_types"])) == {0, 1, 2}
  np.testing.assert_array_equal(x["positions"], np.broadcast_to(np.arange(32), (64, 32)))
  # The row is one text: without padding, a non-target sees every non-target of its half.
  nonmask = ~x["targets"] & ~x["is_func"]
  half = np.arange(32) >= 16
  both = nonmask[:, :, None] & nonmask[:, None, :] & (half[:, None] == half[None, :])[None]
  assert x["query_mask"][both].all()
  with pytest.raises(ValueError, match="reuse_len"):
    PermutationLM(IDS, reuse_len=28, perm_size=4).features(random_rows(jax.random.PRNGKey(0), 2, 29), jax.random.PRNGKey(0))


def test_word_spans_start_at_word_starts():
  word_start = np.zeros(VOCAB, bool)
  word_start[9::3] = True  # every third ordinary id starts a word
  objective = plm(num_predict=12, perm_size=8, word_spans=True, target_mode="span")
  with pytest.raises(ValueError, match="with_word_start"):
    objective.features(random_rows(jax.random.PRNGKey(0), 2, 48), jax.random.PRNGKey(0))
  objective = objective.with_word_start(word_start)
  assert objective.needs_word_start()
  batch = random_rows(jax.random.PRNGKey(34), 256, 48, func_rate=0.0)

  def start_rate(objective):  # fraction of targets that open a run of targets and start a word
    x = features(objective, batch, jax.random.PRNGKey(35))
    first = x["targets"] & ~np.pad(x["targets"][:, :-1], ((0, 0), (1, 0)))
    return word_start[x["tokens"]][first].mean()

  # The span sampler itself is tested in test_spans_avoid_func_and_padding; here the objective
  # must hand it the word starts of its tokens (the random fill-up singles are never aligned).
  assert start_rate(objective) > start_rate(plm(num_predict=12, perm_size=8)) + 0.15


class SignSpy(FakeXLNet):
  """FakeXLNet that records the bi_sign it is given."""

  def apply(self, variables, tokens, token_types, content_mask, query_mask, target_mapping, mems, bi_sign, **kw):
    self.seen.append(bi_sign)
    return super().apply(variables, tokens, token_types, content_mask, query_mask, target_mapping, mems, None, **kw)


def test_bi_data_signs_reach_the_model():
  model = SignSpy()
  object.__setattr__(model, "seen", [])
  params = model.init(jax.random.PRNGKey(0))["params"]
  objective = plm(perm_size=8, bi_data=True)
  assert objective.reversed_streams()
  batch = random_rows(jax.random.PRNGKey(36), 6, 32)

  def sign_seen(train):  # traced (op by op the loss takes seconds); the sign is static
    jax.jit(lambda p, b: objective.loss(model, p, b, jax.random.PRNGKey(37), train=train))(params, batch)
    return model.seen[-1]

  seen = [sign_seen(True), sign_seen(False)]
  assert len(model.seen) == 2
  assert seen[0] == xlnet_nn.HALVES  # the first half forward, the second reversed
  np.testing.assert_array_equal(xlnet_nn.encoding_signs(seen[0], 6, per_row=True), [1, 1, 1, -1, -1, -1])
  np.testing.assert_array_equal(xlnet_nn.encoding_signs(seen[0], 6), [1, -1])  # one encoding per half
  assert seen[1] is None  # eval batches are forward text


def test_reversed_row_with_negated_distances_equals_forward_row():
  """The point of bi_data's sign flip: an xlnet model given a row reversed (tokens, types, masks,
  targets) with bi_sign = -1 computes exactly what it computes on the forward row with +1."""
  xlnet = pytest.importorskip("tfx.models.xlnet")
  import flax.linen as nn

  from tests.conftest import tiny_config
  from tfx.nn.layers import ModelConfig

  t, b = 32, 4
  # A large init makes the position term matter (at 0.02 it moves logits by ~1e-5).
  cfg = tiny_config("--config.model.family=xlnet", "--config.model.dropout=0.0", "--config.model.init_std=0.3")
  model = xlnet.XLNet(ModelConfig.from_config(cfg.model, vocab_size=VOCAB, max_length=t))
  params = nn.unbox(model.init(jax.random.PRNGKey(0), **xlnet.XLNet.init_inputs(b, t))["params"])
  objective = PermutationLM(IDS, perm_size=8)
  x = features(objective, random_rows(jax.random.PRNGKey(38), b, t - 3), jax.random.PRNGKey(39))
  flip = lambda a, axes: np.flip(a, axes)
  rev = {"tokens": flip(x["tokens"], 1), "token_types": flip(x["token_types"], 1),
         "content_mask": flip(x["content_mask"], (1, 2)), "query_mask": flip(x["query_mask"], (1, 2)),
         "target_mapping": flip(x["target_mapping"], 2)}

  def logits(y, sign):
    out, _ = model.apply({"params": params}, y["tokens"], y["token_types"], y["content_mask"], y["query_mask"],
                         y["target_mapping"], None, jnp.full((b,), sign, jnp.float32))
    return np.asarray(out)

  forward = logits(x, 1.0)
  flipped = np.abs(logits(rev, -1.0) - forward).max()
  unflipped = np.abs(logits(rev, 1.0) - forward).max()  # without the flip, direction matters
  assert flipped < 1e-4 * np.abs(forward).max() and unflipped > 1e3 * flipped, (flipped, unflipped)
