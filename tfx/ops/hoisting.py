"""Values a layer computes from constants alone, kept inside the layer loop.

Under `jax.grad` a scan (the scanned layer stack) runs its forward loop after moving out of it
every value that depends on the loop's constants alone (`jax._src.lax.control_flow.loops.
_scan_known_hoisting`): a scalar fill broadcast to the scores' shape, a mask shared by the layers
broadcast over the heads. Moved out, such a value is computed once and stored whole, a loop input
that every layer reads back from memory; left inside, XLA fuses the broadcast into its consumer
and it costs nothing. BERT-base with attention dropout, 32 rows of 512, compiled for an H100 with
its layers scanned, stored two float32 [32, 12, 512, 512] fills, the mask broadcast to the heads
and the dropout's float32 zeros of every activation (1.2 GiB), and read them in every layer.

`tied(x, data)` is `x` itself, bitwise, computed (as far as JAX can tell) from the first element
of `data`: `x | (bits(data[0...0]) & 0)`. XLA folds the `& 0` to a constant and the rest away, so
the compiled program is the one without the tie; JAX sees a value of the loop and leaves it
there. `where(cond, x, fill)` is `jnp.where` with its condition and scalar fill so tied to `x`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _bits(x: jax.Array) -> jax.Array:
  """x's bits as an unsigned integer of its width (bool as uint8)."""
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint8)
  return lax.bitcast_convert_type(x, _UNSIGNED[x.dtype.itemsize])


def _zero_of(data: jax.Array) -> jax.Array:
  """An unsigned scalar 0 computed from data's first element (XLA: a constant)."""
  first = lax.slice(data, (0,) * data.ndim, (1,) * data.ndim).reshape(())
  return _bits(first) & 0


def tied(x: jax.Array, data: jax.Array) -> jax.Array:
  """x, bitwise, as a function of `data` (any shape, non-empty) for JAX and of nothing for XLA."""
  x = jnp.asarray(x)
  zero = _zero_of(data)
  if x.dtype == jnp.bool_:
    return x | (zero != 0)
  bits = _bits(x)
  tied_bits = bits | zero.astype(bits.dtype)
  if jnp.issubdtype(x.dtype, jnp.integer):
    return tied_bits.astype(x.dtype)  # same width: the bits are the value
  return lax.bitcast_convert_type(tied_bits, x.dtype)


def where(cond: jax.Array, x: jax.Array, fill: float) -> jax.Array:
  """jnp.where(cond, x, fill) for `cond` broadcastable to x and a Python scalar `fill`, in x's
  dtype and shape, with nothing a scanned layer's gradient would move out of its loop."""
  return jnp.where(tied(cond, x), x, tied(jnp.asarray(fill, x.dtype), x))
