"""Runs a few training steps of configs/tiny.py on each requested mesh, on 8 fake CPU devices.

Started by tests/test_sharding.py in its own process (the device count is fixed when JAX
starts). Writes, per mesh, the train losses, the final parameters and, for a stateful objective
(XLNet memory), the final objective state to OUT/<mesh>.npz.

    python tests/mesh_worker.py OUT TOKENIZER CONFIG OVERRIDES "8,1,1" "2,4,1" ...

CONFIG is a file under configs/; OVERRIDES a JSON list of extra --config.k=v arguments (they
come last, so they may replace the worker's own step count and batch size).
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from tfx import train  # noqa: E402
from tfx.config import load_config  # noqa: E402
from tfx.metrics import read_metrics  # noqa: E402


def first_mlp_kernel(params):
  """The first stacked MLP input kernel [layers, embed, mlp] of any family."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    name = jax.tree_util.keystr(path)
    if "['mlp']['wi_0']['kernel']" in name and "['layers']" in name:
      return leaf
  raise KeyError("no scanned MLP kernel")


def main(out: str, tokenizer: str, config_name: str, overrides: list[str], meshes: list[str]) -> None:
  assert jax.device_count() == 8, jax.devices()
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  for mesh in meshes:
    d, f, t = mesh.split(",")
    config = load_config(os.path.join(root, "configs", config_name), [
        f"--config.mesh.data={d}", f"--config.mesh.fsdp={f}", f"--config.mesh.tensor={t}",
        f"--config.data.tokenizer={tokenizer}", "--config.train.steps=4", "--config.train.log_every=1",
        "--config.train.eval_every=0", "--config.train.checkpoint_every=0", "--config.model.dropout=0.1",
        "--config.train.batch_size=16", "--config.data.max_documents=60", *overrides])
    workdir = os.path.join(out, "run_" + mesh.replace(",", "_"))
    result = train.run(config, workdir)
    state = result["state"]
    # Parameters really are sharded as the mesh says (not silently replicated).
    kernel = first_mlp_kernel(state.params)
    shard_shape = kernel.sharding.shard_shape(kernel.shape)  # [layers, embed, mlp] on one device
    losses = [r["loss"] for r in read_metrics(workdir) if r["split"] == "train"]
    flat = {jax.tree_util.keystr(k): np.asarray(jax.device_get(v))
            for k, v in jax.tree_util.tree_leaves_with_path(state.params)}
    extra = {}
    if state.objective_state is not None:  # e.g. XLNet memory [layers, batch, mem, e], sharded on batch
      memory = state.objective_state
      extra = {"state": np.asarray(jax.device_get(memory)),
               "state_shard_shape": np.asarray(memory.sharding.shard_shape(memory.shape))}
    np.savez(os.path.join(out, mesh.replace(",", "_") + ".npz"), losses=np.asarray(losses),
             shard_shape=np.asarray(shard_shape), full_shape=np.asarray(kernel.shape), **extra, **flat)


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), sys.argv[5:])
