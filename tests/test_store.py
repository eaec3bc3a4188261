"""The token store: tfx.prepare (shards, workers, resume, bad input) and the reader over it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import ml_collections
import numpy as np
import pytest

from tests.conftest import ROOT
from tfx.data import DataPipeline, Tokenizer, load_documents, store, tokenize_corpus
from tfx.data.prepare import prepare
from tfx.data.training import corpus_changes

VOCAB = 600


def data_config(source: str, **overrides) -> ml_collections.ConfigDict:
  cfg = dict(source=source, text_field="text", max_documents=0, eval_fraction=0.1, vocab_size=VOCAB,
             tokenizer="", tokenizer_sample_bytes=200_000, shard_mb=0.02, prepare_workers=1, eval_batches=2,
             prefetch=0)
  cfg.update(overrides)
  return ml_collections.ConfigDict(cfg)


def write_corpus(directory, num_files: int = 60, seed: int = 0) -> str:
  """Real text of varied length (standard-library docstrings and code), one document per file."""
  rng = np.random.default_rng(seed)
  docs = load_documents("stdlib", max_documents=num_files).documents
  os.makedirs(directory, exist_ok=True)
  for i, doc in enumerate(docs):
    cut = int(rng.integers(200, 4000))
    with open(os.path.join(directory, f"doc{i:03d}.txt"), "w") as f:
      f.write(doc[:cut])
  return f"text:{directory}/*.txt"


def store_files(directory) -> dict[str, bytes]:
  return {name: open(os.path.join(directory, name), "rb").read()
          for name in sorted(os.listdir(directory)) if not name.startswith(".")}


@pytest.fixture(scope="module")
def corpus_source(tmp_path_factory) -> str:
  return write_corpus(str(tmp_path_factory.mktemp("corpus")))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, corpus_source):
  """A store of ~60 documents in several shards, written by 2 worker processes."""
  out = str(tmp_path_factory.mktemp("store") / "s")
  manifest = prepare(data_config(corpus_source), out, workers=2, progress=False)
  return out, manifest


def test_manifest_records_counts_checksums_and_tokenizer(prepared, corpus_source):
  out, manifest = prepared
  assert manifest["format"] == store.FORMAT and manifest["version"] == store.VERSION
  assert manifest["sources"] == [{"spec": corpus_source, "text_field": "text", "max_documents": 0}]
  assert len(manifest["shards"]) >= 4, "the test needs several shards"
  assert manifest["token_dtype"] == "<u2"
  tokenizer = Tokenizer.load(os.path.join(out, "tokenizer.model"))
  assert manifest["tokenizer"] == {"file": "tokenizer.model", "vocab_size": VOCAB,
                                   "sha256": store.sha256_bytes(tokenizer.model_proto)}
  corpus = load_documents(corpus_source)
  assert manifest["documents"] == len(corpus) == sum(s["documents"] for s in manifest["shards"])
  tokens = sum(len(t) for t in tokenize_corpus(tokenizer, corpus))
  assert manifest["splits"]["train"]["tokens"] + manifest["splits"]["eval"]["tokens"] == tokens
  for shard in manifest["shards"]:
    for split in store.SPLITS:
      for entry in shard[split]["files"].values():
        data = open(os.path.join(out, entry["name"]), "rb").read()
        assert len(data) == entry["bytes"] and store.sha256_bytes(data) == entry["sha256"]


def test_store_gives_the_batches_of_the_in_memory_corpus(prepared, corpus_source):
  """The store's batches equal those of the corpus tokenized in memory (today's pipeline, whose
  tests compare it with packing the whole epoch), in every serving mode, and the tokenizer is the
  one Tokenizer.train makes from the same documents."""
  out, _ = prepared
  corpus = load_documents(corpus_source)
  tokenizer = Tokenizer.load(os.path.join(out, "tokenizer.model"))
  trained = Tokenizer.train(corpus.documents, VOCAB, None, max_bytes=200_000)
  assert trained.model_proto == tokenizer.model_proto
  _, train, heldout = store.open_store(out)
  docs = tokenize_corpus(tokenizer, corpus)
  for mode in (dict(), dict(shuffle_rows=False), dict(streams=True, stride=24),
               dict(streams=True, stride=16, reversed_streams=True)):
    options = dict(eos_id=tokenizer.eos_id, row_length=32, global_batch=4, seed=3, eval_batches=2, **mode)
    memory = DataPipeline(docs, eval_fraction=0.1, **options)
    stored = DataPipeline.from_splits(train, heldout, **options)
    assert stored.stats == memory.stats
    steps = memory.batches_per_epoch + 3  # across an epoch boundary
    for k in range(steps):
      a, b = memory.next_batch(), stored.next_batch()
      for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=f"{mode} batch {k} {key}")
    for a, b in zip(memory.eval_batches(), stored.eval_batches()):
      for key in a:
        np.testing.assert_array_equal(a[key], b[key])


def test_prefetch_and_host_slices_keep_the_batches(prepared):
  _, train, heldout = store.open_store(prepared[0])
  options = dict(eos_id=1, row_length=32, global_batch=8, seed=0)
  plain = DataPipeline.from_splits(train, heldout, **options)
  want = [plain.next_batch() for _ in range(plain.batches_per_epoch + 2)]
  ahead = DataPipeline.from_splits(train, heldout, prefetch=3, **options)
  got = [ahead.next_batch() for _ in range(5)]
  ahead.restore(ahead.state())  # resume drops what was prefetched and continues exactly
  got += [ahead.next_batch() for _ in range(len(want) - 5)]
  hosts = [DataPipeline.from_splits(train, heldout, process_index=p, process_count=2, prefetch=2, **options)
           for p in range(2)]
  for k, batch in enumerate(want):
    halves = [h.next_batch() for h in hosts]
    for key in batch:
      np.testing.assert_array_equal(got[k][key], batch[key])
      np.testing.assert_array_equal(np.concatenate([h[key] for h in halves]), batch[key])


def test_interrupted_prepare_resumes_to_the_same_store(tmp_path):
  """SIGKILL of `python -m tfx.prepare` in the middle, then the same command again: the store is
  byte-identical to an uninterrupted one written by 2 workers (and no half-written shard was
  ever visible)."""
  corpus_source = write_corpus(str(tmp_path / "corpus"), num_files=400)
  reference = tmp_path / "reference"
  prepare(data_config(corpus_source), str(reference), workers=2, progress=False)
  out = tmp_path / "s"
  config = os.path.join(ROOT, "configs", "tiny.py")
  args = [sys.executable, "-m", "tfx.prepare", "--config", config, "--out", str(out), "--workers", "1", "--quiet",
          f"--config.data.source={corpus_source}", f"--config.data.vocab_size={VOCAB}",
          "--config.data.eval_fraction=0.1", "--config.data.tokenizer_sample_bytes=200000",
          "--config.data.shard_mb=0.02", "--config.data.max_documents=0"]
  proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  deadline = time.time() + 120
  while time.time() < deadline and len(list(out.glob("shard-*.json"))) < 2 and proc.poll() is None:
    time.sleep(0.01)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert not (out / "manifest.json").exists(), "the kill came too late to test anything"
  with pytest.raises(store.StoreError, match="interrupted"):
    store.open_store(str(out))
  done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "prepared:" in done.stdout
  assert store_files(out) == store_files(reference)


def _disk_full_prepare(source: str, out, monkeypatch, **overrides) -> str:
  """Prepares `source` into `out` on a disk that fills up in the middle of a later shard; returns
  the error's message (the shards finished before are kept)."""
  real = store.write_atomic
  calls = {"n": 0}

  def failing(path, data):
    calls["n"] += 1
    if calls["n"] == 12:
      raise OSError(28, "No space left on device")
    return real(path, data)

  monkeypatch.setattr(store, "write_atomic", failing)
  with pytest.raises(store.StoreError, match="No space left") as info:
    prepare(data_config(source, **overrides), str(out), workers=1, progress=False)
  monkeypatch.setattr(store, "write_atomic", real)
  assert list(out.glob("shard-*.json")) and not (out / "manifest.json").exists()
  return str(info.value)


def test_disk_full_keeps_finished_shards(tmp_path, corpus_source, prepared, monkeypatch):
  out = tmp_path / "s"
  assert "run the same command again" in _disk_full_prepare(corpus_source, out, monkeypatch)
  prepare(data_config(corpus_source), str(out), workers=1, progress=False)
  assert store_files(out) == store_files(prepared[0])  # prepare.json, the unfinished prepare's record, is gone


def test_finishing_a_store_with_other_settings_is_refused(tmp_path, corpus_source, monkeypatch):
  """Its finished shards were split and tokenized as the first command said: a rerun that asks
  for another eval_fraction or tokenizer would mix two stores in one."""
  out = tmp_path / "s"
  _disk_full_prepare(corpus_source, out, monkeypatch)
  with pytest.raises(store.StoreError, match=r"another source \(eval_fraction: 0.1 -> 0.5\)"):
    prepare(data_config(corpus_source, eval_fraction=0.5), str(out), workers=1, progress=False)
  with pytest.raises(store.StoreError, match=r"tokenizer: \{'trained': \{'sample_bytes': 200000, 'seed': 0, "
                                             r"'vocab_size': 600\}\} -> 'other.model'"):
    prepare(data_config(corpus_source, tokenizer="other.model"), str(out), workers=1, progress=False)
  (out / "prepare.json").unlink()  # shards of a prepare that did not say what it was asked for
  with pytest.raises(store.StoreError, match="holds part of a token store but no prepare.json"):
    prepare(data_config(corpus_source), str(out), workers=1, progress=False)
  # the same tokenizer path, but the file changed since the first command: its shards used the old one
  given = tmp_path / "given.model"
  given.write_bytes((out / "tokenizer.model").read_bytes())
  out = tmp_path / "given"
  _disk_full_prepare(corpus_source, out, monkeypatch, tokenizer=str(given))
  Tokenizer.train(load_documents(corpus_source).documents, VOCAB + 50, str(given), max_bytes=100_000)
  with pytest.raises(store.StoreError, match="was made with another tokenizer than"):
    prepare(data_config(corpus_source, tokenizer=str(given)), str(out), workers=1, progress=False)


def test_empty_corpus_is_named_before_the_tokenizer_is_trained(tmp_path):
  os.makedirs(tmp_path / "c")
  (tmp_path / "c" / "a.txt").write_text("")
  (tmp_path / "c" / "b.txt").write_bytes(b"\xff\xfe\x00bad")
  with pytest.raises(store.StoreError, match=r"produced no documents \(1 empty, 1 undecodable\)"):
    prepare(data_config(f"text:{tmp_path}/c/*.txt"), str(tmp_path / "s"), progress=False)


def test_tiny_corpus_still_holds_out_one_document(tmp_path):
  source = write_corpus(str(tmp_path / "c"), num_files=5)
  manifest = prepare(data_config(source, eval_fraction=0.01, tokenizer_sample_bytes=50_000, vocab_size=500),
                     str(tmp_path / "s"), progress=False)
  assert manifest["splits"]["eval"]["documents"] == 1  # heldout_mask's rule: the smallest hash
  forced = [s["forced_eval"] for s in manifest["shards"] if s["forced_eval"] >= 0]
  from tfx.data.pipeline import heldout_mask
  assert forced == list(np.flatnonzero(heldout_mask(5, 0.01)))


# ====================================================================== bad input


@pytest.fixture
def copy_of(prepared, tmp_path):
  def make():
    out = tmp_path / "copy"
    out.mkdir()
    for name, data in store_files(prepared[0]).items():
      (out / name).write_bytes(data)
    return out
  return make


def _shard_file(out, kind="tokens"):
  manifest = json.loads((out / "manifest.json").read_text())
  return out / manifest["shards"][1]["train"]["files"][kind]["name"]


def test_missing_torn_and_damaged_shards_are_named(copy_of):
  out = copy_of()
  path = _shard_file(out)
  data = path.read_bytes()
  path.unlink()
  with pytest.raises(store.StoreError, match=f"{path.name} is missing"):
    store.open_store(str(out))
  path.write_bytes(data[:-2])
  with pytest.raises(store.StoreError, match="torn or truncated"):
    store.open_store(str(out))
  damaged = bytearray(data)
  damaged[3] ^= 0x40
  path.write_bytes(bytes(damaged))
  with pytest.raises(store.StoreError, match=f"{path.name} does not match its checksum"):
    store.open_store(str(out), verify="open")
  _, train, heldout = store.open_store(str(out))  # sizes are right: found by the background check
  pipeline = DataPipeline.from_splits(train, heldout, eos_id=1, row_length=32, global_batch=4, seed=0)
  with pytest.raises(store.StoreError, match=f"{path.name} does not match its checksum"):
    pipeline.wait_verified()
  with pytest.raises(store.StoreError, match=f"{path.name} does not match its checksum"):
    pipeline.next_batch()  # and the run stops at its next batch
  store.open_store(str(out), verify="off")  # sizes only
  offsets = _shard_file(out, "offsets")
  damaged = bytearray(offsets.read_bytes())
  damaged[9] ^= 1
  offsets.write_bytes(bytes(damaged))
  with pytest.raises(store.StoreError, match="does not match its checksum"):
    store.open_store(str(out))


def test_newer_format_missing_store_and_wrong_tokenizer(copy_of, tmp_path, prepared, corpus_source):
  out = copy_of()
  manifest = json.loads((out / "manifest.json").read_text())
  manifest["version"] = store.VERSION + 1
  (out / "manifest.json").write_text(json.dumps(manifest))
  with pytest.raises(store.StoreError, match="newer than this tfx reads"):
    store.open_store(str(out))
  with pytest.raises(store.StoreError, match="does not exist"):
    store.open_store(str(tmp_path / "nowhere"))
  with pytest.raises(store.StoreError, match="another source"):
    prepare(data_config(corpus_source, eval_fraction=0.2), prepared[0], progress=False)


def test_bad_jsonl_line_is_refused_with_file_and_line(tmp_path):
  path = tmp_path / "c.jsonl.gz"
  import gzip
  with gzip.open(path, "wt") as f:
    f.write(json.dumps({"text": "fine " * 50}) + "\n" + "{broken\n")
  with pytest.raises(ValueError, match=r"c\.jsonl\.gz, line 2: not valid JSON"):
    prepare(data_config(f"text:{path}", tokenizer_sample_bytes=10_000, vocab_size=400), str(tmp_path / "s"),
            progress=False)


@pytest.mark.parametrize("damage", ["truncated", "not_gzip"])
def test_a_damaged_gzip_file_is_named(tmp_path, damage):
  """A cut-off download or a plain file with a .gz suffix: one ValueError naming the file, not an
  EOFError without a path or a store error blaming the disk."""
  import gzip
  path = tmp_path / "c.jsonl.gz"
  lines = "".join(json.dumps({"text": f"document {i} " * 40}) + "\n" for i in range(200)).encode()
  packed = gzip.compress(lines)
  path.write_bytes(packed[:len(packed) // 2] if damage == "truncated" else lines)
  with pytest.raises(ValueError, match=r"c\.jsonl\.gz: damaged or not gzip-compressed"):
    prepare(data_config(f"text:{path}", tokenizer_sample_bytes=10_000, vocab_size=400), str(tmp_path / "s"),
            progress=False)


def test_corpus_changes_name_what_changed():
  base = {"checksum": "a" * 64, "sources": [{"spec": "stdlib"}], "tokenizer_sha256": "b" * 64, "vocab_size": 1000,
          "documents": 10, "train_tokens": 100}
  assert corpus_changes(base, dict(base)) == []
  assert corpus_changes(None, base) == []
  assert "source" in corpus_changes(dict(base, sources=[{"spec": "text:x"}]), base)[0]
  assert "tokenizer" in corpus_changes(dict(base, tokenizer_sha256="c" * 64), base)[0]
  assert "vocabulary size 900 -> 1000" in corpus_changes(dict(base, vocab_size=900), base)[0]
  assert "store content" in corpus_changes(dict(base, checksum="d" * 64), base)[0]


def test_resume_on_another_corpus_is_refused_unless_allowed(tmp_path, shared_tokenizer):
  """The checkpoint records the corpus; resuming on another one names what changed, and
  data.allow_changed_corpus continues and says so in metrics.jsonl."""
  from tests.test_train import quick
  from tfx import train
  from tfx.errors import DataError
  from tfx.metrics import read_metrics

  workdir = str(tmp_path / "run")
  train.run(quick(shared_tokenizer, "--config.train.steps=4", "--config.train.stop_after=2"), workdir)
  assert sorted(os.listdir(tmp_path / "run" / "data")) and (tmp_path / "run" / "tokenizer.model").exists()
  changed = ("--config.train.steps=4", "--config.data.max_documents=50")
  with pytest.raises(DataError, match="data.max_documents: 60 -> 50") as info:
    train.run(quick(shared_tokenizer, *changed), workdir)
  assert "allow_changed_corpus" in str(info.value)
  result = train.run(quick(shared_tokenizer, *changed, "--config.data.allow_changed_corpus=true"), workdir)
  assert result["step"] == 4
  events = [r for r in read_metrics(workdir) if r["split"] == "event"]
  corpus = [e for e in events if e["event"] == "corpus_changed"]
  assert len(corpus) == 1 and corpus[0]["step"] == 2 and "max_documents" in corpus[0]["changes"][0]
  [config_changed] = [e for e in events if e["event"] == "config_changed"]  # tfx.drift logs the keys too
  assert config_changed["changes"]["data.max_documents"] == [60, 50]


def test_store_with_another_vocabulary_or_tokenizer_than_the_config(prepared, tmp_path, shared_tokenizer):
  from tfx.data.training import training_data
  from tests.conftest import tiny_config

  config = tiny_config(f"--config.data.source=prepared:{prepared[0]}")  # vocab 1000; the store has 600
  with pytest.raises(store.StoreError, match="vocabulary of 600.*data.vocab_size=1000"):
    training_data(config, str(tmp_path / "run"))
  config = tiny_config(f"--config.data.source=prepared:{prepared[0]}", f"--config.data.tokenizer={shared_tokenizer}")
  with pytest.raises(store.StoreError, match="is not the tokenizer the store"):
    training_data(config, str(tmp_path / "run"))
  data = training_data(tiny_config(f"--config.data.source=prepared:{prepared[0]}", f"--config.data.vocab_size={VOCAB}"),
                       str(tmp_path / "run"))
  assert (tmp_path / "run" / "tokenizer.model").read_bytes() == data.tokenizer.model_proto


def test_split_that_would_be_empty(tmp_path):
  source = write_corpus(str(tmp_path / "c"), num_files=4)
  with pytest.raises(store.StoreError, match="holds out all 4 documents"):
    prepare(data_config(source, eval_fraction=0.9999, tokenizer_sample_bytes=50_000, vocab_size=500),
            str(tmp_path / "s"), progress=False)


def test_hub_source_is_streamed_into_the_same_store(tmp_path, prepared):
  """`hf:` goes through datasets with streaming=True (here a local dataset directory, offline):
  the shards are byte-identical to those of the same records read as `text:` JSON lines."""
  data = tmp_path / "dataset"
  data.mkdir()
  with open(data / "train.jsonl", "w") as f:
    for i in range(40):
      f.write(json.dumps({"text": f"record {i}: " + "some words of text " * (5 + i % 7)}) + "\n")
  tokenizer = os.path.join(prepared[0], "tokenizer.model")
  env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"))
  stores = {}
  for name, source in (("hub", f"hf:{data}"), ("text", f"text:{data}/*.jsonl")):
    out = tmp_path / name
    proc = subprocess.run(
        [sys.executable, "-m", "tfx.prepare", "--config", os.path.join(ROOT, "configs", "tiny.py"), "--out", str(out),
         "--quiet", "--tokenizer", tokenizer, f"--config.data.source={source}", "--config.data.eval_fraction=0.1",
         "--config.data.shard_mb=0.002", "--config.data.max_documents=0"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stores[name] = {k: v for k, v in store_files(out).items() if k != "manifest.json"}
  assert len(stores["hub"]) > 5 and stores["hub"] == stores["text"]


def test_parquet_source_gives_the_store_of_the_same_text(tmp_path, prepared, corpus_source):
  """The corpus's documents as rows of two Parquet files (several row groups) prepare into the same
  tokens as the text files they came from."""
  import pyarrow as pa
  import pyarrow.parquet as pq

  documents = load_documents(corpus_source).documents
  half = len(documents) // 2
  for i, part in enumerate((documents[:half], documents[half:])):
    pq.write_table(pa.table({"text": part}), tmp_path / f"part-{i}.parquet", row_group_size=7)
  tokenizer = os.path.join(prepared[0], "tokenizer.model")
  manifest = prepare(data_config(f"text:{tmp_path}/*.parquet"), str(tmp_path / "s"), tokenizer_path=tokenizer,
                     progress=False)
  assert manifest["content_checksum"] == prepared[1]["content_checksum"]


def test_content_checksum_ignores_sharding_but_not_content(prepared, corpus_source, tmp_path):
  """Preparing the same corpus with other shard sizes changes the files' checksum but not the
  content checksum that checkpoints record; other text or another split changes it."""
  _, manifest = prepared
  tokenizer = os.path.join(prepared[0], "tokenizer.model")
  resharded = prepare(data_config(corpus_source, shard_mb=0.05), str(tmp_path / "a"), tokenizer_path=tokenizer,
                      progress=False)
  assert len(resharded["shards"]) != len(manifest["shards"])
  assert resharded["checksum"] != manifest["checksum"]
  assert resharded["content_checksum"] == manifest["content_checksum"]
  other_split = prepare(data_config(corpus_source, eval_fraction=0.2), str(tmp_path / "b"), tokenizer_path=tokenizer,
                        progress=False)
  assert other_split["content_checksum"] != manifest["content_checksum"]
  fewer = prepare(data_config(corpus_source, max_documents=59), str(tmp_path / "c"), tokenizer_path=tokenizer,
                  progress=False)
  assert fewer["content_checksum"] != manifest["content_checksum"]


def test_a_shared_store_is_prepared_by_one_run_while_the_others_wait(tmp_path, shared_tokenizer):
  """data.store_root: a run that finds another preparing the shared store (holding its lease)
  waits, prepares nothing itself, and reads the finished store; a lone run prepares it."""
  import threading

  from tests.conftest import tiny_config
  from tfx.data.training import prepare_store, store_dir
  from tfx.lock import WorkdirLock

  config = tiny_config(f"--config.data.tokenizer={shared_tokenizer}", "--config.data.max_documents=20",
                       f"--config.data.store_root={tmp_path / 'stores'}", "--config.data.prepare_workers=1")
  directory = store_dir(config, tmp_path / "run")
  assert directory.parent == tmp_path / "stores"
  directory.mkdir(parents=True)
  results = []
  with WorkdirLock(directory, timeout=60):  # another run, preparing
    waiter = threading.Thread(target=lambda: results.append(prepare_store(config, directory, poll=0.05)))
    waiter.start()
    time.sleep(1.0)
    assert waiter.is_alive() and not (directory / store.MANIFEST).exists()  # waiting, not preparing
  waiter.join(timeout=120)
  assert not waiter.is_alive() and results[0]["documents"] == 20
  assert store.read_manifest(directory) == results[0] and not (directory / "tfx.lock").exists()
