"""Dropout drawn from a counter hash: the keep bits of every tfx dropout, in XLA and in the
Pallas attention kernel (`tfx.ops.flash_dropout`).

A keep bit is a function of the layer's seed (one uint32 drawn from its `dropout` key for the step:
`seed`) and the element's coordinates in the whole array, nothing else: a stream key per row and
head (three rounds of a 32-bit mixer over the seed, the row and the head) and two more rounds over
the counter within it, whose top 23 bits are compared with the rate.
So the bits are the same on every mesh (an iota over a sharded array gives each shard its global
coordinates), in every kernel and block size, and the backward pass draws them again instead of
reading a stored mask: `dropout` keeps only the seed for its gradient. XLA fuses the hash into the
ops around it; `jax.random.bernoulli` (threefry) drew the same kind of mask but XLA wrote each one
out, as uint32 bits and a bool mask, and read it back in the backward pass (BERT-base's own step
compiled for an H100 at 32 rows: 2.3 GB of its 50.2 a step).

It is not threefry: the stream differs from flax's `nn.Dropout` (which entries are dropped, not
how many on average; the tests check the rate, the independence of seeds and rows, and that the
gradient drops what the forward pass dropped).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from tfx.ops import hoisting

# A keep bit compares the hash's top 23 bits with the rate.
_BITS = 23
_GOLDEN = 0x9E3779B9


def mix(x: jax.Array) -> jax.Array:
  """A bijection of uint32 that spreads every input bit over the output (the 'lowbias32'
  multipliers and shifts found by Wellons' hash prospector)."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


def stream(seed: jax.Array, row: jax.Array, head: jax.Array) -> jax.Array:
  """The uint32 key of one (global row, head)'s elements under one seed (any broadcastable shapes)."""
  row = lax.convert_element_type(row, jnp.uint32)
  head = lax.convert_element_type(head, jnp.uint32)
  return mix(mix(seed ^ mix(row + jnp.uint32(_GOLDEN))) + head)


def threshold(rate: float) -> int:
  """Elements whose hash's top bits fall below this are dropped: P(drop) = threshold / 2**23."""
  return int(round(rate * (1 << _BITS)))


def keep_probability(rate: float) -> float:
  """P(keep) of an element at dropout `rate`, exactly as the 23-bit threshold draws it."""
  return 1.0 - threshold(rate) / (1 << _BITS)


def kept(key: jax.Array, query: jax.Array, column: jax.Array, columns: int, limit: int) -> jax.Array:
  """Keep bits at (query, column) positions (int32, broadcast against each other) of the stream
  `key`, over rows of `columns` columns, against the threshold `limit`."""
  counter = lax.convert_element_type(query * columns + column, jnp.uint32)
  bits = mix(mix(counter ^ key) + key)
  return lax.convert_element_type(bits >> (32 - _BITS), jnp.int32) >= limit


def seed(rng: jax.Array) -> jax.Array:
  """The uint32 seed a layer draws its keep bits from, given its dropout key for the step."""
  return jax.random.bits(rng, (), jnp.uint32)


def keep_bits(seed: jax.Array, shape: tuple[int, ...], rate: float, first_row: int | jax.Array = 0,
              first_head: int | jax.Array = 0, first_query: int = 0, columns: int | None = None) -> jax.Array:
  """bool [*shape]: the keep bits of an array of `shape` under `seed` (uint32 scalar), for the
  rows first_row.. and heads first_head.. of the whole array (a shard's offsets; 0 for a whole one),
  and for an array of three or more axes the queries first_query.. and the first shape[-1] of
  `columns` keys (a block of the attention's [b, h, t, s] probabilities: `columns` is the whole s;
  None: shape[-1]).

  Coordinates: an array of three or more axes [b, *heads, t, s] (attention probabilities [b, h, t,
  s], hidden states [b, t, e]) has a stream key per (row b, heads flattened) and counts t * s + s
  within it; a 2-D one [n, e] a key per row n and counts e; a 1-D one a single key. So attention's
  [b, h, t, s] bits are those the Pallas kernel draws for (row, head, query, key)."""
  if not shape:
    raise ValueError("dropout needs an array of at least one axis")
  n_tail = 2 if len(shape) >= 3 else 1
  if n_tail == 1 and (first_query or columns is not None):
    raise ValueError(f"a block's query offset and columns need an array of three or more axes, got {shape}")
  lead = shape[:-n_tail]
  iota = lambda axis: lax.broadcasted_iota(jnp.int32, shape, axis)
  row = first_row + (iota(0) if lead else 0)
  head = 0
  for axis in range(1, len(lead)):
    head = head * shape[axis] + iota(axis)
  head = first_head + head
  counter = iota(len(shape) - 1)
  if n_tail == 2:  # query * columns + key
    query = iota(len(shape) - 2) + first_query if first_query else iota(len(shape) - 2)
    counter = query * (shape[-1] if columns is None else columns) + counter
  return kept(stream(seed, row, head), 0, counter, 1, threshold(rate))


def _apply(x: jax.Array, seed: jax.Array, rate: float, block: tuple[int, int]) -> jax.Array:
  scale = 1.0 / keep_probability(rate)
  first, columns = block
  keep = keep_bits(seed, x.shape, rate, first_query=first, columns=columns or None)
  return hoisting.where(keep, x * scale, 0.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def dropout(x: jax.Array, seed: jax.Array, rate: float, block: tuple[int, int] = (0, 0)) -> jax.Array:
  """x [..., n] with the entries `keep_bits(seed, x.shape, rate)` drops zeroed and the others
  scaled by 1 / P(keep) (`keep_probability`), in x's dtype; 0 < rate < 1. `block` (first query,
  columns): x is the block of attention probabilities [b, h, t, s] at the queries first.. and the
  first s of `columns` keys, dropped as that part of the whole array; (0, 0): x is whole. Its
  gradient draws the bits again from the seed (behind an optimization barrier, so that XLA cannot
  merge the two draws into one stored mask)."""
  return _apply(x, seed, rate, block)


def _dropout_fwd(x, seed, rate, block):
  return _apply(x, seed, rate, block), seed


def _dropout_bwd(rate, block, seed, g):
  # The bits drawn again where the gradient is formed. Tried and dropped (compiled for an H100,
  # 32 rows): the bits kept as a bool mask behind a barrier (BART-base 87.9 GB a step but 0.9 GiB
  # more memory, the mask drawn early and held; BERT-base 47.4 against 46.7 GB).
  return _apply(g, lax.optimization_barrier(seed), rate, block), None


dropout.defvjp(_dropout_fwd, _dropout_bwd)


@jax.custom_vjp
def stored_gradient(x: jax.Array) -> jax.Array:
  """x itself; its cotangent is written out whole (behind an optimization barrier) before anything
  reads it.

  For the pre-activation of an MLP whose hidden layer drops (`tfx.nn.layers.Mlp`): the gradient
  there is dh * keep / P(keep) * act'(x), and a biased layer sums it over the tokens for the bias's
  gradient. Where the keep bits are a hash drawn in the same pass, XLA:GPU does not fuse that
  product into the bias's column sum (as it does without dropout, GPT-2's): it wrote the product in
  float32 and read it again in a kernel that rounds it to bf16 for the matmuls and sums it, a
  float32 [b, t, f] written and read once more a layer. Stored as it arrives (bf16), the sum reads
  that. Compiled for an H100 at 32 rows (`model.attention=pallas`), BART-base's own step 72.8 ->
  69.2 GB, XLNet-base's 257.4 -> 252.2 (memory +0.04 GiB and unchanged)."""
  return x


def _stored_gradient_fwd(x):
  return x, None


def _stored_gradient_bwd(_, g):
  return (lax.optimization_barrier(g),)


stored_gradient.defvjp(_stored_gradient_fwd, _stored_gradient_bwd)
