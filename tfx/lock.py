"""One writer per workdir: a lease, WORKDIR/tfx.lock, held for the life of a run.

The lease names its holder (host, pid, start time, a random token) and a heartbeat that a daemon
thread renews every `timeout / 4` seconds. A second run on the same workdir fails at once naming
the holder. A lease whose holder died (SIGKILL, a lost machine) is taken over when its heartbeat is
older than `train.lock_timeout` seconds, or at once when the holder was on this host and its pid is
gone. Only process 0 of a multi-host run takes it.

Every change of the lease is conditional on the version that was read (compare-and-swap), so of
two launches that race for a free or a stale lease exactly one wins:
  local disk  the version is the content's hash; compare and replace happen under an flock of the
              workdir directory, and the new lease is a complete file renamed into place.
  gs://       GCS generation preconditions through gcsfs: created with ifGenerationMatch=0, renewed
              or taken over with ifGenerationMatch=<the generation read>, deleted the same way.
A run whose heartbeat could not be renewed because another run took the lease over (its own
heartbeat stalled past the timeout) is told by `lost`, and stops before its next checkpoint. So
does a run that could not write its lease at all (a full disk, a storage outage) for longer than
the timeout: by then another run may have taken it over.
"""

import contextlib
import fcntl
import hashlib
import json
import os
import socket
import threading
import time
import uuid
from urllib.parse import quote

import jax
from etils import epath

from tfx.errors import UserError

LOCK_FILE = "tfx.lock"
ATTEMPTS = 5  # compare-and-swap rounds before a launch gives up on a contended lease


class LockError(UserError):
  """Another run holds the workdir."""


class Conflict(Exception):
  """The lease changed since it was read (another launch won the race)."""


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  try:  # a zombie (killed, not yet reaped) holds nothing
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except (OSError, IndexError):
    return True


def _when(t: float) -> str:
  return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def _parse(data: bytes) -> dict:
  try:
    record = json.loads(data)
    return record if isinstance(record, dict) else {}
  except ValueError:
    return {}  # a damaged lease: its holder cannot be named; stale (its heartbeat is unknown)


class LocalLease:
  """The lease file on a local (or shared) disk. Versions are content hashes; each read-compare-
  write holds an flock on the workdir directory, so it is one step for every process of this host
  (on a network file system without flock, a takeover race across hosts is not excluded)."""

  def __init__(self, path: epath.Path):
    self.path = str(path)

  @contextlib.contextmanager
  def _exclusive(self):
    fd = os.open(os.path.dirname(self.path), os.O_RDONLY)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX)
      yield
    finally:
      os.close(fd)  # releases the flock

  def read(self) -> tuple[dict | None, str | None]:
    try:
      with open(self.path, "rb") as f:
        data = f.read()
    except FileNotFoundError:
      return None, None
    return _parse(data), hashlib.sha256(data).hexdigest()

  def write(self, data: bytes, if_version: str | None) -> str:
    """Creates (if_version None) or replaces the lease version `if_version`; raises Conflict."""
    tmp = f"{self.path}.{uuid.uuid4().hex}.tmp"
    with open(tmp, "wb") as f:  # complete before it becomes the lease: no reader sees half of it
      f.write(data)
    try:
      with self._exclusive():
        if self.read()[1] != if_version:
          raise Conflict()
        os.replace(tmp, self.path)
    finally:
      if os.path.exists(tmp):
        os.unlink(tmp)
    return hashlib.sha256(data).hexdigest()

  def delete(self, if_version: str) -> None:
    with self._exclusive():
      if self.read()[1] == if_version:
        os.unlink(self.path)


class GcsLease:
  """The lease object on GCS, through gcsfs's JSON-API calls with generation preconditions."""

  def __init__(self, url: str):
    import fsspec

    self.fs, path = fsspec.core.url_to_fs(url)
    self.bucket, self.key = path.split("/", 1)

  def read(self) -> tuple[dict | None, str | None]:
    try:
      headers, data = self.fs.call("GET", "b/{}/o/{}", self.bucket, self.key, alt="media")
    except FileNotFoundError:
      return None, None
    return _parse(data), headers.get("x-goog-generation")

  def write(self, data: bytes, if_version: str | None) -> str:
    try:
      out = self.fs.call("POST", f"{self.fs._location}/upload/storage/v1/b/{quote(self.bucket)}/o",
                         uploadType="media", name=self.key, ifGenerationMatch=if_version or "0", data=data,
                         headers={"Content-Type": "application/octet-stream"}, json_out=True)
    except (FileExistsError, FileNotFoundError) as e:  # gcsfs: HTTP 412 / 404
      raise Conflict() from e
    return str(out["generation"])

  def delete(self, if_version: str) -> None:
    try:
      self.fs.call("DELETE", "b/{}/o/{}", self.bucket, self.key, ifGenerationMatch=if_version)
    except (FileExistsError, FileNotFoundError):
      pass  # no longer ours


class WorkdirLock:

  def __init__(self, workdir, timeout: float = 120.0, lease=None):
    path = epath.Path(workdir) / LOCK_FILE
    self.where = str(epath.Path(workdir))
    self.timeout = timeout
    self.me = {"host": socket.gethostname(), "pid": os.getpid(), "start": time.time(), "token": uuid.uuid4().hex}
    self.enabled = jax.process_index() == 0
    if lease is None and self.enabled:
      lease = GcsLease(str(path)) if str(path).startswith("gs://") else LocalLease(path)
    self.lease = lease
    self.version = None  # the lease version this run wrote last
    self.lost = None  # the record of a run that took the lease over from this one
    self.renewed = 0.0  # time.time() of this run's last successful write of the lease
    self.failure = None  # the error of the last failed heartbeat, None after a success
    self._stop = threading.Event()
    self._thread = None
    # One beat at a time: check() beats from the main thread while the heartbeat thread may be
    # beating too, and two writes from the same version would make the second one a conflict
    # (this run would think another took its lease over).
    self._beating = threading.Lock()
    self.took_over = None  # the holder record of a stale lease this run took over

  def _record(self) -> bytes:
    return json.dumps(dict(self.me, heartbeat=time.time())).encode()

  def acquire(self) -> "WorkdirLock":
    if not self.enabled:
      return self
    for _ in range(ATTEMPTS):
      holder, version = self.lease.read()
      if holder is not None:
        self._refuse_unless_stale(holder)
      try:
        self.version = self.lease.write(self._record(), version)
      except Conflict:
        continue  # another launch changed the lease between our read and write: look again
      self.renewed = time.time()
      self.took_over = holder
      break
    else:
      holder, _ = self.lease.read()
      self._refuse_unless_stale(holder or {}, raced=True)
    self._thread = threading.Thread(target=self._beat, name="tfx-lock-heartbeat", daemon=True)
    self._thread.start()
    return self

  def _refuse_unless_stale(self, holder: dict, raced: bool = False) -> None:
    age = time.time() - float(holder.get("heartbeat", 0) or 0)
    dead_here = holder.get("host") == self.me["host"] and "pid" in holder and not _alive(int(holder["pid"]))
    if raced or (not dead_here and age < self.timeout):
      raise LockError(f"{self.where} is in use by another run ({self._who(holder, age)}). Wait for it to finish "
                      f"or stop it, or use another --workdir; the lock of a run that died is taken over "
                      f"{self.timeout:.0f} s after its last heartbeat (at once on the same host)")

  @staticmethod
  def _who(holder: dict, age: float) -> str:
    start = _when(float(holder["start"])) if holder.get("start") else "?"
    return (f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, started {start}, "
            f"last heartbeat {age:.0f} s ago")

  def beat(self) -> None:
    """Renews the heartbeat once (the daemon thread's body, and check()'s last try); sets `lost` if
    the lease was taken. Beats from the two threads run one after the other."""
    with self._beating:
      if self.lost is not None:
        return
      try:
        self.version = self.lease.write(self._record(), self.version)
      except Conflict:
        try:
          holder, _ = self.lease.read()  # who took it, for the message
        except Exception:  # noqa: BLE001  (lost all the same)
          holder = None
        self.lost = holder or {}
        self._stop.set()
      except Exception as e:  # noqa: BLE001
        # A full disk, a network blip, gcsfs's HttpError once its own retries are spent: the next
        # beat tries again (the thread must not die), and check() stops the run if none succeeds
        # within the timeout.
        self.failure = e
      else:
        self.renewed, self.failure = time.time(), None

  def check(self) -> None:
    """Raises LockError if another run took the lease over, or if this run could not renew it for
    longer than the timeout (another run may have taken it): this run must not write any more."""
    if self.enabled and self.lost is None and time.time() - self.renewed > self.timeout:
      self.beat()  # one more try before giving up
      age = time.time() - self.renewed
      if self.lost is None and age > self.timeout:
        raise LockError(f"the lock of {self.where} could not be renewed for {age:.0f} s, longer than "
                        f"train.lock_timeout={self.timeout:.0f} s (last error: {self.failure!r}): another run may "
                        f"have taken the workdir over, so this run stops without saving. Check that the workdir "
                        f"is writable, then launch again: it resumes from the last checkpoint")
    if self.lost is not None:
      raise LockError(f"the lock of {self.where} was taken over by another run ({self._who(self.lost, 0)}) while "
                      f"this run's heartbeat was stalled past train.lock_timeout={self.timeout:.0f} s; this run "
                      f"stops without saving. Raise train.lock_timeout if the machine stalls this long")

  def _beat(self) -> None:
    while not self._stop.wait(self.timeout / 4):
      self.beat()

  def release(self) -> None:
    if not self.enabled:
      return
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=5)
    if self.lost is None and self.version is not None:
      try:
        self.lease.delete(self.version)
      except OSError:
        pass

  def __enter__(self):
    return self.acquire()

  def __exit__(self, *exc):
    self.release()
