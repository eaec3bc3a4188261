"""Checkpoints: orbax CheckpointManager holding the train state and the data position.

`WORKDIR/checkpoints/<step>/` has two items: `state` (the sharded TrainState, restored onto
whatever mesh the run now has) and `data` (the reader position, JSON).
"""

import os

import jax
import orbax.checkpoint as ocp
from etils import epath

from tfx.errors import UserError


class CheckpointError(UserError):
  """A checkpoint that cannot be read; the message says what to do."""


def checkpoint_dir(workdir) -> epath.Path:
  """WORKDIR/checkpoints (absolute for local paths; gs:// as it is)."""
  directory = epath.Path(workdir) / "checkpoints"
  return directory if "://" in str(directory) else epath.Path(os.path.abspath(directory))


def manager(workdir, *, keep: int, async_save: bool) -> ocp.CheckpointManager:
  directory = checkpoint_dir(workdir)
  options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=True)
  return ocp.CheckpointManager(directory, options=options, item_names=("state", "data"))


def save(mngr: ocp.CheckpointManager, step: int, state, data_state: dict) -> None:
  mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)))


def abstract_like(abstract_state, shardings):
  """ShapeDtypeStructs carrying the target shardings (restore onto the current mesh)."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_state, shardings)


def restore(mngr: ocp.CheckpointManager, step: int, abstract_state):
  """Returns (state, data_state) of `step`, or raises CheckpointError naming the directory."""
  path = f"{mngr.directory}/{step}"
  try:
    out = mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
  except Exception as e:  # noqa: BLE001  (orbax raises many types for damaged files)
    raise CheckpointError(
        f"checkpoint {path} could not be restored ({type(e).__name__}: {str(e)[:300]}). "
        f"If it is damaged, delete that directory to resume from the previous checkpoint, or use a new "
        f"--workdir to start over. If the config changed since it was written, restore the old config.") from e
  return out["state"], dict(out["data"])
