"""Leak and sanity checker for any objective, built-in or user-written.

    python -m tfx.check_objective --config configs/bert_tiny.py
    python -m tfx.check_objective --config configs/tiny.py --config.objective.name=my_objective.py:MyObjective

For each model family the objective drives, on a tiny random model (2 layers, d_model 64) and a
synthetic batch of packed documents, on the CPU:

- information flow: every prediction (`Objective.predictions`) is recomputed with each raw token
  replaced, one at a time, by another ordinary token (same word-start flag, so that whole-word and
  word-span sampling do not move), with the objective's key fixed. A prediction whose logits change
  when its own token changes leaks its target (unless the objective declares that it shows it, as
  BERT's kept 10% do); one that changes with a token it may not see (`Predictions.visible`: later
  tokens of the factorization order, later targets) or with a token of another document is
  reported too. Perturbation rather than Jacobians: the objectives' inputs are integer ids built by
  integer ops (masks, gathers, sentinels), which have no gradient, and an exact comparison of the
  logits catches a dependency of any size. The check fails as vacuous if no prediction depends on
  any token. It runs under several keys (a leak may show in some rows for some keys only), and
  special tokens (EOS) are replaced too, compared where the masks did not move.
- the loss is what was checked: loss(train=False) equals `Objective.loss_from_predictions` of the
  predictions (by default their weighted cross entropy), and loss(train=True) equals
  loss(train=False) with dropout off, unless `Objective.train_differs` says why not;
- padding: filling every padding position (segment 0) with random ids changes neither the loss nor
  the gradients (bitwise), and padding rows make no prediction;
- the loss jit-compiles with static shapes and no host callback; the same key gives the same loss
  bitwise; different keys give different masks; the loss of a random model is near the objective's
  `initial_loss` (ln vocabulary for token prediction);
- with T5 relative positions: the loss is the same with the bias from column offsets (the default,
  model.relative_distance='columns') and from the objective's position ids;
- mesh invariance: the loss is the same on 1 device and on 8 devices as a (2, 2, 2) mesh.

It prints a table (check, result, the first offending row and position) and exits 1 on any failure.
The 8-device check needs XLA_FLAGS=--xla_force_host_platform_device_count=8, which the command sets
itself when it starts jax.
"""

import dataclasses
import os
import sys
from typing import Any, Callable

_DEVICES = 8
if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_DEVICES}")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402

from tfx import config as config_lib, parallel  # noqa: E402
from tfx.errors import UserError  # noqa: E402
from tfx.objectives.base import Objective, Predictions, SpecialIds, family_matches, placeholder_ids  # noqa: E402

VOCAB = 512
BATCH = 4  # rows: packed documents, one document cut at the row end, half a row of padding (synthetic_batch)
FLOW_KEYS = (7, 8, 9)  # the information-flow check runs under each: a leak may show for some keys only
CALLBACKS = ("callback", "outside_call", "host_call")


@dataclasses.dataclass
class Result:
  """One row of the report: ok None = skipped (the detail says why)."""

  family: str
  check: str
  ok: bool | None
  detail: str = ""


# ----------------------------------------------------------------------------- set-up


def tiny_config(config: ml_collections.ConfigDict, family: str) -> ml_collections.ConfigDict:
  """The config with a tiny float32 model of `family` and no dropout (objective settings unchanged)."""
  c = ml_collections.ConfigDict(config.to_dict())
  m = c.model
  m.family = family
  m.num_layers, m.num_decoder_layers, m.d_model, m.num_heads, m.head_dim, m.d_ff = 2, 0, 64, 4, 0, 128
  m.dropout, m.attention_dropout, m.dtype, m.remat = 0.0, 0.0, "float32", "none"
  if m.get("attention", "auto") in ("auto", "cudnn", "pallas", "splash"):
    m.attention = "xla"
  if family == "xlnet" and m.get("mem_len", 0):
    m.mem_len = min(m.mem_len, 16)
  c.data.vocab_size = VOCAB
  c.train.batch_size, c.train.grad_accum = BATCH, 1
  if family != config.model.family:  # another family the objective drives: its own position / memory options
    if m.position == "relative" and family != "encoder_decoder":
      m.position = "learned"
    if family != "xlnet":
      m.mem_len = 0
  return c


def synthetic_word_start(ids: SpecialIds, rng: np.random.Generator) -> np.ndarray:
  """bool [v]: about 70% of the ordinary ids start a word; special ids always do."""
  start = rng.random(ids.vocab_size) < 0.7
  start[list(_special(ids))] = True
  return start


def _special(ids: SpecialIds) -> set[int]:
  named = (ids.pad, ids.eos, ids.bos, ids.unk, ids.mask, ids.cls, ids.sep)
  return {i for i in (*ids.special, *ids.sentinels, *named) if i is not None}


def synthetic_batch(ids: SpecialIds, raw_length: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
  """[BATCH, raw_length] rows as the packer makes them: row 0 full with 2 documents and row 2 with
  3, each ending in EOS; row 1 one document filling the row and cut at its end (no EOS, as the
  packer leaves a document longer than a row: its first and last tokens are ordinary); row 3 half
  full with 2 documents, then padding. `segment_ids` (0 = padding) and `positions`."""
  ordinary = np.array(sorted(set(range(ids.vocab_size)) - _special(ids)), np.int32)
  tokens = np.full((BATCH, raw_length), ids.pad, np.int32)
  segments = np.zeros((BATCH, raw_length), np.int32)
  positions = np.zeros((BATCH, raw_length), np.int32)
  for row, (documents, end) in enumerate([(2, raw_length), (1, raw_length), (3, raw_length),
                                          (2, raw_length // 2)][:BATCH]):
    cuts = sorted(rng.choice(np.arange(4, end - 3), size=min(documents - 1, max(end - 7, 0)), replace=False).tolist())
    bounds = [0, *cuts, end]
    for doc, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]), start=1):
      tokens[row, a:b] = rng.choice(ordinary, size=b - a)
      if documents > 1:
        tokens[row, b - 1] = ids.eos
      segments[row, a:b] = doc
      positions[row, a:b] = np.arange(b - a)
  return {"tokens": tokens, "segment_ids": segments, "positions": positions}


@dataclasses.dataclass
class Setup:
  config: ml_collections.ConfigDict
  objective: Any
  model: Any
  params: Any
  batch: dict[str, np.ndarray]
  ids: SpecialIds
  word_start: np.ndarray
  state: Any
  mesh: Any
  frozen: Any = None  # the objective's frozen inputs (a teacher), with frozen_inputs
  jitted: dict = dataclasses.field(default_factory=dict)  # (train, with_state) -> the jitted loss (_loss)


def build(config: ml_collections.ConfigDict, family: str, seed: int = 0, devices=None,
          mesh_shape: tuple[int, int, int] = (1, 1, 1)) -> Setup:
  """The objective, a tiny random model of `family` and a synthetic batch, on a mesh of `devices`
  (default: the first device) shaped (data, fsdp, tensor) = `mesh_shape`."""
  from tfx import train
  from tfx.models import build_model

  c = tiny_config(config, family)
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = mesh_shape
  rng = np.random.default_rng(seed)
  ids = placeholder_ids(VOCAB)
  objective = config_lib.objective_class(c.objective.name).from_config(c.objective, ids)
  word_start = synthetic_word_start(ids, rng)
  if objective.needs_word_start():
    objective = objective.with_word_start(tuple(bool(x) for x in word_start))
  seq_len = c.data.seq_len
  model = build_model(c.model, vocab_size=VOCAB, max_length=seq_len)
  mesh = parallel.make_mesh(c.mesh, devices or jax.devices()[:1])
  tx, _ = train.make_optimizer(c)
  _, shardings = train.state_shardings(model, tx, mesh, seq_len, objective, BATCH)
  state = train.init_state(model, tx, mesh, seq_len, seed, shardings, objective, BATCH)
  batch = synthetic_batch(ids, objective.raw_length(seq_len), rng)
  frozen = objective.load_frozen(model, mesh) if objective.frozen_inputs else None
  return Setup(c, objective, model, state.params, batch, ids, word_start, state.objective_state, mesh, frozen)


def _extra(s: Setup) -> dict[str, Any]:
  """The keyword arguments of the objective's loss beyond (model, params, batch, rng, train)."""
  from tfx.steps import objective_kwargs

  return objective_kwargs(s.objective, s.state, s.frozen)


def _loss(s: Setup, train: bool = True, with_state: bool = True) -> Callable:
  """The objective's loss (params, batch, key) -> (value, metrics), jitted once per Setup and
  setting, so that the checks that evaluate it share one compilation. `with_state=False` starts a
  stateful objective from an empty state, as predictions() does."""
  with_state = with_state and s.objective.stateful
  if (train, with_state) not in s.jitted:
    extra = {k: v for k, v in _extra(s).items() if with_state or k != "state"}
    s.jitted[train, with_state] = jax.jit(
        lambda params, batch, key: s.objective.loss(s.model, params, batch, key, train=train, **extra))
  return s.jitted[train, with_state]


# ----------------------------------------------------------------------------- checks


def check_compiles(s: Setup) -> list[Result]:
  """Static shapes under jit, no host callback, the same key gives the same loss bitwise."""
  fam, loss = s.config.model.family, _loss(s)
  key = jax.random.key(1)
  try:
    jaxpr = jax.make_jaxpr(loss)(s.params, s.batch, key)
  except Exception as e:  # noqa: BLE001 — any trace failure is the finding
    return [Result(fam, "jit (static shapes)", False, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")]
  found = sorted({p for p in _primitives(jaxpr.jaxpr) if any(c in p for c in CALLBACKS)})
  out = [Result(fam, "jit (static shapes)", True, "traced and compiled"),
         Result(fam, "no host callback", not found, ", ".join(found) or "none in the jaxpr")]
  a, b = jax.device_get(loss(s.params, s.batch, key)), jax.device_get(loss(s.params, s.batch, key))
  same = np.array_equal(np.asarray(a[0]), np.asarray(b[0]))
  detail = f"{float(a[0]):.7g}" + ("" if same else f" vs {float(b[0]):.7g}")
  out.append(Result(fam, "same key, same loss", same, detail))
  return out


def _primitives(jaxpr) -> set[str]:
  names = set()
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    for value in eqn.params.values():
      for sub in value if isinstance(value, (list, tuple)) else (value,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          names |= _primitives(inner)
  return names


def check_keys_and_initial_loss(s: Setup, predict: Callable) -> list[Result]:
  fam = s.config.model.family
  out = []
  if s.objective.uses_rng:
    a, b = predict(s.params, s.batch, jax.random.key(1)), predict(s.params, s.batch, jax.random.key(2))
    differ = any(not np.array_equal(np.asarray(x), np.asarray(y)) for x, y in
                 zip(_mask_fields(a), _mask_fields(b)))
    out.append(Result(fam, "different keys, different masks", differ,
                      "weights / sources / visibility differ" if differ else "keys 1 and 2 predict the same tokens "
                      "from the same context: the masks ignore the key"))
  else:
    out.append(Result(fam, "different keys, different masks", None, "deterministic objective (uses_rng = False)"))
  value, _ = _loss(s)(s.params, s.batch, jax.random.key(3))
  expected = s.objective.initial_loss(VOCAB)
  ok = abs(float(value) - expected) <= 0.1 * expected
  out.append(Result(fam, "initial loss near expected", ok, f"{float(value):.4f} vs {expected:.4f}"
                    + ("" if ok else " (more than 10% off: are the logits scaled, or the targets wrong?)")))
  return out


def _mask_fields(p: Predictions) -> list:
  return [x for x in (p.weights, p.source, p.sees_self, p.visible, p.targets) if x is not None]


def check_information_flow(s: Setup, predict: Callable) -> list[Result]:
  """Perturb each raw token, under each of FLOW_KEYS; report predictions that depend on what they
  may not see. An ordinary token is replaced by one of the same word-start flag (the masks stay
  put); a special one (an EOS) by any ordinary id, compared only where the masks did not move."""
  fam = s.config.model.family
  tokens, segments = s.batch["tokens"], s.batch["segment_ids"]
  raw = tokens.shape[1]
  ordinary = np.array(sorted(set(range(VOCAB)) - _special(s.ids)))
  rng = np.random.default_rng(11)
  flat_segment = segments.reshape(-1)
  findings = {"own token": None, "hidden token": None, "other document": None}
  counts = {k: 0 for k in findings}
  dependencies = checked = moved = 0
  for seed in FLOW_KEYS:
    key = jax.random.key(seed)
    base = jax.device_get(predict(s.params, s.batch, key))
    logits = np.asarray(base.logits)
    weights = np.asarray(base.weights) > 0  # [b, n]
    source = np.asarray(base.source)  # [b, n]
    sees_self = np.zeros_like(weights) if base.sees_self is None else np.asarray(base.sees_self)
    visible = None if base.visible is None else np.asarray(base.visible)  # [b, n, b * raw]
    checked += int(weights.sum())
    for q in np.flatnonzero(flat_segment > 0):
      row, col = divmod(int(q), raw)
      old = tokens[row, col]
      special = old not in ordinary
      pool = ordinary[ordinary != old] if special else ordinary[(s.word_start[ordinary] == s.word_start[old])
                                                                   & (ordinary != old)]
      perturbed = dict(s.batch, tokens=tokens.copy())
      perturbed["tokens"][row, col] = rng.choice(pool)
      out = jax.device_get(predict(s.params, perturbed, key))
      if special and not _same_layout(base, out):
        moved += 1  # the special token shaped the masks (a document or sentence end): not comparable
        continue
      changed = np.any(np.asarray(out.logits) != logits, axis=-1) & weights  # [b, n]
      dependencies += int(changed.sum())
      for r, m in zip(*np.nonzero(changed)):
        src = int(source[r, m])
        if src == q:
          kind = None if sees_self[r, m] else "own token"
        elif visible is not None:
          kind = None if visible[r, m, q] else ("other document" if _other_doc(src, q, r, raw, flat_segment)
                                                 else "hidden token")
        else:
          kind = "other document" if src < 0 or _other_doc(src, q, r, raw, flat_segment) else None
        if kind:
          counts[kind] += 1
          if findings[kind] is None:
            findings[kind] = (f"row {r} slot {m} (predicts raw position {_where(src, raw)}) changes with raw "
                              f"position {_where(int(q), raw)} under key {seed}")
  names = {"own token": "target hidden from its own prediction",
           "hidden token": "no hidden token seen (order, later targets)",
           "other document": "no prediction crosses a document"}
  skipped = f"; {moved} special-token changes moved the masks (not compared)" if moved else ""
  out = [Result(fam, names[k], counts[k] == 0, f"{counts[k]} dependencies; first: {findings[k]}" if counts[k] else
                f"{checked} predictions checked under {len(FLOW_KEYS)} keys{skipped}") for k in names]
  out.append(Result(fam, "predictions depend on the input", dependencies > 0,
                    f"{dependencies} (prediction, token) dependencies found" if dependencies else
                    "no prediction changed with any token: the information-flow checks above are vacuous"))
  return out


def _same_layout(a: Predictions, b: Predictions) -> bool:
  """Whether two predictions select the same slots from the same raw positions with the same visibility."""
  pairs = [(a.weights, b.weights), (a.source, b.source), (a.sees_self, b.sees_self), (a.visible, b.visible)]
  return all((x is None) == (y is None) and (x is None or np.array_equal(np.asarray(x), np.asarray(y)))
             for x, y in pairs)


def check_loss_is_predictions(s: Setup, predict: Callable) -> list[Result]:
  """The loss trains on what `predictions` shows: loss(train=False) equals the objective's
  `loss_from_predictions` of the predictions under the same key, and (dropout being off)
  loss(train=True) equals loss(train=False), unless the objective says why not (`train_differs`)."""
  fam = s.config.model.family
  key = jax.random.key(8)  # predictions run from no state
  outs = {train: jax.device_get(_loss(s, train, with_state=False)(s.params, s.batch, key)) for train in (False, True)}
  losses = {train: float(value) for train, (value, _) in outs.items()}
  expected = s.objective.loss_from_predictions(jax.device_get(predict(s.params, s.batch, key)))
  close = lambda a, b: abs(a - b) <= 1e-5 * max(abs(b), 1.0)
  if expected is None:
    out = [Result(fam, "loss computed from predictions()", None, "the objective's loss has other terms "
                  "(loss_from_predictions returns None)")]
  else:
    ok = close(losses[False], float(expected))
    out = [Result(fam, "loss computed from predictions()", ok, f"{losses[False]:.7g} vs {float(expected):.7g}" + (
        "" if ok else ": loss(train=False) is not computed from what predictions() shows, so the leak checks "
        "above did not see what trains"))]
  out += _loss_terms_results(s.objective, fam, losses[False], outs[False][1], close)
  reason = s.objective.train_differs()
  ok = close(losses[True], losses[False])
  if reason and not ok:
    out.append(Result(fam, "train loss = eval loss (no dropout)", None, reason))
  else:
    out.append(Result(fam, "train loss = eval loss (no dropout)", ok, f"{losses[True]:.7g} vs {losses[False]:.7g}"
                      + ("" if ok else ": loss(train=True) computes something else than the eval path that "
                         "predictions() shows; if that is by design, say why in train_differs()")))
  return out


def _loss_terms_results(objective, fam: str, loss: float, metrics: dict, close: Callable) -> list[Result]:
  """For a loss made of terms (`loss_terms`; none: no row): the loss is their weighted sum, and every
  mean and count named is a metric, which gradient accumulation and the aggregates rely on."""
  terms, counts = objective.loss_terms(), objective.metric_counts()
  if not terms:
    return []
  missing = sorted({*terms, *counts, *counts.values()} - set(metrics))
  if missing:
    return [Result(fam, "loss = sum of loss_terms()", False, "loss_terms / metric_counts name metrics the loss does "
                   f"not return: {', '.join(missing)}")]
  total = sum(weight * float(metrics[name]) for name, weight in terms.items())
  ok = close(loss, total)
  return [Result(fam, "loss = sum of loss_terms()", ok, f"{loss:.7g} vs {total:.7g}" + (
      "" if ok else ": the loss is not the weighted sum of its loss_terms(), so gradient accumulation would train "
      "another loss"))]


def _other_doc(src: int, q: int, row: int, raw: int, flat_segment: np.ndarray) -> bool:
  """Whether raw position q is outside the document of the prediction (its source's, or its row)."""
  if src < 0:
    return q // raw != row
  return q // raw != src // raw or flat_segment[q] != flat_segment[src]


def _where(flat: int, raw: int) -> str:
  return "none" if flat < 0 else f"(row {flat // raw}, {flat % raw})"


def check_padding(s: Setup, predict: Callable) -> list[Result]:
  """Random ids in every padding position change neither the loss nor the gradients, bitwise."""
  fam = s.config.model.family
  noisy = dict(s.batch, tokens=s.batch["tokens"].copy())
  pad = s.batch["segment_ids"] == 0
  noisy["tokens"][pad] = np.random.default_rng(5).integers(0, VOCAB, size=int(pad.sum()))
  grad_fn = jax.jit(jax.value_and_grad(lambda p, b, k: _loss(s)(p, b, k)[0]))
  key = jax.random.key(9)
  (l1, g1), (l2, g2) = jax.device_get(grad_fn(s.params, s.batch, key)), jax.device_get(grad_fn(s.params, noisy, key))
  grads_same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)))
  same = bool(np.array_equal(l1, l2)) and grads_same
  detail = "loss and gradients bitwise equal" if same else (
      f"loss {float(l1):.7g} -> {float(l2):.7g}" + ("" if grads_same else ", gradients differ"))
  base = jax.device_get(predict(s.params, s.batch, key))
  weights, source = np.asarray(base.weights) > 0, np.asarray(base.source)
  raw = s.batch["tokens"].shape[1]
  flat_segment = s.batch["segment_ids"].reshape(-1)
  bad = [(r, m) for r, m in zip(*np.nonzero(weights)) if source[r, m] >= 0 and flat_segment[source[r, m]] == 0]
  return [Result(fam, "padding changes nothing", same, detail),
          Result(fam, "padding is never predicted", not bad, f"row {bad[0][0]} slot {bad[0][1]} predicts padding at "
                 f"{_where(int(source[bad[0]]), raw)}" if bad else "no prediction of a padding position")]


def check_relative_distance(s: Setup) -> list[Result]:
  """With T5 relative positions, the loss is the same whether the bias is computed from column
  offsets (model.relative_distance='columns', the default: one bias per batch) or from the position
  ids the objective gives the model: i.e. its positions advance by one inside every segment."""
  fam, cfg = s.config.model.family, s.model.cfg
  if cfg.position != "relative":
    return []
  extra, key = _extra(s), jax.random.key(6)
  # bias tables of unit scale (a random init's 0.02 would hide a wrong geometry in rounding), placed
  # as the setup's own (the same input shardings: its compiled loss is reused)
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: jax.device_put(jax.random.normal(jax.random.key(7), x.shape, x.dtype), x.sharding)
      if "relative_bias" in jax.tree_util.keystr(path) else x, s.params)
  values = []
  for distance in ("columns", "positions"):
    if cfg.relative_distance == distance:
      loss = _loss(s)  # the setup's own model: its compiled loss
    else:
      model = s.model.clone(cfg=dataclasses.replace(cfg, relative_distance=distance))
      loss = jax.jit(lambda p, b, k, model=model: s.objective.loss(model, p, b, k, train=True, **extra))
    values.append(float(loss(params, s.batch, key)[0]))
  ok = abs(values[0] - values[1]) <= 1e-5 * max(abs(values[1]), 1.0)
  detail = f"{values[0]:.7g} vs {values[1]:.7g}" + ("" if ok else (
      ": the objective's positions skip inside a segment; set model.relative_distance=positions for it"))
  return [Result(fam, "relative bias: columns = positions", ok, detail)]


def check_mesh(s: Setup, seed: int) -> Result:
  """The loss on one device (the setup `s`) equals the loss on a (2, 2, 2) mesh of 8 devices."""
  family = s.config.model.family
  if jax.device_count() < _DEVICES:
    return Result(family, "mesh invariance 1 vs 2x2x2", None,
                  f"needs {_DEVICES} devices (XLA_FLAGS=--xla_force_host_platform_device_count={_DEVICES})")
  key = jax.random.key(4)
  values = [float(_loss(s)(s.params, s.batch, key)[0])]
  wide = build(s.config, family, seed, devices=jax.devices()[:_DEVICES], mesh_shape=(2, 2, 2))
  with parallel.context(wide.mesh):
    values.append(float(_loss(wide)(wide.params, parallel.global_batch(wide.batch, wide.mesh), key)[0]))
  ok = abs(values[0] - values[1]) <= 1e-5 * max(abs(values[0]), 1.0)
  return Result(family, "mesh invariance 1 vs 2x2x2", ok, f"{values[0]:.7g} vs {values[1]:.7g}")


# ----------------------------------------------------------------------------- driver


def check(config: ml_collections.ConfigDict, families: tuple[str, ...] = (), seed: int = 0) -> list[Result]:
  """Every check for every family the objective drives (or `families`)."""
  cls = config_lib.objective_class(config.objective.name)
  if not cls.families:
    raise UserError(f"objective {config.objective.name!r} declares no model families (`families = (...)`), "
                    "so nothing can be checked")
  families = families or tuple(cls.families)
  for family in families:
    if not family_matches(family, cls.families):
      raise UserError(f"objective {config.objective.name!r} does not drive family {family!r}; it drives "
                      f"{', '.join(cls.families)}")
  results = []
  for family in families:
    try:
      config_lib.validate(tiny_config(config, family), num_devices=1)
    except config_lib.ConfigError as e:
      results.append(Result(family, "config for this family", None, " ".join(str(e).split())[:200]))
      continue
    try:
      results += _check_family(config, cls, family, seed)
    except Exception as e:  # noqa: BLE001 — a user's objective that crashes is a finding, not a traceback
      results.append(Result(family, "checker ran", False, f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"))
  if all(r.check == "config for this family" for r in results):
    results.append(Result(",".join(families), "some family checked", False, "no family the objective drives could "
                          "be built from this config (see the rows above): nothing was checked"))
  return results


def _check_family(config, cls, family: str, seed: int) -> list[Result]:
  s = build(config, family, seed)
  if type(s.objective).predictions is Objective.predictions:
    return [Result(family, "predictions() implemented", False, "the objective does not implement predictions(), "
                   "so what it predicts from what cannot be checked"), *check_compiles(s)]
  frozen = {"frozen": s.frozen} if s.objective.frozen_inputs else {}
  predict = jax.jit(lambda p, b, k: s.objective.predictions(s.model, p, b, k, **frozen))
  return [*check_compiles(s), *check_keys_and_initial_loss(s, predict), *check_information_flow(s, predict),
          *check_loss_is_predictions(s, predict), *check_padding(s, predict), *check_relative_distance(s),
          check_mesh(s, seed)]


def table(results: list[Result]) -> str:
  rows = [("family", "check", "result", "detail")]
  rows += [(r.family, r.check, {True: "ok", False: "FAIL", None: "skip"}[r.ok], r.detail) for r in results]
  widths = [max(len(row[i]) for row in rows) for i in range(3)]
  lines = ["  ".join(row[i].ljust(widths[i]) for i in range(3)) + "  " + row[3] for row in rows]
  return "\n".join([lines[0], "-" * min(max(map(len, lines)), 120), *lines[1:]])


def main(argv: list[str] | None = None) -> None:
  import argparse

  parser = argparse.ArgumentParser(prog="python -m tfx.check_objective", description=__doc__.split("\n")[0])
  parser.add_argument("--config", required=True, help="config file whose objective is checked")
  parser.add_argument("--family", action="append", default=[], help="only this family (repeatable)")
  parser.add_argument("--seed", type=int, default=0)
  args, overrides = parser.parse_known_args(argv)
  try:
    config = config_lib.load_config(args.config, overrides)
    results = check(config, tuple(args.family), args.seed)
  except UserError as e:
    sys.exit(f"tfx.check_objective: {e}")
  print(f"objective {config.objective.name}: {sum(r.ok is True for r in results)} ok, "
        f"{sum(r.ok is False for r in results)} failed, {sum(r.ok is None for r in results)} skipped\n")
  print(table(results))
  if any(r.ok is False for r in results):
    sys.exit(1)


if __name__ == "__main__":
  main()
