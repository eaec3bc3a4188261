"""Device mesh, logical-axis rules, sharded state creation and global batch placement.

Parallelism is a choice of mesh shape and of the rules below, never of model code:
- data parallel: `batch` over `data` (and `fsdp`);
- FSDP (ZeRO-3): parameter `embed` dims over `fsdp`, so each device holds 1/fsdp of every
  matrix and its optimizer state, gathered just in time by XLA;
- tensor parallel: `heads`, `mlp` and `vocab` over `tensor` (Megatron-style splits).
"""

import contextlib
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tfx.config import resolve_mesh_shape

@contextlib.contextmanager
def compilation_cache(directory: str | None = None, *, enabled: bool = True):
  """JAX's persistent compilation cache inside the block, as it was after it: at `directory` (None:
  wherever it is, if anywhere), or not read or written at all (`enabled=False`: a compile that is
  timed). JAX decides once per process whether to use the cache, so it is asked again both ways."""
  from jax.experimental.compilation_cache import compilation_cache as cache  # noqa: PLC0415

  settings = {"jax_enable_compilation_cache": enabled}
  if directory is not None:
    settings["jax_compilation_cache_dir"] = directory
  before = {name: getattr(jax.config, name) for name in settings}
  for name, value in settings.items():
    jax.config.update(name, value)
  cache.reset_cache()
  try:
    yield
  finally:
    for name, value in before.items():
      jax.config.update(name, value)
    cache.reset_cache()


MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# Logical axis -> mesh axis (or None = replicated). Parameters use the plain names,
# activations the `act_` names.
LOGICAL_AXIS_RULES: tuple[tuple[str, Any], ...] = (
    ("act_batch", BATCH_AXES),
    ("act_length", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv", None),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv", None),
    ("mlp", "tensor"),
    ("position", None),
    ("relpos", None),
    ("token_type", None),
    ("norm", None),
    ("layers", None),
)


# Exit status of a process that stops because another process of the job died (EX_TEMPFAIL: a
# restart of the whole job resumes from the last checkpoint).
PEER_LOST_EXIT = 75


def initialize_distributed() -> None:
  """Multi-host start-up: `jax.distributed.initialize()` when launched on several hosts.

  On TPU VMs and under SLURM/Open MPI JAX finds the coordinator itself; elsewhere set
  JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID. A single process does nothing.
  `python -m tfx.launch` sets these, and TFX_HEARTBEAT_TIMEOUT (config.launch.heartbeat_timeout):
  then a process that dies makes the others exit within that many seconds with one line
  (`watch_peers`) instead of waiting in a collective.
  """
  import os

  explicit = "JAX_COORDINATOR_ADDRESS" in os.environ
  on_tpu_pod = os.environ.get("TPU_WORKER_HOSTNAMES", "").count(",") > 0
  if explicit or on_tpu_pod or os.environ.get("TFX_DISTRIBUTED") == "1":
    timeout = int(os.environ.get("TFX_HEARTBEAT_TIMEOUT", "0") or 0)
    kwargs = {"heartbeat_timeout_seconds": timeout} if timeout > 0 else {}
    if timeout > 0:  # a dead task is dropped from the live set instead of aborting every process
      jax.config.update("jax_enable_recoverability", True)
    if explicit:
      jax.distributed.initialize(
          coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
          num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
          process_id=int(os.environ["JAX_PROCESS_ID"]),
          **kwargs,
      )
    else:
      local = os.environ.get("TFX_LOCAL_DEVICE_IDS", "")  # set by tfx.launch slurm: every GPU of the node
      if local:
        kwargs["local_device_ids"] = [int(i) for i in local.split(",")]
      jax.distributed.initialize(**kwargs)
    if timeout > 0 and jax.process_count() > 1:
      watch_peers(timeout)


def watch_peers(timeout: int, poll_seconds: float = 1.0) -> None:
  """Starts a daemon thread that ends this process when another process of the job is gone.

  The coordination service drops a process from its live set after `timeout` seconds without a
  heartbeat (heartbeats come from C++ threads, so a busy Python thread is never taken for dead).
  A process that leaves normally first writes a key saying so; one that vanished without it was
  killed or lost its host. Either way the survivors would wait forever in their next collective,
  so this prints one line and exits with PEER_LOST_EXIT. (If process 0, which hosts the service,
  dies, JAX itself aborts the others at once with "the leader task was preempted/died".)
  """
  import atexit
  import os
  import sys
  import threading
  import time

  from jax._src import distributed

  client, me, count = distributed.global_state.client, jax.process_index(), jax.process_count()
  leaving = threading.Event()

  def leave():  # at exit, before JAX's own shutdown
    leaving.set()
    try:
      client.key_value_set(f"tfx/left/{me}", "1")
      if me == 0:  # the service lives here: let the others disconnect first (recoverable mode has no exit barrier)
        deadline = time.monotonic() + timeout
        while len(client.get_live_nodes(list(range(count)))) > 1 and time.monotonic() < deadline:
          time.sleep(0.2)
    except Exception:  # noqa: BLE001  (the service may already be gone)
      pass

  def stop(message: str):
    if not leaving.is_set():
      print(f"tfx: process {me}: {message}; exiting. Restart the job (the same command on every host) to resume "
            f"from the last checkpoint.", file=sys.stderr, flush=True)
      os._exit(PEER_LOST_EXIT)

  def has_left(process: int) -> bool:
    try:
      client.key_value_try_get(f"tfx/left/{process}")
      return True
    except Exception:  # noqa: BLE001  (NOT_FOUND)
      return False

  def watch():
    left_at: dict[int, float] = {}
    while not leaving.is_set():
      try:
        live = client.get_live_nodes(list(range(count)))
      except Exception as e:  # noqa: BLE001
        stop(f"lost the coordination service (process 0): {str(e).splitlines()[0][:200]}")
        return
      for other in range(count):
        if other == me or other in live:
          continue
        if not has_left(other):
          stop(f"process {other} of {count} stopped sending heartbeats for {timeout} s (killed, crashed or its "
               f"host was lost)")
        elif time.monotonic() - left_at.setdefault(other, time.monotonic()) > timeout:
          stop(f"process {other} of {count} exited {timeout} s ago while this one was still running")
      time.sleep(poll_seconds)

  atexit.register(leave)
  threading.Thread(target=watch, name="tfx-watch-peers", daemon=True).start()


def make_mesh(mesh_cfg, devices=None) -> Mesh:
  """A Mesh with axes ('data', 'fsdp', 'tensor') of Auto type, sizes from the config."""
  devices = jax.devices() if devices is None else devices
  shape = resolve_mesh_shape(mesh_cfg, len(devices))
  try:
    from jax.experimental import mesh_utils

    grid = mesh_utils.create_device_mesh(shape, devices=devices)
  except Exception:  # noqa: BLE001  (fake or heterogeneous devices: plain order is fine)
    grid = np.asarray(devices).reshape(shape)
  return Mesh(grid, MESH_AXES)


def _fits(shape, spec: P, mesh: Mesh) -> P:
  """Drops mesh axes from dims they do not divide (e.g. an odd vocabulary), so any size runs."""
  out = []
  for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    if axes is None:
      out.append(None)
      continue
    names = axes if isinstance(axes, tuple) else (axes,)
    size = int(np.prod([mesh.shape[a] for a in names]))
    out.append(axes if dim % size == 0 else None)
  return P(*out)


def logical_to_sharding(abstract_tree, mesh: Mesh, rules=LOGICAL_AXIS_RULES):
  """NamedShardings for a tree of (possibly LogicallyPartitioned) abstract values."""
  mesh_specs = nn.logical_to_mesh(nn.get_partition_spec(abstract_tree), rules)
  return jax.tree.map(lambda spec, x: NamedSharding(mesh, _fits(x.shape, spec, mesh)),
                      mesh_specs, nn.unbox(abstract_tree), is_leaf=lambda s: isinstance(s, P))


@contextlib.contextmanager
def context(mesh: Mesh, rules=LOGICAL_AXIS_RULES):
  """Inside: `mesh` is the current mesh and logical names resolve through `rules`."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    yield


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """[batch, length] arrays: batch split over the data axes."""
  return NamedSharding(mesh, P(BATCH_AXES, None))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def global_batch(local_batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
  """Builds the global, sharded batch from this host's rows (`make_array_from_process_local_data`)."""
  sharding = batch_sharding(mesh)
  return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local_batch.items()}
