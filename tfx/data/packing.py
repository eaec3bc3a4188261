"""Pure packing helpers: the held-out split rule, cutting token streams into rows, host slices.

These are the reference definitions: :class:`tfx.data.pipeline.DataPipeline` packs rows on the
fly, and its tests check that it equals :func:`pack_stream` / :func:`pack_streams` applied to
the whole epoch.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

Batch = dict[str, np.ndarray]


def _flatten(arrays: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
  lengths = np.array([len(a) for a in arrays], dtype=np.int64)
  offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
  flat = (np.concatenate([np.asarray(a, dtype=np.int32) for a in arrays])
          if arrays else np.zeros(0, np.int32))
  return flat, offsets



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
  mask = heldout_by_hash(hashes, eval_fraction)
  if num_documents and not mask.any():
    mask[int(np.argmin(hashes))] = True
  return mask


def document_hashes(indices: np.ndarray) -> np.ndarray:
  """uint64 [n]: the hash that decides the split of the documents with these source indices."""
  return _splitmix64(np.asarray(indices, dtype=np.uint64))


def heldout_by_hash(hashes: np.ndarray, eval_fraction: float) -> np.ndarray:
  """bool [n]: True = held out (the rule of :func:`heldout_mask`, without its fallback)."""
  return hashes < np.uint64(min(eval_fraction, 1.0) * 2.0**64 - 1)


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
