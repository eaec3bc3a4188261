"""Tests for tfx.data.pipeline: packing documents into rows, epochs, the held-out split, host
slices, exact resume, streams (CPU, offline)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tfx.data import Corpus, DataPipeline, tokenize_corpus
from tfx.data.pipeline import heldout_mask

EOS = 1


def synthetic_documents(num_docs: int = 40, seed: int = 0, max_len: int = 60) -> list[np.ndarray]:
  """Documents whose tokens identify them: doc i has tokens 1000*(i+1) + 0, 1, ..."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, max_len, size=num_docs)
  return [np.arange(n, dtype=np.int32) + 1000 * (i + 1) for i, n in enumerate(lengths)]


def make_pipeline(docs=None, **kwargs) -> DataPipeline:
  options = dict(eos_id=EOS, row_length=16, global_batch=4, seed=0, eval_fraction=0.1,
                 eval_batches=2)
  options.update(kwargs)
  return DataPipeline(synthetic_documents() if docs is None else docs, **options)


def take(pipeline: DataPipeline, n: int) -> list[dict]:
  return [pipeline.next_batch() for _ in range(n)]


def assert_batches_equal(a: list[dict], b: list[dict]):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys() == {"tokens", "segment_ids", "positions"}
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])


def assert_valid_rows(batch: dict, row_length: int, eos_id: int = EOS, padded: bool = False):
  tokens, seg, pos = batch["tokens"], batch["segment_ids"], batch["positions"]
  for a in (tokens, seg, pos):
    assert a.dtype == np.int32 and a.ndim == 2 and a.shape[1] == row_length
  for t, s, p in zip(tokens, seg, pos):
    real = s > 0
    if not padded:
      assert real.all()
    # Padding only at the end of a row, with zeros everywhere.
    n = int(real.sum())
    assert real[:n].all() and not real[n:].any()
    assert (t[n:] == 0).all() and (p[n:] == 0).all()
    if n == 0:
      continue
    assert s[0] == 1 and p[0] == 0
    for j in range(1, n):
      if s[j] == s[j - 1]:
        assert p[j] == p[j - 1] + 1
      else:
        assert s[j] == s[j - 1] + 1 and p[j] == 0
        assert t[j - 1] == eos_id  # A segment changes only after a document ends.


def test_rows_have_exact_length_and_consistent_segments():
  pipeline = make_pipeline()
  for batch in take(pipeline, 3 * pipeline.batches_per_epoch):
    assert batch["tokens"].shape == (4, 16)
    assert_valid_rows(batch, 16)
  # Multi-segment rows really occur with short documents.
  rows = pipeline.epoch_rows(0)
  assert rows["segment_ids"].max() >= 2


def test_epoch_concatenates_to_shuffled_documents_plus_eos():
  docs = synthetic_documents()
  pipeline = make_pipeline(docs, seed=7, shuffle_rows=False)  # stream order (rows: see below)
  train_ids = pipeline.train_document_indices
  for epoch in (0, 1):
    order = np.random.default_rng([7, epoch]).permutation(len(train_ids))
    expected = np.concatenate([np.append(docs[train_ids[i]], EOS) for i in order])
    batches = take(pipeline, pipeline.batches_per_epoch)
    got = np.concatenate([b["tokens"].reshape(-1) for b in batches])
    assert len(expected) - len(got) < pipeline.row_length * (pipeline.global_batch + 1)
    np.testing.assert_array_equal(got, expected[:len(got)])
    # The full epoch's rows drop less than one row.
    rows = pipeline.epoch_rows(epoch)["tokens"].reshape(-1)
    assert len(expected) - len(rows) < pipeline.row_length
    np.testing.assert_array_equal(rows, expected[:len(rows)])
  assert pipeline.stats["train_tokens"] == sum(len(docs[i]) + 1 for i in train_ids)


def test_epochs_differ_and_batches_never_mix_epochs():
  pipeline = make_pipeline(shuffle_rows=False)
  first = pipeline.epoch_rows(0)["tokens"].copy()
  second = pipeline.epoch_rows(1)["tokens"]
  assert not np.array_equal(first, second)
  per_epoch = pipeline.batches_per_epoch
  batches = take(pipeline, per_epoch + 1)
  np.testing.assert_array_equal(batches[per_epoch]["tokens"], second[:4])
  assert pipeline.state() == {"epoch": 1, "row": 4}


def test_same_seed_same_batches_different_seed_different_batches():
  a = take(make_pipeline(seed=3), 6)
  b = take(make_pipeline(seed=3), 6)
  c = take(make_pipeline(seed=4), 6)
  assert_batches_equal(a, b)
  assert any(not np.array_equal(x["tokens"], y["tokens"]) for x, y in zip(a, c))


def test_eval_split_is_disjoint_seed_independent_and_stable():
  docs = synthetic_documents(200)
  p0 = make_pipeline(docs, seed=0, eval_fraction=0.1)
  p1 = make_pipeline(docs, seed=1, eval_fraction=0.1)
  eval_ids, train_ids = set(p0.eval_document_indices), set(p0.train_document_indices)
  assert eval_ids and train_ids and not eval_ids & train_ids
  assert eval_ids | train_ids == set(range(len(docs)))
  assert 5 <= len(eval_ids) <= 40
  np.testing.assert_array_equal(p0.eval_document_indices, p1.eval_document_indices)
  assert_batches_equal(p0.eval_batches(), p1.eval_batches())
  assert_batches_equal(p0.eval_batches(), p0.eval_batches())
  # Eval tokens come only from held-out documents (token // 1000 - 1 = document index).
  for batch in p0.eval_batches():
    assert_valid_rows(batch, 16, padded=True)
    docs_seen = {int(t) // 1000 - 1 for t in batch["tokens"].reshape(-1) if t >= 1000}
    assert docs_seen <= eval_ids
  for batch in take(p0, p0.batches_per_epoch):
    docs_seen = {int(t) // 1000 - 1 for t in batch["tokens"].reshape(-1) if t >= 1000}
    assert docs_seen <= train_ids
  # Membership is stable when documents are appended.
  mask = heldout_mask(200, 0.1)
  np.testing.assert_array_equal(heldout_mask(300, 0.1)[:200], mask)


def test_eval_batches_first_rows_in_corpus_order():
  docs = synthetic_documents(200)
  pipeline = make_pipeline(docs, eval_fraction=0.3, eval_batches=2)
  expected = np.concatenate([np.append(docs[i], EOS) for i in pipeline.eval_document_indices])
  got = np.concatenate([b["tokens"].reshape(-1) for b in pipeline.eval_batches()])
  assert len(pipeline.eval_batches()) == 2
  np.testing.assert_array_equal(got, expected[:len(got)])
  assert "first" in pipeline.eval_note


def test_small_eval_split_is_padded_and_explained():
  docs = [np.arange(5, dtype=np.int32) + 1000 * (i + 1) for i in range(100)]
  pipeline = make_pipeline(docs, eval_fraction=0.02, global_batch=4, eval_batches=3)
  batches = pipeline.eval_batches()
  assert len(batches) == 1
  assert pipeline.eval_note
  batch = batches[0]
  assert batch["tokens"].shape == (4, 16)
  assert_valid_rows(batch, 16, padded=True)
  assert (batch["segment_ids"][-1] == 0).all()  # A whole padding row.
  assert (batch["segment_ids"] > 0).sum() == pipeline.stats["eval_tokens"]


def test_fewer_eval_batches_when_split_is_short():
  """A held-out split shorter than eval_batches: every held-out row is evaluated exactly once, the
  last batch filled with rows of padding (none dropped)."""
  docs = [np.arange(15, dtype=np.int32) + 1000 * (i + 1) for i in range(400)]
  pipeline = make_pipeline(docs, eval_fraction=0.1, global_batch=3, eval_batches=1000)
  n_rows = -(-pipeline.stats["eval_tokens"] // 16)
  batches = pipeline.eval_batches()
  assert len(batches) == -(-n_rows // 3) and n_rows % 3  # this split leaves a partial last batch
  assert sum(int((b["segment_ids"] > 0).sum()) for b in batches) == pipeline.stats["eval_tokens"]
  expected = np.concatenate([np.append(docs[i], EOS) for i in pipeline.eval_document_indices])
  got = np.concatenate([b["tokens"][b["segment_ids"] > 0] for b in batches])
  np.testing.assert_array_equal(got, expected)
  assert "eval batches" in pipeline.eval_note and "all-padding rows" in pipeline.eval_note


@pytest.mark.parametrize("process_count", [2, 4])
def test_host_slices_concatenate_to_global_batch(process_count):
  single = make_pipeline(global_batch=8)
  hosts = [make_pipeline(global_batch=8, process_index=p, process_count=process_count)
           for p in range(process_count)]
  for _ in range(single.batches_per_epoch + 2):  # Crosses an epoch boundary.
    full = single.next_batch()
    parts = [h.next_batch() for h in hosts]
    for k in full:
      assert all(p[k].shape == (8 // process_count, 16) for p in parts)
      np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), full[k])
  full_eval = single.eval_batches()
  host_evals = [h.eval_batches() for h in hosts]
  for b, full in enumerate(full_eval):
    for k in full:
      np.testing.assert_array_equal(np.concatenate([e[b][k] for e in host_evals]), full[k])


@pytest.mark.parametrize("k", [0, 1, 3, "epoch_end", "past_epoch"])
def test_exact_resume(k):
  reference = make_pipeline(seed=11)
  per_epoch = reference.batches_per_epoch
  k = {"epoch_end": per_epoch, "past_epoch": per_epoch + 2}.get(k, k)
  take(reference, k)
  state = json.loads(json.dumps(reference.state()))
  expected = take(reference, per_epoch + 3)  # Always crosses an epoch boundary.
  resumed = make_pipeline(seed=11)
  resumed.restore(state)
  assert_batches_equal(take(resumed, per_epoch + 3), expected)
  assert resumed.state() == reference.state()


def test_batch_is_a_copy_and_eval_is_read_only():
  pipeline = make_pipeline()
  batch = pipeline.next_batch()
  batch["tokens"][:] = -5
  assert (pipeline.epoch_rows(0)["tokens"] != -5).all()
  with pytest.raises(ValueError):
    pipeline.eval_batches()[0]["tokens"][0, 0] = 3


def test_invalid_configurations_are_clear_errors():
  with pytest.raises(ValueError, match="too small"):
    make_pipeline(synthetic_documents(10), global_batch=64)
  with pytest.raises(ValueError, match="not divisible"):
    make_pipeline(global_batch=6, process_count=4)
  with pytest.raises(ValueError, match="at least 2"):
    make_pipeline(synthetic_documents(1))
  with pytest.raises(ValueError, match="eval_fraction"):
    make_pipeline(eval_fraction=0.0)
  pipeline = make_pipeline()
  with pytest.raises(ValueError, match="state"):
    pipeline.restore({"epoch": 0})
  with pytest.raises(ValueError, match="does not fit"):
    pipeline.restore({"epoch": 0, "row": 10**9})
  with pytest.raises(ValueError, match="row 6 is not a batch boundary .* another train.batch_size"):
    pipeline.restore({"epoch": 0, "row": 6})  # written by a run with a global batch of 2 or 6


def test_from_config_and_tokenize_cache(tokenizer, small_corpus, tmp_path):
  ml_collections = pytest.importorskip("ml_collections")
  data_cfg = ml_collections.ConfigDict({"eval_fraction": 0.05, "eval_batches": 2})
  corpus = Corpus(small_corpus.documents[:40], small_corpus.names[:40])
  cache = str(tmp_path / "cache")
  pipeline = DataPipeline.from_config(data_cfg, tokenizer, corpus, row_length=64,
                                      global_batch=4, seed=0, process_index=0,
                                      process_count=1, cache_dir=cache)
  batch = pipeline.next_batch()
  assert_valid_rows(batch, 64, eos_id=tokenizer.eos_id)
  assert len(pipeline.eval_batches()) == 2
  assert pipeline.stats["documents"] == 40
  direct = tokenize_corpus(tokenizer, corpus)
  assert len(os.listdir(cache)) == 2 and all(f.endswith(".npy") for f in os.listdir(cache))
  cached = tokenize_corpus(tokenizer, corpus, cache_dir=cache)
  assert len(cached) == len(direct)
  for a, b in zip(cached, direct):
    assert a.dtype == np.int32
    np.testing.assert_array_equal(a, b)
  assert sum(map(len, direct)) + 40 == (pipeline.stats["train_tokens"]
                                        + pipeline.stats["eval_tokens"])


def test_rows_are_served_shuffled_once_per_epoch():
  """Each packed row of an epoch is served exactly once, not in stream order (a long document
  must not fill consecutive batches); shuffle_rows=False serves the stream in order."""
  pipeline = make_pipeline(global_batch=4)
  rows = pipeline.epoch_rows(0)
  served = np.concatenate([pipeline.next_batch()["tokens"] for _ in range(pipeline.batches_per_epoch)])
  index = {row.tobytes(): i for i, row in enumerate(rows["tokens"])}
  order = [index[row.tobytes()] for row in served]
  assert len(set(order)) == len(order)
  assert order != sorted(order)
  ordered = make_pipeline(global_batch=4, shuffle_rows=False)
  first = ordered.next_batch()["tokens"]
  np.testing.assert_array_equal(first, ordered.epoch_rows(0)["tokens"][:4])


def test_streams_continue_row_by_row():
  """streams=True: row b of batch s+1 is the packed row that follows row b of batch s, and the
  union of the epoch's batches is every row once."""
  pipeline = make_pipeline(global_batch=4, streams=True)
  rows = pipeline.epoch_rows(0)["tokens"]
  index = {row.tobytes(): i for i, row in enumerate(rows)}
  batches = [pipeline.next_batch()["tokens"] for _ in range(pipeline.batches_per_epoch)]
  ids = np.array([[index[r.tobytes()] for r in b] for b in batches])  # [steps, rows]
  assert np.all(np.diff(ids, axis=0) == 1)
  assert len(set(ids.reshape(-1))) == ids.size
  # Resume in the middle of the streams.
  again = make_pipeline(global_batch=4, streams=True)
  again.restore({"epoch": 0, "row": 8})
  np.testing.assert_array_equal(again.next_batch()["tokens"], batches[2])


def test_strided_streams_overlap_by_the_stride():
  """streams + stride: row b of batch s+1 starts `stride` tokens after row b of batch s, in the
  same text stream (XLNet: the memory of a row is the text right before it)."""
  docs = synthetic_documents(60)
  pipeline = make_pipeline(docs, global_batch=2, streams=True, stride=6)
  a, b = pipeline.next_batch(), pipeline.next_batch()
  np.testing.assert_array_equal(b["tokens"][:, :10], a["tokens"][:, 6:])
  assert np.all(a["segment_ids"][:, 0] == 1) and np.all(a["positions"][:, 0] == 0)
  # Positions restart where a document starts inside a row (every document ends with EOS).
  for row_tokens, row_pos in zip(a["tokens"], a["positions"]):
    after_eos = np.flatnonzero(row_tokens[:-1] == EOS) + 1
    assert np.all(row_pos[after_eos] == 0)
  with pytest.raises(ValueError, match="stride"):
    make_pipeline(docs, streams=True, stride=17)


def test_reversed_streams_read_the_forward_streams_backwards():
  """reversed_streams (XLNet bi_data): rows [B/2, B) are the streams of rows [0, B/2) read from
  their end, rows still follow each other by the stride, and reversed documents open at EOS."""
  docs = synthetic_documents(60)
  pipeline = make_pipeline(docs, global_batch=4, streams=True, stride=6, reversed_streams=True)
  forward = make_pipeline(docs, global_batch=2, streams=True, stride=6)
  assert pipeline.batches_per_epoch == forward.batches_per_epoch
  batches = take(pipeline, pipeline.batches_per_epoch)
  fwd = take(forward, forward.batches_per_epoch)
  for got, want in zip(batches, fwd):
    np.testing.assert_array_equal(got["tokens"][:2], want["tokens"])
  # Stream s read backwards: the concatenation of the reversed rows (by stride) is the reverse of
  # the forward stream's text.
  per_stream = pipeline.stats["train_tokens"] // 2
  rows = pipeline.epoch_rows(0)
  k = pipeline.batches_per_epoch
  for s in range(2):
    stream = pipeline.epoch_stream(0)[0][s * per_stream:(s + 1) * per_stream]
    backwards = np.concatenate([b["tokens"][2 + s, :6] for b in batches])
    np.testing.assert_array_equal(backwards, stream[::-1][:6 * k])
  b1, b2 = batches[0], batches[1]
  np.testing.assert_array_equal(b2["tokens"][2:, :10], b1["tokens"][2:, 6:])
  for row_tokens, row_pos in zip(rows["tokens"][2 * k:], rows["positions"][2 * k:]):
    starts = np.flatnonzero(row_tokens == EOS)
    assert np.all(row_pos[starts] == 0) and row_pos[0] == 0
  with pytest.raises(ValueError, match="even"):
    make_pipeline(docs, global_batch=3, streams=True, reversed_streams=True)
