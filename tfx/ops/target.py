"""The platform tfx traces its kernels for: this machine's backend, or one named for a cross-lowering.

The attention's kernel choice (`tfx.ops.attention.choose_implementation`), whether the Pallas
kernels run compiled or in Pallas' interpreter, and the form of the norms' and the loss's row
statistics (`one_pass_reductions`) depend on the platform. Normally that is
`jax.default_backend()`. Inside `lowering_for("gpu")` (or "tpu") they are made for that platform
instead, so that a train step traced there and lowered with
`jitted.trace(...).lower(lowering_platforms=(LOWERING_PLATFORMS["gpu"],))` is the program the
GPU would compile: its Triton and cuDNN custom calls (or the TPU's Mosaic kernels) included. That
is how `python -m tfx.bench --lower gpu` checks the accelerator path on a machine without one.
The choice is made while tracing, and `jax.jit` keeps a function's trace whatever the platform
was: jit a fresh function for each platform (as `tfx.bench_lower` and the tests do).
"""

import contextlib
from typing import Iterator

import jax

# Backend name (jax.default_backend()) -> the name `Lowered` takes in `lowering_platforms`.
LOWERING_PLATFORMS = {"gpu": "cuda", "tpu": "tpu", "cpu": "cpu"}
# The cuDNN version JAX's cuDNN attention is told while lowering for a GPU on a machine without
# cuDNN (its argument checks ask for one): 9.8, what jax 0.10's CUDA 12 wheels are built against;
# and the GPU's compute capability: an H100's (9.0, what `tfx.bench_lower`'s topologies are), so
# that Hopper's packed layout (`model.packed_runs`) lowers. tfx's own choice keeps head dims
# <= 128 (`tfx.ops.attention.choose_implementation`) whatever JAX would allow on Hopper.
CUDNN_ASSUMED = 90800
CAPABILITY_ASSUMED = (9, 0)

_TARGETS: list[str] = []


def backend() -> str:
  """'gpu', 'tpu' or 'cpu': the platform kernels are traced for (see the module docstring)."""
  return _TARGETS[-1] if _TARGETS else jax.default_backend()


@contextlib.contextmanager
def lowering_for(platform: str) -> Iterator[None]:
  """Traces inside the block are for `platform` ('gpu', 'tpu' or 'cpu') whatever this machine is.

  Only tracing and lowering are meaningful inside it: a function traced here for a GPU runs
  nowhere but on a GPU. For 'gpu' without cuDNN installed, JAX's cuDNN attention wrapper is
  given `CUDNN_ASSUMED` as the installed version for the duration of the block.
  """
  if platform not in LOWERING_PLATFORMS:
    raise ValueError(f"unknown platform {platform!r}; choose {', '.join(LOWERING_PLATFORMS)}")
  with contextlib.ExitStack() as stack:
    if platform == "gpu":
      stack.enter_context(_assumed_cudnn())
    _TARGETS.append(platform)
    stack.callback(_TARGETS.pop)
    yield


@contextlib.contextmanager
def _assumed_cudnn() -> Iterator[None]:
  """JAX's `check_cudnn_version` answers `CUDNN_ASSUMED` when no cuDNN is installed here, and its
  `check_compute_capability` compares with `CAPABILITY_ASSUMED` when no GPU is here. It is JAX's
  private module: if it moved, nothing is replaced and cuDNN attention is refused (the refusal's
  reason says why), which the report shows."""
  fused = _cudnn_module()
  assumed = {}
  if fused is not None and getattr(fused, "cuda_versions", None) is None:  # else cuDNN's own answer stands
    assumed["check_cudnn_version"] = lambda: CUDNN_ASSUMED
  if jax.default_backend() != "gpu":
    assumed["check_compute_capability"] = lambda wanted: tuple(int(x) for x in wanted.split(".")) <= CAPABILITY_ASSUMED
  with _replaced(fused, assumed):
    yield


def _cudnn_module():
  """JAX's private cuDNN attention module, or None if it moved."""
  try:
    from jax._src.cudnn import fused_attention_stablehlo as fused  # noqa: PLC0415
  except ImportError:
    return None
  return fused


@contextlib.contextmanager
def _replaced(module, functions: dict) -> Iterator[None]:
  """`module`'s functions of those names replaced inside the block (a name it lacks, or no
  module: nothing replaced), the originals back after it, however it ends."""
  originals = {name: getattr(module, name) for name in functions if hasattr(module, name)}
  for name in originals:
    setattr(module, name, functions[name])
  try:
    yield
  finally:
    for name, original in originals.items():
      setattr(module, name, original)


@contextlib.contextmanager
def cudnn_without_bias_gradient() -> Iterator[None]:
  """Inside the block, JAX's cuDNN attention builds its backward pass without the bias's gradient.

  For a mask alone: JAX folds a boolean mask into an additive bias ([b|1, h|1, t, s], 0 or a
  large negative number) and, from jax 0.8 (`should_export_dbias` always true) to 0.11.0, has
  cuDNN's backward kernel write that bias's gradient too, a [b, 1, t, s] tensor nobody reads (and
  on a mesh that splits the heads, summed over their devices); 0.11.1 stopped it for a boolean
  mask (jax-ml/jax#39512). A mask has no gradient: without it the backward kernel reads the bias
  and writes dq, dk and dv only. The choice is made when the call is traced (it is one of the
  primitive's static arguments, forward and backward both), so only the call itself goes inside
  the block. It is JAX's private module: if it moved, nothing is replaced and the gradient is
  computed.
  """
  with _replaced(_cudnn_module(), {"should_export_dbias": lambda *_: False}):
    yield


def unrolled_layers() -> bool:
  """Whether a scanned stack of layers left to choose its layout (`model.scan_unroll=-1`, the
  configs' default) runs as one unrolled loop over its stacked parameters, rather than one layer an
  iteration: on a GPU, not on a CPU or TPU.

  A scanned loop writes each layer's saved activations into stacked buffers (zero-filled first,
  then one in-place update kernel per residual a layer) and slices them out again in the backward
  pass; unrolled, each layer's kernels write and read their own, and XLA merges the rematerialised
  forward ops with the forward pass. Compiled for an H100 (the configs as configured, bf16, 32 rows,
  `model.attention=pallas` where dropout would otherwise send attention to XLA; `python -m
  tfx.bench --config configs/C.py --lower gpu --topology h100`), bytes a step scanned -> unrolled
  and memory: BERT-base 67.1 -> 50.2 GB (5.68 -> 6.52 GiB), RoBERTa-base 68.9 -> 51.9, ELECTRA-base
  92.6 -> 69.8 (5.76 -> 8.66 GiB), BART-base 120.0 -> 91.2 (7.46 -> 12.93 GiB), T5-base 103.6 ->
  70.5 (8.55 -> 10.41 GiB), XLNet-base 300.2 -> 264.5 (14.28 -> 20.49 GiB); BERT-base at its own
  256 rows 460.2 -> 334.8 GB, 32.45 -> 41.72 GiB. The one device comparison (an H100, 2026-11-27,
  with other changes beside it) ran the unrolled steps 1.2-2.1x faster; the byte count predicted the
  fusions' time within about 5%. The price is memory (above) and compile time (about twice, and
  growing with depth where a scan's does not): `model.scan_unroll=1` keeps the scan. On a CPU the
  scan costs no step time and saves memory and compile time; on a TPU (not timed) BERT-base's step
  for a v5e 2x2 moves 10% fewer bytes unrolled for the same memory, but compiles four times longer
  (610 against 154 s here), so a TPU keeps the scan too.
  """
  return backend() == "gpu"


def one_pass_reductions() -> bool:
  """Whether row statistics are taken as one variadic reduction that reads a tensor once (a max
  and a sum of exponentials; a count, mean and squared deviations) rather than one reduction per
  statistic. On a GPU that is a pass over the tensor less (GPT-2-small's step for an H100 at 32
  rows: 4.6 GB of 107.3); XLA:CPU runs such reductions 1.6-2x slower than the separate ones, so
  not there; on a TPU it has not been measured, so not there either.
  """
  return backend() == "gpu"


def row_sums_as_products() -> bool:
  """Whether a wide sum over many rows (the gradient of the output layer's [vocab] bias: [b, n, v]
  summed over b and n) is computed as a product with a vector of ones (`tfx.ops.losses.sum_rows`).

  XLA:CPU hands the reduce to YNNPACK, which took 30 ms for float32 [8, 85, 32000] on this 2-core
  CPU against 2 ms for the product (XLNet's head at 4 layers of d 256: 47.5 ms of an 812 ms step);
  for narrow biases (d_model, d_ff wide) it made no difference in the step, so they keep the reduce,
  and so do the GPU and TPU, whose reductions fuse with the producer of the rows.
  """
  return backend() == "cpu"


def row_major_weight_gradients() -> bool:
  """Whether a dense layer's weight gradient x^T . dy (x [n, k], dy [n, m], contracting the rows n)
  is computed from a transposed copy of the narrower operand, so that the matmul contracts its left
  operand's last dim and its right operand's first (`tfx.nn.layers.weight_gradient`).

  XLA:CPU hands that form to YNNPACK and the other (both operands contracting their rows) to an
  Eigen kernel: with one thread each, T5 medium's weight gradients ran at about 30 GFLOP/s in Eigen
  against about 50 in YNNPACK (the peer benchmark's matmul time 1838 -> 1601 ms a step, the copies
  included); on this 2-core CPU the step got 1-7% faster (GPT-2, T5), BERT's no slower. GPU and
  TPU matmuls read a transposed operand as it is, and the copy would only cost memory traffic.
  """
  return backend() == "cpu"


def flattened_matmuls() -> bool:
  """Whether a dense layer's matmul runs as one 2-D matmul, its leading and contracted dims merged by
  reshapes (`tfx.nn.layers.flat_matmul`): on a CPU (XLA:CPU's kernels want it) and a GPU (its
  layouts are row-major, the reshapes free: compiled for an H100 either way, GPT-2-small and
  T5-base move the same 99.7 and 70.5 GB a step at 32 rows), not on a TPU. XLA:TPU tiles every
  array's two minor dims and picks each intermediate's layout for its users, so the reshapes on
  either side of a 2-D matmul become relayout copies (the fused q, k, v projection's
  [n, h * 3 * d] written row-major, copied column-major, reshaped to [b, t, h, 3, d] and copied to another
  tiling, and the same again for its gradient). Compiled for a v5e 2x2 at the suite's batch
  (`make tpu-compile ARGS="--only MODEL --skip-depth"`), bytes a step and memory per chip,
  flattened -> each product keeping its dims: GPT-2-small 134.0 -> 120.8 GB (14.59 -> 13.78
  GiB), BERT-base 63.0 -> 53.3 (5.13 -> 4.22), T5-base 118.9 -> 94.3 (8.22 -> 7.60), XLNet-base
  180.3 -> 157.3 (10.71 -> 9.67). Merging only the leading dims (the contracted and output dims
  kept) was worse than merging none: T5-base 98.3 GB.
  """
  return backend() != "tpu"


def fused_gated_projections() -> bool:
  """Whether a gated MLP's two input projections (wi_0, wi_1) run as one matmul
  (`tfx.nn.layers.fused_projections`, as a self-attention's q, k and v always do).

  Compiled for an H100 (`make gpu-compile ARGS="--only t5_base --skip-depth --batch 32"`), T5-base's
  step moves 72.4 GB instead of 75.6 (x read once, and no sum of two input gradients). On XLA:CPU
  the peer benchmark's small T5 (d_model 128) got 3-4% slower in one process (the stacked kernel
  and the two interleaved halves cost more than they save there), medium and deep no faster: not
  there. Compiled for a v5e 2x2 (T5-base at the suite's batch, the products keeping their dims):
  94.3 GB a step against 100.5 with two matmuls.
  """
  return backend() != "cpu"


def stored_hidden_gradient() -> bool:
  """Whether the gradient at the pre-activation of an MLP that drops its hidden layer is stored as
  it arrives before the bias's sum reads it (`tfx.ops.dropout.stored_gradient`): on a GPU, where
  XLA otherwise writes it in float32 and reads it again (BART-base's step for an H100: 72.8 -> 69.2
  GB). XLA:CPU's and XLA:TPU's fusions have not been looked at for it, so not there.
  """
  return backend() == "gpu"


def whole_positional_table() -> bool:
  """Whether XLNet's positional scores against encodings projected per row (dropped per row in
  training) are one table over all the queries (`tfx.nn.xlnet.positional_scores`), rather than two
  halves each against its window of the encodings, stacked. XLNet-base's own step compiled for an
  H100 at 32 rows: 174.0 -> 169.2 GB on the Pallas kernel, 252.2 -> 247.4 on XLA's attention
  (15.50 -> 15.14 GiB); for a v5e 2x2 the halves move less (1034.5 against 1047.0 GB, 7.36 against
  7.61 GiB), so not there; XLA:CPU not looked at.
  """
  return backend() == "gpu"


def autodiff_attention_dropout() -> bool:
  """Whether a model's attention with dropout, where the Pallas kernel does not run, is einsum
  attention with autodiff's backward pass (`tfx.nn.attention._reference_with_dropout`: on an H100
  it moves fewer bytes, BERT-base's own step at 32 rows 79.6 against 91.6 GB) rather than
  `tfx.ops.attention.softmax_attention` with its own (the same function and keep bits). Not on a
  TPU: XLA:TPU (libtpu 0.0.42, jax 0.10's pin) crashed with a segmentation fault in
  `FusedSpatialMajorConvolution::MakeConvWindows` compiling autodiff's form inside a
  rematerialised, scanned stack of two or more layers at head dim 64, 12 heads and 512 tokens: 8 of
  the 11 configs/*_base.py did not compile for a v5e 2x2 (stop 67; `make compile-configs`).
  """
  return backend() != "tpu"
