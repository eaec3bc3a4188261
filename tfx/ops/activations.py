"""MLP activations with a one-pass backward on accelerators: the residual is the input alone.

`gelu`, `gelu_exact` and `silu` (what the models call) take the one-pass versions below when the
step is traced for a GPU or TPU and jax.nn's autodiff on a CPU (see their definition); a gated
MLP's product act(gate) * up (`geglu`, `swiglu`) is one op with a one-pass backward on a GPU.

Autodiff of `jax.nn.gelu(x, approximate=True)` keeps tanh(u) (and x) for the backward pass and
computes the derivative in several elementwise steps; on an accelerator, where these passes are
bound by memory bandwidth, XLA then writes an extra [b, t, f] tensor in the forward pass and, in
a rematerialised layer, recomputes tanh in a kernel of its own before the gradient's. Here the
backward pass reads x and the incoming gradient once and recomputes whatever it needs in
registers:

    gelu (tanh):  y = x/2 (1 + t),  t = tanh(c (x + a x^3)),  c = sqrt(2/pi), a = 0.044715
                  dy/dx = (1 + t)/2 + x/2 (1 - t^2) c (1 + 3 a x^2)
                        = s + 2 c x s (1 - s) (1 + 3 a x^2),  s = sigmoid(2 c (x + a x^3))
    gelu (erf):   y = x Phi(x),     dy/dx = Phi(x) + x phi(x)
    silu:         y = x s,  s = sigmoid(x),  dy/dx = s (1 + x (1 - s))

Both passes compute in float32 and return the input's dtype (bf16 in, bf16 out), so a bf16
model's activation is no less exact than autodiff's bf16 arithmetic. The tanh GELU's derivative
is written with sigmoid, not tanh: with the forward pass's tanh(u) in it, XLA merged the two and
kept tanh(u) as a float32 [b, t, f] residual (an optimization barrier on x prevents that too, but
costs more: it splits the backward pass's fusions). Compiled for an H100 at 32 rows, against
jax.nn's (`tfx.bench_traffic`; layers unrolled / scanned): GPT-2-small's kernels move 114.9 ->
110.1 / 151.9 -> 144.7 GB a step and its unrolled step needs 14.5 instead of 16.7 GiB; BERT-base's
(erf GELU) 54.8 -> 49.9 / 79.1 -> 69.4 GB, 6.9 instead of 9.2 GiB.
"""

import math
from typing import Callable

import jax
import jax.numpy as jnp

from tfx.ops import target

_C = math.sqrt(2.0 / math.pi)
_A = 0.044715


def _gelu_tanh(x):
  return 0.5 * x * (1.0 + jnp.tanh(_C * (x + _A * x * x * x)))


def _d_gelu_tanh(x):
  # (1 + t)/2 = sigmoid(2u) and (1 - t^2)/2 = 2 s (1 - s): no cancellation where t is near -1
  s = jax.nn.sigmoid(2.0 * _C * (x + _A * x * x * x))
  return s + 2.0 * _C * x * s * (1.0 - s) * (1.0 + 3.0 * _A * x * x)


def _gelu_erf(x):
  return 0.5 * x * (1.0 + jax.lax.erf(x * (1.0 / math.sqrt(2.0))))


def _d_gelu_erf(x):
  cdf = 0.5 * (1.0 + jax.lax.erf(x * (1.0 / math.sqrt(2.0))))
  return cdf + x * jnp.exp(-0.5 * x * x) * (1.0 / math.sqrt(2.0 * math.pi))


def _silu(x):
  return x * jax.nn.sigmoid(x)


def _d_silu(x):
  s = jax.nn.sigmoid(x)
  return s * (1.0 + x * (1.0 - s))


def _in_float32(f: Callable, x: jax.Array) -> jax.Array:
  """f(x) computed in float32 and rounded to x's dtype."""
  return f(x.astype(jnp.float32)).astype(x.dtype)


def _one_pass(f: Callable, df: Callable) -> Callable:
  """f as a function of x [...] (any float dtype) whose VJP keeps x and calls df(x) once."""

  @jax.custom_vjp
  def act(x):
    return _in_float32(f, x)

  def fwd(x):
    return act(x), x

  def bwd(x, dy):
    return ((dy.astype(jnp.float32) * df(x.astype(jnp.float32))).astype(x.dtype),)

  act.defvjp(fwd, bwd)
  return act


gelu_one_pass = _one_pass(_gelu_tanh, _d_gelu_tanh)
gelu_exact_one_pass = _one_pass(_gelu_erf, _d_gelu_erf)
silu_one_pass = _one_pass(_silu, _d_silu)


def _gated_one_pass(f: Callable, df: Callable) -> Callable:
  """pair [..., f, 2] (a gated MLP's gate and up projections, stacked last) -> act(gate) * up
  [..., f] (GEGLU, SwiGLU), whose VJP keeps the pair alone and computes both gradients in one pass.

  With act's own one-pass VJP and autodiff of the product, act(gate) is a residual of the product,
  and XLA merges the backward pass's recomputation of it with the forward pass's (remat's
  prevent_cse is off in a scanned stack, and an unrolled one thereby keeps forward values): the
  forward pass writes act(gate) beside the product and the backward pass reads it again, though it
  reads gate anyway. Here the backward pass recomputes act(gate) from the pair behind an
  optimization barrier, which XLA cannot merge with the forward pass, in the kernel that reads the
  pair and the incoming gradient once and writes the pair's gradient. The pair is the fused
  projection's output as the matmul wrote it, so the barrier copies nothing. The arithmetic is the
  composition's (act in float32 rounded to the input dtype, the products in the input dtype): the
  same values and gradients. Compiled for an H100 (`make gpu-compile ARGS="--only t5_base
  --skip-depth --batch 32"`), T5-base's step moves 70.5 GB instead of 72.4 and needs 10.41 GiB
  instead of 11.26; at the issue's 128 x 512, 238.0 GB instead of 245.9 and 31.52 GiB instead of
  35.20 (each encoder layer's MLP backward kernel reads the incoming gradient and the pair and
  writes the pair's gradient, 1.34 GB, where it also read the kept act(gate), 1.61 GB, and the
  forward kernel no longer writes act(gate)).
  """

  @jax.custom_vjp
  def gated(pair):
    return _in_float32(f, pair[..., 0]) * pair[..., 1]

  def fwd(pair):
    return gated(pair), pair

  def bwd(pair, dy):
    pair = jax.lax.optimization_barrier(pair)
    gate, up = pair[..., 0], pair[..., 1]
    d_gate = ((dy * up).astype(jnp.float32) * df(gate.astype(jnp.float32))).astype(gate.dtype)
    return (jnp.stack([d_gate, dy * _in_float32(f, gate)], axis=-1),)

  gated.defvjp(fwd, bwd)
  return gated


geglu_one_pass = _gated_one_pass(_gelu_tanh, _d_gelu_tanh)
swiglu_one_pass = _gated_one_pass(_silu, _d_silu)


def _by_platform(one_pass: Callable, autodiff: Callable) -> Callable:
  def act(x: jax.Array) -> jax.Array:
    return autodiff(x) if target.backend() == "cpu" else one_pass(x)
  return act


# What the models call: the one-pass backward where the step is bound by memory bandwidth (GPU,
# TPU, and a cross-lowering for one), jax.nn's autodiff on a CPU, where computing the derivative
# again costs more than reading a kept tanh(u): the peer benchmark's T5 at 12 layers (gated GELU),
# interleaved against HF, ran 0.86x HF's step with the one-pass version and 0.79x with jax.nn's
# (2026-11-27, `make bench-peer ARGS="--models t5 --sizes deep --reps 5"`).
gelu = _by_platform(gelu_one_pass, lambda x: jax.nn.gelu(x, approximate=True))  # GPT-2's gelu_new, T5 v1.1's
gelu_exact = _by_platform(gelu_exact_one_pass, lambda x: jax.nn.gelu(x, approximate=False))  # BERT's gelu
silu = _by_platform(silu_one_pass, jax.nn.silu)


def _on_a_gpu(one_pass: Callable, act: Callable) -> Callable:
  """A gated product from the stacked pair [..., f, 2]: the one-pass op traced for a GPU, else
  act(gate) * up with the platform's `act`. Compiled for a TPU (v5e 2x2, `make tpu-compile
  ARGS="--only t5_base --skip-depth"`) the one-pass op made T5-base's step move 123.2 GB instead of
  118.9 (copies 46.1 -> 50.3: XLA:TPU relays out the pair's gradient, whose minor dim is 2) and need
  9.16 GiB instead of 8.22; since the TPU's matmuls keep their dims (`target.flattened_matmuls`),
  94.5 GB against 94.3 and 7.68 GiB against 7.60: no gain there either."""
  def gated(pair: jax.Array) -> jax.Array:
    return one_pass(pair) if target.backend() == "gpu" else act(pair[..., 0]) * pair[..., 1]
  return gated


# What a gated MLP calls on the fused projection's output (T5 v1.1's GEGLU, SwiGLU).
geglu = _on_a_gpu(geglu_one_pass, gelu)
swiglu = _on_a_gpu(swiglu_one_pass, silu)
