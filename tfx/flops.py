"""Model FLOPs per token and the peak throughput of known accelerators (for MFU).

MFU = achieved model FLOP/s / (peak FLOP/s of one device x number of devices), with model
FLOPs counted as in the PaLM paper (appendix B): 6 FLOPs per token per parameter that takes
part in a matrix multiply (the blocks and the output projection; embedding lookups are free),
plus 6 L T e for the attention score and value products at sequence length T.
Rematerialisation is not counted (that would be hardware FLOPs, not model FLOPs).
"""

import jax

# Dense bf16 peak FLOP/s per device (vendor datasheets; no sparsity).
PEAK_FLOPS = {
    "H100": 989e12,  # H100 SXM
    "H200": 989e12,
    "A100": 312e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,  # v5e
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,  # v6e (Trillium)
    "TPU v6e": 918e12,
}


def device_peak_flops(device=None) -> float | None:
  """Peak bf16 FLOP/s of `device` (default: the first device), None if unknown (e.g. CPU)."""
  device = jax.devices()[0] if device is None else device
  if device.platform == "cpu":
    return None
  kind = getattr(device, "device_kind", "")
  # Longest matching name first, so "TPU v5 lite" wins over "TPU v5".
  for name in sorted(PEAK_FLOPS, key=len, reverse=True):
    if name.lower() in kind.lower():
      return PEAK_FLOPS[name]
  return None


def matmul_params(cfg) -> int:
  """Parameters that take part in a matrix multiply per token (blocks + output projection).

  For encoder_decoder models every position is counted as passing through both stacks (the
  decoder's cross-attention included): exact when encoder and decoder lengths are equal, an
  over-count for span corruption (114 decoder vs 512 encoder positions).
  """
  e, f, l = cfg.d_model, cfg.d_ff, cfg.num_layers
  mlp_in = 2 if cfg.mlp in ("geglu", "swiglu") else 1
  per_layer = 4 * e * e + (mlp_in + 1) * e * f
  total = l * per_layer + e * cfg.vocab_size
  if getattr(cfg, "family", "") == "encoder_decoder":
    total += cfg.decoder_layers * (per_layer + 4 * e * e)
  return total


def flops_per_token(cfg, seq_len: int) -> float:
  """Training FLOPs per token: forward + backward (x3) of the matmuls and attention.

  Args:
    cfg: a ModelConfig (num_layers, d_model, d_ff, mlp, vocab_size).
    seq_len: tokens per row (attention cost grows with it).
  """
  attention = 2 * 2 * cfg.num_layers * seq_len * cfg.d_model  # QK^T and PV, full (unmasked) rows
  return 3 * (2 * matmul_params(cfg) + attention)
