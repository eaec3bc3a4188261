"""Every attention kernel against the reference attention, on whatever device is here.

    python -m tfx.check_attention [--dtype bfloat16] [--implementations auto,cudnn,pallas,splash,xla]
        [--length 128] [--json out.json]

The unit tests check the kernels on the CPU (XLA's attention, and the Pallas kernel in Pallas'
interpreter); this is the same check for the device that trains: run it once on a GPU or TPU
host before trusting a fused kernel there. For each mask a family builds (causal and
bidirectional packed rows with padding, grouped-query heads, the same rows as runs for cuDNN's
packed layout (`model.packed_runs`: a batch that fits it and one that falls back to the mask),
prefix LM, XLNet's two streams, cross attention, T5's relative bias beside a packed mask or
beside rows given by their lengths, `ops.LengthMask`, XLNet's relative terms as a bias per row)
and each `model.attention` value, it runs `tfx.ops.dot_product_attention` as a model does (so a
kernel that cannot take a mask falls back exactly as in training) and compares the output and the
q, k, v (and bias) gradients with `reference_attention` computed in float32 at the highest matmul
precision from the same rounded inputs. It prints which kernel actually ran (`attention: ...`
reasons included) and the largest error relative to the largest reference
value, and fails (exit status 1) where one is over the dtype's tolerance. Query rows with no
allowed key (padding, the first token of a permutation's query stream) must come out as zeros.

The `*_dropout` cases check `pallas` alone, on a GPU, the one kernel that applies attention
dropout (`tfx.ops.flash_dropout`; over segment ids, a dense mask, or XLNet's bias per row carrying
the mask): its output and gradients against the reference dropping the same scores
(`tfx.ops.dropout.keep_bits`, drawn in XLA), which also checks that the GPU compiled the kernel's
keep-bit hash as the interpreter runs it.
"""

import argparse
import dataclasses
import functools
import json
import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from tfx import ops
from tfx.ops import dropout, flash_dropout

# Largest error relative to the largest reference value. Float32 allows TF32 matmuls (a GPU's
# default precision); bf16 and fp16 keep 8 and 11 bits of mantissa in q, k, v and the output.
TOLERANCE = {"float32": 2e-3, "bfloat16": 3e-2, "float16": 5e-3}
IMPLEMENTATIONS = ("auto", "cudnn", "pallas", "splash", "xla")
OUTPUTS = ("out", "dq", "dk", "dv", "dbias")  # dbias where the case has a bias


@dataclasses.dataclass(frozen=True)
class Case:
  """One attention problem: q [b, t, h, d], k and v [b, s, kv, d], a mask, a cotangent."""

  name: str
  q: jax.Array
  k: jax.Array
  v: jax.Array
  mask: Any  # ops.SegmentMask, ops.LengthMask or [b, 1, t, s] bool
  cotangent: jax.Array  # [b, t, h, d] float32
  bias: jax.Array | None = None  # [1, h, t, s] float32 (T5's) or [b, h, t, s] in q's dtype (XLNet's)
  dropout: float = 0.0  # attention dropout (ids, a dense mask, a bias per row carrying it; 'pallas' alone)


# The dropout cases' key: the kernel's seed is drawn from it as a model's layer draws it.
DROPOUT_KEY = 1234
DROPOUT_IMPLEMENTATIONS = ("pallas",)


def _packed(rng: np.random.Generator, b: int, t: int, *, documents: int, padding: int) -> tuple[jax.Array, jax.Array]:
  """Segment ids and positions [b, t]: `documents` packed documents of random lengths, then
  `padding` zeros; positions count from 0 in each document (and in the padding)."""
  seg, pos = np.zeros((b, t), np.int32), np.zeros((b, t), np.int32)
  for row in range(b):
    cuts = np.sort(rng.choice(np.arange(1, t - padding), size=documents - 1, replace=False))
    bounds = [0, *cuts.tolist(), t - padding, t]
    for i, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
      seg[row, start:stop] = i + 1 if stop <= t - padding else 0
      pos[row, start:stop] = np.arange(stop - start)
  return jnp.asarray(seg), jnp.asarray(pos)


def make_cases(*, length: int = 128, heads: int = 4, head_dim: int = 64, batch: int = 2, seed: int = 0,
               dtype=jnp.bfloat16) -> list[Case]:
  """The masks a family's attention sees, on packed rows of `length` tokens (a multiple of 16)."""
  rng = np.random.default_rng(seed)
  b, t, h, d = batch, length, heads, head_dim

  def case(name: str, mask, kv_heads: int = h, keys: int | None = None, bias: str | None = None,
           rows: int = t, dropout: float = 0.0) -> Case:
    """bias: 'heads' (T5's [1, h, t, s] float32) or 'rows' (XLNet's position and segment terms,
    [b, h, t, s] in the inputs' dtype); rows: the query length (the key length's default)."""
    t, keys = rows, rows if keys is None else keys
    q = jnp.asarray(rng.normal(size=(b, t, h, d)), dtype)
    k, v = (jnp.asarray(rng.normal(size=(b, keys, kv_heads, d)), dtype) for _ in range(2))
    if bias is not None:
      rows, bias_dtype = (b, dtype) if bias == "rows" else (1, jnp.float32)
      bias = jnp.asarray(rng.normal(size=(rows, h, t, keys)), bias_dtype)
    return Case(name, q, k, v, mask, jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32), bias, dropout)

  runs = lambda ids, causal, at_most: ops.self_attention_mask(ids, causal=causal, implementation="auto",
                                                              packed_runs=at_most)
  packed, _ = _packed(rng, b, t, documents=3, padding=0)
  padded, positions = _packed(rng, b, t, documents=2, padding=t // 4)
  # XLNet: a random factorisation order per row; the content stream sees the tokens at or before
  # its own place in the order, the query stream those strictly before it.
  rank = jnp.asarray(np.stack([rng.permutation(t) for _ in range(b)]))
  same = ops.segment_mask(padded)
  source, _ = _packed(rng, b, t // 2, documents=2, padding=t // 16)
  # Rows of one segment each (span corruption's): a quarter padding, and a row of two tokens.
  one = lambda n, lengths: jnp.asarray((np.arange(n)[None, :] < np.asarray(lengths)[:, None]).astype(np.int32))
  queries = one(t, [t - t // 4] + [2] * (b - 1))
  keys = one(t // 2, [t // 2 - t // 8] + [3] * (b - 1))
  return [
      case("causal_packed", ops.SegmentMask(packed, causal=True)),
      case("causal_padded", ops.SegmentMask(padded, causal=True)),
      case("bidirectional_padded", ops.SegmentMask(padded)),
      case("grouped_query_causal", ops.SegmentMask(packed, causal=True), kv_heads=h // 2),
      # cuDNN's packed layout (`model.packed_runs`): rows of at most 4 runs go as runs, and a batch
      # with a row of 3 runs against a layout of 2 falls back to the mask
      case("causal_packed_runs", runs(packed, causal=True, at_most=4)),
      case("bidirectional_padded_runs", runs(padded, causal=False, at_most=4)),
      case("grouped_query_causal_runs", runs(padded, causal=True, at_most=4), kv_heads=h // 2),
      case("causal_packed_runs_overflow", runs(packed, causal=True, at_most=2)),
      case("prefix_lm", ops.prefix_lm_mask(padded, positions, jnp.full((b, 1), t // 8))),
      case("two_stream_content", same & (rank[:, None, None, :] <= rank[:, None, :, None])),
      case("two_stream_query", same & (rank[:, None, None, :] < rank[:, None, :, None])),
      # the decoder's documents over the encoder's
      case("cross", ops.segment_mask(jnp.minimum(padded, 2), source), keys=t // 2),
      # T5: the relative bias [1, h, t, s] beside packed rows' mask (cuDNN gets the two folded into one
      # [b, h, t, s] bias) and beside rows' lengths (cuDNN's padding mask)
      case("biased_packed", ops.segment_mask(padded), bias="heads"),
      case("biased_lengths", ops.rows_mask(queries, lengths=True), bias="heads"),
      case("biased_causal_lengths", ops.rows_mask(queries, causal=True, lengths=True), bias="heads"),
      # XLNet: the query stream with its position and segment terms as a bias per row
      case("biased_two_stream", same & (rank[:, None, None, :] < rank[:, None, :, None]), bias="rows"),
      case("cross_lengths", ops.rows_mask(queries, keys, lengths=True), keys=t // 2),
      # odd lengths (a packed row of t - 1 tokens, T5's odd target counts): cuDNN gets them padded
      case("causal_padded_odd", ops.SegmentMask(padded[:, 1:], causal=True), rows=t - 1),
      case("biased_causal_lengths_odd", ops.rows_mask(queries[:, 1:], causal=True, lengths=True), bias="heads",
           rows=t - 1),
      # attention dropout (BERT's, GPT-2's 0.1), drawn inside the Pallas kernel
      case("causal_packed_dropout", ops.SegmentMask(packed, causal=True), dropout=0.1),
      case("bidirectional_padded_dropout", ops.SegmentMask(padded), dropout=0.1),
      case("grouped_query_causal_dropout", ops.SegmentMask(padded, causal=True), kv_heads=h // 2, dropout=0.3),
      # BART's cross attention: the decoder's documents over the encoder's, by their ids
      case("cross_dropout", ops.rows_mask(jnp.minimum(padded, 2), source), keys=t // 2, dropout=0.1),
      # the query stream's slots (fewer than a block's multiple) over every key: the two-stream
      # encoder's under the permutation's dense mask, XLNet's with its relative terms as a bias per row
      # carrying that mask
      case("two_stream_query_dropout", (same & (rank[:, None, None, :] < rank[:, None, :, None]))[:, :, :t - 11],
           rows=t - 11, keys=t, dropout=0.1),
      case("biased_two_stream_dropout", (same & (rank[:, None, None, :] < rank[:, None, :, None]))[:, :, :t - 11],
           bias="rows", rows=t - 11, keys=t, dropout=0.1),
  ]


def _attends(mask) -> jax.Array:
  """[b, t] bool: the query rows that have at least one allowed key."""
  return ops.rows_attend(ops.dense_mask(mask))[:, 0]


def _value_and_grads(fn: Callable, case: Case):
  """fn(q, k, v, bias) and the gradients of sum(fn * cotangent) with respect to q, k, v and the bias
  if there is one (float32)."""
  args = (case.q, case.k, case.v, case.bias)
  loss = lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * case.cotangent)
  grads = jax.grad(loss, argnums=(0, 1, 2, 3) if case.bias is not None else (0, 1, 2))(*args)
  return [np.asarray(x, np.float32) for x in (fn(*args), *grads)]


def reference(case: Case) -> list[np.ndarray]:
  """Output and q, k, v gradients of the einsum attention in float32 at the highest precision;
  rows with no allowed key are zeros (what `dot_product_attention` guarantees); with the case's
  dropout, the scores the Pallas kernel drops dropped."""
  mask = ops.dense_mask(case.mask)
  attends = _attends(mask)[:, :, None, None]  # [b, t, 1, 1]

  def fn(q, k, v, bias):
    if case.dropout and not isinstance(case.mask, (ops.SegmentMask, ops.CrossMask)):
      # a dense mask (and a bias): XLA's attention with them, dropping the same scores
      q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
      bias = None if bias is None else bias.astype(jnp.float32)
      return ops.attention.softmax_attention(q, k, v, mask, bias, q.shape[-1] ** -0.5, dropout_rate=case.dropout,
                                             seed=dropout.seed(jax.random.key(DROPOUT_KEY)))
    if case.dropout:
      cross = isinstance(case.mask, ops.CrossMask)
      ids = ({"segment_ids": case.mask.q_segment_ids, "causal": False, "key_segment_ids": case.mask.k_segment_ids}
             if cross else {"segment_ids": case.mask.segment_ids, "causal": case.mask.causal})
      return flash_dropout.reference_attention(
          *(x.astype(jnp.float32) for x in (q, k, v)), **ids, scale=q.shape[-1] ** -0.5, rate=case.dropout,
          seed=dropout.seed(jax.random.key(DROPOUT_KEY)))
    out = ops.reference_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), mask=mask,
                                  bias=bias)
    return jnp.where(attends, out, 0.0)

  with jax.default_matmul_precision("highest"):
    return _value_and_grads(jax.jit(fn), case)


def check_case(case: Case, implementation: str, want: list[np.ndarray]) -> dict[str, Any]:
  """Runs one kernel on one case; returns the kernel that ran and its relative errors."""
  fn = jax.jit(lambda q, k, v, bias: ops.dot_product_attention(q, k, v, mask=case.mask, bias=bias,
                                                                implementation=implementation))
  if case.dropout:
    fn = jax.jit(functools.partial(_with_dropout, case, implementation))
  with ops.recorded_choices() as chosen:
    got = _value_and_grads(fn, case)
  errors = {name: float(np.max(np.abs(g - w)) / max(float(np.max(np.abs(w))), 1e-30))
            for name, g, w in zip(OUTPUTS, got, want)}
  nonfinite = [name for name, g in zip(OUTPUTS, got) if not np.all(np.isfinite(g))]
  empty_rows_zero = bool(not np.any(got[0][~np.asarray(_attends(case.mask))]))
  kernels = sorted({f"{impl} ({why})" for impl, why in chosen})
  dtype = jnp.dtype(case.q.dtype).name
  ok = not nonfinite and empty_rows_zero and max(errors.values()) <= TOLERANCE[dtype]
  return {"case": case.name, "implementation": implementation, "kernel": " + ".join(kernels), "dtype": dtype,
          **errors, "nonfinite": nonfinite, "empty_rows_zero": empty_rows_zero, "ok": ok}


def _with_dropout(case: Case, implementation: str, q, k, v, bias):
  """The dropout kernel as a model's attention layer calls it; an error if it does not run."""
  out, why = flash_dropout.fused_dropout_attention(q, k, v, case.mask, bias, q.shape[-1] ** -0.5, case.dropout,
                                                   jax.random.key(DROPOUT_KEY), implementation)
  if out is None:
    raise RuntimeError(f"no dropout kernel ran: {why}")
  return out


def _dropout_kernel_runs(implementation: str, case: Case) -> bool:
  """Whether `implementation` runs the Pallas dropout kernel on this device (a GPU): elsewhere
  nothing draws the bits the reference drops, and the dropout cases are skipped."""
  if implementation not in DROPOUT_IMPLEMENTATIONS:
    return False
  chosen = ops.attention.choose_implementation(implementation, case.q.dtype, case.q.shape[-1])[0]
  return chosen in DROPOUT_IMPLEMENTATIONS


def run_checks(cases: list[Case], implementations: tuple[str, ...] = IMPLEMENTATIONS) -> list[dict[str, Any]]:
  """Every case with every implementation (a dropout case with the Pallas kernel, on a GPU).
  A kernel that fails to trace, compile or run fails its case (the error is reported) and the
  others still run: one broken kernel on a device hides nothing else."""
  results = []
  for case in cases:
    chosen = [i for i in implementations if not case.dropout or _dropout_kernel_runs(i, case)]
    want = reference(case) if chosen else None
    for impl in chosen:
      try:
        results.append(check_case(case, impl, want))
      except Exception as e:  # noqa: BLE001  (reported as the case's failure)
        results.append({"case": case.name, "implementation": impl, "kernel": "-",
                        "dtype": jnp.dtype(case.q.dtype).name, "nonfinite": [], "empty_rows_zero": True,
                        "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}",
                        "ok": False})
  return results


def format_results(results: list[dict[str, Any]]) -> str:
  rows = [("case", "model.attention", "ran", *OUTPUTS, "ok")]
  for r in results:
    rows.append((r["case"], r["implementation"], r["kernel"], *(f"{r[k]:.1e}" if k in r else "-" for k in OUTPUTS),
                 "ok" if r["ok"] else "FAIL" + (f" (non-finite {', '.join(r['nonfinite'])})" if r["nonfinite"] else "")
                 + ("" if r["empty_rows_zero"] else " (a row with no key is not zero)")
                 + (f" ({r['error']})" if r.get("error") else "")))
  widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
  lines = ["  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
           for row in rows]
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m tfx.check_attention", description=__doc__.split("\n")[0])
  parser.add_argument("--dtype", default="bfloat16", choices=sorted(TOLERANCE))
  parser.add_argument("--implementations", default=",".join(IMPLEMENTATIONS),
                      help="model.attention values to check (reference is what they are compared with)")
  parser.add_argument("--length", type=int, default=128, help="row length (a multiple of 16)")
  parser.add_argument("--head-dim", type=int, default=64)
  parser.add_argument("--json", default=None, help="also write the results as JSON to this path")
  args = parser.parse_args(argv)
  implementations = tuple(i for i in args.implementations.split(",") if i)
  unknown = sorted(set(implementations) - set(IMPLEMENTATIONS))
  if unknown:
    sys.exit(f"tfx.check_attention: unknown --implementations {', '.join(unknown)}; choose from "
             f"{', '.join(IMPLEMENTATIONS)}")
  if args.length < 32 or args.length % 16:
    sys.exit(f"tfx.check_attention: --length must be a multiple of 16, at least 32 (got {args.length})")
  device = jax.devices()[0]
  print(f"{jax.device_count()} x {getattr(device, 'device_kind', device.platform)}, {args.dtype}, "
        f"jax {jax.__version__}, rows of {args.length}, head dim {args.head_dim}; errors: max |kernel - reference| / "
        f"max |reference|, tolerance {TOLERANCE[args.dtype]:g}")
  cases = make_cases(length=args.length, head_dim=args.head_dim, dtype=jnp.dtype(args.dtype))
  results = run_checks(cases, implementations)
  print(format_results(results))
  if args.json:
    from etils import epath

    epath.Path(args.json).write_text(json.dumps(results, indent=2))
  failed = [f"{r['case']}/{r['implementation']}" for r in results if not r["ok"]]
  if failed:
    sys.exit(f"tfx.check_attention: {len(failed)} failed: {', '.join(failed)}")


if __name__ == "__main__":
  main()
