"""SentencePiece tokenizer: train, load, encode/decode, special ids by name.

The tokenizer is a unigram SentencePiece model set up for source code and prose:

- No normalisation (``identity``), extra whitespace kept, no dummy prefix: what
  goes in comes back out, ``decode(encode(text)) == text``.
- ``"\\n"`` is a user-defined symbol (one piece); runs of spaces may be single
  pieces (``allow_whitespace_only_pieces``), so indentation is cheap.
- ``byte_fallback``: a character outside the learned vocabulary is encoded as
  its UTF-8 bytes (``<0xNN>`` pieces), so no text maps to ``<unk>``. The cost is
  256 reserved ids.
- Reserved ids: pad=0 ``<pad>``, eos=1 ``</s>``, unk=2 ``<unk>``, bos=3 ``<s>``;
  control symbols ``<mask>``, ``<cls>``, ``<sep>`` (never produced by encoding
  text); sentinels ``<extra_id_0>`` ... ``<extra_id_99>`` as user-defined symbols
  (they survive encode/decode of text, as span corruption needs).

Objectives ask a :class:`Tokenizer` for these ids by name (``tok.mask_id``,
``tok.sentinel_ids``); nothing else hard-codes them.

Hugging Face tokenizers (WordPiece ``vocab.txt``, byte-level BPE ``vocab.json`` + ``merges.txt``,
``tokenizer.json``) are the second backend, :class:`tfx.data.hf_tokenizer.HFTokenizer`, with the same
interface. :func:`load_tokenizer` (a path) and :func:`tokenizer_from_bytes` (a saved form, e.g. sent
to a worker process) pick the backend; ``tokenizer.filename`` is the name a run or a store saves
``tokenizer.model_proto`` under (``tokenizer.model`` / ``tokenizer.hf.json``).
"""

from __future__ import annotations

import io
import os
import time
from typing import Iterable, Iterator, Sequence, Union

import numpy as np
import sentencepiece as spm
from etils import epath

from tfx.data import hf_tokenizer
from tfx.data.hf_tokenizer import HFTokenizer
from tfx.data.sources import Corpus

PAD, EOS, UNK, BOS = "<pad>", "</s>", "<unk>", "<s>"
MASK, CLS, SEP = "<mask>", "<cls>", "<sep>"
CONTROL_SYMBOLS = (MASK, CLS, SEP)
NEWLINE = "\n"
NUM_SENTINELS = 100
WORD_START = "\u2581"  # "▁", SentencePiece's whitespace marker.
TOKENIZER_FILENAME = "tokenizer.model"
# The names a run directory or a store keeps its tokenizer under (SentencePiece, Hugging Face).
SAVED_FILENAMES = (TOKENIZER_FILENAME, hf_tokenizer.FILENAME)
SENTENCEPIECE_IN_DIRECTORY = (TOKENIZER_FILENAME, "spiece.model")
DEFAULT_MAX_TRAIN_BYTES = 2_000_000


def sentinel_piece(k: int) -> str:
  """Returns the piece of the k-th sentinel, ``<extra_id_k>``."""
  return f"<extra_id_{k}>"


def reserved_piece_count(num_sentinels: int = NUM_SENTINELS) -> int:
  """Number of ids reserved before any learned piece (specials, bytes, symbols)."""
  return 4 + len(CONTROL_SYMBOLS) + 1 + num_sentinels + 256


class Tokenizer:
  """A loaded SentencePiece model with special ids looked up by name."""

  filename = TOKENIZER_FILENAME  # the name it is saved under in a run directory or a store

  def __init__(self, model_proto: bytes, path: str | None = None):
    """Wraps a serialized SentencePiece model.

    Args:
        model_proto: the bytes of a ``.model`` file.
        path: where the model lives on disk, if anywhere (for messages).
    """
    self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
    self._model_proto = bytes(model_proto)
    self.path = path

  # ----------------------------------------------------------------- creation

  @classmethod
  def load(cls, path: str) -> "Tokenizer":
    """Loads a SentencePiece ``.model`` file.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is not a SentencePiece model.
    """
    from etils import epath  # local or gs://

    file = epath.Path(path)
    if not file.is_file():
      raise FileNotFoundError(
          f"tokenizer model {str(path)!r} does not exist; set data.tokenizer to an existing "
          f"SentencePiece .model file, or to '' to train one on the corpus")
    proto = file.read_bytes()
    try:
      return cls(proto, path=str(path))
    except Exception as e:  # sentencepiece raises RuntimeError / OSError.
      raise ValueError(f"{path!r} is not a valid SentencePiece model: {e}") from e

  @classmethod
  def train(
      cls,
      documents: Iterable[str],
      vocab_size: int,
      path: str | None,
      *,
      seed: int = 0,
      max_bytes: int = DEFAULT_MAX_TRAIN_BYTES,
  ) -> "Tokenizer":
    """Trains a unigram model on documents and (optionally) saves it.

    Training is deterministic: one thread, no input shuffling, a fixed random
    seed, and a training sample chosen by document stride (not at random), so
    the same documents give the same model bytes on every machine.

    Args:
        documents: the texts (a list, or any iterable; it is materialised).
        vocab_size: total number of pieces, reserved ones included.
        path: where to write the ``.model`` file (written atomically); ``None``
            keeps the model in memory only.
        seed: SentencePiece's random generator seed.
        max_bytes: cap on the training text. If the documents are larger, every
            k-th document is used (k chosen so the sample is about ``max_bytes``)
            and the sample is cut at ``max_bytes``.

    Returns:
        The trained tokenizer.

    Raises:
        ValueError: ``vocab_size`` is too small or too large for the text, or
            SentencePiece fails; the message says what to change.
    """
    documents = list(documents)
    return cls.train_on_lines(_training_lines(documents, max_bytes), vocab_size, path, seed=seed)

  @classmethod
  def train_on_lines(cls, lines: Iterable[str], vocab_size: int, path: str | None, *,
                     seed: int = 0) -> "Tokenizer":
    """Trains on an iterator of lines (the sample), see :meth:`train`."""
    minimum = reserved_piece_count() + 1
    if vocab_size < minimum:
      raise ValueError(
          f"data.vocab_size={vocab_size} is too small: {minimum - 1} ids are reserved "
          f"(4 specials, {len(CONTROL_SYMBOLS)} control symbols, newline, {NUM_SENTINELS} "
          f"sentinels, 256 byte-fallback pieces) and the text's characters need more; "
          f"use data.vocab_size >= 1000")
    buffer = io.BytesIO()
    spm.set_random_generator_seed(int(seed))
    try:
      spm.SentencePieceTrainer.train(
          sentence_iterator=iter(lines),
          model_writer=buffer,
          **_trainer_options(vocab_size),
      )
    except RuntimeError as e:
      raise ValueError(_explain_trainer_error(e, vocab_size)) from e
    proto = buffer.getvalue()
    if path:
      _atomic_write(path, proto)
    return cls(proto, path=path)

  # ------------------------------------------------------------------ basics

  @property
  def vocab_size(self) -> int:
    """Number of pieces in the model (the embedding table's rows)."""
    return self._sp.get_piece_size()

  @property
  def model_proto(self) -> bytes:
    """The serialized model (the bytes of the ``.model`` file)."""
    return self._model_proto

  def encode(self, texts: Sequence[str]) -> list[np.ndarray]:
    """Encodes a batch of texts; no BOS/EOS is added.

    Args:
        texts: a list of strings.

    Returns:
        One ``int32 [num_tokens_i]`` array per text.
    """
    if isinstance(texts, str):
      raise TypeError("Tokenizer.encode takes a list of strings; wrap a single text: "
                      "encode([text])[0]")
    ids = self._sp.encode(list(texts))
    return [np.asarray(x, dtype=np.int32) for x in ids]

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    """Decodes one sequence of ids (``[num_tokens]``) into text.

    Control ids (pad, eos, bos, mask, cls, sep) decode to the empty string.
    """
    ids = np.asarray(ids)
    if ids.ndim != 1:
      raise ValueError(f"Tokenizer.decode takes one sequence [num_tokens], got shape "
                       f"{ids.shape}; decode rows one at a time")
    return self._sp.decode([int(i) for i in ids])

  def id_to_piece(self, i: int) -> str:
    """The piece (string) of id ``i``."""
    if not 0 <= int(i) < self.vocab_size:
      raise IndexError(f"id {i} is outside the vocabulary [0, {self.vocab_size})")
    return self._sp.id_to_piece(int(i))

  def piece_to_id(self, piece: str) -> int | None:
    """The id of ``piece``, or ``None`` if the model has no such piece."""
    i = self._sp.piece_to_id(piece)
    if 0 <= i < self.vocab_size and self._sp.id_to_piece(i) == piece:
      return i
    return None

  # ------------------------------------------------------------ special ids

  @property
  def pad_id(self) -> int | None:
    return self.piece_to_id(PAD)

  @property
  def eos_id(self) -> int | None:
    return self.piece_to_id(EOS)

  @property
  def unk_id(self) -> int | None:
    return self.piece_to_id(UNK)

  @property
  def bos_id(self) -> int | None:
    return self.piece_to_id(BOS)

  @property
  def mask_id(self) -> int | None:
    return self.piece_to_id(MASK)

  @property
  def cls_id(self) -> int | None:
    return self.piece_to_id(CLS)

  @property
  def sep_id(self) -> int | None:
    return self.piece_to_id(SEP)

  @property
  def sentinel_ids(self) -> tuple[int, ...]:
    """Ids of ``<extra_id_0>``, ``<extra_id_1>``, ... up to the first missing one."""
    ids = []
    for k in range(self.vocab_size):
      i = self.piece_to_id(sentinel_piece(k))
      if i is None:
        break
      ids.append(i)
    return tuple(ids)

  @property
  def special_ids(self) -> tuple[int, ...]:
    """Sorted ids of every non-text piece: pad, eos, unk, bos, mask, cls, sep, sentinels."""
    named = (self.pad_id, self.eos_id, self.unk_id, self.bos_id,
             self.mask_id, self.cls_id, self.sep_id)
    return tuple(sorted({i for i in named if i is not None} | set(self.sentinel_ids)))

  def word_start_mask(self) -> np.ndarray:
    """Which pieces begin a word, for whole-word masking.

    A piece begins a word if it starts with ``"▁"`` (a space). Because the model
    has no dummy prefix, the first word of a line follows a ``"\\n"`` piece
    without a ``"▁"``; so ``"\\n"`` itself, and every special / control piece,
    also count as word starts. Byte-fallback pieces (``<0xNN>``) do not.

    Returns:
        ``bool [vocab_size]``.
    """
    mask = np.zeros(self.vocab_size, dtype=bool)
    for i in range(self.vocab_size):
      piece = self._sp.id_to_piece(i)
      if self._sp.is_byte(i):
        continue
      if piece.startswith(WORD_START) or piece == NEWLINE:
        mask[i] = True
      elif self._sp.is_control(i) or self._sp.is_unknown(i):
        mask[i] = True
    for i in self.special_ids:
      mask[i] = True
    return mask

  def __repr__(self) -> str:
    return f"Tokenizer(vocab_size={self.vocab_size}, path={self.path!r})"


AnyTokenizer = Union[Tokenizer, HFTokenizer]
KINDS = f"a SentencePiece .model (or a directory with tokenizer.model / spiece.model), or a Hugging Face {hf_tokenizer.KINDS}"


# ------------------------------------------------------------ either backend


def load_tokenizer(path: str) -> AnyTokenizer:
  """Loads the tokenizer at ``path`` (local or gs://), SentencePiece or Hugging Face.

  - a Hugging Face ``tokenizer.json``, ``vocab.txt``, ``vocab.json`` (``merges.txt`` beside it) or
    tfx's ``tokenizer.hf.json``: :meth:`HFTokenizer.load`;
  - a directory: its ``tokenizer.hf.json``, ``tokenizer.json``, ``vocab.txt`` or ``vocab.json`` (in
    that order), else its ``tokenizer.model`` or ``spiece.model`` (SentencePiece);
  - any other file: a SentencePiece model.

  Raises:
      FileNotFoundError: ``path`` does not exist, or a ``vocab.json`` has no ``merges.txt``.
      ValueError: ``path`` is no tokenizer of these kinds; the message lists them.
  """
  if hf_tokenizer.resolve(path) is not None:
    return HFTokenizer.load(path)
  p = epath.Path(path)
  if p.is_dir():
    for name in SENTENCEPIECE_IN_DIRECTORY:
      if (p / name).is_file():
        return Tokenizer.load(str(p / name))
    names = sorted(child.name for child in p.iterdir())
    raise ValueError(f"directory {path} holds no tokenizer (it has {', '.join(names[:12]) or 'nothing'}"
                     f"{', ...' if len(names) > 12 else ''}); expected {KINDS}")
  try:
    return Tokenizer.load(path)
  except ValueError as e:
    raise ValueError(f"{path} is neither a SentencePiece model ({e.__cause__ or e}) nor a Hugging Face tokenizer "
                     f"file; expected {KINDS}") from e


def tokenizer_from_bytes(blob: bytes, path: str | None = None) -> AnyTokenizer:
  """Rebuilds a tokenizer from its ``model_proto`` (a saved form): JSON is the Hugging Face backend's
  ``tokenizer.hf.json`` (or a plain ``tokenizer.json``), anything else a SentencePiece model.

  Raises:
      ValueError: the bytes are neither.
  """
  if bytes(blob[:1]) == b"{":  # a serialized SentencePiece model starts with 0x0a (field 1, a piece)
    return HFTokenizer.from_bytes(blob, path=path)
  try:
    return Tokenizer(blob, path=path)
  except Exception as e:  # sentencepiece raises RuntimeError / OSError.
    raise ValueError(f"{path or 'the tokenizer bytes'} is not a tokenizer ({e}); expected {KINDS}") from e


def saved_tokenizer(directory: str | os.PathLike) -> epath.Path | None:
  """The tokenizer a run directory or a store keeps (``tokenizer.model`` or ``tokenizer.hf.json``),
  or ``None``."""
  for name in SAVED_FILENAMES:
    path = epath.Path(directory) / name
    if path.exists():
      return path
  return None


def fit_vocab_size(tokenizer: AnyTokenizer, vocab_size: int) -> AnyTokenizer:
  """The tokenizer a model of ``data.vocab_size`` embedding rows is built with.

  A SentencePiece model is returned as it is (its pieces are the rows). A Hugging Face tokenizer is
  padded to ``vocab_size`` rows (checkpoints often round their embedding up, e.g. to a multiple of
  128; the extra ids are never produced).

  Raises:
      ValueError: the Hugging Face tokenizer has more ids than ``vocab_size``; the message says what
          to set.
  """
  if isinstance(tokenizer, HFTokenizer):
    return tokenizer.with_vocab_size(int(vocab_size))
  return tokenizer


def build_tokenizer(
    tokenizer_path: str,
    corpus: Corpus,
    vocab_size: int,
    workdir: str | None,
    *,
    seed: int = 0,
    max_bytes: int = DEFAULT_MAX_TRAIN_BYTES,
) -> AnyTokenizer:
  """Loads or trains the run's tokenizer.

  1. ``tokenizer_path`` non-empty: load it (``data.tokenizer``, see :func:`load_tokenizer`).
  2. Else ``WORKDIR/tokenizer.model`` exists: load it (resuming a run).
  3. Else train on ``corpus`` and save to ``WORKDIR/tokenizer.model`` (kept in
     memory only if ``workdir`` is None).

  Multi-host: only process 0 trains and writes; the others wait at a barrier and
  then load the file, so ``workdir`` must be on a filesystem all hosts share.

  Args:
      tokenizer_path: path of an existing model, or ``""``.
      corpus: the documents to train on.
      vocab_size: ``data.vocab_size``, used when training.
      workdir: the run directory, or None.
      seed: training seed.
      max_bytes: cap on training text (see :meth:`Tokenizer.train`).

  Returns:
      The tokenizer. If it was loaded, its ``vocab_size`` may differ from
      ``vocab_size``; the caller decides whether that is an error.
  """
  if tokenizer_path:
    return load_tokenizer(tokenizer_path)
  if workdir is None:
    return Tokenizer.train(corpus.documents, vocab_size, None, seed=seed, max_bytes=max_bytes)

  import jax  # Lazy: only the multi-host barrier needs it.

  path = os.path.join(workdir, TOKENIZER_FILENAME)
  multihost = jax.process_count() > 1
  if jax.process_index() == 0 and not os.path.isfile(path):
    os.makedirs(workdir, exist_ok=True)
    Tokenizer.train(corpus.documents, vocab_size, path, seed=seed, max_bytes=max_bytes)
  if multihost:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices("tfx-tokenizer")
    if not os.path.isfile(path):
      raise FileNotFoundError(
          f"process {jax.process_index()} cannot see {path!r}, which process 0 wrote; the "
          f"workdir must be on a filesystem shared by all hosts (or set data.tokenizer to a "
          f"model every host can read)")
  return Tokenizer.load(path)


# --------------------------------------------------------------------- helpers


def _trainer_options(vocab_size: int) -> dict:
  return dict(
      model_type="unigram",
      vocab_size=vocab_size,
      pad_id=0, eos_id=1, unk_id=2, bos_id=3,
      pad_piece=PAD, eos_piece=EOS, unk_piece=UNK, bos_piece=BOS,
      control_symbols=list(CONTROL_SYMBOLS),
      user_defined_symbols=[NEWLINE] + [sentinel_piece(k) for k in range(NUM_SENTINELS)],
      normalization_rule_name="identity",
      remove_extra_whitespaces=False,
      add_dummy_prefix=False,
      allow_whitespace_only_pieces=True,
      byte_fallback=True,
      character_coverage=0.9995,
      num_threads=1,
      shuffle_input_sentence=False,
      input_sentence_size=0,
      train_extremely_large_corpus=False,
      max_sentence_length=MAX_LINE_BYTES,  # its default (4192) drops longer lines silently
      minloglevel=2,
  )


def _training_lines(documents: list[str], max_bytes: int) -> Iterator[str]:
  """Yields the non-empty lines of a deterministic, about ``max_bytes`` sample."""
  if max_bytes <= 0:
    raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
  return sample_lines(documents, sum(utf8_bytes(d) for d in documents), max_bytes)


def utf8_bytes(text: str) -> int:
  """Bytes of `text` in UTF-8 (what the sample's budget counts)."""
  return len(text.encode("utf-8"))


MAX_LINE_BYTES = 1 << 16  # the trainer's longest sentence; sample lines are cut well below it
_CHUNK_CHARS = 4096  # at most 16 KiB of UTF-8


def _chunks(line: str) -> Iterator[str]:
  """`line` in pieces of at most _CHUNK_CHARS characters, cut after a space where there is one
  (JSON-lines paragraphs, minified code and text without newlines have lines of any length)."""
  while len(line) > _CHUNK_CHARS:
    cut = line.rfind(" ", 0, _CHUNK_CHARS) + 1 or _CHUNK_CHARS
    yield line[:cut]
    line = line[cut:]
  yield line


def sample_lines(documents: Iterable[str], total_bytes: int, max_bytes: int) -> Iterator[str]:
  """The tokenizer's training sample from a stream of documents (of ``total_bytes`` of UTF-8).

  Every k-th document, ``k = ceil(total_bytes / max_bytes)``, split into its non-empty lines (a
  line longer than 4096 characters into pieces), until ``max_bytes`` are taken. A stream gives
  the same lines as the whole list.
  """
  if max_bytes <= 0:
    raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
  stride = max(1, -(-total_bytes // max_bytes))
  used = 0
  for index, document in enumerate(documents):
    if index % stride:
      continue
    for line in document.split(NEWLINE):
      if not line.strip():
        continue
      for piece in _chunks(line):
        used += utf8_bytes(piece)
        if used > max_bytes:
          return
        yield piece


def _explain_trainer_error(error: RuntimeError, vocab_size: int) -> str:
  message = str(error)
  if "Vocabulary size is smaller than required_chars" in message or "smaller than" in message:
    hint = "increase data.vocab_size"
  elif "sentences_.empty()" in message:
    hint = "the sample has no text to learn from: check data.source and data.text_field"
  elif "Vocabulary size too high" in message:
    hint = ("decrease data.vocab_size (the corpus is too small to learn that many pieces) or "
            "use a larger data.source")
  else:
    hint = "check data.vocab_size and data.source"
  return f"training the tokenizer with data.vocab_size={vocab_size} failed: {message}; {hint}"


def _atomic_write(path: str, data: bytes) -> None:
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  tmp = f"{path}.tmp-{os.getpid()}-{time.monotonic_ns()}"
  with open(tmp, "wb") as f:
    f.write(data)
  os.replace(tmp, path)
