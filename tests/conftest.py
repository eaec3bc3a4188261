"""Shared test helpers. Tests run on the CPU; sharding tests start their own 8-device processes."""

import atexit
import os
import shutil
import sys
import tempfile

# One persistent XLA compilation cache for the session, shared by this process, pytest-xdist's
# workers and every subprocess a test starts (they inherit the environment). The suite compiles
# the same small programs many times: a resumed run compiles the step its first half compiled, the
# same tiny config trains in several tests and subprocesses. A cache hit loads the executable XLA built for the same HLO,
# compile options and XLA flags (all part of the key), so results are bitwise those of a fresh
# compile. Set JAX_COMPILATION_CACHE_DIR yourself to keep (or disable, with an empty value) it.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _CACHE_DIR = tempfile.mkdtemp(prefix="tfx-tests-xla-cache-")
  atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE_DIR
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
# The suite's time is mostly XLA:CPU compiling small programs, and most of that is LLVM's code
# generation: at backend optimisation level 0 and with the loop emitters instead of the fusion
# emitters, the tiny T5's loss and gradient compiles in 2.6 s instead of 10 s (the tiny decoder's in
# 0.6 s instead of 2.8 s) and runs in 44 ms instead of 25. The program is partitioned as always;
# XLA:CPU fuses somewhat differently (the tiny decoder's gradient: 179 fusions instead of 204,
# temporary memory +0.006%, cost-analysis FLOPs -0.03%) and its machine code is less optimised.
# The flags are inherited by the subprocesses tests start (tfx.launch local sets its own
# XLA_FLAGS, on both sides of its comparison). TFX_TEST_XLA_OPT=1: XLA's default code generation.
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
if os.environ.get("TFX_TEST_XLA_OPT", "0") != "1" and "xla_backend_optimization_level" not in os.environ.get(
    "XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *TEST_XLA_FLAGS]).strip()

import jax  # noqa: E402  (after the cache settings, which jax reads at import)
import pytest

jax.config.update("jax_platforms", "cpu")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)


def tiny_config(*overrides: str):
  """configs/tiny.py with --config.k=v overrides (unlocked copy)."""
  from tfx.config import load_config

  return load_config(os.path.join(ROOT, "configs", "tiny.py"), list(overrides))


@pytest.fixture
def root() -> str:
  return ROOT


SMALL_VOCAB = 1000
TRAIN_BYTES = 500_000  # keeps each tokenizer training around 1.5 s


@pytest.fixture(scope="session")
def stdlib_corpus():
  """The default offline corpus (the Python standard library's sources), loaded once."""
  from tfx.data import load_documents

  return load_documents("stdlib")


@pytest.fixture(scope="session")
def small_corpus(stdlib_corpus):
  """The stdlib corpus's first 100 documents."""
  from tfx.data import Corpus

  n = 100
  return Corpus(stdlib_corpus.documents[:n], stdlib_corpus.names[:n], {}, "stdlib")


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory, small_corpus):
  """A SMALL_VOCAB sentencepiece model trained on `small_corpus` (seed 0), for the data tests."""
  from tfx.data import Tokenizer

  path = str(tmp_path_factory.mktemp("tok") / "tokenizer.model")
  return Tokenizer.train(small_corpus.documents, SMALL_VOCAB, path, seed=0, max_bytes=TRAIN_BYTES)


@pytest.fixture(scope="session")
def shared_tokenizer(tmp_path_factory) -> str:
  """A sentencepiece model trained once on configs/tiny.py's corpus, for tests that do not
  test tokenizer training itself."""
  from tfx.data import build_tokenizer, load_documents

  config = tiny_config()
  workdir = str(tmp_path_factory.mktemp("tokenizer"))
  corpus = load_documents(config.data.source, max_documents=config.data.max_documents)
  build_tokenizer("", corpus, config.data.vocab_size, workdir)
  return os.path.join(workdir, "tokenizer.model")


def train_and_resume(config, tmp_path, stop_after: int = 2):
  """Trains `config()` in one go (tmp_path/full) and as `stop_after` steps, a stop and a resume
  (tmp_path/part); asserts that both give the same metrics (timings aside) and bitwise the same
  parameters. `config(*overrides)` returns a fresh config. Returns (full, resumed, records)."""
  import numpy as np

  from tfx import train
  from tfx.metrics import read_metrics

  full = train.run(config(), str(tmp_path / "full"))
  part = str(tmp_path / "part")
  assert train.run(config(f"--config.train.stop_after={stop_after}"), part)["step"] == stop_after
  resumed = train.run(config(), part)
  assert resumed["step"] == full["step"]
  strip = lambda rows: [{k: v for k, v in row.items() if k not in ("tokens_per_sec", "mfu")} for row in rows]
  records = strip(read_metrics(str(tmp_path / "full")))
  assert strip(read_metrics(part)) == records
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(full["state"].params),
               jax.device_get(resumed["state"].params))
  return full, resumed, records


def compare_with_float32_logits_loss(ours, reference, params) -> tuple[int, int]:
  """`ours` and `reference` (params -> (loss, metrics)): the head's loss from bf16 logits and the
  loss of the float32 logits the model returns without `loss=`. Asserts the same loss and accuracy
  to the bit and every gradient within bf16's rounding; returns the number of scatters in each
  one's lowered gradient (autodiff's float32 loss scatters the targets' logits' gradient)."""
  import numpy as np

  (loss, metrics), grads = jax.value_and_grad(ours, has_aux=True)(params)
  (want, want_metrics), want_grads = jax.value_and_grad(reference, has_aux=True)(params)
  assert float(loss) == float(want) and float(metrics["accuracy"]) == float(want_metrics["accuracy"])
  for (path, a), w in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree_util.tree_leaves(want_grads)):
    np.testing.assert_allclose(a, w, rtol=2e-2, atol=2e-3 * max(1.0, float(np.abs(w).max())),
                               err_msg=jax.tree_util.keystr(path))
  scatters = lambda f: jax.jit(jax.grad(lambda p: f(p)[0])).lower(params).as_text().count('"stablehlo.scatter"')
  return scatters(ours), scatters(reference)
