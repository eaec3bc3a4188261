"""Does cuDNN's fused attention (through jax.nn.dot_product_attention) give finite gradients for a
query row that may attend no key? On a GPU:

    python benchmarks/gpu/cudnn_empty_rows.py

JAX hands cuDNN a boolean mask as a bias of -2**41 (bf16) on the masked scores, so such a row's
scores are all that one large negative number. For each shape and mask it prints whether the
output and the q, k, v gradients are finite, and which query rows of dq are not: rows with no key
("empty"), or others. `unmasked` is the same problem with the empty rows given every key, what
tfx.ops.dot_product_attention hands the kernel before it zeroes those rows' output.
"""

import jax
import jax.numpy as jnp
import numpy as np


def probe(t: int, s: int, empty: int, *, unmask: bool, seed: int) -> str:
  rng = np.random.default_rng(seed)
  b, h, d = 2, 4, 64
  q = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.bfloat16)
  k, v = (jnp.asarray(rng.normal(size=(b, s, h, d)), jnp.bfloat16) for _ in range(2))
  keep = rng.random((b, 1, t, s)) < 0.7
  keep[:, :, t - empty:, :] = False  # the last `empty` query rows may attend nothing
  mask = jnp.asarray(keep)
  rows = jnp.any(mask, axis=-1)[..., None]  # [b, 1, t, 1]
  kernel_mask = mask | ~rows if unmask else mask
  cot = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)

  def loss(q, k, v):
    out = jax.nn.dot_product_attention(q, k, v, mask=kernel_mask, implementation="cudnn")
    out = jnp.where(jnp.moveaxis(rows, 1, 2), out, 0)  # [b, t, 1, 1]: zero the empty rows
    return jnp.sum(out.astype(jnp.float32) * cot), out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  finite = {name: bool(jnp.all(jnp.isfinite(x))) for name, x in zip(("out", "dq", "dk", "dv"), (out, *grads))}
  bad = np.asarray(~jnp.all(jnp.isfinite(grads[0].astype(jnp.float32)), axis=(0, 2, 3)))  # [t]
  where = "-"
  if bad.any():
    in_empty = bad[t - empty:].sum() if empty else 0
    where = f"{int(bad.sum())} rows ({int(in_empty)} of them empty)"
  flags = " ".join(f"{n}={'ok' if f else 'NaN'}" for n, f in finite.items())
  setting = "unmasked" if unmask else "as is"
  return f"{t:4d} x {s:4d}  empty rows {empty:3d}  {setting:8s}  {flags}  non-finite dq: {where}"


def main() -> None:
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
  for t, s in ((128, 64), (128, 128), (114, 512), (512, 512), (64, 128)):
    for empty in (0, 16):
      for unmask in ((False, True) if empty else (False,)):
        try:
          print(probe(t, s, empty, unmask=unmask, seed=t + s + empty), flush=True)
        except Exception as e:  # noqa: BLE001  (cuDNN refuses a shape)
          print(f"{t:4d} x {s:4d}  empty rows {empty:3d}  refused: {str(e).splitlines()[0][:100]}", flush=True)


if __name__ == "__main__":
  main()
