"""Small linen layers with logical axis names on every parameter.

Parameter axis names: `vocab`, `embed`, `heads`, `kv` (head dim), `mlp`, `position`, `norm`,
`layers` (added by nn.scan). Activation axis names start with `act_`. `tfx/parallel.py`
maps both to mesh axes; the modules never name a mesh axis.
"""

import dataclasses
import functools
import math
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from tfx import ops
from tfx.ops import activations, dropout, hoisting, target

Dtype = Any


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The model's hyper-parameters, resolved from `config.model` plus the data facts."""

  family: str
  vocab_size: int
  max_length: int
  num_layers: int
  d_model: int
  num_heads: int
  d_ff: int
  num_decoder_layers: int = 0
  head_dim: int = 0  # 0 = d_model // num_heads (resolved in __post_init__)
  position: str = "learned"
  rope_base: float = 10000.0
  relative_buckets: int = 32
  relative_max_distance: int = 128
  relative_distance: str = "columns"  # T5 bias from column offsets ([1, h, t, s]) or from position ids
  type_vocab_size: int = 0
  mem_len: int = 0
  reuse_len: int = 0
  clamp_len: int = -1
  untie_r: bool = True
  embed_norm: bool = False
  embed_scale: bool = False
  scale_attention: bool = True
  scale_tied_logits: bool = False
  norm: str = "pre"
  norm_type: str = "layernorm"
  mlp: str = "gelu"
  use_bias: bool = True
  tie_embeddings: bool = True
  dropout: float = 0.0
  attention_dropout: float = 0.0
  mlp_dropout: float = -1.0  # on the MLP's hidden layer; < 0: `dropout` (T5's, XLNet's placement)
  dtype: str = "float32"
  scan_layers: bool = True
  scan_unroll: int = -1  # layers per scanned iteration (0 = all: unrolled, parameters still stacked; -1 = by platform)
  remat: str = "none"
  attention: str = "auto"
  packed_runs: int = 0  # cuDNN's packed layout for packed rows of at most this many runs of one id (0 = the mask)
  causal_blocks: int = 0  # query blocks of XLA's causal self-attention (0 = automatic, 1 = none)
  loss_chunk: int = 0  # tokens per row per chunk of the fused output projection + loss (0 = logits materialised)
  init_std: float = 0.02
  norm_eps: float = 1e-6

  def __post_init__(self):
    if not self.head_dim:
      object.__setattr__(self, "head_dim", self.d_model // self.num_heads)

  @property
  def hidden_dropout(self) -> float:
    """The dropout rate on the MLP's hidden layer: `mlp_dropout`, or `dropout` where it is < 0."""
    return self.dropout if self.mlp_dropout < 0 else self.mlp_dropout

  def layers_per_iteration(self, length: int) -> int:
    """The `unroll` of a scanned stack of `length` layers: `scan_unroll` layers an iteration, all of
    them for 0, and for -1 (the configs' default) all of them where the step is traced for a GPU
    and one elsewhere (`tfx.ops.target.unrolled_layers`)."""
    unroll = self.scan_unroll
    if unroll < 0:
      unroll = 0 if target.unrolled_layers() else 1
    return unroll or length

  @property
  def attention_dim(self) -> int:
    """num_heads * head_dim: the width of the query / key / value projections."""
    return self.num_heads * self.head_dim

  @property
  def decoder_layers(self) -> int:
    return self.num_decoder_layers or self.num_layers

  @property
  def compute_dtype(self) -> Dtype:
    return jnp.dtype(self.dtype)

  @classmethod
  def from_config(cls, model_cfg, *, vocab_size: int, max_length: int) -> "ModelConfig":
    """Builds it from a `config.model` ConfigDict (unknown extra fields are ignored)."""
    fields = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in model_cfg.to_dict().items() if k in fields}
    return cls(vocab_size=vocab_size, max_length=max_length, **values)


def take_rows(x: jax.Array | None, rows: jax.Array | None) -> jax.Array | None:
  """x [b, t, ...] at `rows` [b, n] int -> [b, n, ...] (x itself when rows is None; None stays None)."""
  if rows is None or x is None:
    return x
  return jnp.take_along_axis(x, rows.reshape(rows.shape + (1,) * (x.ndim - 2)), axis=1)


def rows_together(fn, h: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(fn(h), fn(g)) for a row-by-row `fn` of two streams h [b, t, e] and g [b, n, e] (XLNet's
  content and query streams through their shared MLP), as one call on their rows side by side:
  called apart, XLA merges the two calls' matmuls by copying their [b, ., f] hidden layers into
  one buffer each way (117 MB a layer of XLNet-base at 32 x (512 + 85) rows)."""
  both = fn(jnp.concatenate([h, g], axis=1))  # [b, t + n, e]
  return both[:, :h.shape[1]], both[:, h.shape[1]:]


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
  """Logical sharding constraint on an activation (no-op outside a mesh + rules context)."""
  return nn.with_logical_constraint(x, tuple(axes))


def _init(std: float):
  return nn.initializers.normal(stddev=std)


def flat_matmul(x: jax.Array, kernel: jax.Array, n_in: int) -> jax.Array:
  """x [..., *in] . kernel [*in, *out] -> [..., *out] in x's dtype; on a CPU or GPU as one 2-D
  matmul [n, k] . [k, m] (`target.flattened_matmuls`).

  The leading dims are flattened into one row dim (and the contracted ones into one): the
  kernel's gradient is then a single-contraction x2^T . dy2, which XLA:CPU runs as one matmul,
  where with the leading dims kept apart it transposes one operand into a copy first and runs a
  slower kernel on the result (T5's gated MLP: 13% of the step on the CPU peer benchmark). The
  reshapes are layout no-ops there; on a sharded batch they merge a sharded major dim with
  unsharded minor ones, which GSPMD keeps sharded. XLA:TPU tiles an array's two minor dims and
  lays out each intermediate as suits its users, so a reshape is rarely free there: the product
  keeps its dims.

  `kernel` is the parameter itself (float32 master weights): it is cast to x's dtype for the
  matmul, and its gradient is that matmul's float32 product (`project`).
  """
  if not target.flattened_matmuls():
    return project(x, kernel, False, n_in)
  lead, ins, outs = x.shape[: x.ndim - n_in], kernel.shape[:n_in], kernel.shape[n_in:]
  k, m = math.prod(ins), math.prod(outs)
  y = project(x.reshape(-1, k), kernel.reshape(k, m))  # [n, m]
  return y.reshape(lead + outs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def project(x: jax.Array, kernel: jax.Array, kernel_major: bool = False, n_in: int = 1) -> jax.Array:
  """x [..., *in] . kernel [*in, *out] (or [*out, *in] with `kernel_major`) -> [..., *out] in x's
  dtype, contracting x's last `n_in` dims, the kernel cast to x's dtype; the kernel's gradient
  comes out of its matmul in the kernel's own dtype.

  Autodiff would give the gradient of a bf16 matmul in bf16 and convert it to the float32 master
  weights' dtype afterwards: rounded to 8 bits once on one device (the matmul accumulates in
  float32 inside), and on a data- or FSDP-sharded batch each device's partial sum rounded, then
  summed across the devices by a bf16 all-reduce (so compiled by XLA:GPU and XLA:TPU; NCCL rounds
  at every step of its ring). Here the partial sums stay float32 and so does their reduction, as
  Megatron-LM reduces bf16 models' gradients in float32, for one more float32 write and read of
  each weight's gradient. In float32 it is autodiff's computation on a GPU or TPU; on a CPU the
  same products summed in another kernel's order (`weight_gradient`). The kernel's gradient
  contracts all of x's leading dims at once, as autodiff of the same einsum does.
  """
  return _project_fwd(x, kernel, kernel_major, n_in)[0]


def _kernel_dims(kernel: jax.Array, kernel_major: bool, n_in: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """The kernel's (in, out) dims."""
  n_out = kernel.ndim - n_in
  dims = tuple(range(kernel.ndim))
  return (dims[n_out:], dims[:n_out]) if kernel_major else (dims[:n_in], dims[n_in:])


def _project_fwd(x, kernel, kernel_major, n_in):
  ins, _ = _kernel_dims(kernel, kernel_major, n_in)
  dims = (tuple(range(x.ndim - n_in, x.ndim)), ins)
  return jax.lax.dot_general(x, kernel.astype(x.dtype), (dims, ((), ()))), (x, kernel)


def _project_bwd(kernel_major, n_in, residuals, g):
  x, kernel = residuals  # x [..., *in]; g [..., *out]
  _, outs = _kernel_dims(kernel, kernel_major, n_in)
  w = kernel.astype(x.dtype)
  d_x = jax.lax.dot_general(g, w, ((tuple(range(g.ndim - len(outs), g.ndim)), outs), ((), ())))  # [..., *in]
  return d_x, weight_gradient(x, g, kernel.dtype, kernel_major, n_in)


project.defvjp(_project_fwd, _project_bwd)


def weight_gradient(x: jax.Array, g: jax.Array, dtype: Dtype, kernel_major: bool = False,
                    n_in: int = 1) -> jax.Array:
  """x [..., *in], g [..., *out] (the same leading dims; `n_in` dims in) -> the product x^T . g
  over all the leading dims in `dtype`: [*in, *out], or [*out, *in] with `kernel_major`.

  Traced for a CPU (`target.row_major_weight_gradients`) the operands are flattened to 2-D, the
  narrower one is transposed into a copy first and the matmul reads both row-major, which XLA:CPU
  runs in YNNPACK rather than Eigen; the optimization barriers keep XLA from folding a transpose
  back into the matmul (its transpose folding would, and a transposed output would be folded by
  swapping the operands). The same sum of products, accumulated in the other kernel's order.
  """
  n_lead = x.ndim - n_in
  ins, outs = x.shape[n_lead:], g.shape[n_lead:]
  if not target.row_major_weight_gradients():
    lead = tuple(range(n_lead))
    d_w = jax.lax.dot_general(g, x, ((lead, lead), ((), ())), preferred_element_type=dtype)  # [*out, *in]
    n_out = len(outs)
    return d_w if kernel_major else d_w.transpose(tuple(range(n_out, d_w.ndim)) + tuple(range(n_out)))
  fixed = jax.lax.optimization_barrier
  x2, g2 = x.reshape(-1, math.prod(ins)), g.reshape(-1, math.prod(outs))  # [n, k], [n, m]
  x_narrower = x2.shape[1] <= g2.shape[1]
  a, b = (x2, g2) if x_narrower else (g2, x2)  # the narrower one is copied transposed
  d_w = jax.lax.dot_general(fixed(a.T), b, (((1,), (0,)), ((), ())), preferred_element_type=dtype)
  # d_w: [k, m] when x was the narrower, else [m, k]
  d_w = d_w if x_narrower != kernel_major else fixed(d_w).T
  return d_w.reshape(outs + ins if kernel_major else ins + outs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def add_bias(y: jax.Array, bias: jax.Array, wide: bool = False) -> jax.Array:
  """y [..., *s] + bias [*s] in y's dtype, with bias's gradient summed over the leading dims in
  float32 (returned in bias's dtype); `wide` for a bias as wide as the vocabulary, whose gradient
  is summed by `ops.sum_rows` (a product with ones on a CPU).

  Autodiff of `y + bias.astype(y.dtype)` sums the incoming gradient in y's dtype: in a bf16
  model each bias's gradient is a bf16 sum over every token of the batch, whose partial sums are
  rounded to 8 bits (16 x 512 rows of unit-scale gradients summed on this CPU: 2.2% off the
  exact sum, relative to its largest entry; tests/test_model.py). Here the gradient is converted as it is read, so the
  sum costs no more bytes; in float32 it is the same sum as autodiff's.
  """
  return y + bias.astype(y.dtype)


def _add_bias_fwd(y, bias, wide):
  return add_bias(y, bias, wide), bias  # the parameter itself: alive anyway, it only carries shape and dtype


def _add_bias_bwd(wide, bias, g):
  return g, ops.sum_rows(g, g.ndim - bias.ndim, wide).astype(bias.dtype)


add_bias.defvjp(_add_bias_fwd, _add_bias_bwd)


def broadcast_param(param: jax.Array, shape: tuple[int, ...], dtype: Dtype) -> jax.Array:
  """param [*s] as an array of `shape` [..., *s] in `dtype` (XLNet's mask_emb for every slot),
  its gradient summed over the new leading dims in float32 (`add_bias` onto zeros, which XLA
  drops), where autodiff's broadcast would sum it in `dtype`."""
  return add_bias(jnp.zeros(shape, dtype), param)


def gathered(param: jax.Array, axes: tuple[str | None, ...], dtype: Dtype) -> jax.Array:
  """A weight with logical `axes` as its matmul or lookup reads it: its FSDP-sharded `embed` dim
  gathered (its other dims sharded as before: tensor parallelism's stay), as FSDP does for every
  weight before it is used, in `dtype` (the compute dtype its reader casts it to: a bf16 model
  gathers bf16; the values come back in the parameter's dtype, exactly). Its gradient is laid out
  the same way, in the parameter's dtype (float32: not rounded), so each device computes its whole
  partial product once and the partitioner reduce-scatters it into the parameter's shards. Left to
  itself, XLA:TPU ran each FSDP matmul as a windowed loop over the weight's shards that read and
  wrote its [tokens, out] accumulator (or, for the head's gradient, read the whole [b, t, vocab]
  gradient) once per shard. A no-op outside a mesh."""
  return _gathered(param, tuple(None if a == "embed" else a for a in axes), jnp.dtype(dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gathered(param, axes, dtype):
  return constrain(param.astype(dtype), axes).astype(param.dtype)


def _gathered_fwd(param, axes, dtype):
  return _gathered(param, axes, dtype), None


def _gathered_bwd(axes, dtype, _, g):
  return (constrain(g, axes),)


_gathered.defvjp(_gathered_fwd, _gathered_bwd)


class DenseGeneral(nn.Module):
  """y = x . W (+ b), contracting the last `len(in_shape)` dims of x.

  Attributes:
    in_shape: shape of the contracted trailing dims of x.
    out_shape: shape of the output trailing dims.
    axes: logical names of W's dims (in dims then out dims).
  """

  in_shape: tuple[int, ...]
  out_shape: tuple[int, ...]
  axes: tuple[str, ...]
  use_bias: bool = True
  init_std: float = 0.02
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array | None, *, weights_only: bool = False):
    """[..., *in_shape] -> [..., *out_shape]; with `weights_only` (x unused, may be None) the
    (kernel, bias or None) parameters themselves, for a caller that fuses the projection."""
    kernel = self.param(
        "kernel",
        nn.with_logical_partitioning(_init(self.init_std), self.axes),
        self.in_shape + self.out_shape,
        jnp.float32,
    )
    bias = None
    if self.use_bias:
      bias = self.param(
          "bias",
          nn.with_logical_partitioning(nn.initializers.zeros, self.axes[len(self.in_shape):]),
          self.out_shape,
          jnp.float32,
      )
      bias = gathered(bias, self.axes[len(self.in_shape):], self.dtype)
    kernel = gathered(kernel, self.axes, self.dtype)
    if weights_only:
      return kernel, bias
    y = flat_matmul(x.astype(self.dtype), kernel, len(self.in_shape))
    return y if bias is None else add_bias(y, bias)


class Embed(nn.Module):
  """Token embedding table [vocab, embed]; `attend` is the tied output projection."""

  num_embeddings: int
  features: int
  axes: tuple[str, str] = ("vocab", "embed")
  init_std: float = 0.02
  dtype: Dtype = jnp.float32

  def setup(self):
    self.embedding = self.param(
        "embedding",
        nn.with_logical_partitioning(_init(self.init_std), self.axes),
        (self.num_embeddings, self.features),
        jnp.float32,
    )

  def __call__(self, ids: jax.Array) -> jax.Array:
    """[b, t] int -> [b, t, e]."""
    # Gathered (`gathered`) before the lookup: a lookup from an embed-sharded table gives an
    # embed-sharded output that XLA cannot re-shard to the batch-sharded activation without
    # replicating it in full.
    return jnp.take(self.table(), ids, axis=0).astype(self.dtype)

  def table(self) -> jax.Array:
    """[rows, e]: the table as a lookup or the tied output projection reads it (`gathered`)."""
    return gathered(self.embedding, self.axes, self.dtype)

  def attend(self, x: jax.Array) -> jax.Array:
    """[b, t, e] -> [b, t, v] logits against the embedding table."""
    return project(x.astype(self.dtype), self.table(), True)  # [b, t, v]


class Norm(nn.Module):
  """LayerNorm ('layernorm', with bias) or RMSNorm ('rmsnorm', scale only), in float32."""

  kind: str = "layernorm"
  eps: float = 1e-6
  use_bias: bool = True
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    d = x.shape[-1]
    scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)), (d,), jnp.float32)
    if self.kind == "rmsnorm":
      y = ops.rms_norm(x, scale, eps=self.eps)
    elif self.kind == "layernorm":
      bias = None
      if self.use_bias:
        bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, ("norm",)), (d,), jnp.float32)
      y = ops.layer_norm(x, scale, bias, eps=self.eps)
    else:
      raise ValueError(f"unknown norm_type {self.kind!r}")
    return y.astype(self.dtype)


def make_norm(cfg: ModelConfig, name: str | None = None) -> Norm:
  return Norm(kind=cfg.norm_type, eps=cfg.norm_eps, use_bias=cfg.use_bias, dtype=cfg.compute_dtype, name=name)


_ACTIVATIONS = {
    "gelu": activations.gelu,
    "gelu_exact": activations.gelu_exact,
    "relu": jax.nn.relu,
    "geglu": activations.gelu,
    "swiglu": activations.silu,
}
GATED = ("geglu", "swiglu")
# A gated kind's act(gate) * up as one op on the fused projection's output (its backward pass
# recomputes act(gate): `activations.geglu`).
_GATED_PRODUCTS = {"geglu": activations.geglu, "swiglu": activations.swiglu}
MLP_KINDS = tuple(_ACTIVATIONS)


def activation(kind: str):
  """The elementwise activation of an MLP kind (the gate's, for gated kinds)."""
  return _ACTIVATIONS[kind]


def fused_projections(projections: list["DenseGeneral"], x: jax.Array, dtype, stacked: bool = False,
                      bias_apart: bool = False) -> list[jax.Array] | jax.Array | tuple:
  """x [b, t, e] through `DenseGeneral`s that share it (e -> [o, *rest] each) as one matmul.

  The kernels stay separate parameters; stacked on an axis right after their first output dim
  ([e, o, n, *rest]), a kernel sharded on that dim (heads or mlp: tensor parallelism) stays sharded
  on the flattened output dim. One matmul reads x once, and in the backward pass the input gradient
  is one matmul over the n projections' output gradients together, instead of n matmuls whose
  products are then summed. Used for q, k and v of a self-attention, k and v of a cross-attention,
  and a gated MLP's two input projections. Returns [b, t, o, *rest] each, or with `stacked` the
  matmul's output [b, t, o, n, *rest] as it is, and with `bias_apart` too (that output before the
  bias, the stacked bias [o, n, *rest] float32 or None): for a kernel that adds it as it reads.
  """
  weights = [p(None, weights_only=True) for p in projections]
  kernel = jnp.stack([w[0] for w in weights], axis=2)  # [e, o, n, *rest], float32
  bias = None if weights[0][1] is None else jnp.stack([w[1] for w in weights], axis=1)  # [o, n, *rest]
  y = flat_matmul(x.astype(dtype), kernel, 1)  # [b, t, o, n, *rest]
  if stacked and bias_apart:
    return y, bias
  if bias is not None:
    y = add_bias(y, bias)
  if stacked:
    return y
  at = (slice(None),) * x.ndim  # up to and including o
  return [y[at + (i,)] for i in range(len(projections))]


class Mlp(nn.Module):
  """Position-wise feed-forward: dense-act-dense, or gated (act(x W0) * (x W1)) W_out."""

  cfg: ModelConfig
  deterministic: bool = True

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    """[b, t, e] -> [b, t, e]."""
    cfg = self.cfg
    dense = lambda out, axes, name: DenseGeneral(
        (x.shape[-1],) if axes[0] == "embed" else (cfg.d_ff,), (out,), axes,
        use_bias=cfg.use_bias, init_std=cfg.init_std, dtype=cfg.compute_dtype, name=name)
    act = _ACTIVATIONS[cfg.mlp]
    if cfg.mlp in GATED:  # act(x W0) * (x W1)
      projections = [dense(cfg.d_ff, ("embed", "mlp"), name) for name in ("wi_0", "wi_1")]
      if target.fused_gated_projections():  # one matmul: [b, t, f, 2], gate and up
        h = _GATED_PRODUCTS[cfg.mlp](fused_projections(projections, x, cfg.compute_dtype, stacked=True))
      else:
        gate, up = (projection(x) for projection in projections)
        h = act(gate) * up
    else:
      pre = dense(cfg.d_ff, ("embed", "mlp"), "wi_0")(x)  # [b, t, f]
      if cfg.hidden_dropout > 0 and not self.deterministic and target.stored_hidden_gradient():
        pre = dropout.stored_gradient(pre)
      h = act(pre)
    h = constrain(h, ("act_batch", "act_length", "act_mlp"))
    h = Dropout(cfg.hidden_dropout)(h, deterministic=self.deterministic)
    return dense(cfg.d_model, ("mlp", "embed"), "wo")(h)  # [b, t, e]


class Dropout(nn.Module):
  """Dropout drawn from the `dropout` collection: x [...] -> [...], the entries
  `tfx.ops.dropout.keep_bits` drops for the layer's seed zeroed and the others scaled by 1 / P(keep).
  Unlike flax's `nn.Dropout` (threefry bits, a bool mask XLA writes out and reads back in the
  backward pass), the bits are a counter hash drawn where they are used, forward and backward
  (`tfx.ops.dropout.dropout`); nor are there zeros of the input's shape built from a constant,
  which a scanned stack under `jax.grad` would store whole outside its loop (`tfx.ops.hoisting`)."""

  rate: float

  @nn.compact
  def __call__(self, x: jax.Array, deterministic: bool) -> jax.Array:
    if deterministic or self.rate == 0.0:
      return x
    if self.rate == 1.0:  # as flax: zeros, and no NaN gradient from 1 / 0
      return hoisting.where(False, x, 0.0)
    return dropout.dropout(x, dropout.seed(self.make_rng("dropout")), self.rate)
