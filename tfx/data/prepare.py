"""Prepare a token store: stream a source, train or reuse the tokenizer, tokenize in workers, shard.

    python -m tfx.prepare --config configs/quickstart.py --out DIR [--workers N] [--config.k=v ...]

``tfx.train`` runs the same function into ``WORKDIR/data/<key>`` when ``data.source`` is a raw
corpus, so a run tokenizes once and a resume never again. See :mod:`tfx.data.store` for the
layout. Preparing is resumable shard by shard: a shard is done when its ``.json`` exists and its
files have the recorded sizes and checksums; anything else is rewritten. Shards are consecutive
documents of the source closed at ``data.shard_mb`` of UTF-8 text, and a document's split depends
only on its index in the source, so an interrupted-and-rerun prepare writes the same bytes as an
uninterrupted one, whatever the number of workers. The rerun must ask for the same store: what the
first command asked for is recorded in ``prepare.json`` before anything else is written.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import json
import multiprocessing
import os
import sys
import time
from typing import Any, Iterator

import numpy as np
from etils import epath

from tfx.data import sources, store
from tfx.data.packing import document_hashes, heldout_by_hash
from tfx.data.tokenizer import (AnyTokenizer, Tokenizer, load_tokenizer, sample_lines, saved_tokenizer,
                                tokenizer_from_bytes, utf8_bytes)

PREPARED = "prepared:"
PREPARING = "prepare.json"  # what an unfinished prepare was asked for; removed once the manifest is written
DEFAULT_SAMPLE_BYTES = 2_000_000
_ENCODE_CHUNK = 256


@dataclasses.dataclass(frozen=True)
class Spec:
  """What decides a store's content (besides the tokenizer): recorded in the manifest."""

  source: str
  text_field: str = "text"
  max_documents: int = 0
  eval_fraction: float = 0.02
  shard_mb: float = 64.0

  @classmethod
  def from_config(cls, data_cfg) -> "Spec":
    return cls(source=data_cfg.source, text_field=data_cfg.text_field,
               max_documents=int(data_cfg.max_documents), eval_fraction=float(data_cfg.eval_fraction),
               shard_mb=float(data_cfg.get("shard_mb", 64.0)))

  def as_source(self) -> dict:
    return {"spec": self.source, "text_field": self.text_field, "max_documents": self.max_documents}


def tokenizer_sample_bytes(data_cfg) -> int:
  """``data.tokenizer_sample_bytes``, or (0 = auto) 2 MB or 1 kB per vocabulary entry if more."""
  configured = int(data_cfg.get("tokenizer_sample_bytes", 0))
  return configured if configured > 0 else max(DEFAULT_SAMPLE_BYTES, 1000 * int(data_cfg.vocab_size))


def store_key(data_cfg, tokenizer_sha256: str = "") -> str:
  """Short name of the store a config prepares into ``WORKDIR/data/`` (changes with the spec)."""
  spec = Spec.from_config(data_cfg)
  text = repr((dataclasses.astuple(spec), tokenizer_sha256 or (data_cfg.vocab_size, tokenizer_sample_bytes(data_cfg))))
  return hashlib.sha256(text.encode()).hexdigest()[:12]


# ==================================================================================== workers

_WORKER: dict[str, Any] = {}


def _init_worker(model_proto: bytes) -> None:
  _WORKER["tokenizer"] = tokenizer_from_bytes(model_proto)


def _encode(texts: list[str]) -> list[np.ndarray]:
  tokenizer = _WORKER["tokenizer"]
  out: list[np.ndarray] = []
  for start in range(0, len(texts), _ENCODE_CHUNK):
    out.extend(tokenizer.encode(texts[start:start + _ENCODE_CHUNK]))
  return out


def write_shard(out: str, index: int, first_document: int, texts: list[str], text_bytes: int,
                eval_fraction: float, dtype: str, forced_eval: int = -1) -> dict:
  """Tokenizes one shard's documents and writes its files, then its record (runs in a worker).

  Args:
      out: the store directory.
      index: the shard number.
      first_document: source index of ``texts[0]``.
      texts: the shard's documents.
      text_bytes: their UTF-8 size (recorded for progress and the manifest).
      eval_fraction: the split rule's fraction.
      dtype: the token dtype name.
      forced_eval: a source index held out whatever its hash (the corpus had no held-out
          document otherwise), or -1.

  Returns:
      The shard's record, as in the manifest.
  """
  directory = epath.Path(out)
  name = store.shard_name(index)
  tokens = _encode(texts)
  indices = np.arange(first_document, first_document + len(texts))
  hashes = document_hashes(indices)
  heldout = heldout_by_hash(hashes, eval_fraction) | (indices == forced_eval)
  record: dict[str, Any] = {
      "name": name, "index": index, "first_document": first_document, "documents": len(texts),
      "text_bytes": text_bytes, "forced_eval": forced_eval,
      "min_hash_document": int(indices[np.argmin(hashes)]) if len(texts) else -1,
      "min_hash": int(hashes.min()) if len(texts) else 2**64 - 1,
  }
  np_dtype = np.dtype(dtype)
  for split, take in (("train", ~heldout), ("eval", heldout)):
    chosen = np.flatnonzero(take)
    docs = [tokens[i] for i in chosen]
    content = store.content_sum(docs, indices[chosen], np_dtype)
    lengths = np.array([len(d) for d in docs], np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(store.OFFSET_DTYPE)
    flat = np.concatenate(docs).astype(np_dtype) if docs else np.zeros(0, np_dtype)
    files = {}
    for kind, array in (("tokens", flat), ("offsets", offsets)):
      data = array.tobytes()
      file_name = f"{name}.{split}.{kind}"
      store.write_atomic(directory / file_name, data)
      files[kind] = {"name": file_name, "bytes": len(data), "sha256": store.sha256_bytes(data)}
    record[split] = {"documents": len(docs), "tokens": int(lengths.sum()), "files": files, "content": content}
  store.write_json_atomic(directory / f"{name}.json", record)  # the commit mark, written last
  return record


def _shard_is_complete(directory: epath.Path, index: int, first_document: int, count: int,
                       forced_eval: int) -> dict | None:
  """The record of a finished shard that matches what would be written now, else None."""
  path = directory / f"{store.shard_name(index)}.json"
  if not path.exists():
    return None
  try:
    record = json.loads(path.read_text())
  except ValueError:
    return None
  if (record.get("first_document"), record.get("documents")) != (first_document, count):
    return None
  if forced_eval >= 0 and record.get("forced_eval") != forced_eval:
    return None
  for split in store.SPLITS:
    for entry in record[split]["files"].values():
      file = directory / entry["name"]
      if not file.exists() or file.stat().length != entry["bytes"]:
        return None
      if store.sha256_bytes(file.read_bytes()) != entry["sha256"]:
        return None
  return record


# ==================================================================================== prepare


def _shards(documents: Iterator[tuple[str, str]], shard_bytes: int,
            max_documents: int) -> Iterator[tuple[int, int, list[str], int]]:
  """(index, first document, texts, UTF-8 bytes): consecutive documents closed at ``shard_bytes``."""
  texts: list[str] = []
  size = first = index = count = 0
  for _, text in _limited(documents, max_documents):
    texts.append(text)
    size += len(text.encode("utf-8"))
    count += 1
    if size >= shard_bytes:
      yield index, first, texts, size
      index, first, texts, size = index + 1, count, [], 0
  if texts:
    yield index, first, texts, size


def resolve_tokenizer(data_cfg, directory: epath.Path, spec: Spec, *, seed: int = 0,
                      tokenizer_path: str = "", log=None) -> AnyTokenizer:
  """The store's tokenizer: ``tokenizer_path`` (or ``data.tokenizer``; SentencePiece or Hugging Face,
  see :func:`tfx.data.tokenizer.load_tokenizer`), the one the store already has, or a SentencePiece
  model trained on a sample of the source; a copy is kept in the store as ``tokenizer.filename``."""
  existing = saved_tokenizer(directory)
  path = tokenizer_path or data_cfg.tokenizer
  if path:
    tokenizer = load_tokenizer(path)
  elif existing is not None:
    return tokenizer_from_bytes(existing.read_bytes(), path=str(existing))
  else:
    max_bytes = tokenizer_sample_bytes(data_cfg)
    if spec.source.startswith("hf:"):  # one pass only: the first documents of the stream
      total = 0
    else:  # a counting pass, so the sample is spread over the whole corpus
      skipped: collections.Counter = collections.Counter()
      total = sum(utf8_bytes(t) for _, t in _limited(
          sources.iter_documents(spec.source, text_field=spec.text_field, skipped=skipped), spec.max_documents))
      if not total:  # before SentencePiece fails on an empty sample with a message of its own
        raise _no_documents(spec, skipped)
    if log:
      log(f"training the tokenizer (vocab {data_cfg.vocab_size}) on a {max_bytes / 1e6:.1f} MB sample")
    docs = (t for _, t in _limited(sources.iter_documents(spec.source, text_field=spec.text_field, streaming=True),
                                   spec.max_documents))
    tokenizer = Tokenizer.train_on_lines(sample_lines(docs, total, max_bytes), int(data_cfg.vocab_size), None,
                                         seed=seed)
  target = directory / tokenizer.filename
  if existing is not None and existing.read_bytes() != tokenizer.model_proto:
    raise store.StoreError(
        f"token store {directory} was made with another tokenizer than {path}; use another --out, "
        f"or delete {directory} to prepare it again")
  if existing is None:
    store.write_atomic(target, tokenizer.model_proto)
  return tokenizer_from_bytes(tokenizer.model_proto, path=str(target))


def _limited(documents, max_documents: int):
  for count, item in enumerate(documents):
    if max_documents and count >= max_documents:
      return
    yield item


def prepare(data_cfg, out: str | epath.Path, *, seed: int = 0, workers: int = 0, tokenizer_path: str = "",
            progress: bool = True) -> dict:
  """Prepares (or finishes preparing) the store of ``data_cfg`` in ``out``; returns its manifest.

  Args:
      data_cfg: ``config.data`` (source, text_field, max_documents, eval_fraction, vocab_size,
          tokenizer, tokenizer_sample_bytes, shard_mb).
      out: the store directory, local or ``gs://``.
      seed: the tokenizer training seed.
      workers: tokenizing processes (0 = all cores).
      tokenizer_path: a tokenizer to use instead of ``data.tokenizer`` (a SentencePiece model or a
          Hugging Face tokenizer, see :func:`tfx.data.tokenizer.load_tokenizer`).
      progress: print a progress bar to stderr.

  Raises:
      StoreError / ValueError: a source that cannot be read, a store prepared from another
          source, an empty split, a full disk (the finished shards are kept).
  """
  directory = epath.Path(out)
  spec = Spec.from_config(data_cfg)
  if spec.source.startswith(PREPARED):
    raise store.StoreError(f"data.source={spec.source!r} is already a prepared store; train on it directly")
  log = (lambda text: print(f"tfx.prepare: {text}", file=sys.stderr, flush=True)) if progress else None
  try:
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / store.MANIFEST).exists():
      manifest = store.read_manifest(directory)
      _check_same_spec(manifest, spec, directory)
      return manifest
    sources.iter_documents(spec.source, text_field=spec.text_field, streaming=True)  # a bad source fails fast
    _resume_same_spec(directory, spec, _requested(data_cfg, spec, tokenizer_path, seed))
    for stale in directory.glob(".*.tmp-*"):  # left by a prepare that was killed mid-write
      stale.unlink()
    tokenizer = resolve_tokenizer(data_cfg, directory, spec, seed=seed, tokenizer_path=tokenizer_path, log=log)
    manifest = _write_store(directory, spec, tokenizer, workers or os.cpu_count() or 1, log)
    (directory / PREPARING).unlink(missing_ok=True)
    return manifest
  except OSError as e:
    raise store.StoreError(
        f"writing the token store {directory} failed ({type(e).__name__}: {e}); the shards finished so far "
        f"are kept: fix the cause (disk or bucket full? permissions?) and run the same command again") from e


def _requested(data_cfg, spec: Spec, tokenizer_path: str, seed: int) -> dict:
  """What decides the bytes of a store being prepared: its spec and where its tokenizer comes from."""
  trained = {"vocab_size": int(data_cfg.vocab_size), "sample_bytes": tokenizer_sample_bytes(data_cfg), "seed": seed}
  return {"sources": [spec.as_source()], "eval_fraction": spec.eval_fraction, "shard_mb": spec.shard_mb,
          "tokenizer": tokenizer_path or data_cfg.tokenizer or {"trained": trained}}


def _resume_same_spec(directory: epath.Path, spec: Spec, requested: dict) -> None:
  """Records what this prepare is asked for before it writes anything; a rerun that finishes an
  interrupted one must ask for the same, or its kept shards (split by the old eval_fraction,
  tokenized by the old tokenizer) would mix with new ones in one store."""
  path = directory / PREPARING
  if path.exists():
    _check_same_spec(json.loads(path.read_text()), spec, directory, ("shard_mb", "tokenizer"), requested)
  elif any(directory.glob("shard-*.json")):  # (a tokenizer alone was put there on purpose: it is used)
    raise store.StoreError(f"{directory} holds part of a token store but no {PREPARING} saying what it was prepared "
                           f"from; use another --out, or delete {directory} to prepare it again")
  else:
    store.write_json_atomic(path, requested)


def _check_same_spec(manifest: dict, spec: Spec, directory: epath.Path, keys: tuple[str, ...] = (),
                     requested: dict | None = None) -> None:
  """`manifest` (or an unfinished prepare's record) against `spec`, and its `keys` against `requested`."""
  recorded = manifest.get("sources", [{}])[0]
  mine = spec.as_source()
  changed = [f"{k}: {recorded.get(k)!r} -> {v!r}" for k, v in mine.items() if recorded.get(k) != v]
  if manifest.get("eval_fraction") != spec.eval_fraction:
    changed.append(f"eval_fraction: {manifest.get('eval_fraction')} -> {spec.eval_fraction}")
  changed += [f"{k}: {manifest.get(k)!r} -> {requested[k]!r}" for k in keys if manifest.get(k) != requested[k]]
  if changed:
    raise store.StoreError(f"token store {directory} was prepared from another source ({'; '.join(changed)}); "
                           f"use another --out, or delete {directory} to prepare it again")


def _write_store(directory: epath.Path, spec: Spec, tokenizer: AnyTokenizer, workers: int, log) -> dict:
  dtype = store.token_dtype(tokenizer.vocab_size).str
  skipped: collections.Counter = collections.Counter()
  documents = sources.iter_documents(spec.source, text_field=spec.text_field, skipped=skipped, streaming=True)
  shard_bytes = max(int(spec.shard_mb * 1e6), 1)
  meter = _Meter(None if spec.max_documents else sources.source_bytes(spec.source), log)
  records: dict[int, dict] = {}
  pool = None
  _init_worker(tokenizer.model_proto)
  pending: dict[concurrent.futures.Future, int] = {}
  try:
    for index, first, texts, size in _shards(documents, shard_bytes, spec.max_documents):
      done = _shard_is_complete(directory, index, first, len(texts), -1)
      if done is not None:
        records[index] = done
        meter.add(done, reused=True)
        continue
      args = (str(directory), index, first, texts, size, spec.eval_fraction, dtype)
      if pool is None and workers > 1 and index > 0:  # a one-shard corpus never pays for worker start-up
        pool = concurrent.futures.ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker,
            initargs=(tokenizer.model_proto,))
      if pool is None:
        records[index] = write_shard(*args)
        meter.add(records[index])
        continue
      pending[pool.submit(write_shard, *args)] = index
      while len(pending) >= 2 * workers:
        _collect(pending, records, meter, concurrent.futures.FIRST_COMPLETED)
    while pending:
      _collect(pending, records, meter, concurrent.futures.ALL_COMPLETED)
  finally:
    if pool is not None:
      pool.shutdown(wait=True, cancel_futures=True)
  meter.close()
  shards = [records[i] for i in sorted(records)]
  total_documents = sum(s["documents"] for s in shards)
  if not total_documents:
    raise _no_documents(spec, skipped)
  if not sum(s["eval"]["documents"] for s in shards):
    shards = _hold_out_one(directory, spec, shards, dtype, shard_bytes)
  if not sum(s["train"]["documents"] for s in shards):
    raise store.StoreError(f"data.eval_fraction={spec.eval_fraction} holds out all {total_documents} documents; "
                           f"lower it or use a larger corpus")
  manifest = _manifest(spec, tokenizer, dtype, shards, dict(skipped))
  store.write_json_atomic(directory / store.MANIFEST, manifest)
  if log:
    log(f"{directory}: {total_documents:,} documents, {manifest['splits']['train']['tokens']:,} train / "
        f"{manifest['splits']['eval']['tokens']:,} eval tokens in {len(shards)} shard(s)")
  return manifest


def _no_documents(spec: Spec, skipped: collections.Counter) -> store.StoreError:
  return store.StoreError(
      f"data source {spec.source!r} produced no documents ({skipped['empty']} empty, "
      f"{skipped['undecodable']} undecodable); point data.source at non-empty UTF-8 text")


def _collect(pending, records, meter, how) -> None:
  done, _ = concurrent.futures.wait(list(pending), return_when=how)
  for future in done:
    index = pending.pop(future)
    records[index] = future.result()
    meter.add(records[index])


def _hold_out_one(directory, spec, shards, dtype, shard_bytes) -> list[dict]:
  """No document fell in the eval split: hold out the one with the smallest hash (as
  :func:`tfx.data.packing.heldout_mask` does) by rewriting its shard."""
  best = min(shards, key=lambda s: s["min_hash"])
  forced = best["min_hash_document"]
  documents = sources.iter_documents(spec.source, text_field=spec.text_field, streaming=True)
  for index, first, texts, size in _shards(documents, shard_bytes, spec.max_documents):
    if index == best["index"]:
      shards[index] = (_shard_is_complete(directory, index, first, len(texts), forced)
                       or write_shard(str(directory), index, first, texts, size, spec.eval_fraction, dtype, forced))
      return shards
  raise store.StoreError(f"data source {spec.source!r} changed while it was being prepared; run again")


def _manifest(spec: Spec, tokenizer: AnyTokenizer, dtype: str, shards: list[dict], skipped: dict) -> dict:
  tokenizer_sha = store.sha256_bytes(tokenizer.model_proto)
  splits = {split: {"documents": sum(s[split]["documents"] for s in shards),
                    "tokens": sum(s[split]["tokens"] for s in shards)} for split in store.SPLITS}
  return {
      "format": store.FORMAT, "version": store.VERSION,
      "sources": [spec.as_source()],
      "tokenizer": {"file": tokenizer.filename, "sha256": tokenizer_sha, "vocab_size": tokenizer.vocab_size},
      "token_dtype": dtype,
      "eval_fraction": spec.eval_fraction,
      "split_rule": "document i is held out when splitmix64(i) < eval_fraction * 2**64 (i = index in the source)",
      "shard_mb": spec.shard_mb,
      "documents": sum(s["documents"] for s in shards),
      "skipped": skipped,
      "splits": splits,
      "shards": shards,
      "checksum": store.store_checksum(tokenizer_sha, dtype, shards),
      "content_checksum": store.content_checksum(tokenizer_sha, dtype, shards),
  }


class _Meter:
  """Progress on stderr: documents/s, MB/s of text, tokens so far and an ETA when the size is known."""

  def __init__(self, total_bytes: int | None, log):
    self.total, self.log = total_bytes, log
    self.start = self.last = time.time()
    self.documents = self.bytes = self.tokens = self.shards = self.reused = 0
    self.bar = None
    if log is not None:
      import tqdm  # datasets depends on tqdm; the bar only exists when progress is wanted

      self.bar = tqdm.tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tfx.prepare", file=sys.stderr,
                           mininterval=1.0 if sys.stderr.isatty() else 30.0, dynamic_ncols=True)

  def add(self, record: dict, reused: bool = False) -> None:
    self.shards += 1
    self.reused += int(reused)
    self.documents += record["documents"]
    self.bytes += record["text_bytes"]
    self.tokens += record["train"]["tokens"] + record["eval"]["tokens"]
    if self.bar is not None:
      elapsed = max(time.time() - self.start, 1e-9)
      self.bar.update(record["text_bytes"] if self.total is None or self.bar.n + record["text_bytes"] <= self.total
                      else max(self.total - self.bar.n, 0))
      self.bar.set_postfix_str(f"{self.shards} shards ({self.reused} kept), {self.documents:,} docs "
                               f"({self.documents / elapsed:,.0f}/s), {self.tokens:,} tokens", refresh=False)

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()
