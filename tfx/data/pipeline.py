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
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Sequence

import numpy as np

from tfx.data.sources import Corpus
from tfx.data.tokenizer import Tokenizer

Batch = dict[str, np.ndarray]
BATCH_KEYS = ("tokens", "segment_ids", "positions")
_ENCODE_CHUNK = 256


# -------------------------------------------------------------------- tokenizing


def tokenize_corpus(tokenizer: Tokenizer, corpus: Corpus, *,
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


def _corpus_key(tokenizer: Tokenizer, corpus: Corpus) -> str:
  digest = hashlib.sha256(tokenizer.model_proto)
  for document in corpus.documents:
    encoded = document.encode("utf-8")
    digest.update(len(encoded).to_bytes(8, "little"))
    digest.update(encoded)
  return digest.hexdigest()[:24]


def _flatten(arrays: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
  lengths = np.array([len(a) for a in arrays], dtype=np.int64)
  offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
  flat = (np.concatenate([np.asarray(a, dtype=np.int32) for a in arrays])
          if arrays else np.zeros(0, np.int32))
  return flat, offsets


def _unflatten(flat: np.ndarray, offsets: np.ndarray) -> list[np.ndarray]:
  return [flat[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]


def _atomic_save(path: str, array: np.ndarray) -> None:
  tmp = f"{path}.tmp-{os.getpid()}.npy"
  np.save(tmp, array, allow_pickle=False)
  os.replace(tmp, path)


# ------------------------------------------------------------------ pure helpers


def heldout_mask(num_documents: int, eval_fraction: float) -> np.ndarray:
  """Chooses the held-out documents by a stable hash of their index.

  Document ``i`` is held out when ``hash(i) / 2**64 < eval_fraction``; if that
  selects none, the document with the smallest hash is held out. The choice does
  not depend on any seed, and a document keeps its split when documents are
  appended to the corpus.

  Args:
      num_documents: number of documents.
      eval_fraction: target fraction held out, in (0, 1).

  Returns:
      ``bool [num_documents]``, True = eval.
  """
  hashes = _splitmix64(np.arange(num_documents, dtype=np.uint64))
  mask = hashes < np.uint64(min(eval_fraction, 1.0) * 2.0**64 - 1)
  if num_documents and not mask.any():
    mask[int(np.argmin(hashes))] = True
  return mask


def _splitmix64(x: np.ndarray) -> np.ndarray:
  """The SplitMix64 finaliser: a fixed, well-mixed uint64 -> uint64 hash."""
  with np.errstate(over="ignore"):
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def pack_stream(stream: np.ndarray, doc_starts: np.ndarray, row_length: int,
                *, pad_tail: bool) -> Batch:
  """Cuts a token stream into rows with segment ids and positions.

  Args:
      stream: ``int32 [n]`` concatenated documents (each already ending in EOS).
      doc_starts: ``bool [n]``, True where a document begins.
      row_length: tokens per row.
      pad_tail: if True the incomplete last row is padded with zeros (segment 0,
          position 0); if False it is dropped.

  Returns:
      ``tokens``, ``segment_ids``, ``positions``: ``int32 [rows, row_length]``.
  """
  n = len(stream)
  rows = -(-n // row_length) if pad_tail else n // row_length
  used = min(n, rows * row_length)
  size = rows * row_length
  tokens = np.zeros(size, np.int32)
  tokens[:used] = stream[:used]
  index = np.arange(size)
  starts = np.zeros(size, bool)
  starts[:used] = doc_starts[:used]
  starts[:used] |= index[:used] % row_length == 0  # A row always opens a segment.
  real = index < used
  segment_ids = np.cumsum(starts.reshape(rows, row_length), axis=1).reshape(-1)
  segment_ids = np.where(real, segment_ids, 0).astype(np.int32)
  last_start = np.maximum.accumulate(np.where(starts, index, 0))
  positions = np.where(real, index - last_start, 0).astype(np.int32)
  shape = (rows, row_length)
  return {"tokens": tokens.reshape(shape), "segment_ids": segment_ids.reshape(shape),
          "positions": positions.reshape(shape)}


def pack_streams(stream: np.ndarray, doc_starts: np.ndarray, row_length: int, num_streams: int,
                 stride: int, *, reversed_copies: bool = False) -> Batch:
  """Cuts a token stream into `num_streams` equal streams and each into rows `stride` apart.

  Row ``s * k + i`` (stream s, row i) holds ``stream_s[i * stride : i * stride + row_length]``;
  each row opens a segment at its first token and at every document start inside it.

  With ``reversed_copies`` (XLNet's bi_data) there are ``2 * num_streams`` streams: stream
  ``num_streams + s`` is stream s read backwards (from its last token to its first), so its
  rows also follow each other ``stride`` apart and a row's memory is again the text "before"
  it in reading order. A reversed document starts at its (reversed) EOS.

  Returns:
      ``tokens``, ``segment_ids``, ``positions``: ``int32 [streams * k, row_length]``.
  """
  per_stream = len(stream) // num_streams
  k = (per_stream - row_length) // stride + 1
  streams = stream[:per_stream * num_streams].reshape(num_streams, per_stream)  # [s, n]
  opens = doc_starts[:per_stream * num_streams].reshape(num_streams, per_stream)
  if reversed_copies:
    # Reading backwards, a document opens where the forward one closed: at the token before a
    # forward start (and at the stream's last token).
    closes = np.concatenate([opens[:, 1:], np.ones((num_streams, 1), bool)], axis=1)
    streams = np.concatenate([streams, streams[:, ::-1]])
    opens = np.concatenate([opens, closes[:, ::-1]])
  starts = np.arange(k) * stride  # [k]
  index = starts[:, None] + np.arange(row_length)[None, :]  # [k, L]
  tokens = streams[:, index].reshape(-1, row_length).astype(np.int32)  # [streams * k, L]
  row_opens = opens[:, index].reshape(-1, row_length).copy()
  row_opens[:, 0] = True
  segment_ids = np.cumsum(row_opens, axis=1).astype(np.int32)
  column = np.broadcast_to(np.arange(row_length), row_opens.shape)
  last_open = np.maximum.accumulate(np.where(row_opens, column, 0), axis=1)
  return {"tokens": tokens, "segment_ids": segment_ids, "positions": (column - last_open).astype(np.int32)}


def host_slice(batch: Batch, process_index: int, process_count: int) -> Batch:
  """The contiguous rows of a global batch that belong to one host.

  Args:
      batch: arrays ``[global_batch, length]``.
      process_index: this host, in ``[0, process_count)``.
      process_count: number of hosts; must divide ``global_batch``.

  Returns:
      Arrays ``[global_batch // process_count, length]`` (copies).
  """
  global_batch = len(batch["tokens"])
  local = global_batch // process_count
  lo = process_index * local
  return {k: np.array(v[lo:lo + local], dtype=np.int32) for k, v in batch.items()}


# ---------------------------------------------------------------------- pipeline


class DataPipeline:
  """Deterministic, resumable, host-sliced batches of packed documents.

  Attributes:
      stats: counts of documents, tokens, rows (see :meth:`__init__`).
      eval_note: why eval has fewer batches / padded rows, or ``""``.
      local_batch: rows per host batch, ``global_batch // process_count``.
  """

  def __init__(
      self,
      documents_tokens: Sequence[np.ndarray],
      *,
      eos_id: int,
      row_length: int,
      global_batch: int,
      seed: int,
      eval_fraction: float = 0.02,
      eval_batches: int = 4,
      process_index: int = 0,
      process_count: int = 1,
      shuffle_rows: bool = True,
      streams: bool = False,
      stride: int = 0,
      reversed_streams: bool = False,
  ):
    """Splits, and checks that the corpus can fill a batch.

    Args:
        documents_tokens: one ``int [num_tokens_i]`` array per document, in corpus
            order (no EOS; it is appended here).
        eos_id: the id appended to every document.
        row_length: tokens per row (the objective's raw length).
        global_batch: rows per global batch (``train.batch_size``).
        seed: shuffling seed (``train.seed``); does not affect the eval split.
        eval_fraction: fraction of documents held out, in (0, 1).
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

    Raises:
        ValueError: invalid arguments, fewer than 2 documents, or an epoch too
            small to fill one global batch.
    """
    _check_args(row_length, global_batch, seed, eval_fraction, eval_batches,
                process_index, process_count)
    num_documents = len(documents_tokens)
    if num_documents < 2:
      raise ValueError(
          f"the corpus has {num_documents} document(s); at least 2 are needed (one held out "
          f"for eval, one for training); use a larger data.source")
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
    if not 0 < self.stride <= self.row_length:
      raise ValueError(f"stride={stride} must be in (0, row_length={self.row_length}]")
    self.reversed_streams = bool(reversed_streams)
    if self.reversed_streams and (not self.streams or self.global_batch % 2):
      raise ValueError(f"reversed streams (objective.bi_data) need contiguous streams and an even global batch, "
                       f"got train.batch_size={self.global_batch}; use an even batch size")

    heldout = heldout_mask(num_documents, eval_fraction)
    if heldout.all():
      raise ValueError(
          f"data.eval_fraction={eval_fraction} holds out all {num_documents} documents; "
          f"lower it or use a larger corpus")
    eos = np.int32(self.eos_id)
    docs = [np.append(np.asarray(d, dtype=np.int32), eos) for d in documents_tokens]
    self.train_document_indices = np.flatnonzero(~heldout)
    self.eval_document_indices = np.flatnonzero(heldout)
    train_docs = [docs[i] for i in self.train_document_indices]
    self._train_flat, self._train_offsets = _flatten(train_docs)
    eval_flat, eval_offsets = _flatten([docs[i] for i in self.eval_document_indices])

    train_tokens = len(self._train_flat)
    self.rows_per_epoch = train_tokens // self.row_length
    if self.streams:  # global_batch streams of train_tokens // global_batch tokens, rows every stride
      per_stream = train_tokens // self._forward_streams
      rows = (per_stream - self.row_length) // self.stride + 1 if per_stream >= self.row_length else 0
      self.rows_per_epoch = rows * self.global_batch
    self.batches_per_epoch = self.rows_per_epoch // self.global_batch
    if self.batches_per_epoch == 0:
      raise ValueError(
          f"the training split has {train_tokens} tokens = {self.rows_per_epoch} rows of "
          f"{self.row_length}, fewer than one global batch of {self.global_batch} rows "
          f"({self.global_batch * self.row_length} tokens); the corpus is too small for "
          f"train.batch_size x data.seq_len: lower either, or use a larger data.source")

    self._eval = self._build_eval(eval_flat, eval_offsets)
    self.stats: dict[str, Any] = {
        "documents": num_documents,
        "train_documents": len(self.train_document_indices),
        "eval_documents": len(self.eval_document_indices),
        "train_tokens": train_tokens,
        "eval_tokens": len(eval_flat),
        "rows_per_epoch": self.rows_per_epoch,
        "batches_per_epoch": self.batches_per_epoch,
        "dropped_tokens_per_epoch": train_tokens - self.batches_per_epoch
        * self.global_batch * self.row_length,
        "eval_batches": len(self._eval),
    }
    self._epoch = 0
    self._row = 0
    self._cached_epoch: int | None = None
    self._cached_rows: Batch | None = None
    self._cached_order: np.ndarray | None = None

  @classmethod
  def from_config(
      cls,
      data_cfg: Any,
      tokenizer: Tokenizer,
      corpus: Corpus,
      *,
      row_length: int,
      global_batch: int,
      seed: int,
      process_index: int = 0,
      process_count: int = 1,
      cache_dir: str | None = None,
      streams: bool = False,
      stride: int = 0,
      reversed_streams: bool = False,
  ) -> "DataPipeline":
    """Tokenizes a corpus and builds the pipeline from ``config.data``.

    Args:
        data_cfg: any object with ``eval_fraction`` and ``eval_batches``
            attributes (an ``ml_collections.ConfigDict``); missing ones take the
            defaults 0.02 and 4.
        tokenizer: gives the EOS id and encodes the corpus.
        corpus: the documents.
        row_length, global_batch, seed, process_index, process_count, streams, stride,
            reversed_streams: see :meth:`__init__`.
        cache_dir: optional directory for cached token arrays.
    """
    eos_id = tokenizer.eos_id
    if eos_id is None:
      raise ValueError(f"tokenizer {tokenizer.path!r} has no '</s>' piece; the data "
                       f"pipeline needs an EOS id to separate documents")
    return cls(
        tokenize_corpus(tokenizer, corpus, cache_dir=cache_dir),
        eos_id=eos_id,
        row_length=row_length,
        global_batch=global_batch,
        seed=seed,
        eval_fraction=float(getattr(data_cfg, "eval_fraction", 0.02)),
        eval_batches=int(getattr(data_cfg, "eval_batches", 4)),
        process_index=process_index,
        process_count=process_count,
        streams=streams,
        stride=stride,
        reversed_streams=reversed_streams,
    )

  # ------------------------------------------------------------------- train

  def epoch_rows(self, epoch: int) -> Batch:
    """All rows of one train epoch, ``int32 [rows_per_epoch, row_length]`` each.

    The most recent epoch is cached; asking for another one repacks.
    """
    if self._cached_epoch != epoch:
      self._cached_rows = None  # Free the old epoch before packing the next.
      self._cached_rows = self._pack_epoch(epoch)
      self._cached_order = self.row_order(epoch)
      self._cached_epoch = epoch
    return self._cached_rows

  @property
  def _forward_streams(self) -> int:
    """Distinct text streams per epoch (half the batch when the other half reads them backwards)."""
    return self.global_batch // 2 if self.reversed_streams else self.global_batch

  def epoch_order(self, epoch: int) -> np.ndarray:
    """Train documents (indices into the train split) in epoch ``epoch``'s order."""
    rng = np.random.default_rng([self.seed, epoch])
    return rng.permutation(len(self._train_offsets) - 1)

  def row_order(self, epoch: int) -> np.ndarray:
    """The order in which the packed rows of epoch ``epoch`` are served."""
    if self.streams:
      per_stream = self.rows_per_epoch // self.global_batch
      order = np.arange(per_stream * self.global_batch).reshape(self.global_batch, per_stream)
      return order.T.reshape(-1)  # batch s = row s of every stream
    if not self.shuffle_rows:
      return np.arange(self.rows_per_epoch)
    return np.random.default_rng([self.seed, epoch, 1]).permutation(self.rows_per_epoch)

  def _pack_epoch(self, epoch: int) -> Batch:
    stream, doc_starts = self.epoch_stream(epoch)
    if self.streams:
      return pack_streams(stream, doc_starts, self.row_length, self._forward_streams, self.stride,
                          reversed_copies=self.reversed_streams)
    return pack_stream(stream, doc_starts, self.row_length, pad_tail=False)

  def epoch_stream(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens int32 [n], doc_starts bool [n]): the train documents of epoch `epoch`, in order."""
    order = self.epoch_order(epoch)
    starts = self._train_offsets[:-1][order]
    lengths = np.diff(self._train_offsets)[order]
    new_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    gather = np.arange(int(lengths.sum())) + np.repeat(starts - new_starts, lengths)
    stream = self._train_flat[gather]
    doc_starts = np.zeros(len(stream), bool)
    doc_starts[new_starts] = True
    return stream, doc_starts

  def next_batch(self) -> Batch:
    """The next train batch for this host.

    Returns:
        ``tokens``, ``segment_ids``, ``positions``: ``int32 [local_batch, row_length]``.
    """
    if self._row + self.global_batch > self.batches_per_epoch * self.global_batch:
      self._epoch += 1
      self._row = 0
    rows = self.epoch_rows(self._epoch)
    lo = self._row + self.process_index * self.local_batch
    take = self._cached_order[lo:lo + self.local_batch]
    batch = {k: np.array(rows[k][take]) for k in BATCH_KEYS}
    self._row += self.global_batch
    return batch

  def __iter__(self):
    while True:
      yield self.next_batch()

  def state(self) -> dict[str, int]:
    """The position of the next batch, JSON-serialisable: ``{"epoch", "row"}``."""
    return {"epoch": int(self._epoch), "row": int(self._row)}

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
    if epoch < 0 or not 0 <= row <= self.rows_per_epoch:
      raise ValueError(
          f"data pipeline state {state!r} does not fit this corpus ({self.rows_per_epoch} "
          f"rows per epoch); was the checkpoint written with a different data.source, "
          f"tokenizer or data.seq_len?")
    self._epoch, self._row = epoch, row

  # -------------------------------------------------------------------- eval

  def _build_eval(self, flat: np.ndarray, offsets: np.ndarray) -> list[Batch]:
    doc_starts = np.zeros(len(flat), bool)
    doc_starts[offsets[:-1]] = True
    rows = pack_stream(flat, doc_starts, self.row_length, pad_tail=True)
    available = len(rows["tokens"])
    wanted = self.num_eval_batches * self.global_batch
    notes = []
    if available >= wanted:
      count = self.num_eval_batches
      if available > wanted:
        notes.append(f"eval uses the first {wanted} of {available} held-out rows")
    elif available >= self.global_batch:
      count = available // self.global_batch
      notes.append(f"held-out split has {available} rows, enough for {count} of "
                   f"{self.num_eval_batches} eval batches of {self.global_batch} rows")
    else:
      count = 1
      padding = self.global_batch - available
      rows = {k: np.concatenate([v, np.zeros((padding, self.row_length), np.int32)])
              for k, v in rows.items()}
      notes.append(f"held-out split has {available} rows, fewer than one batch of "
                   f"{self.global_batch}; the eval batch has {padding} all-padding rows "
                   f"(segment 0)")
    self.eval_note = "; ".join(notes)
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


def _check_args(row_length: int, global_batch: int, seed: int, eval_fraction: float,
                eval_batches: int, process_index: int, process_count: int) -> None:
  if row_length < 1:
    raise ValueError(f"row_length must be >= 1, got {row_length}")
  if global_batch < 1:
    raise ValueError(f"global batch size must be >= 1, got {global_batch}")
  if seed < 0:
    raise ValueError(f"train.seed must be >= 0 for the data pipeline, got {seed}")
  if not 0.0 < eval_fraction < 1.0:
    raise ValueError(f"data.eval_fraction must be in (0, 1), got {eval_fraction}")
  if eval_batches < 1:
    raise ValueError(f"data.eval_batches must be >= 1, got {eval_batches}")
  if process_count < 1 or not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index} must be in [0, process_count="
                     f"{process_count})")
  if global_batch % process_count:
    raise ValueError(
        f"train.batch_size={global_batch} is not divisible by the number of hosts "
        f"({process_count}); each host must get the same number of rows")
