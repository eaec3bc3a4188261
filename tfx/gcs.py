"""gs:// paths: a pre-flight check that fails in seconds, with a message that says how to fix it.

Every gs:// read and write goes through etils.epath (gcsfs underneath) and, for checkpoint arrays,
through tensorstore (inside orbax). Both retry for a long time when the bucket cannot be reached
(gcsfs ~35 s, tensorstore minutes), and a missing credential or bucket would otherwise surface as
a traceback deep inside a save. So each entry point first checks every gs:// bucket it will use:
credentials present, bucket exists and is readable, within ``timeout`` seconds.

A local GCS emulator is honoured: with ``STORAGE_EMULATOR_HOST`` set, no credentials are needed
(the tests use gcp-storage-emulator this way).
"""

from __future__ import annotations

import os
import threading

from tfx.errors import UserError

AUTH_HELP = ("authenticate with `gcloud auth application-default login` (a workstation), or set "
             "GOOGLE_APPLICATION_CREDENTIALS to a service-account key file; on a TPU VM or GCE instance the "
             "VM's service account is used and needs storage access")


class GcsError(UserError):
  """A gs:// path that cannot be used; the message says what to do."""


def buckets(*paths) -> list[str]:
  """The distinct bucket names of the gs:// paths among ``paths`` (others are ignored)."""
  out = []
  for path in paths:
    text = str(path or "")
    if text.startswith("prepared:"):
      text = text[len("prepared:"):]
    if text.startswith("gs://"):
      name = text[len("gs://"):].split("/", 1)[0]
      if not name:
        raise GcsError(f"{text!r} has no bucket name; write gs://BUCKET/path")
      if name not in out:
        out.append(name)
  return out


def _check_bucket(name: str, timeout: float) -> None:
  from google.api_core import exceptions
  from google.auth import exceptions as auth_exceptions
  from google.cloud import storage

  try:
    if os.environ.get("STORAGE_EMULATOR_HOST"):
      client = storage.Client.create_anonymous_client()
    else:
      client = storage.Client()
    found = client.bucket(name).exists(timeout=timeout, retry=None)
  except auth_exceptions.DefaultCredentialsError:
    raise GcsError(f"gs://{name}: no Google Cloud credentials were found; {AUTH_HELP}") from None
  except exceptions.Forbidden as e:
    raise GcsError(f"gs://{name}: these credentials may not read the bucket ({e.message}); grant them storage "
                   f"access (roles/storage.objectAdmin) or {AUTH_HELP}") from None
  except exceptions.Unauthorized as e:
    raise GcsError(f"gs://{name}: the credentials were refused ({e.message}); {AUTH_HELP}") from None
  except Exception as e:  # noqa: BLE001  (network errors come in many types)
    raise GcsError(f"gs://{name}: Google Cloud Storage could not be reached ({type(e).__name__}: {str(e)[:200]}); "
                   f"check the network, or {AUTH_HELP}") from None
  if not found:
    raise GcsError(f"bucket gs://{name} does not exist (or is not visible to these credentials); create it with "
                   f"`gcloud storage buckets create gs://{name} --location=REGION`, or fix the path")


def preflight(*paths, timeout: float = 15.0) -> None:
  """Checks every bucket named by ``paths`` (local paths pass untouched).

  Raises:
      GcsError: no credentials, credentials refused, no such bucket, or no answer within
          ``timeout`` seconds; the message says how to fix it.
  """
  for name in buckets(*paths):
    errors: list[BaseException] = []

    def run(name=name):
      try:
        _check_bucket(name, timeout)
      except BaseException as e:  # noqa: BLE001  (re-raised in the caller's thread)
        errors.append(e)

    thread = threading.Thread(target=run, name=f"tfx-gcs-check-{name}", daemon=True)
    thread.start()
    thread.join(timeout + 5)
    if thread.is_alive():
      raise GcsError(f"gs://{name}: no answer from Google Cloud Storage within {timeout + 5:.0f} s; check the "
                     f"network, or {AUTH_HELP}")
    if errors:
      raise errors[0]
