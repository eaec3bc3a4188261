"""benchmarks/gpu/session.sh, the prepared device calls of the accelerator work, run end to end at
toy sizes on this CPU, as the device image would see the repository: the modules that image lacks
and the benchmark path must not need (grain, datasets, tensorboardX, gcsfs) cannot be imported,
and ml-collections comes from a carried wheel, unpacked in front of the installed one."""

import json
import os
import subprocess
import sys
import zipfile

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

# A module that the image lacks: None in sys.modules (an import of it fails, and
# importlib.util.find_spec answers None, as transformers' availability checks expect).
BLOCKER = '''
import sys
sys.modules.update(dict.fromkeys(("grain", "datasets", "tensorboardX", "gcsfs")))
'''
# Every step but `peer`, which needs transformers 4.57.6 (not in tfx's environment: its own test
# below runs it in benchmarks/.venv-peer where that exists).
STEPS = ["env", "attention", "reductions", "suite", "t5_128", "t5_128u", "scanned", "kernels", "loss_chunk", "packed",
         "profile", "bias", "xla_flags", "baseline", "dropout", "finetune"]
PEER_PYTHON = os.path.join(ROOT, "benchmarks", ".venv-peer", "bin", "python")


def _pack(package: str, wheel) -> None:
  """A wheel (a zip) of the installed `package` directory."""
  with zipfile.ZipFile(wheel, "w") as z:
    for folder, _, files in os.walk(package):
      for name in files:
        path = os.path.join(folder, name)
        z.write(path, os.path.relpath(path, os.path.dirname(package)))


def _device_image(tmp_path):
  """(wheels folder, blocker folder): the device image's view (see the module docstring)."""
  wheels, blocker = tmp_path / "wheels", tmp_path / "blocker"
  wheels.mkdir()
  blocker.mkdir()
  (blocker / "sitecustomize.py").write_text(BLOCKER)
  return wheels, blocker


def test_session_runs_every_step_and_writes_its_results(tmp_path):
  import ml_collections

  (wheels, blocker), out = _device_image(tmp_path), tmp_path / "out"
  package = os.path.dirname(ml_collections.__file__)
  _pack(package, wheels / "ml_collections-0-py3-none-any.whl")
  env = dict(os.environ, PYTHON=sys.executable, TFX_GPU_TINY="1", TFX_GPU_WHEELS=str(wheels),
             PYTHONPATH=str(blocker), JAX_PLATFORMS="cpu",
             TFX_GPU_BASELINE=ROOT)  # the "older tree" is this one
  proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu", "session.sh"), str(out), *STEPS], env=env,
                        capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-2000:]
  summary = (out / "summary.txt").read_text().splitlines()
  assert [line.split()[0] for line in summary] == STEPS
  assert all(line.split()[1] == "rc=0" for line in summary), summary
  assert proc.stdout.rstrip().endswith(summary[-1])  # the summary is printed last
  env_log = (out / "env.log").read_text()
  assert "ml_collections from " in env_log and package not in env_log  # the unpacked wheel came first

  checked = json.loads((out / "attention.json").read_text())
  assert len(checked) >= 20 and all(row["ok"] for row in checked)
  reductions = json.loads((out / "reductions.json").read_text())["rows"]
  assert len(reductions) == 20 and all(row["ok"] for row in reductions)
  suite = json.loads((out / "suite.json").read_text())
  assert [m["name"] for m in suite["models"]] == ["gpt2_small", "bert_base", "t5_base", "xlnet_base"]
  assert all(m["batch_size"] == 2 for m in suite["models"]) and sorted(suite["compile_layers"]) == ["2", "8"]
  assert all(m["profile"]["busy_ms_per_step"] > 0 for m in suite["models"])  # traced after the timed steps
  for case, variants in (("t5", ["mask", "lengths", "no mask"]), ("gpt2", ["mask", "mask, no dbias", "causal only"])):
    bias = json.loads((out / f"bias_{case}.json").read_text())
    assert [r["variant"] for r in bias["rows"]] == variants and all(r["ms"] > 0 and r["finite"] for r in bias["rows"])
    assert all(v <= 1e-6 for v in bias["agreement"].values())  # the XLA path: the same function
    if case == "t5":
      assert [r["padding_gradient_max"] == 0.0 for r in bias["rows"]] == [True, True, False]  # "no mask" has none
  for i in (1, 2):  # GPT-2 under each XLA:GPU option (on this CPU: parsed, and without effect)
    flagged = json.loads((out / f"xla_flags_{i}.json").read_text())
    assert [m["name"] for m in flagged["models"]] == ["gpt2_small"]
  flag_lines = [line for line in (out / "xla_flags.log").read_text().splitlines() if line.startswith("== XLA_FLAGS=")]
  assert [line.split()[-1] for line in flag_lines] == ["--xla_gpu_experimental_enable_fusion_block_level_rewriter=true",
                                                       "--xla_gpu_enable_cudnn_layer_norm=true"]
  assert all(os.environ.get("XLA_FLAGS", "") in line for line in flag_lines)  # added to the outer flags
  baseline = json.loads((out / "baseline.json").read_text())
  assert [m["name"] for m in baseline["models"]] == [m["name"] for m in suite["models"]]
  assert baseline["compile_layers"] == {}
  for name in ("t5_128", "t5_128u"):  # scanned, then unrolled
    t5 = json.loads((out / f"{name}.json").read_text())
    assert [m["name"] for m in t5["models"]] == ["t5_base"] and t5["models"][0]["batch_size"] == 4
    assert t5["compile_layers"] == {}
  scanned = json.loads((out / "scanned.json").read_text())
  assert [r["overrides"] for r in scanned["runs"]] == [["model.scan_unroll=1"]]
  assert [m["name"] for m in scanned["runs"][0]["models"]] == ["gpt2_small", "bert_base", "t5_base"]
  kernels = json.loads((out / "kernels.json").read_text())
  assert [r["overrides"] for r in kernels["runs"]] == [[f"model.attention={k}"] for k in ("pallas", "xla")]
  assert all(len(r["models"]) == 1 and r["compile_layers"] == {} for r in kernels["runs"])
  for docs, runs in ((1, ("0", "1")), (4, ("0", "8"))):  # rows of one document, then of four
    packed = json.loads((out / f"packed_{docs}.json").read_text())
    assert [r["overrides"] for r in packed["runs"]] == [[f"model.packed_runs={n}"] for n in runs]
    assert all([m["name"] for m in r["models"]] == ["gpt2_small"] for r in packed["runs"])
    assert all(m["documents"] == docs for r in packed["runs"] for m in r["models"])
  chunks = json.loads((out / "loss_chunk.json").read_text())
  assert [r["overrides"] for r in chunks["runs"]] == [["model.loss_chunk=256"]]
  for name, objective in (("dropout", "masked_lm"), ("dropout_bart", "text_infilling"),
                          ("dropout_xlnet", "permutation_lm")):  # own configs, auto then pallas
    dropout = json.loads((out / f"{name}.json").read_text())
    assert [(r["sweep_value"], r["objective"]) for r in dropout] == [("auto", objective), ("pallas", objective)]
    assert all(r["step_s"] > 0 and "model.attention_dropout=0.1" in r["attention"] for r in dropout)
  tuned = json.loads((out / "finetune.json").read_text())
  assert tuned["objective"] == "finetune (2 classes, pooling first)" and tuned["batch_size"] == 2
  assert tuned["row_length"] == 64 and tuned["step_s"] > 0
  profiled = json.loads((out / "profile.json").read_text())
  assert all(m["profile"]["busy_ms_per_step"] > 0 for m in profiled["models"])
  assert sorted(p.name for p in (out / "profile").iterdir()) == sorted(m["name"] for m in profiled["models"])


@pytest.mark.skipif(not os.path.exists(PEER_PYTHON), reason="no benchmarks/.venv-peer (make bench-peer creates it)")
def test_session_peer_step_compares_with_hugging_face_from_carried_wheels(tmp_path):
  """The `peer` step at toy sizes in bfloat16, with transformers unpacked from a carried wheel in
  front of the one installed (as on the device, whose image has none)."""
  (wheels, blocker), out = _device_image(tmp_path), tmp_path / "out"
  peer_wheels = tmp_path / "peer_wheels"
  peer_wheels.mkdir()
  found = subprocess.run([PEER_PYTHON, "-c", "import os, transformers; print(os.path.dirname(transformers.__file__))"],
                         capture_output=True, text=True, check=True).stdout.strip()
  _pack(found, peer_wheels / "transformers-0-py3-none-any.whl")
  env = dict(os.environ, PYTHON=PEER_PYTHON, TFX_GPU_TINY="1", TFX_GPU_WHEELS=str(wheels),
             TFX_GPU_PEER_WHEELS=str(peer_wheels), PYTHONPATH=str(blocker), JAX_PLATFORMS="cpu")
  proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu", "session.sh"), str(out), "peer"], env=env,
                        capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert [line.split()[:2] for line in (out / "summary.txt").read_text().splitlines()] == [["peer", "rc=0"]]
  log = (out / "peer.log").read_text()
  assert "transformers 4.57.6 from " in log and found not in log  # the unpacked wheel came first
  rows = json.loads((out / "peer.json").read_text())
  assert [(r["model"], r["size"], r["dtype"]) for r in rows] == [("gpt2", "small", "bfloat16"), ("t5", "small", "bfloat16")]
  assert all(r["step_s_tfx"] > 0 and r["step_s_hf"] > 0 and r["gflop_tfx"] > 0 for r in rows)
  assert all(abs(r["loss_tfx"] - r["loss_hf"]) <= 5e-3 * r["loss_hf"] for r in rows)


def test_the_baseline_step_needs_an_older_tree(tmp_path):
  env = {k: v for k, v in os.environ.items() if k != "TFX_GPU_BASELINE"}
  session = os.path.join(ROOT, "benchmarks", "gpu", "session.sh")
  proc = subprocess.run(["bash", session, str(tmp_path), "env", "baseline"], env=env, capture_output=True, text=True,
                        timeout=60)
  assert proc.returncode == 2 and "TFX_GPU_BASELINE" in proc.stderr
  assert not (tmp_path / "env.log").exists()


def test_an_unknown_step_is_refused(tmp_path):
  proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu", "session.sh"), str(tmp_path), "env", "suit"],
                        capture_output=True, text=True, timeout=60)
  assert proc.returncode == 2 and "unknown step suit" in proc.stderr
  assert not (tmp_path / "env.log").exists()  # refused before the first step ran
