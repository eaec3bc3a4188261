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
