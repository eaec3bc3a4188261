"""ELECTRA replaced-token detection (tfx/objectives/electra.py) and the objective-owned parameters
it introduced (Objective.init_params, params["objective"])."""

import dataclasses
import math
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import ROOT, train_and_resume
from tfx.config import load_config
from tfx.models import build_model
from tfx.objectives import OBJECTIVE_PARAMS, placeholder_ids, split_params
from tfx.objectives.electra import Electra, generator_config
from tfx.registry import OBJECTIVES

SEQ = 32


def _setup(**fields):
  """The tiny config's model, an Electra objective, params (with the objective's) and a packed batch."""
  from tfx import parallel, steps

  c = load_config(os.path.join(ROOT, "configs", "electra_tiny.py"), [f"--config.data.seq_len={SEQ}"])
  ids = placeholder_ids(512)
  objective = Electra(ids=ids, **fields)
  model = build_model(c.model, vocab_size=512, max_length=SEQ)
  tx, _ = steps.make_optimizer(c)
  mesh = parallel.make_mesh(c.mesh, jax.devices()[:1])
  _, shardings = steps.state_shardings(model, tx, mesh, SEQ, objective)
  state = steps.init_state(model, tx, mesh, SEQ, 0, shardings, objective)
  rng = np.random.default_rng(0)
  tokens = rng.integers(7, 400, size=(4, SEQ)).astype(np.int32)
  segment_ids = np.ones((4, SEQ), np.int32)
  segment_ids[1, SEQ // 2:] = 2
  segment_ids[3, SEQ // 3:] = 0  # padding
  tokens[segment_ids == 0] = ids.pad
  positions = np.concatenate([np.arange(SEQ)[None]] * 4).astype(np.int32)
  positions[1, SEQ // 2:] -= SEQ // 2
  batch = {"tokens": tokens, "segment_ids": segment_ids, "positions": positions}
  return objective, model, state, shardings, batch


def test_registered_with_the_papers_defaults():
  cls = OBJECTIVES.get("electra")
  opts = {o.name: o for o in cls.options()}
  assert opts["rtd_weight"].default == 50.0 and opts["mask_rate"].default == 0.15
  assert opts["mask_token_rate"].default == 0.85 and opts["random_token_rate"].default == 0.0
  assert all(o.doc for o in opts.values())
  base = load_config(os.path.join(ROOT, "configs", "electra_base.py"))
  m = generator_config(build_model(base.model, vocab_size=30522, max_length=512).cfg, base.objective.generator_size)
  assert (m.num_layers, m.d_model, m.num_heads, m.d_ff, m.head_dim) == (12, 256, 4, 1024, 64)  # a third of BERT base


def test_objective_params_are_initialised_sharded_and_in_the_state():
  objective, model, state, shardings, _ = _setup()
  model_part, own = split_params(state.params)
  assert set(own) == {"generator", "discriminator_head"}
  assert "token_embed" in model_part and OBJECTIVE_PARAMS not in model_part
  # The generator has no token table of its own: it shares the discriminator's [v, d] one.
  shapes = [x.shape for x in jax.tree.leaves(own["generator"])]
  assert (512, 16) not in shapes and (512, 64) not in shapes
  assert own["generator"]["embed_project"]["kernel"].shape == (64, 16)
  # Logical axis names like the model's: the boxed init carries them, the shardings follow.
  from tfx import steps

  boxed = jax.eval_shape(steps._init_fn(model, steps.make_optimizer(load_config(
      os.path.join(ROOT, "configs", "electra_tiny.py")))[0], SEQ, objective), jax.random.key(0))
  kernel = boxed.params[OBJECTIVE_PARAMS]["generator"]["embed_project"]["kernel"]
  assert isinstance(kernel, nn.LogicallyPartitioned) and kernel.names == ("embed", "mlp")
  assert isinstance(shardings.params[OBJECTIVE_PARAMS]["generator"]["embed_project"]["kernel"],
                    jax.sharding.NamedSharding)
  # The optimizer state covers them too.
  assert any(OBJECTIVE_PARAMS in str(p) for p, _ in jax.tree_util.tree_leaves_with_path(state.opt_state))


@pytest.mark.parametrize("fields", [{"mask_rate": 0.5}, {"mask_rate": 0.5, "max_predictions": 24}],
                         ids=["every_position", "gathered"])
def test_replaced_labels_are_exactly_where_the_sample_differs(fields):
  """At every position, and with the generator at 24 gathered slots (its samples scattered back)."""
  objective, model, state, _, batch = _setup(**fields)
  out, gen_logits, disc_logits = jax.jit(lambda p, b: objective._forward(model, p, b, jax.random.key(3), train=False))(
      state.params, batch)
  out = jax.device_get(out)
  tokens, real = batch["tokens"], batch["segment_ids"] > 0
  selected = out["selected"] > 0
  assert selected.sum() > 10 and not selected[~real].any()
  np.testing.assert_array_equal(out["corrupted"], np.where(selected, out["sampled"], tokens))
  np.testing.assert_array_equal(out["replaced"], (out["corrupted"] != tokens) & real)
  # Some samples hit the original token (then labelled original), most do not (a random generator).
  assert 0 < (selected & ~out["replaced"]).sum() < selected.sum() or (selected & ~out["replaced"]).sum() == 0
  assert out["replaced"].sum() > 0 and not out["replaced"][~selected].any()
  slots = objective.generator_slots(SEQ) or SEQ
  assert slots == fields.get("max_predictions", SEQ) and (selected.sum(axis=1) <= slots).all()
  assert gen_logits.shape == (4, slots, 512) and disc_logits.shape == (4, SEQ)


def test_the_gathered_generator_gives_the_dense_mlm_loss_and_gradients():
  """With `gather_predictions` (the default) the generator's last layer, head and sampling run at
  the selected tokens' 16 slots only. Its MLM loss (which no sample enters) and every gradient
  of it equal those of the generator at every position under the same key (the same selection:
  the cap applies to both)."""
  gathered, model, state, _, batch = _setup()
  dense = dataclasses.replace(gathered, gather_predictions=False)
  assert gathered.generator_slots(SEQ) == 16 and dense.generator_slots(SEQ) is None
  key = jax.random.key(5)

  def mlm(objective):
    loss = lambda p: objective.loss(model, p, batch, key, train=False)[1]["mlm_loss"]
    return jax.jit(jax.value_and_grad(loss))(state.params)

  (loss_g, grads_g), (loss_d, grads_d) = mlm(gathered), mlm(dense)
  np.testing.assert_allclose(float(loss_g), float(loss_d), rtol=1e-6)
  scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(grads_d))  # (some leaves are 0 up to rounding)
  close = lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6 * scale)
  jax.tree.map(close, grads_g, grads_d)
  assert float(jnp.max(jnp.abs(grads_g[OBJECTIVE_PARAMS]["generator"]["head_dense"]["kernel"]))) > 0
  # The count has the last layer, head and vocabulary projection at the slots (tests/test_bench.py
  # checks it against XLA's).
  cfg = model.cfg
  assert gathered.train_flops_per_row(cfg, SEQ) < dense.train_flops_per_row(cfg, SEQ)


def test_sample_follows_the_generator_and_the_key():
  """The samples are the generator's softmax draws: over many keys, the empirical frequency of
  each sampled id at a position follows softmax(logits / temperature)."""
  from tfx.objectives.electra import sample_rows

  logits = jnp.asarray(np.random.default_rng(1).normal(size=(1, 1, 6)) * 2, jnp.float32)
  draws = jax.vmap(lambda k: sample_rows(k, logits, 2.0))(jax.random.split(jax.random.key(0), 20000))[:, 0, 0]
  freq = np.bincount(np.asarray(draws), minlength=6) / 20000
  np.testing.assert_allclose(freq, jax.nn.softmax(logits[0, 0] / 2.0), atol=0.015)
  assert not np.array_equal(sample_rows(jax.random.key(1), logits.repeat(8, 1), 1.0),
                            sample_rows(jax.random.key(2), logits.repeat(8, 1), 1.0))


def test_loss_is_mlm_plus_lambda_rtd_and_no_gradient_through_the_sample():
  objective, model, state, _, batch = _setup()
  key = jax.random.key(5)
  metric = lambda name: lambda p: objective.loss(model, p, batch, key, train=False)[1][name]

  @jax.jit  # one compilation for the loss, the forward pass and the two gradients below
  def evaluate(p):
    return (objective.loss(model, p, batch, key, train=False), objective._forward(model, p, batch, key, train=False),
            jax.grad(metric("rtd_loss"))(p), jax.grad(metric("mlm_loss"))(p))

  (loss, m), (out, _, disc_logits), g_rtd, g_mlm = evaluate(state.params)
  np.testing.assert_allclose(float(loss), float(m["mlm_loss"]) + 50.0 * float(m["rtd_loss"]), rtol=1e-6)
  # Independent discriminator loss: numpy sigmoid cross-entropy over real tokens.
  z, y, w = np.asarray(disc_logits, np.float64), np.asarray(out["replaced"], np.float64), batch["segment_ids"] > 0
  bce = np.maximum(z, 0) - z * y + np.log1p(np.exp(-np.abs(z)))
  np.testing.assert_allclose(float(m["rtd_loss"]), bce[w].mean(), rtol=1e-5)
  assert float(m["num_tokens"]) == w.sum()

  # The discriminator's loss sends no gradient into the generator (it only sees the sample) ...
  assert all(float(jnp.max(jnp.abs(x))) == 0.0 for x in jax.tree.leaves(g_rtd[OBJECTIVE_PARAMS]["generator"]))
  assert float(jnp.max(jnp.abs(g_rtd[OBJECTIVE_PARAMS]["discriminator_head"]["out"]["kernel"]))) > 0
  # ... and the generator's MLM loss reaches the shared token embeddings and the generator.
  assert float(jnp.max(jnp.abs(g_mlm["token_embed"]["embedding"]))) > 0
  assert float(jnp.max(jnp.abs(g_mlm[OBJECTIVE_PARAMS]["generator"]["head_dense"]["kernel"]))) > 0
  assert all(float(jnp.max(jnp.abs(x))) == 0.0
             for x in jax.tree.leaves(g_mlm[OBJECTIVE_PARAMS]["discriminator_head"]))
  assert abs(objective.initial_loss(512) - (math.log(512) + 50 * math.log(2))) < 1e-9


@pytest.mark.parametrize("bad, message", [({"generator_size": 0.0}, "generator_size"),
                                          ({"mask_rate": 1.5}, "mask_rate")])
def test_bad_fields_are_refused(bad, message):
  with pytest.raises(ValueError, match=message):
    Electra(ids=placeholder_ids(512), **bad)


@pytest.mark.slow
def test_electra_tiny_trains_resumes_exactly_and_exports_the_discriminator(tmp_path, shared_tokenizer):
  """configs/electra_tiny.py through tfx.train.run: 4 steps in one go equal 2 + stop + 2 resumed
  (metrics and every parameter, the generator's included); restore_params (fine-tuning, export)
  gives the discriminator without the objective's parameters, and tfx.convert --to-hf writes it."""
  from tfx import train
  from tfx.convert.run import _load_params
  from tfx.runs import load_trained

  overrides = [f"--config.data.tokenizer={shared_tokenizer}", "--config.data.max_documents=40",
               "--config.train.steps=4", "--config.train.log_every=1", "--config.train.eval_every=2",
               "--config.train.checkpoint_every=2", "--config.model.dropout=0.1", "--config.data.eval_batches=1"]
  config = lambda *extra: load_config(os.path.join(ROOT, "configs", "electra_tiny.py"), [*overrides, *extra])
  full, _, records = train_and_resume(config, tmp_path)
  final = jax.device_get(full["state"].params)
  part = tmp_path / "part"
  train_rows = [r for r in records if r["split"] == "train"]
  assert all(np.isfinite(r["loss"]) and "rtd_loss" in r for r in train_rows)
  assert abs(train_rows[0]["loss"] - (math.log(1000) + 50 * math.log(2))) < 2.0

  _, _, _, params = load_trained(str(part))
  assert OBJECTIVE_PARAMS not in params
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(params), split_params(final)[0])
  _, exported, _ = _load_params(str(part), None)
  assert OBJECTIVE_PARAMS not in exported

  # Fine-tuning from the ELECTRA run starts from the discriminator.
  from tfx import finetune
  from tfx.metrics import Progress

  smoke = ["finetune.stdlib_classes=4", "finetune.max_train_examples=40", "finetune.max_eval_examples=40",
           "finetune.steps=1", "finetune.batch_size=8", "finetune.max_length=32", "finetune.init=pretrained"]
  setup = finetune.build(None, str(part), "stdlib:package", str(tmp_path / "ft"), smoke)
  exp = setup.exp
  _, shardings = train.state_shardings(exp.model, exp.tx, exp.mesh, setup.length)
  state, _, book = finetune._initial_state(setup, shardings, finetune._copier(exp, shardings), Progress(1))
  assert book["pretrained_step"] == 4
  backbone = jax.device_get(state.params["backbone"])
  for name in ("token_embed", "encoder", "embed_norm"):
    jax.tree.map(np.testing.assert_array_equal, backbone[name], split_params(final)[0][name])


def test_a_bf16_generator_hands_the_loss_its_bf16_logits():
  """In bf16 the generator's logits stay bf16 (the loss reads them in float32 and writes their
  gradient in one bf16 pass, `ops.losses.log_z_and_target`) and its masked-LM loss is exactly the
  loss of the same logits cast to float32 first (what it returned before)."""
  from tfx import ops
  from tfx.objectives.electra import Generator

  objective, model, state, _, batch = _setup()
  cfg = dataclasses.replace(generator_config(model.cfg, objective.generator_size), dtype="bfloat16")
  params = split_params(state.params)[1]["generator"]
  table = split_params(state.params)[0]["token_embed"]["embedding"]
  embedded = jnp.asarray(np.random.default_rng(2).normal(size=(4, SEQ, model.cfg.d_model)), jnp.bfloat16)
  logits = Generator(cfg, model.cfg.d_model).apply({"params": params}, embedded, jnp.asarray(batch["segment_ids"]),
                                                   jnp.asarray(batch["positions"]), table)
  assert logits.dtype == jnp.bfloat16 and logits.shape == (4, SEQ, 512)
  weights = jnp.asarray(batch["segment_ids"] > 0, jnp.float32)
  got, _ = ops.weighted_cross_entropy(logits, jnp.asarray(batch["tokens"]), weights)
  want, _ = ops.weighted_cross_entropy(logits.astype(jnp.float32), jnp.asarray(batch["tokens"]), weights)
  assert float(got) == float(want) and np.isfinite(float(got))
