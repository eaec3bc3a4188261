"""Position encodings as pure functions: sinusoidal tables and rotary embeddings.

Positions are explicit int arrays [b, t] (they restart at 0 for each packed document), never
an implicit arange, so packing and KV-cache decoding see the same positions.
"""

import jax
import jax.numpy as jnp


def sinusoidal(positions: jax.Array, dim: int, base: float = 10000.0) -> jax.Array:
  """Vaswani et al. encodings: [..., dim] = concat(sin(p * w), cos(p * w)), w_k = base^(-2k/dim).

  Args:
    positions: [...] int or float.
    dim: even embedding width.
  Returns:
    [..., dim] float32.
  """
  half = dim // 2
  freqs = base ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / dim)  # [dim/2]
  angles = positions.astype(jnp.float32)[..., None] * freqs  # [..., dim/2]
  return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


def rotary(x: jax.Array, positions: jax.Array, base: float = 10000.0) -> jax.Array:
  """Rotary position embedding (RoPE), rotate-half convention.

  Args:
    x: [b, t, h, d] queries or keys (d even).
    positions: [b, t] int.
  Returns:
    [b, t, h, d] in x's dtype.
  """
  d = x.shape[-1]
  half = d // 2
  freqs = base ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / d)  # [d/2]
  angles = positions.astype(jnp.float32)[:, :, None, None] * freqs  # [b, t, 1, d/2]
  sin, cos = jnp.sin(angles), jnp.cos(angles)
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)  # [b, t, h, d/2] each
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def t5_relative_buckets(relative: jax.Array, *, bidirectional: bool, num_buckets: int = 32,
                        max_distance: int = 128) -> jax.Array:
  """T5's bucketing of relative positions (key position - query position).

  Half the buckets (of each direction, when bidirectional) hold exact small distances; the
  rest cover distances up to `max_distance` logarithmically; farther ones share the last.
  Unidirectional (decoder) buckets only distinguish keys at or before the query.

  Args:
    relative: int [...] key position minus query position.
  Returns:
    int32 [...] bucket index in [0, num_buckets).
  """
  bucket = jnp.zeros_like(relative)
  if bidirectional:
    num_buckets //= 2
    bucket = bucket + (relative > 0).astype(relative.dtype) * num_buckets
    distance = jnp.abs(relative)
  else:
    distance = jnp.maximum(-relative, 0)
  max_exact = num_buckets // 2
  is_small = distance < max_exact
  scaled = jnp.log(jnp.maximum(distance, 1).astype(jnp.float32) / max_exact) / jnp.log(max_distance / max_exact)
  large = max_exact + (scaled * (num_buckets - max_exact)).astype(relative.dtype)
  large = jnp.minimum(large, num_buckets - 1)
  return (bucket + jnp.where(is_small, distance, large)).astype(jnp.int32)
