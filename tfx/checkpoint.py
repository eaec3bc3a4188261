"""Checkpoints: orbax CheckpointManager holding the train state and the data position, verified.

`WORKDIR/checkpoints/<step>/` has two orbax items, `state` (the sharded TrainState, restored onto
whatever mesh the run now has) and `data` (the reader position, JSON), and `tfx_manifest.json`:
the size and sha256 of every file of the step, the save time and whether the state was finite.

orbax-checkpoint 0.12.8 commits a step atomically (a temporary directory renamed when complete)
but keeps no checksum of the data: its zarr3 layout has a crc32c on the shard index only, and the
default layout none, so a flipped bit loads silently. The manifest is written right after orbax
commits the step (its post-finalization callback for async saves, at once for synchronous ones);
a step killed between the two has no manifest and is "unverified": it is still restored, and its
parameters are checked to be finite. `restore_good` verifies before restoring and falls back to the
previous step when the latest is damaged; a damaged step is moved to WORKDIR/checkpoints_set_aside/
(never deleted) so that the run can save that step again.
"""

import collections
import datetime
import hashlib
import json
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from tfx.errors import UserError

MANIFEST = "tfx_manifest.json"
# orbax rewrites its step metadata when it commits the step (after the manifest is written): not checksummed
UNHASHED = (MANIFEST, "_CHECKPOINT_METADATA")
SET_ASIDE = "checkpoints_set_aside"


class CheckpointError(UserError):
  """A checkpoint that cannot be read; the message says what to do."""


class CheckpointMismatch(CheckpointError):
  """A readable checkpoint of other array shapes than the config builds (never damage)."""


def checkpoint_dir(workdir) -> epath.Path:
  """WORKDIR/checkpoints (absolute for local paths; gs:// as it is)."""
  directory = epath.Path(workdir) / "checkpoints"
  return directory if "://" in str(directory) else epath.Path(os.path.abspath(directory))


class _Manifests:
  """Steps saved but not yet given a manifest: written once orbax has committed them."""

  def __init__(self, directory: epath.Path):
    self.directory = directory
    self.pending: dict[int, bool] = {}  # step -> finite
    self.lock = threading.Lock()

  def add(self, step: int, finite: bool) -> None:
    with self.lock:
      self.pending[step] = finite

  def write_committed(self) -> None:
    """Writes the manifest of every pending step whose files orbax has finished: into its temporary
    directory when the callback runs before orbax's rename (local disks: the manifest is then
    committed with the step), else into the step's directory."""
    if jax.process_index() != 0:
      return
    with self.lock:
      for step, finite in sorted(self.pending.items()):
        path = self.directory / str(step)
        if not path.exists():
          tmp = sorted(self.directory.glob(f"{step}.orbax-checkpoint-tmp*"))
          path = tmp[-1] if tmp else None
        if path is not None:
          write_manifest(path, step, finite)
          del self.pending[step]


def manager(workdir, *, keep: int, async_save: bool) -> ocp.CheckpointManager:
  directory = checkpoint_dir(workdir)
  manifests = _Manifests(directory)
  hooks = {"async_options": ocp.AsyncOptions(post_finalization_callback=manifests.write_committed)} if async_save else {}
  options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=True, **hooks)
  mngr = ocp.CheckpointManager(directory, options=options, item_names=("state", "data"))
  mngr.tfx_manifests, mngr.tfx_async = manifests, async_save
  return mngr


def save(mngr: ocp.CheckpointManager, step: int, state, data_state: dict, finite: bool = True) -> None:
  """Saves `step` (async if the manager is); its manifest follows the commit."""
  manifests = getattr(mngr, "tfx_manifests", None)
  if manifests is not None:
    manifests.add(step, finite)
  mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)))
  if manifests is not None and not mngr.tfx_async:
    manifests.write_committed()


def finish(mngr: ocp.CheckpointManager) -> None:
  """Waits for a save in flight and writes any manifest still owed."""
  mngr.wait_until_finished()
  manifests = getattr(mngr, "tfx_manifests", None)
  if manifests is not None:
    manifests.write_committed()


def all_finite(tree) -> bool:
  """Whether every floating-point value of `tree` is finite (one reduction on device)."""
  leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
  return bool(jax.jit(lambda xs: jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in xs])))(leaves)) if leaves else True


def abstract_like(abstract_state, shardings):
  """ShapeDtypeStructs carrying the target shardings (restore onto the current mesh)."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_state, shardings)


def _shape_difference(step_dir: epath.Path, abstract_state) -> str:
  """What differs between the (shape, dtype) of the arrays saved in `step_dir` and those of
  `abstract_state`, from the checkpoint's metadata alone; "" when they agree or cannot be read
  (the restore then decides). Checked first, so that orbax is never asked to read arrays into
  other shapes (it fails half-way and leaves its reads running)."""
  try:
    saved = jax.tree.leaves(ocp.StandardCheckpointHandler().metadata(step_dir / "state"))
  except Exception:  # noqa: BLE001  (unreadable metadata: damage, for the restore to report)
    return ""
  if not all(hasattr(x, "shape") and hasattr(x, "dtype") for x in saved):
    return ""
  key = lambda x: f"{tuple(x.shape)} {np.dtype(x.dtype).name}"
  have = collections.Counter(key(x) for x in saved)
  want = collections.Counter(key(x) for x in jax.tree.leaves(abstract_state))
  if have == want:
    return ""
  return (f"it holds arrays of {', '.join(sorted(have - want)[:4])} where this config builds "
          f"{', '.join(sorted(want - have)[:4])}")


def restore(mngr: ocp.CheckpointManager, step: int, abstract_state):
  """Returns (state, data_state) of `step`, or raises CheckpointError naming the directory
  (CheckpointMismatch when its arrays have other shapes than `abstract_state`'s)."""
  path = f"{mngr.directory}/{step}"
  difference = _shape_difference(epath.Path(str(mngr.directory)) / str(step), abstract_state)
  if difference:
    raise CheckpointMismatch(
        f"checkpoint {path} was written by another model or optimizer than this config builds ({difference}); "
        f"restore the config it was written with (the workdir's config.json), or use a new --workdir")
  try:
    out = mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
  except Exception as e:  # noqa: BLE001  (orbax raises many types for damaged files)
    raise CheckpointError(
        f"checkpoint {path} could not be restored ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}). "
        f"If it is damaged, delete that directory to resume from the previous checkpoint, or use a new "
        f"--workdir to start over. If the config changed since it was written, restore the old config.") from e
  return out["state"], dict(out["data"])


# ----------------------------------------------------------------------------- manifests


def _files(step_dir: epath.Path) -> list[epath.Path]:
  """Every file under `step_dir` but the manifest (a walk: epath has no recursive glob on gs://)."""
  out, folders = [], [step_dir]
  while folders:
    for path in sorted(folders.pop().iterdir(), key=lambda p: p.name):
      if path.is_dir():
        folders.append(path)
      elif path.name not in UNHASHED and ".tmp-" not in path.name:
        out.append(path)
  return sorted(out, key=lambda p: str(p))


def _sha256(path: epath.Path) -> str:
  digest = hashlib.sha256()
  with path.open("rb") as f:
    for chunk in iter(lambda: f.read(1 << 22), b""):
      digest.update(chunk)
  return digest.hexdigest()


def write_manifest(step_dir: epath.Path, step: int, finite: bool) -> None:
  files = {str(p.relative_to(step_dir)): {"bytes": p.stat().length, "sha256": _sha256(p)} for p in _files(step_dir)}
  manifest = {"step": step, "time": time.time(), "finite": bool(finite), "files": files,
              "bytes": sum(f["bytes"] for f in files.values())}
  _write_atomic(step_dir / MANIFEST, json.dumps(manifest, indent=1))


def _write_atomic(path: epath.Path, text: str) -> None:
  """A whole file or none (a kill mid-write leaves no torn manifest): local files via a rename;
  a gs:// object write is atomic by itself."""
  if "://" in str(path):
    path.write_text(text)
    return
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "w") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def verify(step_dir: epath.Path) -> tuple[str, str, dict]:
  """(status, detail, manifest) of a step directory. status: 'ok', 'damaged', 'nonfinite' or
  'unverified' (no manifest: saved before tfx wrote them, or killed between commit and manifest)."""
  path = step_dir / MANIFEST
  if not path.exists():
    return "unverified", "no manifest", {}
  try:
    manifest = json.loads(path.read_text())
    files = manifest["files"]
  except (ValueError, KeyError, TypeError):
    return "damaged", f"{MANIFEST} is unreadable", {}
  for name, want in files.items():
    p = step_dir / name
    if not p.exists():
      return "damaged", f"{name} is missing", manifest
    if p.stat().length != want["bytes"]:
      return "damaged", f"{name} has {p.stat().length} bytes, {want['bytes']} were saved (truncated?)", manifest
    if _sha256(p) != want["sha256"]:
      return "damaged", f"{name} does not match its checksum", manifest
  if not manifest.get("finite", True):
    return "nonfinite", "saved with non-finite values", manifest
  return "ok", f"{len(files)} files verified", manifest


def steps(workdir) -> dict[int, epath.Path]:
  """{step: directory} of the committed steps. Orbax's temporary directories are left out, and so
  is a step directory orbax has not finalized: on gs:// a step is written in place and committed by
  its commit_success.txt, so one cut short by a crash has its final name but is not a checkpoint."""
  directory = checkpoint_dir(workdir)
  if not directory.exists():
    return {}
  return {int(p.name): p for p in directory.iterdir()
          if p.name.isdigit() and p.is_dir() and ocp.path.step.is_path_finalized(p)}


def set_aside(workdir, step: int, why: str) -> epath.Path:
  """Moves checkpoint `step` to WORKDIR/checkpoints_set_aside/<step>[.n] (nothing is deleted). Process 0
  moves; every process reaches the same verdict on its own and skips the step."""
  source = checkpoint_dir(workdir) / str(step)
  root = epath.Path(workdir) / SET_ASIDE
  if jax.process_index() != 0:
    return root / str(step)
  root.mkdir(parents=True, exist_ok=True)
  target, n = root / str(step), 1
  while target.exists():
    target, n = root / f"{step}.{n}", n + 1
  if "://" in str(source):
    import fsspec

    fs, _ = fsspec.core.url_to_fs(str(source))
    fs.mv(str(source), str(target), recursive=True)
  else:
    os.rename(source, target)
  (target / "SET_ASIDE_REASON.txt").write_text(why + "\n")
  return target


def restore_good(workdir, mngr: ocp.CheckpointManager, abstract_state, *, step: int = 0, note=print,
                 move_aside: bool = True):
  """(state, data_state, step) of the newest good checkpoint (of `step` if > 0), or None if the
  workdir has none. A damaged, unreadable or non-finite step is reported in one line, moved aside
  (when `move_aside`) and the next older one tried. A step whose files all match their manifest's
  checksums but that does not restore (a config that builds another state, a storage error) is
  not damaged: CheckpointError, and nothing is moved. Raises CheckpointError if none is good."""
  found = steps(workdir)
  marker = epath.Path(workdir) / SET_ASIDE / f"restore_step_{step}.done"
  if step and move_aside and marker.exists():  # applied by an earlier invocation: resume as usual
    note(f"train.restore_step={step} was applied by an earlier run of this command ({marker}); resuming from the "
         f"newest checkpoint. To roll back to step {step} again, delete that file.")
    step = 0
  _barrier("tfx-restore-listed")  # every process has its view of the steps before process 0 moves any
  if not found:
    if step:
      raise CheckpointError(f"train.restore_step={step}: {checkpoint_dir(workdir)} has no checkpoints")
    return None
  if step:
    if step not in found:
      raise CheckpointError(f"train.restore_step={step}: no such checkpoint; {checkpoint_dir(workdir)} has steps "
                            f"{sorted(found)}")
    if move_aside and jax.process_index() == 0:
      marker.parent.mkdir(parents=True, exist_ok=True)
      marker.write_text(f"train.restore_step={step} applied at {time.time()}\n")
    for later in sorted(s for s in found if s > step):
      if move_aside:
        where = set_aside(workdir, later, f"set aside by train.restore_step={step}")
        note(f"checkpoint {later} set aside to {where} (train.restore_step={step})")
  candidates = sorted((s for s in found if not step or s <= step), reverse=True)
  problems = []
  for s in candidates:
    status, detail, _ = verify(found[s])
    state = None
    if status in ("ok", "unverified"):
      try:
        state, data_state = restore(mngr, s, abstract_state)
      except CheckpointMismatch as e:  # a config that builds other shapes: never damage
        raise CheckpointMismatch(f"{e}. Nothing was set aside.") from None
      except CheckpointError as e:
        if status == "ok":  # every file matches its checksum: not damage but this run's config, code or storage
          raise CheckpointError(f"{e} Its files match their checksums, so nothing was set aside.") from e.__cause__
        status, detail = "damaged", str(e.__cause__ or e).splitlines()[0][:200]
    if state is not None and not all_finite(state.params if hasattr(state, "params") else state):
      status, detail = "nonfinite", "its parameters are not finite"
    if state is not None and status != "nonfinite":
      _barrier(f"tfx-restored-{s}")  # processes that reached different verdicts fail here, not later
      if move_aside:
        mngr.reload()
      return state, data_state, s
    problems.append(f"step {s}: {detail}")
    older = [c for c in candidates if c < s]
    _barrier(f"tfx-set-aside-{s}")  # every process is done reading step s (and agrees it is bad)
    if move_aside:
      where = set_aside(workdir, s, f"{status}: {detail}")
      note(f"warning: checkpoint {s} is {status} ({detail}); moved to {where}; "
           + (f"trying step {older[0]}" if older else "no older checkpoint"))
    else:
      note(f"warning: checkpoint {s} is {status} ({detail}); " + (f"using step {older[0]}" if older else ""))
  raise CheckpointError(f"no checkpoint in {checkpoint_dir(workdir)} could be restored ({'; '.join(problems)}); "
                        f"start over with a new --workdir")


def _barrier(name: str) -> None:
  """All processes of a multi-host run meet here; a process that arrives with another name (it
  reached another verdict on a checkpoint) makes the check fail instead of restoring other bits."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


def describe(workdir) -> list[dict]:
  """One row per checkpoint: step, time, size, status (ok / damaged / unverified / nonfinite), finite."""
  rows = []
  for s, path in sorted(steps(workdir).items()):
    status, detail, manifest = verify(path)
    size = manifest.get("bytes") if manifest else sum(p.stat().length for p in _files(path))
    when = manifest.get("time") if manifest else path.stat().mtime
    rows.append({"step": s, "time": datetime.datetime.fromtimestamp(when, datetime.timezone.utc).strftime(
        "%Y-%m-%d %H:%M:%S UTC") if when else "?", "bytes": size, "status": status, "detail": detail,
                 "finite": manifest.get("finite") if manifest else None})
  return rows
