"""One writer per workdir: a lease file, WORKDIR/tfx.lock, held for the life of a run.

The file names its holder (host, pid, start time) and a heartbeat that a daemon thread renews
every `timeout / 4` seconds. A second run on the same workdir fails at once naming the holder.
A lock whose holder died (SIGKILL, a lost machine) is taken over when its heartbeat is older than
`train.lock_timeout` seconds, or at once when the holder was on this host and its pid is gone.
Only process 0 of a multi-host run takes it.

Local disks create the file atomically (O_CREAT | O_EXCL). gs:// objects are written through
etils.epath, which has no generation precondition: there the lock is written, read back after a
short settle delay and kept only if it is still ours (two launches within that delay of each other
could both read back their own write on an eventually consistent store; GCS is strongly consistent
for a single object, so the later write wins and the earlier launch sees it).
"""

import json
import os
import socket
import threading
import time
import uuid

import jax
from etils import epath

from tfx.errors import UserError

LOCK_FILE = "tfx.lock"
SETTLE_SECONDS = 1.0  # gs:// read-back delay


class LockError(UserError):
  """Another run holds the workdir."""


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


class WorkdirLock:

  def __init__(self, workdir, timeout: float = 120.0):
    self.path = epath.Path(workdir) / LOCK_FILE
    self.remote = "://" in str(self.path)
    self.timeout = timeout
    self.me = {"host": socket.gethostname(), "pid": os.getpid(), "start": time.time(), "token": uuid.uuid4().hex}
    self.enabled = jax.process_index() == 0
    self._stop = threading.Event()
    self._thread = None
    self.took_over = None  # the holder record of a stale lock this run took over

  def _read(self):
    try:
      return json.loads(self.path.read_text())
    except FileNotFoundError:
      return None
    except (ValueError, OSError):
      return {}  # a torn lock file: its holder cannot be named; treated as stale after the timeout

  def _record(self) -> str:
    return json.dumps(dict(self.me, heartbeat=time.time()))

  def acquire(self) -> "WorkdirLock":
    if not self.enabled:
      return self
    holder = self._read()
    if holder is not None:
      self._refuse_unless_stale(holder)
      self.took_over = holder
    if self.remote or holder is not None:
      self.path.write_text(self._record())
      if self.remote:
        time.sleep(SETTLE_SECONDS)
    else:
      try:
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
      except FileExistsError:  # another launch won the race
        self._refuse_unless_stale(self._read() or {})
        return self.acquire()
      with os.fdopen(fd, "w") as f:
        f.write(self._record())
    now = self._read() or {}
    if now.get("token") != self.me["token"]:
      self._refuse_unless_stale(now, raced=True)
    self._thread = threading.Thread(target=self._beat, name="tfx-lock-heartbeat", daemon=True)
    self._thread.start()
    return self

  def _refuse_unless_stale(self, holder: dict, raced: bool = False) -> None:
    age = time.time() - float(holder.get("heartbeat", 0) or 0)
    dead_here = holder.get("host") == self.me["host"] and "pid" in holder and not _alive(int(holder["pid"]))
    if raced or (not dead_here and age < self.timeout):
      who = (f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, started "
             f"{_when(float(holder['start'])) if holder.get('start') else '?'}, last heartbeat {age:.0f} s ago")
      raise LockError(f"{self.path.parent} is in use by another run ({who}). Wait for it to finish or stop it, or "
                      f"use another --workdir; the lock of a run that died is taken over {self.timeout:.0f} s after "
                      f"its last heartbeat (at once on the same host)")

  def _beat(self) -> None:
    while not self._stop.wait(self.timeout / 4):
      try:
        holder = self._read() or {}
        if holder.get("token") == self.me["token"]:
          self.path.write_text(self._record())
      except OSError:
        pass  # a full disk or a network blip: the next beat tries again

  def release(self) -> None:
    if not self.enabled:
      return
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=5)
    try:
      if (self._read() or {}).get("token") == self.me["token"]:
        self.path.unlink()
    except OSError:
      pass

  def __enter__(self):
    return self.acquire()

  def __exit__(self, *exc):
    self.release()
