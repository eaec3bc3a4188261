"""What cuDNN attention pays for a mask that JAX folds into its bias, and what would avoid it.
On a GPU:

    python benchmarks/gpu/cudnn_bias.py --case t5|gpt2 [--batch 32 --length 512 --json OUT.json]

jax.nn.dot_product_attention(implementation='cudnn') folds a boolean mask into the bias
(`combine_bias_and_mask`: bias + where(mask, 0, -2**41)), so T5's [1, h, t, s] position bias and
its [b, 1, t, s] padding mask reach cuDNN as a [b, h, t, s] tensor: written once, read by the
forward and the backward kernel, and its gradient written [b, h, t, s] and summed over the batch
by XLA. Compiled for an H100 at 32 x 512 (`tfx.bench_traffic`), T5-base's encoder attention
kernels move 18.1 GB a step and the batch sums of their bias gradients 4.6 GB. A padding mask
(each row's real tokens first, as in span corruption's inputs) can instead go to cuDNN as
sequence lengths (its PADDING mask), leaving the bias [1, h, t, s]: compiled for an H100 (no GPU
here), one call of this script's step at T5's shape moves 1.4 GB with the mask and 0.4 GB with
lengths, the same as with no mask at all; whether cuDNN runs it, and how fast, takes the GPU.
This times, forward and backward with the gradients of q, k, v and the bias:

  mask      bias [1, h, t, t] and the boolean padding mask (what tfx does today)
  lengths   the same bias with query and key lengths instead of the mask
  no mask   the bias alone (what the bias costs without any mask)

and checks `lengths` against `mask` (outputs and every gradient, on the real query rows; the padded
rows' outputs are zeroed first, as tfx's guard does); one row has 2 real tokens, and every
output and gradient must be finite (cuDNN gave NaN for rows without keys before:
benchmarks/gpu/cudnn_empty_rows.py). Each T5 row also reports `padding_gradient_max`, the largest
|dq|, |dk|, |dv| at padding positions, which are 0: whether cuDNN writes them with lengths (tfx,
which adopted the lengths on 2026-11-27 without a GPU, zeroes them itself: three selects a call),
and `padding_output_max`, the largest |output| of the kernel on the padding query rows before tfx's
guard zeroes them (were both 0 with lengths, the guard and the zeroing could go for rows of one
segment, as they went for packed rows' padding on 2026-11-28).

`--case gpt2` asks the same of GPT-2's packed causal rows (two documents a row, no bias): JAX
turns the mask into a [b, 1, t, t] bias and, since its `should_export_dbias` always says yes,
cuDNN's backward pass also computes and writes that bias's gradient, which nothing reads:

  mask            the causal segment mask, as tfx hands it to cuDNN today
  mask, no dbias  the same with JAX's should_export_dbias answering no (a private function,
                  patched for the call; refused if this JAX has none)
  causal only     is_causal and no mask (ignores the documents: the lower bound)

checking `mask, no dbias` against `mask`. Compiled for an H100 at 32 x 1024, the backward kernel
moves 0.54 GB with the mask, 0.47 without its gradient and 0.40 causal only (the forward 0.27 /
0.27 / 0.20); what the gradient costs cuDNN in arithmetic only the GPU tells.

`--implementation xla` runs either case on any device (tests/test_gpu_session.py, on a CPU).
"""

import argparse
import contextlib
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

CASES = {  # batch, length, heads, head_dim, variants (the first is today's, the second checked against it)
    "t5": (32, 512, 12, 64, ("mask", "lengths", "no mask")),
    "gpt2": (32, 1024, 12, 64, ("mask", "mask, no dbias", "causal only")),
}


def inputs(case: str, batch: int, length: int, heads: int, head_dim: int, seed: int = 0):
  """q, k, v [b, t, h, d] bf16; T5: bias [1, h, t, t] bf16, else None; lengths [b] int32 (T5: even,
  >= t / 2, the real tokens of a row; GPT-2: where each row's second document starts); the cotangent."""
  rng = np.random.default_rng(seed)
  q, k, v = (jnp.asarray(rng.normal(size=(batch, length, heads, head_dim)), jnp.bfloat16) for _ in range(3))
  bias = jnp.asarray(rng.normal(size=(1, heads, length, length)), jnp.bfloat16) if case == "t5" else None
  lengths = jnp.asarray(2 * rng.integers(length // 4, length // 2 + 1, size=batch), jnp.int32)
  lengths = lengths.at[0].set(length)  # one row without padding (T5) or of one document (GPT-2)
  if batch > 2:
    lengths = lengths.at[1].set(2)  # one nearly empty row (T5) or a document of two tokens (GPT-2)
  cot = jnp.asarray(rng.normal(size=(batch, length, heads, head_dim)), jnp.float32)
  return q, k, v, bias, lengths, cot


@contextlib.contextmanager
def _no_dbias():
  from jax._src.cudnn import fused_attention_stablehlo as fused  # noqa: PLC0415

  original = getattr(fused, "should_export_dbias", None)
  if original is None:
    raise RuntimeError(f"jax {jax.__version__} has no fused_attention_stablehlo.should_export_dbias")
  fused.should_export_dbias = lambda *_: False
  try:
    yield
  finally:
    fused.should_export_dbias = original


def attention_loss(variant: str, implementation: str | None):
  """loss(q, k, v, bias, lengths, cot) -> (sum(out * cot) over the rows tfx keeps, out) for one variant."""

  def loss(q, k, v, bias, lengths, cot):
    t = q.shape[1]
    pos = jnp.arange(t)
    kwargs, real = {}, jnp.ones(q.shape[:2], bool)  # [b, t]
    if bias is not None:  # T5 (the only case with a bias): padding after `lengths`
      real = pos[None, :] < lengths[:, None]
      if variant == "mask":
        kwargs["mask"] = (real[:, None, :, None] & real[:, None, None, :]) | ~real[:, None, :, None]  # rows kept
      elif variant == "lengths":
        kwargs["query_seq_lengths"] = kwargs["key_value_seq_lengths"] = lengths
    else:  # GPT-2: documents [0, lengths) and [lengths, t), causal
      doc = (pos[None, :] >= lengths[:, None]).astype(jnp.int32)  # [b, t]
      if variant == "causal only":
        kwargs["is_causal"] = True
      else:
        kwargs["mask"] = ((doc[:, None, :, None] == doc[:, None, None, :]) & (pos[:, None] >= pos[None, :]))
        kwargs["is_causal"] = True  # as tfx: cuDNN skips the blocks above the diagonal
    with _no_dbias() if variant == "mask, no dbias" else contextlib.nullcontext():
      out = jax.nn.dot_product_attention(q, k, v, bias=bias, implementation=implementation, **kwargs)
    # the kernel's own output on the padding rows, before tfx's guard zeroes it
    raw_padding = jnp.max(jnp.where(real[:, :, None, None], 0.0, jnp.abs(out.astype(jnp.float32))))
    out = jnp.where(real[:, :, None, None], out, jnp.zeros((), out.dtype))  # tfx's guard
    return jnp.sum(out.astype(jnp.float32) * cot), (out, raw_padding)

  return loss


def run(variant: str, implementation: str | None, args_: tuple, steps: int) -> dict:
  argnums = (0, 1, 2, 3) if args_[3] is not None else (0, 1, 2)
  step = jax.jit(jax.value_and_grad(attention_loss(variant, implementation), argnums=argnums, has_aux=True))
  start = time.perf_counter()
  result = jax.block_until_ready(step(*args_))
  compile_s = time.perf_counter() - start
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    result = jax.block_until_ready(step(*args_))
    times.append(time.perf_counter() - start)
  (_, (out, raw_padding)), grads = result
  finite = all(bool(jnp.all(jnp.isfinite(x.astype(jnp.float32)))) for x in (out, *grads))
  row = {"variant": variant, "ms": 1e3 * statistics.median(times), "compile_s": compile_s, "finite": finite,
         "values": (out, *grads)}
  if args_[3] is not None:  # T5: the q, k, v gradients at padding positions, which are 0 (a kernel that
    # leaves them unwritten gives whatever the memory held: tfx zeroes them behind cuDNN's lengths)
    padding = jnp.arange(out.shape[1])[None, :] >= args_[4][:, None]  # [b, t]
    row["padding_gradient_max"] = max(float(jnp.max(jnp.where(padding[:, :, None, None], jnp.abs(g), 0)))
                                      for g in grads[:3])
    row["padding_output_max"] = float(raw_padding)
  return row


def max_difference(a, b) -> float:
  return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--case", choices=sorted(CASES), default="t5")
  parser.add_argument("--batch", type=int, default=None, help="default: the case's (32)")
  parser.add_argument("--length", type=int, default=None, help="default: the case's (T5 512, GPT-2 1024)")
  parser.add_argument("--heads", type=int, default=12)
  parser.add_argument("--head-dim", type=int, default=64)
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--implementation", default="cudnn", choices=["cudnn", "xla"])
  parser.add_argument("--json", default=None)
  args = parser.parse_args(argv)
  batch, length, _, _, variants = CASES[args.case]
  batch, length = args.batch or batch, args.length or length
  implementation = None if args.implementation == "xla" else "cudnn"
  data = inputs(args.case, batch, length, args.heads, args.head_dim)
  shape = [batch, length, args.heads, args.head_dim]
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {args.implementation}, {args.case}: q {shape}, "
        f"lengths {int(data[4].min())}-{int(data[4].max())}", flush=True)
  rows = []
  for variant in variants:
    try:
      rows.append(run(variant, implementation, data, args.steps))
    except Exception as e:  # noqa: BLE001  (cuDNN refuses a shape or a combination)
      rows.append({"variant": variant, "refused": str(e).splitlines()[0][:200]})
    row = rows[-1]
    print(f"{variant:15s} " + (f"refused: {row['refused']}" if "refused" in row else
                               f"{row['ms']:8.3f} ms fwd+bwd  compile {row['compile_s']:.1f} s"
                               f"{'' if row['finite'] else '  NOT FINITE'}"
                               + (f"  padding gradients <= {row['padding_gradient_max']:.3g}, outputs <= "
                                  f"{row['padding_output_max']:.3g}" if "padding_gradient_max" in row else "")),
          flush=True)
  reference, candidate = rows[0], rows[1]
  agreement = None
  if "values" in reference and "values" in candidate:
    names = ("out", "dq", "dk", "dv", "dbias")
    agreement = {n: max_difference(a, b) for n, a, b in zip(names, reference["values"], candidate["values"])}
    scale = {n: float(jnp.max(jnp.abs(a.astype(jnp.float32)))) for n, a in zip(names, reference["values"])}
    print(f"{candidate['variant']} against {reference['variant']}, max |difference| (max |value|): " +
          ", ".join(f"{n} {agreement[n]:.3g} ({scale[n]:.3g})" for n in agreement), flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"device": jax.devices()[0].device_kind, "implementation": args.implementation, "case": args.case,
                 "shape": shape, "agreement": agreement,
                 "rows": [{k: v for k, v in r.items() if k != "values"} for r in rows]}, f, indent=1)


if __name__ == "__main__":
  main()
