"""`--verify`: run the HF model (PyTorch) and the imported tfx model on the same random padded
batch and measure how far apart their logits are.

The HF side runs in float64 (XLNet: float32, HF's XLNet cannot run in float64), so the reference does not depend on the CPU
kernels torch picks; tfx runs in float32 at the highest matmul precision. The error is
max |tfx - HF| / max |HF| over the real (non-padding) positions: float32 rounding gives about
1e-6; a wrong activation, norm epsilon or tensor mapping gives 1e-4 and more.
"""

from __future__ import annotations

import numpy as np

from tfx.convert.layouts import ConvertError
from tfx.convert.xlnet import XLNET

LIMIT = 1e-4  # above this, --verify fails
_ROWS, _LENGTH = 3, 16


def _need_torch():
  try:
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415
  except ImportError as e:
    raise ConvertError("--verify runs the Hugging Face model beside tfx and needs torch and transformers: "
                       "pip install torch transformers (the CPU build is enough: "
                       "pip install torch --index-url https://download.pytorch.org/whl/cpu), "
                       "or `make install-parity` in a tfx checkout") from e
  return torch, transformers


def _padded_batch(rng: np.random.Generator, vocab: int, length: int, avoid: set[int]):
  """tokens [b, t] (no id of `avoid` at real positions) and mask [b, t] (rows of decreasing length)."""
  lengths = np.array([length, max(2 * length // 3, 1), max(length // 3, 1)])[:_ROWS]
  mask = np.arange(length)[None, :] < lengths[:, None]  # [b, t]
  allowed = np.array([i for i in range(vocab) if i not in avoid] or [0])
  tokens = allowed[rng.integers(0, len(allowed), (_ROWS, length))]
  return tokens.astype(np.int64), mask


def _rel_error(ours, theirs, mask) -> float:
  a, b = np.asarray(ours, np.float64)[mask], np.asarray(theirs, np.float64)[mask]
  return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def verify(hf_dir: str, architecture: str, config, params, *, seed: int = 0) -> float:
  """Max relative logit error of the tfx model (`config`, `params`) against the HF model saved in
  `hf_dir`, on one random padded batch. Raises ConvertError without torch / transformers."""
  torch, transformers = _need_torch()
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  from tfx.models import build_model  # noqa: PLC0415

  hf = getattr(transformers, architecture).from_pretrained(hf_dir).eval()
  if architecture != XLNET:  # HF's XLNet builds its sinusoids in float32 whatever the weights are
    hf = hf.double()
  model = build_model(config.model, vocab_size=config.data.vocab_size, max_length=config.data.seq_len)
  rng = np.random.default_rng(seed)
  length = min(_LENGTH, int(config.data.seq_len))
  pad = hf.config.pad_token_id
  tokens, mask = _padded_batch(rng, config.data.vocab_size, length, {pad} if pad is not None else set())
  seg = mask.astype(np.int32)
  positions = (np.arange(length)[None] * seg).astype(np.int32)
  j = lambda x: jnp.asarray(x, jnp.int32)
  variables = {"params": jax.tree.map(jnp.asarray, params)}

  with jax.default_matmul_precision("highest"), torch.no_grad():
    if architecture in ("BertForMaskedLM", "RobertaForMaskedLM"):
      types = (np.arange(length)[None] >= length // 2) * seg if config.model.type_vocab_size >= 2 else 0 * seg
      inputs = dict(input_ids=torch.tensor(np.where(mask, tokens, pad or 0)),
                    attention_mask=torch.tensor(seg, dtype=torch.long))
      if architecture == "BertForMaskedLM":
        inputs["token_type_ids"] = torch.tensor(types, dtype=torch.long)
      want = hf(**inputs).logits.numpy()
      ours = model.apply(variables, j(inputs["input_ids"].numpy()), j(seg), j(positions),
                         token_types=j(types) if config.model.type_vocab_size else None)
    elif architecture == "GPT2LMHeadModel":
      want = hf(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(seg, dtype=torch.long),
                position_ids=torch.arange(length)[None].repeat(_ROWS, 1)).logits.numpy()
      ours = model.apply(variables, j(tokens), j(seg), j(positions))
    elif architecture == "T5ForConditionalGeneration":
      dec_tokens, dec_mask = _padded_batch(rng, config.data.vocab_size, length, set())
      dec_mask = dec_mask[::-1]  # other lengths than the encoder's
      dec_seg = dec_mask.astype(np.int32)
      want = hf(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(seg, dtype=torch.long),
                decoder_input_ids=torch.tensor(dec_tokens)).logits.numpy()
      ours = model.apply(variables, j(tokens), j(seg), j(positions), j(dec_tokens), j(dec_seg),
                         j(np.arange(length)[None] * dec_seg))
      mask = dec_mask
    elif architecture == XLNET:
      want, ours, mask = _xlnet(hf, model, variables, tokens, rng, torch, config)
    else:
      raise ConvertError(f"--verify does not know how to run {architecture}")
  return _rel_error(ours, want, mask)


def _xlnet(hf, model, variables, tokens, rng, torch, config):
  """One step of the two-stream model (no memory) under a random factorization order, with every
  position a target: the query stream's logits of HF and tfx."""
  import jax.numpy as jnp  # noqa: PLC0415

  bi = bool(config.objective.get("bi_data", False))
  tokens = tokens[:2] if bi else tokens  # bi_data needs an even batch (half forward, half backward)
  b, t = tokens.shape
  z = np.stack([rng.permutation(t) for _ in range(b)])  # each position's rank in the order
  cannot_see = z[:, None, :] >= z[:, :, None]  # [b, i, j]: i may not see j
  mapping = np.broadcast_to(np.eye(t, dtype=np.float32), (b, t, t))
  types = np.zeros((b, t), np.int64)
  out = hf(input_ids=torch.tensor(tokens), token_type_ids=torch.tensor(types),
           perm_mask=torch.tensor(cannot_see.astype(np.float32)), target_mapping=torch.tensor(mapping.copy()))
  query = ~cannot_see
  content = query | np.eye(t, dtype=bool)[None]
  bi_sign = jnp.asarray([1.0] * (b // 2) + [-1.0] * (b - b // 2)) if bi else None
  ours, _ = model.apply(variables, jnp.asarray(tokens, jnp.int32), jnp.asarray(types, jnp.int32),
                        jnp.asarray(content), jnp.asarray(query), jnp.asarray(mapping), None, bi_sign)
  return out.logits.numpy(), ours, np.ones((b, t), bool)
