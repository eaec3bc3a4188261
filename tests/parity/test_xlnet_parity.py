"""Numerical parity of the `xlnet` family with HF `XLNetLMHeadModel`, through tfx.convert.from_hf.

A small randomly initialised HF model is saved with `save_pretrained`, imported, and both run
on the same tokens, token types, permutation masks and target mapping in float32; the query
stream's logits and the new memories must agree, first without memory, then with the memory
HF returned fed to both. HF's perm_mask (1 = cannot attend) becomes tfx's query mask
(True = may attend) and the content mask is the query mask plus the diagonal; memory columns
are always visible.
"""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from tfx import convert  # noqa: E402
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


def test_zz_report():
  """Prints the max relative errors (run with -s to see them)."""
  for k, v in sorted(RESULTS.items()):
    print(f"{k}: {v:.2e}")
