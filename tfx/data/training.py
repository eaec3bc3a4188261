"""The data of a training run: the token store it reads, its tokenizer, and the corpus identity.

``data.source = "prepared:DIR"`` reads a store made by ``python -m tfx.prepare``; a raw source
(``stdlib``, ``text:GLOB``, ``hf:NAME``) is prepared first into ``WORKDIR/data/<key>``, or
``data.store_root/<key>`` when runs share their stores (process 0 prepares, the other hosts wait and
then read it), so a resume never tokenizes again. The run's tokenizer is the store's, copied to
``WORKDIR/<tokenizer.filename>`` (``tokenizer.model`` for SentencePiece, ``tokenizer.hf.json`` for a
Hugging Face tokenizer) for ``tfx.generate``.
"""

from __future__ import annotations

import dataclasses
import sys
import time

from etils import epath

from tfx.data import store
from tfx.data.pipeline import DataPipeline
from tfx.data.prepare import PREPARED, prepare, store_key
from tfx.data.hf_tokenizer import HFTokenizer
from tfx.data.tokenizer import AnyTokenizer, fit_vocab_size, load_tokenizer, saved_tokenizer, tokenizer_from_bytes


@dataclasses.dataclass
class TrainingData:
  tokenizer: AnyTokenizer  # a Hugging Face one padded to data.vocab_size rows (see fit_vocab_size)
  train: store.SplitReader
  heldout: store.SplitReader
  store_dir: epath.Path
  identity: dict  # recorded in every checkpoint; see corpus_changes

  def pipeline(self, config, *, row_length: int, process_index: int = 0, process_count: int = 1,
               streams: bool = False, stride: int = 0, reversed_streams: bool = False,
               eval_streams: bool = False) -> DataPipeline:
    """This host's batches of the store (see :meth:`DataPipeline.from_splits`)."""
    return DataPipeline.from_splits(
        self.train, self.heldout, eos_id=self.tokenizer.eos_id, row_length=row_length,
        global_batch=config.train.batch_size, seed=config.train.seed, eval_batches=config.data.eval_batches,
        process_index=process_index, process_count=process_count, streams=streams, stride=stride,
        reversed_streams=reversed_streams, eval_streams=eval_streams, prefetch=int(config.data.get("prefetch", 0)))


def store_dir(config, workdir) -> epath.Path:
  """Where the run's token store is: the ``prepared:`` directory, or ``ROOT/<key>`` with ROOT
  ``data.store_root`` (shared by runs: a sweep's) or ``WORKDIR/data``."""
  source = config.data.source
  if source.startswith(PREPARED):
    path = source[len(PREPARED):]
    if not path:
      raise store.StoreError("data.source='prepared:' needs a directory, e.g. 'prepared:gs://bucket/c4'")
    return epath.Path(path)
  root = config.data.get("store_root", "") or epath.Path(workdir) / "data"
  return epath.Path(root) / store_key(config.data, config.data.tokenizer)


def _barrier(name: str) -> None:
  import jax

  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


def prepare_store(config, directory, *, tokenizer_path: str = "", poll: float = 5.0) -> dict:
  """``prepare`` of the run's store in `directory`. One that runs share (``data.store_root``) is
  prepared under the store directory's lease (tfx.lock, see tfx.lock.WorkdirLock): of runs that
  start together one prepares it, the others wait for it (as long as its heartbeat lives) and then
  find it finished. (A store in WORKDIR/data is under the run's own lease already.)"""
  from tfx.lock import LockError, WorkdirLock  # noqa: PLC0415

  d = config.data
  run = lambda: prepare(d, directory, seed=config.train.seed, workers=int(d.get("prepare_workers", 0)),
                        tokenizer_path=tokenizer_path)
  if not d.get("store_root"):
    return run()
  directory = epath.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  waiting = False
  while True:
    try:
      with WorkdirLock(directory, timeout=config.train.lock_timeout):
        return run()
    except LockError as e:
      if not waiting:
        print(f"tfx: waiting for another run to prepare the token store: {e}", file=sys.stderr, flush=True)
        waiting = True
      time.sleep(poll)


def training_data(config, workdir, *, process_index: int = 0) -> TrainingData:
  """Prepares (if needed) and opens the run's store and its tokenizer."""
  d = config.data
  workdir = epath.Path(workdir)
  directory = store_dir(config, workdir)
  own_tokenizer = saved_tokenizer(workdir)  # WORKDIR/tokenizer.model or tokenizer.hf.json, once written
  if not d.source.startswith(PREPARED):
    if process_index == 0:
      reuse = d.tokenizer or (str(own_tokenizer) if own_tokenizer else "")
      prepare_store(config, directory, tokenizer_path=reuse)
    _barrier("tfx-prepare")
  manifest, train, heldout = store.open_store(directory, verify=d.get("verify_store", "background"))
  store_tokenizer = directory / manifest["tokenizer"].get("file", store.TOKENIZER)
  tokenizer = tokenizer_from_bytes(store_tokenizer.read_bytes(), path=str(store_tokenizer))
  recorded = manifest["tokenizer"]["sha256"]
  if store.sha256_bytes(tokenizer.model_proto) != recorded:
    raise store.StoreError(f"{store_tokenizer} does not match the tokenizer recorded in its manifest; "
                           f"the store is damaged: prepare it again")
  if d.tokenizer and store.sha256_bytes(load_tokenizer(d.tokenizer).model_proto) != recorded:
    raise store.StoreError(
        f"data.tokenizer={d.tokenizer} is not the tokenizer the store {directory} was prepared with; set "
        f"data.tokenizer='' to use the store's, or prepare the store again with this tokenizer")
  vocab = manifest["tokenizer"]["vocab_size"]
  if not d.tokenizer and not isinstance(tokenizer, HFTokenizer) and vocab != d.vocab_size:
    raise store.StoreError(
        f"the store {directory} was tokenized with a vocabulary of {vocab} (its {store_tokenizer.name}), but "
        f"data.vocab_size={d.vocab_size}; set data.vocab_size={vocab}, or prepare a store with the vocabulary you "
        f"want (in a new --workdir when the run trained its own tokenizer)")
  if process_index == 0 and own_tokenizer is None:
    store.write_atomic(workdir / tokenizer.filename, tokenizer.model_proto)
  tokenizer = fit_vocab_size(tokenizer, d.vocab_size)  # a Hugging Face tokenizer: data.vocab_size rows
  if tokenizer.eos_id is None:
    raise store.StoreError("the store's tokenizer has no '</s>' piece; the data pipeline needs an EOS id")
  identity = {"checksum": manifest.get("content_checksum", manifest["checksum"]), "sources": manifest["sources"], "store": str(directory),
              "tokenizer_sha256": recorded, "vocab_size": manifest["tokenizer"]["vocab_size"],
              "documents": manifest["documents"], "train_tokens": manifest["splits"]["train"]["tokens"]}
  return TrainingData(tokenizer, train, heldout, directory, identity)


def corpus_changes(saved: dict | None, current: dict) -> list[str]:
  """What differs between the corpus a checkpoint was trained on and the current one ([] = same)."""
  if not saved:
    return []  # a checkpoint from before corpus identity was recorded
  changes = []
  if saved.get("sources") != current["sources"]:
    changes.append(f"source {saved.get('sources')} -> {current['sources']}")
  if saved.get("tokenizer_sha256") != current["tokenizer_sha256"]:
    changes.append(f"tokenizer sha256 {str(saved.get('tokenizer_sha256'))[:12]} -> {current['tokenizer_sha256'][:12]}")
  if saved.get("vocab_size") != current["vocab_size"]:
    changes.append(f"vocabulary size {saved.get('vocab_size')} -> {current['vocab_size']}")
  if saved.get("checksum") != current["checksum"] and not changes:
    changes.append(f"store content (content checksum {str(saved.get('checksum'))[:12]} -> {current['checksum'][:12]}; "
                   f"documents {saved.get('documents')} -> {current['documents']}, train tokens "
                   f"{saved.get('train_tokens')} -> {current['train_tokens']})")
  return changes
