"""Numerical parity of the `xlnet` family with HF `XLNetLMHeadModel`, through tfx.convert.from_hf.

A small randomly initialised HF model is saved with `save_pretrained`, imported, and both run
on the same tokens, token types, permutation masks and target mapping in float32; the query
stream's logits and the new memories must agree, first without memory, then with the memory
HF returned fed to both. HF's perm_mask (1 = cannot attend) becomes tfx's query mask
(True = may attend) and the content mask is the query mask plus the diagonal; memory columns
are always visible.

Export: a random tfx model (scanned or unrolled) written by tfx.convert.to_hf loads in HF with
the same logits and memories, and from_hf of the export gives back the same parameters bit for
bit.
"""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from tests.conftest import ROOT  # noqa: E402
from tfx import convert  # noqa: E402
from tfx.config import load_config  # noqa: E402
from tfx.models.xlnet import XLNet  # noqa: E402
from tfx.nn.layers import ModelConfig  # noqa: E402

VOCAB, D, HEADS, LAYERS, FF, MEM = 128, 64, 4, 2, 128, 8
B, T, N = 2, 12, 5
RTOL = 1e-4
RESULTS: dict[str, float] = {}


def _hf_model(untie_r: bool, clamp_len: int, seed: int, bi_data: bool = False):
  torch.manual_seed(seed)
  cfg = transformers.XLNetConfig(vocab_size=VOCAB, d_model=D, n_layer=LAYERS, n_head=HEADS, d_inner=FF,
                                 ff_activation="gelu", untie_r=untie_r, attn_type="bi", bi_data=bi_data,
                                 clamp_len=clamp_len, mem_len=MEM, dropout=0.0, use_mems_eval=True,
                                 use_mems_train=True, layer_norm_eps=1e-12)
  model = transformers.XLNetLMHeadModel(cfg).eval()
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for p in model.parameters():
      p.add_(torch.randn(p.shape, generator=g) * 0.05)
    if not untie_r:  # HF keeps the biases per layer; a tied model has the same ones everywhere
      for layer in model.transformer.layer[1:]:
        for name in ("r_w_bias", "r_r_bias", "r_s_bias"):
          getattr(layer.rel_attn, name).copy_(getattr(model.transformer.layer[0].rel_attn, name))
  return model


def _inputs(seed: int):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, VOCAB, (B, T))
  types = np.concatenate([np.zeros((B, T // 2), np.int64), np.ones((B, T - T // 2), np.int64)], axis=1)
  types[:, -1] = 2
  z = np.stack([rng.permutation(T) for _ in range(B)])  # factorization order ranks
  perm = (z[:, None, :] >= z[:, :, None]).astype(np.float32)  # [b, i, j]: 1 = i cannot see j
  mapping = np.zeros((B, N, T), np.float32)
  for b in range(B):
    pos = rng.choice(T, N - 1, replace=False)
    mapping[b, np.arange(N - 1), pos] = 1.0  # the last slot stays all-zero (padding)
  return tokens, types, perm, mapping


def _tfx_masks(perm: np.ndarray, mlen: int):
  query = perm == 0  # [b, t, t]
  content = query | np.eye(T, dtype=bool)[None]
  mem = np.ones((B, T, mlen), bool)
  return np.concatenate([mem, content], -1), np.concatenate([mem, query], -1)


def _rel(name: str, ours, theirs) -> None:
  a, b = np.asarray(ours), np.asarray(theirs)
  rel = float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
  RESULTS[name] = max(rel, RESULTS.get(name, 0.0))
  assert rel < RTOL, f"{name}: max relative error {rel:.2e}"


@pytest.mark.parametrize("untie_r,clamp_len,bi_data", [(True, -1, False), (False, -1, False), (True, 3, False),
                                                       (True, -1, True)])
def test_xlnet_lm_parity(tmp_path, untie_r: bool, clamp_len: int, bi_data: bool):
  hf = _hf_model(untie_r, clamp_len, seed=1 + int(untie_r) + max(clamp_len, 0) + 5 * bi_data, bi_data=bi_data)
  path = os.path.join(str(tmp_path), "xlnet")
  hf.save_pretrained(path)
  config, params = convert.from_hf(path)
  assert config.model.family == "xlnet" and config.objective.name == "permutation_lm"
  assert config.model.untie_r == untie_r and config.model.clamp_len == clamp_len
  assert config.model.mem_len == MEM and config.objective.bi_data == bi_data
  cfg = ModelConfig.from_config(config.model, vocab_size=config.data.vocab_size, max_length=config.data.seq_len)
  model = XLNet(cfg)
  params = jax.tree_util.tree_map(jnp.asarray, params)
  name = f"xlnet untie_r={untie_r} clamp_len={clamp_len} bi_data={bi_data}"
  # bi_data: HF uses +d for the first half of the batch and -d for the second.
  bi_sign = jnp.asarray([1.0] * (B // 2) + [-1.0] * (B - B // 2)) if bi_data else None

  mems_hf, mems_tfx = None, None
  for step in range(2):  # 0: no memory; 1: the memory from step 0 fed to both
    tokens, types, perm, mapping = _inputs(seed=10 + step)
    with torch.no_grad():
      out = hf(input_ids=torch.tensor(tokens), token_type_ids=torch.tensor(types),
               perm_mask=torch.tensor(perm), target_mapping=torch.tensor(mapping), mems=mems_hf, use_mems=True)
    mlen = 0 if mems_hf is None else MEM
    content, query = _tfx_masks(perm, mlen)
    logits, new_mems = model.apply({"params": params}, jnp.asarray(tokens), jnp.asarray(types),
                                   jnp.asarray(content), jnp.asarray(query), jnp.asarray(mapping), mems_tfx, bi_sign)
    assert logits.shape == (B, N, VOCAB) and new_mems.shape == (LAYERS, B, MEM, D)
    _rel(f"{name} logits", logits, out.logits.numpy())
    hf_mems = np.stack([m.numpy().transpose(1, 0, 2) for m in out.mems])  # [l, b, m, e]
    _rel(f"{name} mems", new_mems, hf_mems)
    mems_hf, mems_tfx = out.mems, jnp.asarray(hf_mems)


def _run_both(hf, model, params, bi_sign, name: str) -> None:
  """Two steps (no memory, then each side's own memory) on the same inputs: logits and new
  memories of HF and tfx must agree."""
  mems_hf, mems_tfx = None, None
  for step in range(2):
    tokens, types, perm, mapping = _inputs(seed=20 + step)
    with torch.no_grad():
      out = hf(input_ids=torch.tensor(tokens), token_type_ids=torch.tensor(types),
               perm_mask=torch.tensor(perm), target_mapping=torch.tensor(mapping), mems=mems_hf, use_mems=True)
    content, query = _tfx_masks(perm, 0 if mems_tfx is None else MEM)
    args = (params, jnp.asarray(tokens), jnp.asarray(types), jnp.asarray(content), jnp.asarray(query),
            jnp.asarray(mapping), mems_tfx, bi_sign)
    # Compiled at XLA backend level 0: ~2x faster than eager here, and float32 all the same.
    forward = jax.jit(lambda p, *x: model.apply({"params": p}, *x)).lower(*args).compile(
        {"xla_backend_optimization_level": 0})
    logits, new_mems = forward(*args)
    _rel(f"{name} logits", logits, out.logits.numpy())
    _rel(f"{name} mems", new_mems, np.stack([m.numpy().transpose(1, 0, 2) for m in out.mems]))
    mems_hf, mems_tfx = out.mems, new_mems


@pytest.mark.parametrize("scan_layers,untie_r,clamp_len,reuse_len,bi_data",
                         [(True, True, -1, 0, False), (False, False, 3, 10, True)])
def test_xlnet_export(tmp_path, scan_layers: bool, untie_r: bool, clamp_len: int, reuse_len: int, bi_data: bool):
  """A random tfx XLNet -> to_hf -> HF XLNetLMHeadModel: the same query-stream logits and memories;
  from_hf of the export is the identity on the parameters and the architecture fields."""
  config = load_config(os.path.join(ROOT, "configs", "xlnet_tiny.py"), [
      f"--config.data.vocab_size={VOCAB}", f"--config.model.scan_layers={scan_layers}",
      f"--config.model.untie_r={untie_r}", f"--config.model.clamp_len={clamp_len}", f"--config.model.mem_len={MEM}",
      f"--config.model.reuse_len={reuse_len}", f"--config.objective.bi_data={bi_data}", "--config.model.dropout=0.0",
      "--config.model.attention_dropout=0.0"])
  assert (config.model.d_model, config.model.num_layers, config.model.num_heads) == (D, LAYERS, HEADS)
  cfg = ModelConfig.from_config(config.model, vocab_size=VOCAB, max_length=config.data.seq_len)
  model = XLNet(cfg)
  shapes = jax.eval_shape(lambda: nn.unbox(model.init(jax.random.key(0), **XLNet.init_inputs(1, 4))["params"]))
  rng = np.random.default_rng(7)  # every tensor random (norm scales around 1, biases included)
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: (jax.tree_util.keystr(path).endswith("['scale']") + 0.05 * rng.standard_normal(x.shape))
      .astype(np.float32), shapes)
  assert ("layers" in params) == scan_layers and ("r_w_bias" in params) == (not untie_r)

  out = os.path.join(str(tmp_path), "exported")
  assert convert.to_hf(config, params, out) == convert.XLNET
  hf = transformers.XLNetLMHeadModel.from_pretrained(out).eval()
  assert hf.config.untie_r == untie_r and hf.config.mem_len == MEM and hf.config.bi_data == bi_data
  assert hf.config.reuse_len == (reuse_len or None) and hf.config.clamp_len == clamp_len
  bi_sign = jnp.asarray([1.0] * (B // 2) + [-1.0] * (B - B // 2)) if bi_data else None
  _run_both(hf, model, jax.tree_util.tree_map(jnp.asarray, params), bi_sign,
            f"export scan_layers={scan_layers} untie_r={untie_r}")

  config2, params2 = convert.from_hf(out, scan_layers=scan_layers)
  for field in convert.MODEL_FIELDS + ("mem_len", "reuse_len", "clamp_len", "untie_r", "scan_layers", "dropout"):
    assert config2.model[field] == config.model[field], field
  assert config2.objective.bi_data == bi_data and config2.data.vocab_size == VOCAB
  flat, flat2 = convert._flatten(params), convert._flatten(params2)
  assert flat.keys() == flat2.keys()
  for k in flat:
    np.testing.assert_array_equal(flat2[k], flat[k], err_msg=k)


def test_zz_report():
  """Prints the max relative errors (run with -s to see them)."""
  for k, v in sorted(RESULTS.items()):
    print(f"{k}: {v:.2e}")
