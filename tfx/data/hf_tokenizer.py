"""Hugging Face tokenizers (WordPiece, byte-level BPE, any ``tokenizer.json``) behind tfx's tokenizer interface.

:class:`HFTokenizer` has the public interface of the SentencePiece :class:`tfx.data.tokenizer.Tokenizer`
(``vocab_size``, ``model_proto``, ``filename``, ``encode``/``decode``, special ids by name,
``word_start_mask``), so the store, the pipeline, the objectives and ``tfx.generate`` use either.
It runs on the Rust ``tokenizers`` library (no torch, no transformers). :meth:`HFTokenizer.load`
reads a ``tokenizer.json``, a ``vocab.txt`` (WordPiece), a ``vocab.json`` + ``merges.txt``
(byte-level BPE) or a directory, with the ids transformers' fast tokenizers give for the same files
and the special-token roles of the configs beside them (see :mod:`tfx.data.hf_files`).

tfx's own two roles are derived (the packer appends ``eos_id`` to every document, and causal LM
shifts ``bos_id`` in as the start token):

- ``eos_id`` = the eos token if there is one, else the sep token (BERT: ``[SEP]``);
- ``bos_id`` = the bos token if there is one, else the cls token (BERT: ``[CLS]``).

A tokenizer with neither eos nor sep is refused at load.

The saved form (``model_proto``, written as ``tokenizer.hf.json`` into a run or a store) is one UTF-8
JSON object, self-contained and deterministic for the same input::

    {"format": "tfx-hf-tokenizer/1",
     "special_tokens": {"unk": "[UNK]", "sep": "[SEP]", "pad": "[PAD]", "cls": "[CLS]", "mask": "[MASK]"},
     "vocab_size": 30592,              # only when padded past the tokenizer's ids (see with_vocab_size)
     "tokenizer": {...}}               # the tokenizer.json object of the pipeline

A copy read back keeps its bytes (and so its sha256, the tokenizer's identity in a store's manifest).
"""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import tokenizers

from tfx.data import hf_files
from tfx.data.hf_files import FILENAME, KINDS, ROLES, resolve

FORMAT = "tfx-hf-tokenizer/1"
BYTE_LEVEL_SPACE, BYTE_LEVEL_TAB, BYTE_LEVEL_NEWLINE = "\u0120", "\u0109", "\u010a"  # "Ġ", "ĉ", "Ċ"
METASPACE = "\u2581"  # "▁"
__all__ = ["FILENAME", "FORMAT", "HFTokenizer", "KINDS", "ROLES", "resolve"]


class HFTokenizer:
  """A Hugging Face ``tokenizers`` pipeline with special-token roles, as tfx uses a tokenizer.

  Attributes:
      path: where it was loaded from, if anywhere (for messages).
      filename: the name its saved form gets in a run directory or a token store.
  """

  filename = FILENAME

  def __init__(self, tokenizer: tokenizers.Tokenizer, special_tokens: Mapping[str, str], *,
               vocab_size: int = 0, path: str | None = None, model_proto: bytes | None = None):
    """Wraps a pipeline.

    Args:
        tokenizer: the ``tokenizers.Tokenizer`` (truncation and padding are switched off).
        special_tokens: role -> token content, for roles among :data:`ROLES` (absent = none).
        vocab_size: embedding rows, if more than the tokenizer's ids (0 = max id + 1).
        path: where it came from (for messages).
        model_proto: its saved form when it was read from one (kept byte for byte, so a copy has
            the same sha256); ``None`` serializes it.

    Raises:
        ValueError: a role names a token the tokenizer does not have, neither eos nor sep exists,
            or ``vocab_size`` is smaller than the tokenizer's ids.
    """
    tokenizer.no_truncation()
    tokenizer.no_padding()
    self._tok = tokenizer
    self.path = path
    self._roles = {role: special_tokens[role] for role in ROLES if special_tokens.get(role) is not None}
    unknown = set(special_tokens) - set(ROLES)
    if unknown:
      raise ValueError(f"unknown special-token roles {sorted(unknown)}; the roles are {', '.join(ROLES)}")
    self._ids = {role: tokenizer.token_to_id(token) for role, token in self._roles.items()}
    missing = [f"{role}={self._roles[role]!r}" for role, i in self._ids.items() if i is None]
    if missing:
      raise ValueError(f"tokenizer {path or ''} has no token for {', '.join(missing)}; fix the special tokens in "
                       f"tokenizer_config.json / special_tokens_map.json")
    if self._ids.get("eos") is None and self._ids.get("sep") is None:
      raise ValueError(
          f"tokenizer {path or ''} has neither an eos nor a sep token, and tfx ends every document with one; name "
          f"one in tokenizer_config.json or special_tokens_map.json (\"eos_token\": \"...\") next to the tokenizer")
    self._num_ids = _num_ids(tokenizer)
    if vocab_size and vocab_size < self._num_ids:
      raise ValueError(too_many_ids_message(self, vocab_size))
    self._rows = max(int(vocab_size), self._num_ids)
    self._spec = json.loads(tokenizer.to_str())
    self._proto = model_proto if model_proto is not None else self._serialize()
    self._word_start: np.ndarray | None = None

  # ----------------------------------------------------------------- creation

  @classmethod
  def load(cls, path: str) -> "HFTokenizer":
    """Loads a ``tokenizer.json``, ``vocab.txt``, ``vocab.json`` (+ ``merges.txt``), tfx's
    ``tokenizer.hf.json``, or a directory holding one of them (local or gs://).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is none of these kinds, a ``vocab.json`` has no ``merges.txt``, or the
            special tokens do not fit (see :class:`HFTokenizer`); the message says what to change.
    """
    found = resolve(path)
    if found is None:
      raise ValueError(f"{path} is not a Hugging Face tokenizer; expected {KINDS}")
    kind, file = found
    if kind == "tfx":
      return cls.from_bytes(file.read_bytes(), path=str(file))
    tokenizer, roles = hf_files.read_pipeline(kind, file)
    return cls(tokenizer, roles, path=str(path))

  @classmethod
  def from_bytes(cls, blob: bytes, path: str | None = None) -> "HFTokenizer":
    """Rebuilds a tokenizer from its saved form (:attr:`model_proto`); a plain ``tokenizer.json``'s
    bytes are accepted too (roles by convention)."""
    try:
      spec = json.loads(blob.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
      raise ValueError(f"{path or 'the tokenizer bytes'} is not valid JSON ({e}); expected {KINDS}") from e
    if not isinstance(spec, dict):
      raise ValueError(f"{path or 'the tokenizer bytes'} is not a tokenizer; expected {KINDS}")
    if "format" not in spec and isinstance(spec.get("model"), dict):  # a plain tokenizer.json
      tokenizer = tokenizers.Tokenizer.from_str(blob.decode("utf-8"))
      return cls(tokenizer, hf_files.tokenizer_json_roles(tokenizer, {}), path=path)
    if spec.get("format") != FORMAT:
      raise ValueError(f"{path or 'the tokenizer bytes'} has format {spec.get('format')!r}; this tfx reads "
                       f"{FORMAT!r} (a newer tfx wrote it? update tfx)")
    tokenizer = tokenizers.Tokenizer.from_str(json.dumps(spec["tokenizer"]))
    return cls(tokenizer, spec["special_tokens"], vocab_size=int(spec.get("vocab_size", 0)), path=path,
               model_proto=bytes(blob))

  def with_vocab_size(self, rows: int) -> "HFTokenizer":
    """A copy with ``rows`` embedding rows (ids past the tokenizer's are never produced).

    Raises:
        ValueError: ``rows`` is smaller than the tokenizer's ids.
    """
    if rows == self._rows:
      return self
    if rows < self._num_ids:
      raise ValueError(too_many_ids_message(self, rows))
    return HFTokenizer(tokenizers.Tokenizer.from_str(self._tok.to_str()), self._roles, vocab_size=rows,
                       path=self.path)

  def _serialize(self) -> bytes:
    spec: dict[str, Any] = {"format": FORMAT, "special_tokens": dict(self._roles)}
    if self._rows > self._num_ids:
      spec["vocab_size"] = self._rows
    spec["tokenizer"] = self._spec
    return json.dumps(spec, ensure_ascii=False, separators=(",", ":")).encode("utf-8")

  # ------------------------------------------------------------------ basics

  @property
  def vocab_size(self) -> int:
    """Embedding rows needed: the largest id + 1 (added tokens included), or more if padded."""
    return self._rows

  @property
  def num_ids(self) -> int:
    """The tokenizer's own ids: the largest id + 1 (``vocab_size`` without padding)."""
    return self._num_ids

  @property
  def model_proto(self) -> bytes:
    """The saved form: the bytes of ``tokenizer.hf.json`` (its sha256 is the tokenizer's identity)."""
    return self._proto

  @property
  def tokenizer(self) -> tokenizers.Tokenizer:
    """The underlying ``tokenizers.Tokenizer``."""
    return self._tok

  @property
  def special_tokens(self) -> dict[str, str]:
    """Role -> token content of the roles the tokenizer has (as saved)."""
    return dict(self._roles)

  def encode(self, texts: Sequence[str]) -> list[np.ndarray]:
    """Encodes a batch of texts without special tokens (``add_special_tokens=False``).

    Args:
        texts: a list of strings.

    Returns:
        One ``int32 [num_tokens_i]`` array per text.
    """
    if isinstance(texts, str):
      raise TypeError("HFTokenizer.encode takes a list of strings; wrap a single text: encode([text])[0]")
    encodings = self._tok.encode_batch_fast(list(texts), add_special_tokens=False)
    return [np.asarray(e.ids, dtype=np.int32) for e in encodings]

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    """Decodes one sequence of ids (``[num_tokens]``). The role tokens (pad, eos, bos, unk, mask,
    cls, sep) and padding ids are skipped, as transformers' ``skip_special_tokens`` skips them; every
    other token is kept, sentinels (T5's ``<extra_id_k>``, special tokens to ``tokenizers``)
    included, as the SentencePiece backend keeps them."""
    ids = np.asarray(ids)
    if ids.ndim != 1:
      raise ValueError(f"HFTokenizer.decode takes one sequence [num_tokens], got shape {ids.shape}; decode rows "
                       f"one at a time")
    roles = set(self._ids.values())
    kept = [int(i) for i in ids if 0 <= int(i) < self._num_ids and int(i) not in roles]
    return self._tok.decode(kept, skip_special_tokens=False)

  def id_to_piece(self, i: int) -> str:
    """The token (string) of id ``i``; ``""`` for a padding id the tokenizer never produces."""
    if not 0 <= int(i) < self.vocab_size:
      raise IndexError(f"id {i} is outside the vocabulary [0, {self.vocab_size})")
    return self._tok.id_to_token(int(i)) or ""

  def piece_to_id(self, piece: str) -> int | None:
    """The id of ``piece``, or ``None`` if the tokenizer has no such token."""
    return self._tok.token_to_id(piece) if piece else None

  # ------------------------------------------------------------ special ids

  @property
  def pad_id(self) -> int | None:
    return self._ids.get("pad")

  @property
  def eos_id(self) -> int | None:
    """The eos token's id, else the sep token's (the token that ends every packed document)."""
    return self._ids["eos"] if self._ids.get("eos") is not None else self._ids.get("sep")

  @property
  def unk_id(self) -> int | None:
    return self._ids.get("unk")

  @property
  def bos_id(self) -> int | None:
    """The bos token's id, else the cls token's (causal LM's start token)."""
    return self._ids["bos"] if self._ids.get("bos") is not None else self._ids.get("cls")

  @property
  def mask_id(self) -> int | None:
    return self._ids.get("mask")

  @property
  def cls_id(self) -> int | None:
    return self._ids.get("cls")

  @property
  def sep_id(self) -> int | None:
    return self._ids.get("sep")

  @property
  def sentinel_ids(self) -> tuple[int, ...]:
    """Ids of the added tokens ``<extra_id_0>``, ``<extra_id_1>``, ... up to the first missing one."""
    added = {str(t.content): i for i, t in self._tok.get_added_tokens_decoder().items()}
    ids = []
    while f"<extra_id_{len(ids)}>" in added:
      ids.append(added[f"<extra_id_{len(ids)}>"])
    return tuple(ids)

  @property
  def special_ids(self) -> tuple[int, ...]:
    """Sorted ids of every non-text token: the roles, the sentinels and every special added token."""
    specials = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
    return tuple(sorted(specials | {i for i in self._ids.values() if i is not None} | set(self.sentinel_ids)))

  def word_start_mask(self) -> np.ndarray:
    """Which ids begin a word, for whole-word masking: ``bool [vocab_size]``.

    - WordPiece: a token that does not start with the continuing-subword prefix (``"##"``).
    - Byte-level BPE: a token that starts with an encoded space ``"Ġ"`` or tab ``"ĉ"``, or contains an
      encoded newline ``"Ċ"`` (the first word of a line follows a newline token, as in the
      SentencePiece rule, so the newline opens the word).
    - Metaspace pipelines (SentencePiece-style ``tokenizer.json``): a token that starts with ``"▁"``.
    - Any other pipeline: every token (whole-word masking falls back to token masking).

    Every added token (specials included) starts a word; padding ids do not.
    """
    if self._word_start is None:
      starts = self._word_rule()
      mask = np.zeros(self.vocab_size, dtype=bool)
      for token, i in self._tok.get_vocab(with_added_tokens=False).items():
        mask[i] = starts(token)
      mask[list(self._tok.get_added_tokens_decoder())] = True
      mask[list(self.special_ids)] = True
      self._word_start = mask
    return self._word_start.copy()

  def _word_rule(self) -> Callable[[str], bool]:
    model = self._spec.get("model") or {}
    types = _component_types(self._spec.get("pre_tokenizer")) | _component_types(self._spec.get("decoder"))
    prefix = model.get("continuing_subword_prefix") or ""
    if model.get("type") == "WordPiece" or (model.get("type") == "BPE" and prefix):
      prefix = prefix or hf_files.WORDPIECE_PREFIX
      return lambda token: not token.startswith(prefix)
    if "ByteLevel" in types:
      return lambda token: token.startswith((BYTE_LEVEL_SPACE, BYTE_LEVEL_TAB)) or BYTE_LEVEL_NEWLINE in token
    if "Metaspace" in types:
      replacement = _find_component(self._spec.get("pre_tokenizer"), "Metaspace").get("replacement", METASPACE)
      return lambda token: token.startswith(replacement)
    return lambda token: True

  def __repr__(self) -> str:
    model = (self._spec.get("model") or {}).get("type", "?")
    return f"HFTokenizer({model}, vocab_size={self.vocab_size}, path={self.path!r})"


# ============================================================================ helpers


def too_many_ids_message(tokenizer: HFTokenizer, rows: int) -> str:
  """The error for a tokenizer whose ids do not fit ``rows`` embedding rows."""
  return (f"the tokenizer {tokenizer.path or ''} has {tokenizer.num_ids} ids (largest id + 1, added tokens included) "
          f"but data.vocab_size={rows} (the model's embedding rows); set data.vocab_size={tokenizer.num_ids} or more "
          f"(extra rows are never produced, e.g. round up to a multiple of 128), or use the tokenizer the checkpoint "
          f"was trained with")


def _num_ids(tokenizer: tokenizers.Tokenizer) -> int:
  ids = list(tokenizer.get_vocab(with_added_tokens=True).values())
  return max(ids) + 1 if ids else 0


def _component_types(node: Any) -> set[str]:
  """Every ``"type"`` in a pipeline component's JSON (a ``Sequence`` nests others)."""
  if isinstance(node, dict):
    types = {node["type"]} if isinstance(node.get("type"), str) else set()
    for value in node.values():
      types |= _component_types(value)
    return types
  if isinstance(node, list):
    return set().union(*(_component_types(v) for v in node)) if node else set()
  return set()


def _find_component(node: Any, kind: str) -> dict:
  """The first component of type ``kind`` in a pipeline component's JSON, or ``{}``."""
  if isinstance(node, dict):
    if node.get("type") == kind:
      return node
    node = list(node.values())
  if isinstance(node, list):
    for value in node:
      found = _find_component(value, kind)
      if found:
        return found
  return {}
