"""Local GCS emulator (gcp-storage-emulator, in a subprocess) that gcsfs, etils.epath, tensorstore
and orbax reach without credentials or network (tests/test_gcs.py runs tfx through all of them).
Use: `with start_emulator("tfx-test") as env:` (gs://tfx-test exists), then give a child process
`env={**os.environ, **env}`, e.g. subprocess.run([sys.executable, "-m", "tfx.train", ...], env=...).
Patched emulator gaps: downloads lack x-goog-generation (tensorstore OCDBT: "Malformed
StorageGeneration"), listing ignores startOffset/endOffset (tensorstore List: wrong keys), uploads
and deletes ignore ifGenerationMatch, objects.moveTo answers 501 (gcsfs retries ~33 s, then copies)."""

import contextlib
import json
import os
import select
import subprocess
import sys
import time
import warnings
from unittest import mock


def emulator_env(url: str) -> dict:
  """Environment that points every GCS layer at `url` (http://127.0.0.1:PORT)."""
  return {
      "STORAGE_EMULATOR_HOST": url,  # gcsfs and google-cloud-storage (orbax's HNS check)
      "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",  # read at `import gcsfs`; else 60 s gRPC probes
      "FSSPEC_GS": json.dumps({"token": "anon"}),  # read at `import fsspec`: anonymous gcsfs
      "NO_GCE_CHECK": "true",  # gcsfs: skip the GCE metadata credential probe (~15 s)
      "EPATH_USE_TF": "false",  # etils.epath: the fsspec backend even if tensorflow is installed
      "TENSORSTORE_GCS_HTTP_URL": url,  # read at each open
      "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",  # tensorstore: fixed token, no credential lookup
  }


@contextlib.contextmanager
def start_emulator(bucket: str = "tfx-test", set_environ: bool = False):
  """Starts the emulator with `bucket` created; yields `emulator_env(url)`. set_environ also puts
  it in os.environ meanwhile (in-process use: import gcsfs and fsspec only after that)."""
  if set_environ and "gcsfs" in sys.modules:  # it has already read GCSFS_EXPERIMENTAL_...
    warnings.warn("gcsfs was imported before the emulator env was set: expect 60 s stalls")
  proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", bucket,
                           str(os.getpid())], stdout=subprocess.PIPE, text=True)
  try:  # the child prints its port once it is serving
    line = proc.stdout.readline() if select.select([proc.stdout], [], [], 30)[0] else ""
    if not line.strip().isdigit():
      raise RuntimeError(f"GCS emulator did not start (exit code {proc.poll()}): {line!r}")
    env = emulator_env(f"http://127.0.0.1:{int(line)}")
    with mock.patch.dict(os.environ, env if set_environ else {}):  # restores os.environ after
      yield env
  finally:
    proc.kill(); proc.wait(); proc.stdout.close()  # in-memory data: nothing to flush


try:
  import pytest
  @pytest.fixture(scope="session")
  def gcs_env():  # usable in a test module that does `from gcs_emulator import gcs_env`
    with start_emulator() as env:
      yield env
except ImportError:  # the emulator subprocess does not need pytest
  pass


def _serve(bucket: str, parent_pid: int) -> None:
  """Subprocess side: run the patched emulator on a free port, print the port."""
  import http.server, logging
  from gcp_storage_emulator import server
  from gcp_storage_emulator.handlers import objects
  logging.disable(logging.CRITICAL)
  http.server.HTTPServer.request_queue_size = 128  # tensorstore opens up to 32 connections
  http.server.HTTPServer.handle_error = lambda s, r, a, h=http.server.HTTPServer.handle_error: (
      None if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError))  # gcsfs
      else h(s, r, a))  # cancels racing requests (info = GET object + list prefix): no error

  def download_(req, res, storage, *a, download=objects.download):  # GCS sends the generation
    download(req, res, storage)
    if res.status < 300:
      obj = storage.get_file_obj(req.params["bucket_name"], req.params["object_id"])
      res["x-goog-generation"], res["x-goog-metageneration"] = obj["generation"], obj["metageneration"]

  def ls_(req, res, storage, *a):  # tensorstore lists the key range [startOffset, endOffset)
    objects.ls(req, res, storage)
    lo, hi = req.query.get("startOffset", [""])[0], req.query.get("endOffset", [None])[0]
    if res.status == 200 and (lo or hi):
      body = json.loads(res._content)
      body["items"] = [o for o in body["items"] if lo <= o["name"] and (hi is None or o["name"] < hi)]
      res.json(body)

  def insert_(req, res, storage, *a):  # ifGenerationMatch (0: must not exist), used by OCDBT
    want, name = req.query.get("ifGenerationMatch", [None])[0], req.query.get("name", [""])[0]
    have = storage.objects.get(req.params["bucket_name"], {}).get(name, {}).get("generation", "0")
    if want is not None and name and str(have) != want:
      req.data  # drain the body before answering
      res.status = server.HTTPStatus.PRECONDITION_FAILED
    else:
      objects.insert(req, res, storage)

  def delete_(req, res, storage, *a):  # ifGenerationMatch on delete (tfx.lock's release)
    want = req.query.get("ifGenerationMatch", [None])[0]
    obj = storage.objects.get(req.params["bucket_name"], {}).get(req.params["object_id"])
    if want is not None and obj is not None and str(obj.get("generation")) != want:
      res.status = server.HTTPStatus.PRECONDITION_FAILED
    else:
      objects.delete(req, res, storage)

  def move_(req, res, storage, *a):  # objects.moveTo: copy + delete, atomic here (one thread)
    b, src = req.params["bucket_name"], req.params["object_id"]
    if src in storage.objects.get(b, {}):
      res.json(objects._copy(req.base_url, storage, b, src, b, req.params["dest_object_id"]))
      storage.delete_file(b, src)
    else:
      res.status = server.HTTPStatus.NOT_FOUND

  objects.download = download_  # objects.get calls it by its global name
  move = r"^/storage/v1/b/(?P<bucket_name>[-.\w]+)/o/(?P<object_id>.*[^/]+)/moveTo/o/(?P<dest_object_id>.*[^/]+)$"
  server.HANDLERS = ((move, {"POST": move_}),) + tuple(
      (rx, {m: {objects.ls: ls_, objects.insert: insert_, objects.delete: delete_}.get(f, f) for m, f in h.items()}) for rx, h in server.HANDLERS)
  emu = server.create_server("127.0.0.1", 0, in_memory=True, default_bucket=bucket)
  emu.start()
  print(emu._api._httpd.server_address[1], flush=True)
  while os.getppid() == parent_pid:  # exit with the parent, even if it was SIGKILLed
    time.sleep(0.5)
  os._exit(0)


if __name__ == "__main__" and sys.argv[1:2] == ["--serve"]:
  _serve(sys.argv[2], int(sys.argv[3]))
