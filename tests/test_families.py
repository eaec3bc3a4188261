"""Encoder and encoder-decoder families: information flow, packing isolation, variants."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import tiny_config
from tfx import ops
from tfx.models import ClassifierHead, build_model

VOCAB = 97
BERT = ("--config.model.family=encoder", "--config.model.norm=post", "--config.model.embed_norm=true",
        "--config.model.type_vocab_size=2", "--config.model.mlp=gelu_exact")
T5 = ("--config.model.family=encoder_decoder", "--config.model.position=relative", "--config.model.norm_type=rmsnorm",
      "--config.model.use_bias=false", "--config.model.mlp=geglu", "--config.model.scale_attention=false",
      "--config.model.tie_embeddings=false")
VASWANI = ("--config.model.family=encoder_decoder", "--config.model.position=sinusoidal", "--config.model.norm=post",
           "--config.model.embed_scale=true", "--config.model.scan_layers=false", "--config.model.num_decoder_layers=3")


def make(*overrides, length=16):
  cfg = tiny_config("--config.model.d_model=32", "--config.model.d_ff=64", *overrides)
  model = build_model(cfg.model, vocab_size=VOCAB, max_length=length)
  variables = model.init(jax.random.key(0), **type(model).init_inputs(1, length))
  return model, nn.unbox(variables["params"])


def packed(lengths, total, seed=0):
  rng = np.random.default_rng(seed)
  tokens, seg, pos = (np.zeros(total, np.int32) for _ in range(3))
  start = 0
  for i, n in enumerate(lengths):
    tokens[start:start + n] = rng.integers(3, VOCAB, n)
    seg[start:start + n] = i + 1
    pos[start:start + n] = np.arange(n)
    start += n
  return tokens[None], seg[None], pos[None]


def zero_perturbations(model, inputs):  # (from the shapes alone: an op-by-op init takes seconds)
  return jax.tree.map(jnp.zeros_like, jax.eval_shape(model.init, jax.random.key(0), **inputs)["perturbations"])


@pytest.mark.parametrize("variant", [BERT, ("--config.model.family=encoder", "--config.model.position=rotary"),
                                     ("--config.model.family=encoder", "--config.model.position=relative")])
def test_encoder_sees_its_whole_document_and_nothing_else(variant):
  model, params = make(*variant)
  tokens, seg, pos = packed([5, 7, 2], 16)  # 2 padding tokens
  inputs = dict(tokens=tokens, segment_ids=seg, positions=pos)
  eps0 = zero_perturbations(model, inputs)

  @jax.jit
  def jacobian(eps):
    f = lambda e: model.apply({"params": params, "perturbations": e}, tokens, seg, pos)[0].sum(-1)  # [t]
    return jax.jacrev(f)(eps)["embeddings"][:, 0]  # [t, t, e]

  influence = np.abs(np.asarray(jacobian(eps0))).sum(-1)  # [t (logits), t (inputs)]
  for i in range(14):
    for j in range(16):
      same = seg[0, j] == seg[0, i]
      assert (influence[i, j] > 0) == bool(same), (variant, i, j)


@pytest.mark.parametrize("variant", [T5, VASWANI])
def test_encoder_decoder_information_flow(variant):
  """Decoder position i depends on decoder inputs j <= i of its own document and on the encoder
  tokens of its own document only; the encoder never crosses documents."""
  model, params = make(*variant)
  enc_tokens, enc_seg, enc_pos = packed([6, 8], 16, seed=1)  # 2 padding tokens
  dec_tokens, dec_seg, dec_pos = packed([4, 5], 12, seed=2)  # 3 padding tokens
  inputs = dict(encoder_tokens=enc_tokens, encoder_segment_ids=enc_seg, encoder_positions=enc_pos,
                decoder_tokens=dec_tokens, decoder_segment_ids=dec_seg, decoder_positions=dec_pos)
  eps0 = zero_perturbations(model, inputs)

  @jax.jit
  def jacobians(eps):
    def f(e):
      return model.apply({"params": params, "perturbations": e}, **inputs)[0].sum(-1)  # [t]
    jac = jax.jacrev(f)(eps)
    return jac["decoder_embeddings"][:, 0], jac["encoder_embeddings"][:, 0]

  dec_jac, enc_jac = (np.abs(np.asarray(j)).sum(-1) for j in jacobians(eps0))  # [t, t] and [t, s]
  for i in range(9):
    for j in range(12):
      allowed = j <= i and dec_seg[0, j] == dec_seg[0, i]
      assert (dec_jac[i, j] > 0) == bool(allowed), ("decoder", i, j)
    for j in range(16):
      assert (enc_jac[i, j] > 0) == bool(enc_seg[0, j] == dec_seg[0, i]), ("cross", i, j)

  w = jnp.asarray(np.random.default_rng(0).normal(size=32), jnp.float32)  # a random read-out: a plain
  # sum over features of a layer-normed output is constant and would hide all dependence
  encoded = lambda e: model.apply({"params": params, "perturbations": e}, enc_tokens, enc_seg, enc_pos)[0] @ w
  enc_only = np.abs(np.asarray(jax.jit(jax.jacrev(encoded))(eps0)["encoder_embeddings"][:, 0])).sum(-1)  # [s, s]
  for i in range(14):
    for j in range(16):
      assert (enc_only[i, j] > 0) == bool(enc_seg[0, j] == enc_seg[0, i]), ("encoder", i, j)


def test_encoder_packed_equals_unpacked():
  model, params = make(*BERT, length=24)
  tokens, seg, pos = packed([6, 9, 5], 24, seed=3)
  full = np.asarray(model.apply({"params": params}, tokens, seg, pos))
  start = 0
  for d, n in enumerate([6, 9, 5]):
    alone = np.zeros((1, 24), np.int32)
    alone[0, :n] = tokens[0, start:start + n]
    alone_seg = (np.arange(24) < n).astype(np.int32)[None]
    alone_pos = np.where(alone_seg > 0, np.arange(24), 0).astype(np.int32)
    out = np.asarray(model.apply({"params": params}, alone, alone_seg, alone_pos))
    np.testing.assert_allclose(full[0, start:start + n], out[0, :n], atol=1e-5)
    start += n


def t5_bucket_reference(relative, bidirectional, num_buckets=32, max_distance=128):
  """Scalar port of the T5 bucketing rule, written from its description."""
  bucket = 0
  if bidirectional:
    num_buckets //= 2
    if relative > 0:
      bucket += num_buckets
    n = abs(relative)
  else:
    n = max(-relative, 0)
  max_exact = num_buckets // 2
  if n < max_exact:
    return bucket + n
  large = max_exact + int(math.log(n / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact))
  return bucket + min(large, num_buckets - 1)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_relative_buckets(bidirectional):
  rel = np.arange(-300, 301)
  got = np.asarray(ops.t5_relative_buckets(jnp.asarray(rel), bidirectional=bidirectional))
  want = [t5_bucket_reference(int(r), bidirectional) for r in rel]
  np.testing.assert_array_equal(got, want)
  assert got.min() >= 0 and got.max() <= 31


def test_classifier_head_pooling():
  model, params = make(*BERT)
  tokens, seg, pos = packed([10], 16)
  hidden = model.apply({"params": params}, tokens, seg, pos, return_hidden=True)
  assert hidden.shape == (1, 16, 32)
  for pooling in ("first", "mean"):
    head = ClassifierHead(num_classes=3, pooling=pooling)
    hp = head.init(jax.random.key(1), hidden, seg)
    logits = head.apply(hp, hidden, seg)
    assert logits.shape == (1, 3)
    # Padding does not change the mean-pooled prediction.
    noisy = hidden.at[:, 10:].set(100.0)
    same = head.apply(hp, noisy, seg)
    if pooling == "mean":
      np.testing.assert_allclose(np.asarray(same), np.asarray(logits), atol=1e-5)


@pytest.mark.parametrize("variant", [T5, VASWANI])
def test_seq2seq_kv_cache_decoding_equals_recomputation(variant):
  from tfx.generate import generate_seq2seq, greedy_seq2seq_by_recomputation

  cfg = tiny_config("--config.model.d_model=32", "--config.model.d_ff=64", "--config.model.init_std=0.3", *variant)
  model = build_model(cfg.model, vocab_size=VOCAB, max_length=16)
  params = nn.unbox(model.init(jax.random.key(0), **type(model).init_inputs(1, 16))["params"])
  enc, seg, _ = packed([9], 12, seed=5)
  enc = np.concatenate([enc, packed([12], 12, seed=6)[0]])
  seg = np.concatenate([seg, np.ones((1, 12), np.int32)])
  cached = generate_seq2seq(model, params, jnp.asarray(enc), jnp.asarray(seg), jax.random.key(0), max_new_tokens=10,
                            start_id=0)
  reference = greedy_seq2seq_by_recomputation(model, params, jnp.asarray(enc), jnp.asarray(seg), 10, start_id=0)
  np.testing.assert_array_equal(np.asarray(cached), np.asarray(reference))
  assert len(np.unique(np.asarray(cached))) > 3  # a real sequence, not one repeated token


@pytest.mark.parametrize("variant, final", [(T5, True), (VASWANI, False)])
def test_encoder_decoder_drops_a_stacks_output_only_after_a_final_norm(variant, final):
  """In training, dropout runs on the embeddings, every sublayer's output and the MLP's hidden
  layer, and on each stack's output only after its final norm: T5's pre-LN stacks drop there, a
  post-LN stack (Vaswani's, BART's) ends at its last layer's norm."""
  from tfx.nn.layers import Dropout

  model, params = make(*variant, "--config.model.dropout=0.1", "--config.model.scan_layers=false")
  tokens, seg, pos = packed([6, 8], 16, seed=1)
  dropped = []

  def spy(next_fun, args, kwargs, context):
    if isinstance(context.module, Dropout) and context.method_name == "__call__" and context.module.rate > 0:
      dropped.append("/".join(context.module.scope.path))
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(spy):
    model.apply({"params": params}, tokens, seg, pos, tokens, seg, pos, train=True, rngs={"dropout": jax.random.key(1)})
  top = [path for path in dropped if "/" not in path]  # the family's own: embeddings, stack outputs
  assert len(top) == (4 if final else 2), dropped
  layers = model.cfg.num_layers + model.cfg.decoder_layers
  assert len(dropped) - len(top) == 3 * layers + model.cfg.decoder_layers  # attention, MLP (+ its hidden), cross
