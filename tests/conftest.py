"""Shared test helpers. Tests run on the CPU; sharding tests start their own 8-device processes."""

import os
import sys

import jax
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
