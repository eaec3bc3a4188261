"""Packing tokenized documents into fixed-length rows: splits, host slices, resume.

A batch is a dict of ``int32 [local_batch, row_length]`` arrays:

- ``tokens``: token ids; each document ends with EOS.
- ``segment_ids``: 1..k for the document pieces in the row, in order; 0 = padding.
- ``positions``: 0, 1, ... within each piece (restarting at 0 for every piece).

Train rows are never padded. For epoch ``e`` the train documents are permuted with
``np.random.default_rng([seed, e])``, concatenated and cut into rows of exactly
``row_length`` tokens (the incomplete tail of the epoch is dropped); a document
crossing a row boundary is split and each piece is its own segment. The global
batch is rows ``[r, r + global_batch)`` of the epoch; host ``p`` of ``P`` gets the
contiguous slice ``[p * local, (p + 1) * local)``, ``local = global_batch // P``.
The batch sequence is a pure function of (documents, seed, row_length,
global_batch) and the position ``{"epoch", "row"}``, which is what
:meth:`DataPipeline.state` / :meth:`DataPipeline.restore` save and load.

The held-out (eval) documents are chosen by a hash of the document index, not by
the seed, so every run on a corpus evaluates on the same text.

Rows are cut on the fly (:meth:`DataPipeline.batch_at`): only the epoch's document order and
cumulative lengths are kept, never the epoch's tokens, so a token store of any size can be read.
"""

from __future__ import annotations

import hashlib
import os
import threading
from typing import Any, Sequence

import numpy as np

from tfx.data.sources import Corpus
from tfx.data.packing import _flatten, heldout_mask, host_slice, pack_stream, pack_streams
from tfx.data.store import MemorySplit
from tfx.data.tokenizer import AnyTokenizer

Batch = dict[str, np.ndarray]
__all__ = ["DataPipeline", "heldout_mask", "host_slice", "pack_stream", "pack_streams", "tokenize_corpus"]
BATCH_KEYS = ("tokens", "segment_ids", "positions")
_ENCODE_CHUNK = 256


# -------------------------------------------------------------------- tokenizing


def tokenize_corpus(tokenizer: AnyTokenizer, corpus: Corpus, *,
                    cache_dir: str | None = None) -> list[np.ndarray]:
  """Encodes every document of a corpus (no BOS/EOS added).

  Args:
      tokenizer: the tokenizer.
      corpus: the documents.
      cache_dir: if set, the result is cached there as two ``.npy`` files (flat
          tokens and offsets) keyed by a hash of the tokenizer model and the
          documents; a later call with the same inputs loads them instead.

  Returns:
      One ``int32 [num_tokens_i]`` array per document.
  """
  if cache_dir:
    key = _corpus_key(tokenizer, corpus)
    tokens_path = os.path.join(cache_dir, f"tokens-{key}.npy")
    offsets_path = os.path.join(cache_dir, f"offsets-{key}.npy")
    if os.path.isfile(tokens_path) and os.path.isfile(offsets_path):
      flat = np.load(tokens_path, allow_pickle=False)
      offsets = np.load(offsets_path, allow_pickle=False)
      return _unflatten(flat, offsets)
  documents_tokens: list[np.ndarray] = []
  for start in range(0, len(corpus.documents), _ENCODE_CHUNK):
    documents_tokens.extend(tokenizer.encode(corpus.documents[start:start + _ENCODE_CHUNK]))
  if cache_dir:
    flat, offsets = _flatten(documents_tokens)
    os.makedirs(cache_dir, exist_ok=True)
    _atomic_save(tokens_path, flat)
    _atomic_save(offsets_path, offsets)
  return documents_tokens


def _corpus_key(tokenizer: AnyTokenizer, corpus: Corpus) -> str:
  digest = hashlib.sha256(tokenizer.model_proto)
  for document in corpus.documents:
    encoded = document.encode("utf-8")
    digest.update(len(encoded).to_bytes(8, "little"))
    digest.update(encoded)
  return digest.hexdigest()[:24]


def _unflatten(flat: np.ndarray, offsets: np.ndarray) -> list[np.ndarray]:
  return [flat[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]


def _atomic_save(path: str, array: np.ndarray) -> None:
  tmp = f"{path}.tmp-{os.getpid()}.npy"
  np.save(tmp, array, allow_pickle=False)
  os.replace(tmp, path)


# ---------------------------------------------------------------------- pipeline


class _Epoch:
  """What packing an epoch needs, without the epoch itself: the document order and ends."""

  def __init__(self, order: np.ndarray, lengths: np.ndarray):
    self.order = order  # int64 [documents]: train documents in this epoch's order
    self.cum_end = np.cumsum(lengths[order] + 1)  # int64 [documents]: stream end of each (with EOS)


class DataPipeline:
  """Deterministic, resumable, host-sliced batches of packed documents, packed on the fly.

  The epoch is never materialized: for each row the documents it covers are found by binary
  search in the epoch's cumulative document lengths and read from the split (in memory, or a
  token store read with ``pread`` / ranged reads). Batch ``k`` is a pure function of ``k``
  (:meth:`batch_at`), and is identical to cutting the concatenated epoch into rows
  (:meth:`epoch_rows`, the reference the tests compare against). With ``prefetch > 0`` a Grain
  iterator builds the next batches in a background thread while the step runs.

  Attributes:
      stats: counts of documents, tokens, rows (see :meth:`__init__`).
      eval_note: why eval has fewer batches / padded rows, or ``""``.
      local_batch: rows per host batch, ``global_batch // process_count``.
  """

  def __init__(self, documents_tokens: Sequence[np.ndarray], *, eval_fraction: float = 0.02, **kwargs):
    """Splits in-memory documents and checks that the corpus can fill a batch.

    Args:
        documents_tokens: one ``int [num_tokens_i]`` array per document, in corpus
            order (no EOS; it is appended here).
        eval_fraction: fraction of documents held out, in (0, 1) (:func:`heldout_mask`).
        **kwargs: see :meth:`from_splits`.
    """
    if not 0.0 < eval_fraction < 1.0:
      raise ValueError(f"data.eval_fraction must be in (0, 1), got {eval_fraction}")
    num_documents = len(documents_tokens)
    if num_documents < 2:
      raise ValueError(
          f"the corpus has {num_documents} document(s); at least 2 are needed (one held out "
          f"for eval, one for training); use a larger data.source")
    heldout = heldout_mask(num_documents, eval_fraction)
    if heldout.all():
      raise ValueError(
          f"data.eval_fraction={eval_fraction} holds out all {num_documents} documents; "
          f"lower it or use a larger corpus")
    self.train_document_indices = np.flatnonzero(~heldout)
    self.eval_document_indices = np.flatnonzero(heldout)
    self._setup(MemorySplit([documents_tokens[i] for i in self.train_document_indices]),
                MemorySplit([documents_tokens[i] for i in self.eval_document_indices]), **kwargs)

  @classmethod
  def from_splits(cls, train, heldout, **kwargs) -> "DataPipeline":
    """A pipeline over two splits (a token store's :class:`~tfx.data.store.SplitReader` s).

    Args:
        train, heldout: objects with ``lengths`` (int64 [docs]), ``starts``, ``num_tokens`` and
            ``read(lo, hi)``.
        eos_id: the id appended to every document.
        row_length: tokens per row (the objective's raw length).
        global_batch: rows per global batch (``train.batch_size``).
        seed: shuffling seed (``train.seed``); does not affect the eval split.
        eval_batches: number of eval batches wanted.
        process_index: this host.
        process_count: number of hosts; must divide ``global_batch``.
        shuffle_rows: serve the packed rows of an epoch in a random order (from
            ``(seed, epoch)``), so that one long document (a 700 kB module of the
            standard library is ~230k tokens) does not fill many consecutive
            batches. Ignored with ``streams``.
        streams: serve the epoch as ``global_batch`` contiguous text streams: row b
            of every batch continues row b of the previous batch (XLNet's memory
            needs this). Each stream is a contiguous stretch of the (document-
            shuffled) epoch.
        stride: with ``streams``, consecutive rows of a stream start ``stride``
            tokens apart (0 = ``row_length``: no overlap). XLNet uses its reuse
            length, so that a row's memory is the text right before it.
        reversed_streams: with ``streams`` (XLNet's bi_data): rows ``[0, B/2)`` of
            every global batch are ``B/2`` forward streams and rows ``[B/2, B)`` are
            the same streams read backwards. ``global_batch`` must be even.
        eval_streams: with ``streams``, the eval batches are laid out like the
            training ones (held-out documents in order, cut into contiguous streams
            ``stride`` apart, reversed ones too with ``reversed_streams``), so that an
            objective with memory can be evaluated carrying it (train.eval_memory).
        prefetch: batches built ahead in a background thread (0 = on the caller's thread).

    Raises:
        ValueError: invalid arguments, an empty split, or an epoch too small to fill one
            global batch.
    """
    self = cls.__new__(cls)
    self.train_document_indices = self.eval_document_indices = None
    self._setup(train, heldout, **kwargs)
    return self

  def _setup(self, train, heldout, *, eos_id: int, row_length: int, global_batch: int, seed: int,
             eval_batches: int = 4, process_index: int = 0, process_count: int = 1,
             shuffle_rows: bool = True, streams: bool = False, stride: int = 0,
             reversed_streams: bool = False, eval_streams: bool = False, prefetch: int = 0) -> None:
    _check_args(row_length, global_batch, seed, eval_batches, process_index, process_count)
    if not len(train.lengths) or not len(heldout.lengths):
      empty = "training" if not len(train.lengths) else "held-out (eval)"
      raise ValueError(f"the {empty} split has no documents; use a larger data.source or change "
                       f"data.eval_fraction")
    self.eos_id = int(eos_id)
    self.row_length = int(row_length)
    self.global_batch = int(global_batch)
    self.seed = int(seed)
    self.process_index = int(process_index)
    self.process_count = int(process_count)
    self.local_batch = self.global_batch // self.process_count
    self.num_eval_batches = int(eval_batches)
    self.shuffle_rows = bool(shuffle_rows)
    self.streams = bool(streams)
    self.stride = int(stride) or self.row_length
    self.prefetch = max(int(prefetch), 0)
    if not 0 < self.stride <= self.row_length:
      raise ValueError(f"stride={stride} must be in (0, row_length={self.row_length}]")
    self.reversed_streams = bool(reversed_streams)
    self.eval_streams = bool(eval_streams) and self.streams
    if self.reversed_streams and (not self.streams or self.global_batch % 2):
      raise ValueError(f"reversed streams (objective.bi_data) need contiguous streams and an even global batch, "
                       f"got train.batch_size={self.global_batch}; use an even batch size")
    self._train, self._heldout = train, heldout

    train_tokens = train.num_tokens + len(train.lengths)  # with one EOS per document
    self.rows_per_epoch = train_tokens // self.row_length
    self._per_stream = train_tokens // self._forward_streams
    if self.streams:  # global_batch streams of train_tokens // global_batch tokens, rows every stride
      per_stream = self._per_stream
      rows = (per_stream - self.row_length) // self.stride + 1 if per_stream >= self.row_length else 0
      self.rows_per_epoch = rows * self.global_batch
    self.batches_per_epoch = self.rows_per_epoch // self.global_batch
    if self.batches_per_epoch == 0:
      raise ValueError(
          f"the training split has {train_tokens} tokens = {self.rows_per_epoch} rows of "
          f"{self.row_length}, fewer than one global batch of {self.global_batch} rows "
          f"({self.global_batch * self.row_length} tokens); the corpus is too small for "
          f"train.batch_size x data.seq_len: lower either, or use a larger data.source")

    self._eval = self._build_eval()
    self.stats: dict[str, Any] = {
        "documents": len(train.lengths) + len(heldout.lengths),
        "train_documents": len(train.lengths),
        "eval_documents": len(heldout.lengths),
        "train_tokens": train_tokens,
        "eval_tokens": heldout.num_tokens + len(heldout.lengths),
        "rows_per_epoch": self.rows_per_epoch,
        "batches_per_epoch": self.batches_per_epoch,
        "dropped_tokens_per_epoch": train_tokens - self.batches_per_epoch
        * self.global_batch * self.row_length,
        "eval_batches": len(self._eval),
    }
    self._next = 0  # global index of the next batch this host returns
    self._iterator = None
    self._epochs: dict[int, tuple[_Epoch, np.ndarray]] = {}
    self._lock = threading.Lock()

  @classmethod
  def from_config(cls, data_cfg: Any, tokenizer: AnyTokenizer, corpus: Corpus, *,
                  cache_dir: str | None = None, **kwargs) -> "DataPipeline":
    """Tokenizes an in-memory corpus and builds the pipeline from ``config.data``.

    (Training reads a prepared token store instead, see :mod:`tfx.data.prepare`.)

    Args:
        data_cfg: any object with ``eval_fraction`` and ``eval_batches`` attributes (an
            ``ml_collections.ConfigDict``); missing ones take the defaults 0.02 and 4.
        tokenizer: gives the EOS id and encodes the corpus.
        corpus: the documents.
        cache_dir: optional directory for cached token arrays.
        **kwargs: see :meth:`from_splits`.
    """
    eos_id = tokenizer.eos_id
    if eos_id is None:
      raise ValueError(f"tokenizer {tokenizer.path!r} has no '</s>' piece; the data "
                       f"pipeline needs an EOS id to separate documents")
    return cls(tokenize_corpus(tokenizer, corpus, cache_dir=cache_dir), eos_id=eos_id,
               eval_fraction=float(getattr(data_cfg, "eval_fraction", 0.02)),
               eval_batches=int(getattr(data_cfg, "eval_batches", 4)), **kwargs)

  # ------------------------------------------------------------------- train

  @property
  def _forward_streams(self) -> int:
    """Distinct text streams per epoch (half the batch when the other half reads them backwards)."""
    return self.global_batch // 2 if self.reversed_streams else self.global_batch

  def epoch_order(self, epoch: int) -> np.ndarray:
    """Train documents (indices into the train split) in epoch ``epoch``'s order."""
    rng = np.random.default_rng([self.seed, epoch])
    return rng.permutation(len(self._train.lengths))

  def row_order(self, epoch: int) -> np.ndarray:
    """The order in which the packed rows of epoch ``epoch`` are served."""
    if self.streams:
      per_stream = self.rows_per_epoch // self.global_batch
      order = np.arange(per_stream * self.global_batch).reshape(self.global_batch, per_stream)
      return order.T.reshape(-1)  # batch s = row s of every stream
    if not self.shuffle_rows:
      return np.arange(self.rows_per_epoch)
    return np.random.default_rng([self.seed, epoch, 1]).permutation(self.rows_per_epoch)

  def _epoch(self, epoch: int) -> tuple[_Epoch, np.ndarray | None]:
    """(document order and ends, row order) of an epoch; the last two epochs are cached."""
    with self._lock:
      if epoch not in self._epochs:
        if len(self._epochs) >= 2:
          self._epochs.pop(min(self._epochs))
        rows = None if self.streams else self.row_order(epoch)
        self._epochs[epoch] = (_Epoch(self.epoch_order(epoch), self._train.lengths), rows)
      return self._epochs[epoch]

  def _gather(self, ep: _Epoch, starts: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Spans ``[a, a + n)`` of the epoch stream, for each ``a`` in ``starts``.

    Returns:
        tokens ``int32 [rows, n]``, and ``opens`` ``bool [rows, n + 1]``: True where a document
        starts (column n: at the token right after the span).
    """
    lengths, doc_starts, cum_end = self._train.lengths, self._train.starts, ep.cum_end
    tokens = np.empty((len(starts), n), np.int32)
    opens = np.zeros((len(starts), n + 1), bool)
    for r, a in enumerate(starts.tolist()):
      b = a + n
      d = int(np.searchsorted(cum_end, a, side="right"))  # the document holding token a
      pos = a
      while pos < b:
        doc, end = int(ep.order[d]), int(cum_end[d])
        length = int(lengths[doc])
        begin = end - length - 1
        if begin >= a:
          opens[r, begin - a] = True
        hi = min(b, end)
        real_hi = min(hi - begin, length)  # the EOS sits at offset `length`
        if real_hi > pos - begin:
          base = int(doc_starts[doc])
          tokens[r, pos - a:pos - a + real_hi - (pos - begin)] = self._train.read(base + pos - begin, base + real_hi)
        if hi == end:
          tokens[r, end - 1 - a] = self.eos_id
        pos, d = hi, d + 1
      opens[r, n] = d < len(cum_end) and int(cum_end[d - 1]) == b
    return tokens, opens

  def batch_at(self, k: int) -> Batch:
    """This host's rows of global batch ``k`` (counted from the start of training).

    Returns:
        ``tokens``, ``segment_ids``, ``positions``: ``int32 [local_batch, row_length]``.
    """
    self._train.check()  # a damaged store stops the run here, naming the file
    epoch, b = divmod(int(k), self.batches_per_epoch)
    ep, row_order = self._epoch(epoch)
    rows = np.arange(self.process_index * self.local_batch, (self.process_index + 1) * self.local_batch)
    n = self.row_length
    if not self.streams:
      starts = row_order[b * self.global_batch + rows] * n
      tokens, opens = self._gather(ep, starts, n)
      return _segments(tokens, opens[:, :n])
    forward = rows < self._forward_streams
    stream = np.where(forward, rows, rows - self._forward_streams)
    offset = np.where(forward, b * self.stride, self._per_stream - b * self.stride - n)
    tokens, opens = self._gather(ep, stream * self._per_stream + offset, n)
    # Reading backwards, a document opens where the forward one closed: at the token before a
    # forward start, and at the stream's last token.
    closes = opens[:, 1:].copy()
    closes[offset + n == self._per_stream, -1] = True
    tokens = np.where(forward[:, None], tokens, tokens[:, ::-1])
    opens = np.where(forward[:, None], opens[:, :n], closes[:, ::-1])
    return _segments(tokens, opens)

  def wait_verified(self) -> None:
    """Blocks until the store's background checksum pass is done; raises if it found damage."""
    for split in (self._train, self._heldout):
      verifier = getattr(split, "verifier", None)
      if verifier is not None:
        verifier.wait()

  def next_batch(self) -> Batch:
    """The next train batch for this host (from the prefetch thread when ``prefetch > 0``)."""
    if not self.prefetch:
      batch = self.batch_at(self._next)
    else:
      if self._iterator is None:
        import grain  # Lazy: only the prefetching loader needs it.

        dataset = grain.MapDataset.range(self._next, 2**62).map(self.batch_at)
        self._iterator = iter(dataset.to_iter_dataset(
            grain.ReadOptions(num_threads=1, prefetch_buffer_size=self.prefetch)))
      batch = next(self._iterator)
    self._next += 1
    return batch

  def __iter__(self):
    while True:
      yield self.next_batch()

  def state(self) -> dict[str, int]:
    """The position of the next batch, JSON-serialisable: ``{"epoch", "row"}``."""
    epoch, b = divmod(self._next, self.batches_per_epoch)
    if epoch and not b:  # after the last batch of an epoch, as the packed pipeline said it
      epoch, b = epoch - 1, self.batches_per_epoch
    return {"epoch": int(epoch), "row": int(b * self.global_batch)}

  def restore(self, state: dict[str, int]) -> None:
    """Moves to a position saved by :meth:`state`.

    Raises:
        ValueError: the state is malformed or does not fit this corpus.
    """
    try:
      epoch, row = int(state["epoch"]), int(state["row"])
    except (KeyError, TypeError, ValueError) as e:
      raise ValueError(f"data pipeline state must be {{'epoch': int, 'row': int}}, got "
                       f"{state!r}") from e
    if 0 <= row <= self.rows_per_epoch and row % self.global_batch:
      raise ValueError(
          f"data pipeline state {state!r}: row {row} is not a batch boundary of this run's global batch of "
          f"{self.global_batch} rows; was the checkpoint written with another train.batch_size? Resume with the "
          f"batch size it was written with")
    if epoch < 0 or not 0 <= row <= self.rows_per_epoch:
      raise ValueError(
          f"data pipeline state {state!r} does not fit this corpus ({self.rows_per_epoch} "
          f"rows per epoch); was the checkpoint written with a different data.source, "
          f"tokenizer or data.seq_len?")
    self._next = epoch * self.batches_per_epoch + row // self.global_batch
    self._iterator = None

  # ------------------------------------------------------- reference packing

  def epoch_stream(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens int32 [n], doc_starts bool [n]): the train documents of epoch `epoch`, in order.

    The whole epoch in memory: a reference for tests, never used for training.
    """
    order = self.epoch_order(epoch)
    docs = [np.append(self._train.read(int(self._train.starts[d]), int(self._train.starts[d] + self._train.lengths[d])),
                      np.int32(self.eos_id)) for d in order]
    stream = np.concatenate(docs).astype(np.int32)
    doc_starts = np.zeros(len(stream), bool)
    doc_starts[np.concatenate([[0], np.cumsum([len(d) for d in docs])[:-1]])] = True
    return stream, doc_starts

  def epoch_rows(self, epoch: int) -> Batch:
    """All rows of one train epoch, ``int32 [rows_per_epoch, row_length]`` each (reference)."""
    stream, doc_starts = self.epoch_stream(epoch)
    if self.streams:
      return pack_streams(stream, doc_starts, self.row_length, self._forward_streams, self.stride,
                          reversed_copies=self.reversed_streams)
    return pack_stream(stream, doc_starts, self.row_length, pad_tail=False)

  # -------------------------------------------------------------------- eval

  def _heldout_stream(self, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [n], doc_starts [n]) of the first held-out documents, in order, with their EOS,
    until at least `tokens` tokens (or the whole split)."""
    split, eos = self._heldout, np.int32(self.eos_id)
    docs, used = [], 0
    for d in range(len(split.lengths)):  # only as many held-out documents as the batches need
      if used >= tokens:
        break
      start = int(split.starts[d])
      docs.append(np.append(split.read(start, start + int(split.lengths[d])), eos))
      used += len(docs[-1])
    flat, offsets = _flatten(docs)
    doc_starts = np.zeros(len(flat), bool)
    doc_starts[offsets[:-1]] = True
    return flat, doc_starts

  def _build_eval_streams(self) -> list[Batch]:
    """Eval batch b holds row b of each of the global_batch held-out streams (the training layout)."""
    forward = self.global_batch // 2 if self.reversed_streams else self.global_batch
    per_stream = (self.num_eval_batches - 1) * self.stride + self.row_length
    flat, doc_starts = self._heldout_stream(forward * per_stream)
    count = min(self.num_eval_batches, (len(flat) // forward - self.row_length) // self.stride + 1)
    if count < 1:
      raise ValueError(f"eval with memory (train.eval_memory) needs {forward} held-out streams of at least "
                       f"{self.row_length} tokens ({forward * self.row_length} in all); the held-out split has "
                       f"{len(flat)}: raise data.eval_fraction or lower train.batch_size")
    used = forward * ((count - 1) * self.stride + self.row_length)  # exactly `count` rows per stream
    rows = pack_streams(flat[:used], doc_starts[:used], self.row_length, forward, self.stride,
                        reversed_copies=self.reversed_streams)
    self.eval_note = (f"eval on {count} of {self.num_eval_batches} batches of held-out streams (the held-out split "
                      f"is too small for more)" if count < self.num_eval_batches else "")
    order = np.arange(self.global_batch)[None, :] * count + np.arange(count)[:, None]  # [count, global_batch]
    return self._host_batches({k: v[order.reshape(-1)] for k, v in rows.items()}, count)

  def _build_eval(self) -> list[Batch]:
    if self.eval_streams:
      return self._build_eval_streams()
    wanted = self.num_eval_batches * self.global_batch
    split = self._heldout
    available = -(-(split.num_tokens + len(split.lengths)) // self.row_length)
    flat, doc_starts = self._heldout_stream(wanted * self.row_length)
    rows = pack_stream(flat, doc_starts, self.row_length, pad_tail=True)
    if len(rows["tokens"]) > wanted:
      rows = {k: v[:wanted] for k, v in rows.items()}
    notes = []
    count = min(self.num_eval_batches, -(-available // self.global_batch))  # every held-out row, once
    padding = count * self.global_batch - len(rows["tokens"])
    if padding > 0:  # the last batch is filled with rows of padding (segment 0), which no loss counts
      rows = {k: np.concatenate([v, np.zeros((padding, self.row_length), np.int32)]) for k, v in rows.items()}
    if available > wanted:
      notes.append(f"eval uses the first {wanted} of {available} held-out rows")
    elif count < self.num_eval_batches or padding > 0:
      notes.append(f"held-out split has {available} rows: {count} of {self.num_eval_batches} eval batches of "
                   f"{self.global_batch} rows" + (f", the last with {padding} all-padding rows (segment 0)"
                                                  if padding > 0 else ""))
    self.eval_note = "; ".join(notes)
    return self._host_batches(rows, count)

  def _host_batches(self, rows: Batch, count: int) -> list[Batch]:
    """This host's part of each of the first `count` global batches of `rows` (read-only)."""
    batches = []
    for b in range(count):
      global_batch = {k: v[b * self.global_batch:(b + 1) * self.global_batch]
                      for k, v in rows.items()}
      batch = host_slice(global_batch, self.process_index, self.process_count)
      for v in batch.values():
        v.setflags(write=False)
      batches.append(batch)
    return batches

  def eval_batches(self) -> list[Batch]:
    """The eval batches for this host: identical on every call.

    Held-out documents in corpus order, packed without shuffling; the last row
    is padded with zeros (segment 0). See ``eval_note`` when there are fewer
    than ``eval_batches`` batches. The arrays are read-only.

    Returns:
        A list of dicts of ``int32 [local_batch, row_length]`` arrays.
    """
    return list(self._eval)

  def __repr__(self) -> str:
    return (f"DataPipeline(row_length={self.row_length}, global_batch={self.global_batch}, "
            f"seed={self.seed}, host={self.process_index}/{self.process_count}, "
            f"stats={self.stats})")


def _segments(tokens: np.ndarray, opens: np.ndarray) -> Batch:
  """Rows with segment ids and positions from where segments open. [rows, n] each."""
  opens = opens.copy()
  opens[:, 0] = True  # a row always opens a segment
  column = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
  last_open = np.maximum.accumulate(np.where(opens, column, 0), axis=1)
  return {"tokens": np.ascontiguousarray(tokens, dtype=np.int32),
          "segment_ids": np.cumsum(opens, axis=1, dtype=np.int32),
          "positions": (column - last_open).astype(np.int32)}


def _check_args(row_length: int, global_batch: int, seed: int, eval_batches: int,
                process_index: int, process_count: int) -> None:
  if row_length < 1:
    raise ValueError(f"row_length must be >= 1, got {row_length}")
  if global_batch < 1:
    raise ValueError(f"global batch size must be >= 1, got {global_batch}")
  if seed < 0:
    raise ValueError(f"train.seed must be >= 0 for the data pipeline, got {seed}")
  if eval_batches < 1:
    raise ValueError(f"data.eval_batches must be >= 1, got {eval_batches}")
  if process_count < 1 or not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index} must be in [0, process_count="
                     f"{process_count})")
  if global_batch % process_count:
    raise ValueError(
        f"train.batch_size={global_batch} is not divisible by the number of hosts "
        f"({process_count}); each host must get the same number of rows")
