"""gs:// end to end against a local GCS emulator: prepare -> train -> stop -> resume -> generate ->
convert.

The emulator (gcp-storage-emulator, see tests/gcs_emulator.py) speaks the GCS JSON API on
127.0.0.1; gcsfs, etils.epath, tensorstore and orbax are pointed at it by environment variables,
so every layer that a real run uses on GCS is exercised, with no network and no credentials.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.conftest import ROOT
from tests.gcs_emulator import start_emulator
from tfx.metrics import read_metrics

CONFIG = os.path.join(ROOT, "configs", "tiny.py")
TIMING = ("tokens_per_sec", "mfu")
RUN = ("--config.data.max_documents=60", "--config.train.steps=8", "--config.train.log_every=2",
       "--config.train.eval_every=4", "--config.train.checkpoint_every=4", "--config.data.shard_mb=0.1")


@pytest.fixture(scope="module")
def gcs():
  with start_emulator("tfx-test") as env:
    yield env


def tfx(command, *args, env=None, timeout=600):
  proc = subprocess.run([sys.executable, "-m", f"tfx.{command}", *args], cwd=ROOT, capture_output=True, text=True,
                        timeout=timeout, env={**os.environ, **(env or {})})
  return proc


def gs_metrics(env, path):
  code = ("import json, sys; from tfx.metrics import read_metrics; "
          f"print(json.dumps(read_metrics({path!r})))")
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, **env}, check=True)
  import json
  return json.loads(out.stdout)


def without_timing(records):
  return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


@pytest.mark.slow
def test_store_and_workdir_on_gcs(gcs, tmp_path, shared_tokenizer):
  """A run whose store and workdir are both on gs://, stopped after 4 steps and resumed, writes the
  metrics of an uninterrupted local run on a local copy of the same store; generate reads it."""
  tok = f"--config.data.tokenizer={shared_tokenizer}"
  prepared = tfx("prepare", "--config", CONFIG, "--out", "gs://tfx-test/store", "--quiet", tok, *RUN, env=gcs)
  assert prepared.returncode == 0, prepared.stderr[-3000:]
  local_store = tmp_path / "store"
  assert tfx("prepare", "--config", CONFIG, "--out", str(local_store), "--quiet", tok, *RUN).returncode == 0

  remote = ("--config", CONFIG, "--workdir", "gs://tfx-test/run", "--config.data.source=prepared:gs://tfx-test/store",
            *RUN)
  first = tfx("train", *remote, "--config.train.stop_after=4", env=gcs)
  assert first.returncode == 0, first.stderr[-3000:]
  assert "stopping at step 4" in first.stdout
  second = tfx("train", *remote, env=gcs)
  assert second.returncode == 0, second.stderr[-3000:]
  assert "resumed from gs://tfx-test/run/checkpoints/4" in second.stdout

  local = tmp_path / "run"
  done = tfx("train", "--config", CONFIG, "--workdir", str(local), f"--config.data.source=prepared:{local_store}", *RUN)
  assert done.returncode == 0, done.stderr[-3000:]
  assert without_timing(gs_metrics(gcs, "gs://tfx-test/run")) == without_timing(read_metrics(str(local)))

  sample = tfx("generate", "--workdir", "gs://tfx-test/run", "--prompt", "def ", "--max-new-tokens", "8",
               "--temperature", "0", env=gcs)
  assert sample.returncode == 0, sample.stderr[-3000:]
  local_sample = tfx("generate", "--workdir", str(local), "--prompt", "def ", "--max-new-tokens", "8",
                     "--temperature", "0")
  assert sample.stdout == local_sample.stdout

  # tfx.convert with the run on gs://: export equals the local run's export; import into gs:// and
  # export again gives the same tensors.
  exports = {}
  for name, run in (("gs", "gs://tfx-test/run"), ("local", str(local)), ("imported", "gs://tfx-test/imported")):
    if name == "imported":
      imported = tfx("convert", "--from-hf", str(tmp_path / "hf-local"), "--workdir", run, env=gcs)
      assert imported.returncode == 0, imported.stderr[-3000:]
    out = tmp_path / f"hf-{name}"
    exported = tfx("convert", "--to-hf", str(out), "--workdir", run, env=gcs)
    assert exported.returncode == 0, exported.stderr[-3000:]
    exports[name] = load_file(str(out / "model.safetensors"))
  for name in ("gs", "imported"):
    assert exports[name].keys() == exports["local"].keys()
    for key, value in exports["local"].items():
      np.testing.assert_array_equal(exports[name][key], value, err_msg=f"{name} {key}")


def test_missing_bucket_and_missing_credentials_are_clear_errors(gcs, tmp_path):
  """Each gets a message that says what to do (the subprocess timeouts only guard against a hang;
  tfx.gcs.preflight bounds the wait itself)."""
  proc = tfx("train", "--config", CONFIG, "--workdir", "gs://no-such-bucket/run", *RUN, env=gcs, timeout=120)
  assert proc.returncode == 1 and "Traceback" not in proc.stderr
  assert "bucket gs://no-such-bucket does not exist" in proc.stderr and "gcloud storage buckets create" in proc.stderr
  proc = tfx("prepare", "--config", CONFIG, "--out", "gs://no-such-bucket/store", env=gcs, timeout=120)
  assert proc.returncode == 1 and "does not exist" in proc.stderr
  # No emulator, no credentials (and no network): a message that says how to authenticate.
  env = {k: v for k, v in os.environ.items() if k not in gcs and k != "GOOGLE_APPLICATION_CREDENTIALS"}
  env.update(HOME=str(tmp_path), CLOUDSDK_CONFIG=str(tmp_path / "gcloud"), NO_GCE_CHECK="true",
             GCE_METADATA_HOST="127.0.0.1:9", GCE_METADATA_IP="127.0.0.1:9")
  proc = subprocess.run([sys.executable, "-m", "tfx.train", "--config", CONFIG, "--workdir", "gs://some-bucket/run"],
                        cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
  assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
  assert "gcloud auth application-default login" in proc.stderr


def test_bench_writes_its_json_to_gcs(gcs):
  proc = tfx("bench", "--config", CONFIG, "--steps", "1", "--warmup", "0", "--json", "gs://tfx-test/bench/out.json",
             env=gcs)
  assert proc.returncode == 0, proc.stderr[-3000:]
  code = "from etils import epath; import json; print(json.loads(epath.Path('gs://tfx-test/bench/out.json').read_text())['objective'])"
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, **gcs})
  assert out.stdout.strip() == "causal_lm", out.stderr[-2000:]


def test_a_step_written_in_place_but_not_committed_is_not_a_checkpoint(gcs):
  """On gs:// orbax writes a step under its final name and commits it with commit_success.txt: a
  step a crash cut short is left out of checkpoint.steps (not restored, nor set aside as damaged)."""
  code = ("from etils import epath; from tfx import checkpoint\n"
          "root = epath.Path('gs://tfx-test/uncommitted/checkpoints')\n"
          "for step in ('4', '8'):\n"
          "  (root / step / 'state').mkdir(parents=True, exist_ok=True)\n"
          "  (root / step / 'state' / 'x').write_text('x')\n"
          "(root / '4' / 'commit_success.txt').write_text('ok')\n"
          "print(sorted(checkpoint.steps('gs://tfx-test/uncommitted')))\n")
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, **gcs})
  assert out.stdout.strip() == "[4]", out.stderr[-2000:]
