"""Model FLOPs per token and the peak throughput of known accelerators (for MFU).

MFU = achieved model FLOP/s / (peak FLOP/s of one device x number of devices), with model
FLOPs counted as in the PaLM paper (appendix B): 6 FLOPs per token per parameter that takes
part in a matrix multiply (the blocks and the output projection; embedding lookups are free),
plus the attention score and value products (12 L T e per token for training at sequence
length T: 4 L T e forward, twice that backward; causal attention is not halved, as in PaLM).
Rematerialisation is not counted (that would be hardware FLOPs, not model FLOPs).

What a row computes depends on the objective (`Objective.train_flops_per_row`): one stack at
every position (`row_forward_flops`), an encoder over the inputs and a decoder over the shorter
targets (`seq2seq_forward_flops`), or a content stream plus a query stream over the prediction
slots (`two_stream_forward_flops`). tests/test_bench.py checks each against XLA's own count.
"""

import jax

# Dense bf16 peak FLOP/s per device (vendor datasheets; no sparsity).
PEAK_FLOPS = {
    "H100": 989e12,  # H100 SXM ("NVIDIA H100 80GB HBM3")
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H200": 989e12,
    "H200 NVL": 835e12,
    "A100": 312e12,
    "TPU v4": 275e12,
    "TPU v4 lite": 138e12,  # v4i
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


def mlp_params(cfg) -> int:
  """Parameters of one MLP (two input projections when gated)."""
  return (3 if cfg.mlp in ("geglu", "swiglu") else 2) * cfg.d_model * cfg.d_ff


def attention_dim(cfg) -> int:
  """num_heads * head_dim: the width of the q / k / v projections (d_model unless head_dim is set)."""
  return cfg.num_heads * getattr(cfg, "head_dim", cfg.d_model // cfg.num_heads)


def matmul_params(cfg) -> int:
  """Parameters that take part in a matrix multiply per token (blocks + output projection),
  every position counted through every stack (see `row_forward_flops` for the exact counts)."""
  e, l, a = cfg.d_model, cfg.num_layers, attention_dim(cfg)
  per_layer = 4 * e * a + mlp_params(cfg)
  total = l * per_layer + e * cfg.vocab_size
  if getattr(cfg, "family", "") == "encoder_decoder":
    total += cfg.decoder_layers * (per_layer + 4 * e * a)
  return total


def attention_flops(cfg, queries: int, keys: int) -> float:
  """Forward FLOPs of one attention layer for one row: q and output projections on `queries`
  positions, k and v projections on `keys` positions, scores and the weighted sum."""
  e, a = cfg.d_model, attention_dim(cfg)
  return 4 * e * a * (queries + keys) + 4 * queries * keys * a


def row_forward_flops(cfg, length: int, outputs: int | None = None, *, last_layer_queries: int | None = None) -> float:
  """Forward FLOPs of one row of `length` positions through one stack with full attention and
  the output projection (the encoder's MLM transform too) at `outputs` positions (default:
  every position; fewer when masked LM gathers its selected tokens). `last_layer_queries`: the
  last layer's queries, attention output and MLP run at that many positions only, its keys and
  values at all (`tfx.nn.Stack`'s `rows`)."""
  e = cfg.d_model
  outputs = length if outputs is None else outputs
  layer = lambda queries: attention_flops(cfg, queries, length) + 2 * queries * mlp_params(cfg)
  last = length if last_layer_queries is None else last_layer_queries
  head = 2 * outputs * e * cfg.vocab_size
  if getattr(cfg, "family", "") == "encoder":
    head += 2 * outputs * e * e  # MLM head transform
  return (cfg.num_layers - 1) * layer(length) + layer(last) + head


def classifier_forward_flops(cfg, length: int, num_classes: int, *, last_layer_queries: int | None = None) -> float:
  """Forward FLOPs of one fine-tuning row (`tfx.models.Classifier`): the backbone over `length`
  positions without its LM head (an encoder-decoder's encoder alone), its last layer's queries,
  attention output and MLP at `last_layer_queries` positions (a pooled token: 1; default every
  position), then the pooler and the classifier on one vector. The xlnet family adds its positional
  score table per layer (the relative encodings' projection is once per batch, as in
  `two_stream_forward_flops` without bi_data)."""
  e, t = cfg.d_model, length
  layer = lambda queries: attention_flops(cfg, queries, t) + 2 * queries * mlp_params(cfg)
  last = t if last_layer_queries is None else last_layer_queries
  total = (cfg.num_layers - 1) * layer(t) + layer(last)
  if getattr(cfg, "family", "") == "xlnet":  # q . W_r R(d) for every distance, per query
    total += ((cfg.num_layers - 1) * t + last) * 2 * (2 * t - 1) * attention_dim(cfg)
  return total + 2 * e * e + 2 * e * num_classes


def seq2seq_forward_flops(cfg, inputs: int, targets: int) -> float:
  """Forward FLOPs of one encoder-decoder row: `inputs` positions through the encoder,
  `targets` through the decoder (self-attention, cross-attention over the inputs, MLP) and the
  output projection."""
  e, mlp = cfg.d_model, mlp_params(cfg)
  encoder = cfg.num_layers * (attention_flops(cfg, inputs, inputs) + 2 * inputs * mlp)
  decoder = cfg.decoder_layers * (attention_flops(cfg, targets, targets) + attention_flops(cfg, targets, inputs)
                                  + 2 * targets * mlp)
  return encoder + decoder + 2 * targets * e * cfg.vocab_size


def two_stream_forward_flops(cfg, length: int, predictions: int, memory: int = 0, *,
                             per_row_encoding: bool = True) -> float:
  """Forward FLOPs of one permutation-LM row: the content stream over `length` positions (keys
  = memory + length) and the query stream over `predictions` slots, which shares the content
  stream's keys and values; the output projection only at the slots. The last layer's content
  stream is not counted beyond its keys and values: nothing reads its output.

  xlnet family: Transformer-XL positions add the W_r projection of the s + t - 1 distances (per
  row when `per_row_encoding`, as with bi_data's signed distances under dropout; otherwise once per
  batch, or per half of it, which a per-row count leaves out) and positional scores: the content
  stream's per position, the query stream's per slot against every distance
  (`tfx.nn.xlnet.row_positional_scores`); each slot
  attends from its own position alone. Encoder family: the query stream attends from its slots
  too, and the MLM head transform runs on the slots (XLNet has num_heads * head_dim = d_model;
  the encoder may not).
  """
  e, a, mlp, n, t = cfg.d_model, attention_dim(cfg), mlp_params(cfg), predictions, length
  s = memory + t
  keys = 4 * e * a * s  # k and v projections (memory included), read by both streams
  content = 4 * e * a * t + 4 * t * s * a + 2 * t * mlp  # q, output, scores, weighted sum, MLP
  query = 4 * e * a * n + 2 * n * mlp  # q and output projections, MLP
  head = 2 * n * e * cfg.vocab_size
  if getattr(cfg, "family", "") == "xlnet":
    p = s + t - 1
    keys += 2 * e * e * p if per_row_encoding else 0  # W_r R(d) of every distance
    content += 2 * t * p * e  # positional score table
    query += 2 * n * p * e  # the slots' positional scores
  else:
    head += 2 * n * e * e  # MLM head transform
  query += 4 * n * s * a  # scores and weighted sum at the slots
  return cfg.num_layers * (keys + query) + (cfg.num_layers - 1) * content + head


def flops_per_token(cfg, seq_len: int) -> float:
  """Training FLOPs per token of a single-stack row (forward + backward = 3x forward).

  Args:
    cfg: a ModelConfig (num_layers, d_model, d_ff, mlp, vocab_size).
    seq_len: tokens per row (attention cost grows with it).
  """
  return 3 * row_forward_flops(cfg, seq_len) / seq_len
