"""Numerical parity with Hugging Face transformers (PyTorch), through tfx.convert.

Small randomly initialised HF models (no downloads) are saved with `save_pretrained`, imported
with `tfx.convert.from_hf`, and run on the same padded batch: tfx in float32 against the HF model
run in float64, so that the reference does not depend on which CPU kernels torch picks on the
machine at hand (AVX2, AVX-512, oneDNN). Logits on the real positions must agree to `TOL` of their
largest magnitude, a twentieth of the gap that exact-instead-of-tanh GELU or a
wrong norm epsilon opens (`test_gpt2` checks that it does); the loss must match; `to_hf` then
`from_hf` must give back the same parameters, and the exported directory must load in HF and give
the original logits.

Needs `pip install torch==2.13.0 transformers` (`make test-parity`); skipped without them.
"""

import copy
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from tfx import convert, ops  # noqa: E402
from tfx.models import build_model  # noqa: E402

VOCAB, D, HEADS, LAYERS, FF, MAXPOS = 128, 64, 4, 2, 128, 32
LENGTHS = (16, 11, 5)  # real tokens per row; rows are padded on the right to 16
RTOL = 1e-4  # losses
TOL = 1e-5  # logits: max |ours - reference| / max |reference| on the real positions
RESULTS: dict[str, float] = {}  # that error per model, printed at the end

torch.set_float32_matmul_precision("highest")
jax.config.update("jax_default_matmul_precision", "highest")


def _perturb(model: "torch.nn.Module", seed: int) -> None:
  """Adds noise to every parameter, so that norm scales/biases and all biases are non-trivial and
  activations are large enough for exact vs tanh GELU, scales and offsets to matter."""
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for p in model.parameters():
      p.add_(torch.randn(p.shape, generator=g) * 0.05)


def _batch(seed: int, pad_id: int, low: int = 3):
  rng = np.random.default_rng(seed)
  t = max(LENGTHS)
  mask = np.arange(t)[None, :] < np.array(LENGTHS)[:, None]  # [b, t]
  tokens = np.where(mask, rng.integers(low, VOCAB, (len(LENGTHS), t)), pad_id).astype(np.int64)
  return tokens, mask


def _save(model, tmp_path, name: str) -> str:
  path = os.path.join(str(tmp_path), name)
  model.save_pretrained(path)
  return path


def _tfx_model(config):
  return build_model(config.model, vocab_size=config.data.vocab_size, max_length=config.data.seq_len)


def _reference(hf_model, **inputs) -> np.ndarray:
  """The HF model's logits computed in float64 on a copy (the float32 model is left as it is)."""
  model = copy.deepcopy(hf_model).double()
  with torch.no_grad():
    return model(**inputs).logits.numpy()


def _rel_error(ours, reference, mask: np.ndarray) -> float:
  a, b = np.asarray(ours, np.float64)[mask], np.asarray(reference, np.float64)[mask]
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _assert_close(ours, reference, mask: np.ndarray, tol: float, what: str) -> None:
  rel = _rel_error(ours, reference, mask)
  assert rel <= tol, f"{what}: max |difference| is {rel:.2e} of the largest logit, above {tol:.0e}"


def _compare(name: str, ours, reference, mask: np.ndarray) -> None:
  RESULTS[name] = max(_rel_error(ours, reference, mask), RESULTS.get(name, 0.0))
  _assert_close(ours, reference, mask, TOL, name)


def _mlm_labels(tokens: np.ndarray, mask: np.ndarray, seed: int) -> np.ndarray:
  rng = np.random.default_rng(seed)
  picked = mask & (rng.random(tokens.shape) < 0.3)
  picked[0, 0] = True
  return np.where(picked, tokens, -100)


def _tfx_loss(logits, labels: np.ndarray) -> float:
  loss, _ = ops.weighted_cross_entropy(jnp.asarray(logits), jnp.asarray(np.maximum(labels, 0)),
                                       jnp.asarray(labels >= 0, jnp.float32))
  return float(loss)


def _check_roundtrip(config, params, tmp_path, hf_cls, hf_model, hf_inputs, mask, name: str) -> None:
  """to_hf -> from_hf is the identity; the exported dir loads in HF with the same logits (up to
  float rounding: RoBERTa's token-type row is folded into the position table on import)."""
  out = os.path.join(str(tmp_path), "exported")
  convert.to_hf(config, params, out)
  config2, params2 = convert.from_hf(out)
  for field in convert.MODEL_FIELDS:
    assert config2.model[field] == config.model[field], field
  assert config2.data.seq_len == config.data.seq_len and config2.data.vocab_size == config.data.vocab_size
  flat1, flat2 = convert._flatten(params), convert._flatten(params2)
  assert flat1.keys() == flat2.keys()
  for k in flat1:
    np.testing.assert_array_equal(flat1[k], flat2[k], err_msg=k)
  reloaded = hf_cls.from_pretrained(out).eval()
  with torch.no_grad():
    want = hf_model(**hf_inputs).logits.numpy()
    got = reloaded(**hf_inputs).logits.numpy()
  _assert_close(got, want, mask, TOL, f"{name} exported")


# ============================================================================ encoders


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_masked_lm(kind, tied, tmp_path):
  common = dict(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                intermediate_size=FF, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                initializer_range=0.1, tie_word_embeddings=tied)
  if kind == "bert":
    hf_cls, hf_cfg, pad = transformers.BertForMaskedLM, transformers.BertConfig(
        max_position_embeddings=MAXPOS, type_vocab_size=2, **common), 0
  else:
    hf_cls, hf_cfg, pad = transformers.RobertaForMaskedLM, transformers.RobertaConfig(
        max_position_embeddings=MAXPOS + 2, type_vocab_size=1, pad_token_id=1, **common), 1
  torch.manual_seed(0)
  hf = hf_cls(hf_cfg).eval()
  _perturb(hf, 1)
  config, params = convert.from_hf(_save(hf, tmp_path, kind))
  assert config.model.family == "encoder" and config.data.seq_len == MAXPOS
  assert config.model.mlp == "gelu_exact" and config.model.norm_eps == 1e-12
  assert config.model.type_vocab_size == (2 if kind == "bert" else 0)  # RoBERTa's single row is folded
  assert config.model.tie_embeddings == tied and ("lm_head" in params) == (not tied)
  name = f"{kind} {'tied' if tied else 'untied'}"

  tokens, mask = _batch(2, pad)
  types = np.where(np.arange(tokens.shape[1])[None] >= 6, 1, 0) * mask if kind == "bert" else np.zeros_like(tokens)
  labels = _mlm_labels(tokens, mask, 3)
  inputs = dict(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64)))
  if kind == "bert":
    inputs["token_type_ids"] = torch.tensor(types)
  with torch.no_grad():
    out = hf(**inputs, labels=torch.tensor(labels))

  seg = mask.astype(np.int32)
  positions = (np.arange(tokens.shape[1])[None] * seg).astype(np.int32)
  model = _tfx_model(config)
  logits = model.apply({"params": params}, jnp.asarray(tokens, jnp.int32), jnp.asarray(seg), jnp.asarray(positions),
                       token_types=jnp.asarray(types, jnp.int32) if kind == "bert" else None)
  _compare(name, logits, _reference(hf, **inputs), mask)
  np.testing.assert_allclose(_tfx_loss(logits, labels), float(out.loss), rtol=RTOL)

  # Scanned and unrolled imports agree.
  config_u, params_u = convert.from_hf(os.path.join(str(tmp_path), kind), scan_layers=False)
  logits_u = _tfx_model(config_u).apply({"params": params_u}, jnp.asarray(tokens, jnp.int32), jnp.asarray(seg),
                                        jnp.asarray(positions),
                                        token_types=jnp.asarray(types, jnp.int32) if kind == "bert" else None)
  _assert_close(logits_u, logits, mask, 1e-6, f"{kind} unrolled vs scanned")

  _check_roundtrip(config, params, tmp_path, hf_cls, hf, inputs, mask, name)


# ============================================================================ GPT-2


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_gpt2(tied, tmp_path):
  hf_cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=D, n_layer=LAYERS, n_head=HEADS, n_positions=MAXPOS,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.1,
                                   bos_token_id=0, eos_token_id=0, tie_word_embeddings=tied)
  torch.manual_seed(0)
  hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
  _perturb(hf, 1)
  config, params = convert.from_hf(_save(hf, tmp_path, "gpt2"))
  assert config.model.family == "decoder" and config.model.mlp == "gelu" and config.model.norm_eps == 1e-5
  assert config.model.d_ff == 4 * D and config.data.seq_len == MAXPOS
  assert config.model.tie_embeddings == tied and ("lm_head" in params) == (not tied)
  name = f"gpt2 {'tied' if tied else 'untied'}"

  tokens, mask = _batch(4, 0)
  t = tokens.shape[1]
  inputs = dict(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64)),
                position_ids=torch.arange(t)[None].repeat(len(LENGTHS), 1))
  want = _reference(hf, **inputs)
  seg = mask.astype(np.int32)
  positions = (np.arange(t)[None] * seg).astype(np.int32)

  def run(cfg):
    return _tfx_model(cfg).apply({"params": params}, jnp.asarray(tokens, jnp.int32), jnp.asarray(seg),
                                 jnp.asarray(positions))

  _compare(name, run(config), want, mask)

  # The tolerance sees a real mistake: the same weights with exact GELU (GPT-2 uses the tanh form)
  # or BERT's norm epsilon miss by several times TOL.
  for field, wrong_value in (("mlp", "gelu_exact"), ("norm_eps", 1e-12)):
    wrong = copy.deepcopy(config)
    wrong.model[field] = wrong_value
    gap = _rel_error(run(wrong), want, mask)
    assert gap > 3 * TOL, f"{field}={wrong_value} is only {gap:.2e} off: the test could not see it"

  _check_roundtrip(config, params, tmp_path, transformers.GPT2LMHeadModel, hf, inputs, mask, name)


# ============================================================================ T5


@pytest.mark.parametrize("version", ["v1_0", "v1_1", "v1_1_wide_heads"])
def test_t5(version, tmp_path):
  # wide heads: num_heads * d_kv != d_model (4 x 24 on 64), as t5-v1_1-small (6 x 64 on 512).
  d_kv = 24 if version == "v1_1_wide_heads" else D // HEADS
  kw = dict(vocab_size=VOCAB, d_model=D, d_kv=d_kv, d_ff=FF, num_layers=LAYERS, num_decoder_layers=LAYERS,
            num_heads=HEADS, relative_attention_num_buckets=8, relative_attention_max_distance=20,
            dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
  if version == "v1_0":
    hf_cfg = transformers.T5Config(feed_forward_proj="relu", **kw)
  else:
    hf_cfg = transformers.T5Config(feed_forward_proj="gated-gelu", tie_word_embeddings=False, **kw)
  torch.manual_seed(0)
  hf = transformers.T5ForConditionalGeneration(hf_cfg).eval()
  if version != "v1_0" and hf.lm_head.weight is hf.shared.weight:
    # transformers 5 builds every T5 tied; a v1.1 checkpoint has its own output projection.
    hf.lm_head.weight = torch.nn.Parameter(torch.randn(VOCAB, D) * 0.05)
  _perturb(hf, 1)
  config, params = convert.from_hf(_save(hf, tmp_path, f"t5_{version}"))
  m = config.model
  assert m.family == "encoder_decoder" and m.norm_type == "rmsnorm" and not m.use_bias and not m.scale_attention
  if version == "v1_0":
    assert m.mlp == "relu" and m.tie_embeddings and m.scale_tied_logits
  else:
    assert m.mlp == "geglu" and not m.tie_embeddings and "lm_head" in params
  assert m.head_dim == (24 if version == "v1_1_wide_heads" else 0)

  enc_tokens, enc_mask = _batch(5, 0)
  rng = np.random.default_rng(6)
  dec_lengths = np.array([9, 16, 3])
  t = 16
  dec_mask = np.arange(t)[None] < dec_lengths[:, None]
  labels = np.where(dec_mask, rng.integers(2, VOCAB, (3, t)), -100)
  shifted = np.concatenate([np.zeros((3, 1), np.int64), np.where(labels < 0, 0, labels)[:, :-1]], axis=1)
  inputs = dict(input_ids=torch.tensor(enc_tokens), attention_mask=torch.tensor(enc_mask.astype(np.int64)),
                decoder_input_ids=torch.tensor(shifted))
  want = _reference(hf, **inputs)
  with torch.no_grad():
    hf_loss = float(hf(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                       labels=torch.tensor(labels)).loss)

  enc_seg, dec_seg = enc_mask.astype(np.int32), dec_mask.astype(np.int32)
  enc_pos = (np.arange(enc_tokens.shape[1])[None] * enc_seg).astype(np.int32)
  dec_pos = (np.arange(t)[None] * dec_seg).astype(np.int32)
  logits = _tfx_model(config).apply(
      {"params": params}, jnp.asarray(enc_tokens, jnp.int32), jnp.asarray(enc_seg), jnp.asarray(enc_pos),
      jnp.asarray(shifted, jnp.int32), jnp.asarray(dec_seg), jnp.asarray(dec_pos))
  _compare(f"t5_{version}", logits, want, dec_mask)
  np.testing.assert_allclose(_tfx_loss(logits, labels), hf_loss, rtol=RTOL)

  _check_roundtrip(config, params, tmp_path, transformers.T5ForConditionalGeneration, hf, inputs, dec_mask,
                   f"t5_{version}")


# ============================================================================ errors and summary


def test_unsupported_and_missing(tmp_path):
  with pytest.raises(convert.ConvertError, match="config.json"):
    convert.from_hf(str(tmp_path))
  (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "model_type": "llama"}')
  with pytest.raises(convert.ConvertError, match="unsupported architecture"):
    convert.from_hf(str(tmp_path))
  (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "n_layer": 1, "n_embd": 8, '
                                        '"n_head": 2, "vocab_size": 10}')
  with pytest.raises(convert.ConvertError, match="model.safetensors"):
    convert.from_hf(str(tmp_path))


def test_zz_report():
  """Prints the max relative logit error of each model (run with -s to see it)."""
  for name, rel in sorted(RESULTS.items()):
    print(f"parity {name}: max relative error {rel:.2e}")


def test_cli_import_checkpoint_and_export(tmp_path):
  """--from-hf writes a step-0 checkpoint that restores to the imported params; --to-hf exports it."""
  from tfx.convert import _load_params, main

  hf_cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=16,
                                   bos_token_id=0, eos_token_id=0)
  torch.manual_seed(0)
  hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
  src = _save(hf, tmp_path, "gpt2")
  run = str(tmp_path / "run")
  main(["--from-hf", src, "--workdir", run])
  assert {"config.json", "config.py", "checkpoints"} <= set(os.listdir(run))
  config, params, _ = _load_params(run, None)
  _, want = convert.from_hf(src)
  got, want = convert._flatten(jax.device_get(params)), convert._flatten(want)
  assert got.keys() == want.keys()
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  out = str(tmp_path / "out")
  main(["--to-hf", out, "--workdir", run])
  reloaded = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
  ids = torch.tensor([[3, 4, 5, 6]])
  with torch.no_grad():
    np.testing.assert_allclose(reloaded(ids).logits.numpy(), hf(ids).logits.numpy(), rtol=1e-6, atol=1e-6)


def test_t5_tokenizer_gets_sentinels_at_hf_ids(tmp_path):
  """A T5 spiece.model (no sentinels) is extended to the embedding rows with <extra_id_k> where
  HF's T5 tokenizer puts them (extra_id_0 = pieces + 99)."""
  import io

  import sentencepiece as spm

  from tfx.data import Tokenizer

  text = ["the quick brown fox jumps over the lazy dog", "a stitch in time saves nine"] * 50
  buf = io.BytesIO()
  spm.SentencePieceTrainer.train(sentence_iterator=iter(text), model_writer=buf, vocab_size=30,
                                 model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1, minloglevel=2)
  path = tmp_path / "spiece.model"
  path.write_bytes(buf.getvalue())
  tok = Tokenizer(convert.t5_tokenizer_proto(str(path), 30 + 100 + 28))
  assert tok.vocab_size == 158
  assert tok.sentinel_ids[0] == 30 + 99 and tok.sentinel_ids[99] == 30 and len(tok.sentinel_ids) == 100
  assert 129 in list(tok.encode(["<extra_id_0>"])[0])  # one piece (after T5's dummy-prefix "▁")
