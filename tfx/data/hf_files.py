"""Reading Hugging Face tokenizer files into a ``tokenizers`` pipeline and its special-token roles.

What a path may be (:func:`resolve`), building the pipelines transformers' fast tokenizers
(``BertTokenizerFast``, ``GPT2TokenizerFast``, ``RobertaTokenizerFast``) build for the same files, so
that the ids agree with theirs (``add_special_tokens=False``):

- ``tokenizer.json``: the ``tokenizers`` pipeline as it is.
- ``vocab.txt``: BERT's WordPiece: ``BertNormalizer`` (``do_lower_case``, ``strip_accents``,
  ``tokenize_chinese_chars`` from ``tokenizer_config.json``; defaults as BERT uncased),
  ``BertPreTokenizer``, WordPiece with ``"##"`` continuations and ``[UNK]``, WordPiece decoder.
- ``vocab.json`` + ``merges.txt`` (GPT-2 / RoBERTa): ``ByteLevel`` pre-tokenizer
  (``add_prefix_space`` from ``tokenizer_config.json``, default False), BPE, ``ByteLevel`` decoder.
- a directory holding one of these (preferred in the order ``tokenizer.hf.json``,
  ``tokenizer.json``, ``vocab.txt``, ``vocab.json``), with its ``tokenizer_config.json`` and
  ``special_tokens_map.json``.

Special-token roles (bos, eos, unk, sep, pad, cls, mask) come from ``tokenizer_config.json``, then
``special_tokens_map.json`` (which wins, as in transformers); a value may be a string or a dict with
``"content"`` (and ``lstrip`` / ``rstrip`` / ``single_word`` / ``normalized``), and ``null`` means
none. A role neither file names takes its conventional token: for ``vocab.txt`` BERT's
(``[PAD] [UNK] [CLS] [SEP] [MASK]``); for ``vocab.json`` RoBERTa's (``<s> </s> <pad> <unk> <mask>``,
cls = ``<s>``, sep = ``</s>``) when the vocabulary has ``<s> <pad> </s> <unk>`` or the config's
``tokenizer_class`` is RoBERTa's (or BART's), else GPT-2's (``<|endoftext|>`` as bos = eos = unk, as
``GPT2TokenizerFast`` adds it); for a ``tokenizer.json`` those
names (GPT-2's first) that are among its special added tokens. As transformers does, the role tokens
of a ``vocab.txt`` / ``vocab.json`` (and any role token a config names) are added as special tokens,
matched whole in text; one missing from the vocabulary gets the next free id. So do the config's
``additional_special_tokens`` / ``extra_special_tokens``.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Mapping, Sequence

import tokenizers
from etils import epath
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers

FILENAME = "tokenizer.hf.json"  # tfx's saved form (see tfx.data.hf_tokenizer)
ROLES = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")  # transformers' order (new tokens get ids in it)
TOKENIZER_JSON, VOCAB_TXT, VOCAB_JSON, MERGES_TXT = "tokenizer.json", "vocab.txt", "vocab.json", "merges.txt"
CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")  # read in this order; the later wins
# The files a directory is searched for, in order of preference.
DIRECTORY_FILES = (FILENAME, TOKENIZER_JSON, VOCAB_TXT, VOCAB_JSON)
KINDS = ("tokenizer.hf.json (tfx's saved form), tokenizer.json, vocab.txt (WordPiece), "
         "vocab.json with merges.txt beside it (byte-level BPE), or a directory holding one of these")

BERT_TOKENS = {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}
ROBERTA_TOKENS = {"pad": "<pad>", "unk": "<unk>", "bos": "<s>", "eos": "</s>", "mask": "<mask>", "cls": "<s>",
                  "sep": "</s>"}
GPT2_TOKENS = {"unk": "<|endoftext|>", "bos": "<|endoftext|>", "eos": "<|endoftext|>"}
WORDPIECE_PREFIX = "##"


def read_pipeline(kind: str, file: epath.Path) -> tuple[tokenizers.Tokenizer, dict[str, str]]:
  """(pipeline, role -> token) of a ``"tokenizer.json"``, ``"wordpiece"`` or ``"bpe"`` file (see
  :func:`resolve`), with the configs beside it applied.

  Raises:
      ValueError / FileNotFoundError: unreadable configs, a missing ``merges.txt`` or unknown token.
  """
  config = read_config(file.parent)
  if kind == "tokenizer.json":
    tokenizer = tokenizers.Tokenizer.from_str(file.read_text())
    roles = tokenizer_json_roles(tokenizer, config)
  elif kind == "wordpiece":
    tokenizer, roles = _wordpiece(file, config)
  elif kind == "bpe":
    tokenizer, roles = _byte_level_bpe(file, config)
  else:
    raise ValueError(f"unknown Hugging Face tokenizer kind {kind!r}")
  add_special_tokens(tokenizer, extra_tokens(config))
  return tokenizer, roles


# ============================================================================ resolving a path


def resolve(path: str | os.PathLike) -> tuple[str, epath.Path] | None:
  """(kind, file) of the Hugging Face tokenizer at ``path``, or ``None`` if it is not one.

  Kinds: ``"tfx"`` (a ``tokenizer.hf.json``), ``"tokenizer.json"``, ``"wordpiece"`` (a ``vocab.txt``),
  ``"bpe"`` (a ``vocab.json``). A directory resolves to its first file of :data:`DIRECTORY_FILES`.

  Raises:
      FileNotFoundError: ``path`` does not exist.
      ValueError: a ``.json`` file that is no tokenizer, or a ``merges.txt`` given on its own.
  """
  p = epath.Path(path)
  if not p.exists():
    raise FileNotFoundError(f"tokenizer {str(path)!r} does not exist; set data.tokenizer to a SentencePiece .model "
                            f"or to a Hugging Face {KINDS}")
  if p.is_dir():
    for name in DIRECTORY_FILES:
      if (p / name).is_file():
        return resolve(p / name)
    return None
  if p.name.endswith(".json"):
    return _json_kind(p), p
  if p.name.endswith(".txt"):
    if "merges" in p.name:
      raise ValueError(f"{path} is a BPE merges file; point data.tokenizer at the vocab.json beside it, or at the "
                       f"directory that holds both")
    return "wordpiece", p
  return None


def _json_kind(file: epath.Path) -> str:
  try:
    spec = json.loads(file.read_text())
  except (UnicodeDecodeError, ValueError) as e:
    raise ValueError(f"{file} is not valid JSON ({e}); expected {KINDS}") from e
  if isinstance(spec, dict) and "format" in spec and "tokenizer" in spec:
    return "tfx"
  if isinstance(spec, dict) and isinstance(spec.get("model"), dict):
    return "tokenizer.json"
  if isinstance(spec, dict) and spec and all(isinstance(v, int) for v in spec.values()):
    return "bpe"
  raise ValueError(f"{file} is JSON but not a tokenizer (no \"model\" section, not a token -> id vocabulary); "
                   f"expected {KINDS}")


def merges_for(vocab: epath.Path) -> epath.Path:
  """The ``merges.txt`` of a BPE ``vocab.json``: beside it, as ``merges.txt`` or with ``vocab`` in the
  name replaced by ``merges`` (``gpt2-vocab.json`` -> ``gpt2-merges.txt``).

  Raises:
      FileNotFoundError: there is none; the message names where it was looked for.
  """
  stem = vocab.name[:-len(".json")]
  names = dict.fromkeys([f"{stem.replace('vocab', 'merges')}.txt" if "vocab" in stem else MERGES_TXT, MERGES_TXT])
  candidates = [vocab.parent / name for name in names]
  for candidate in candidates:
    if candidate.is_file():
      return candidate
  raise FileNotFoundError(
      f"{vocab} is a byte-level BPE vocabulary but there is no {' or '.join(c.name for c in candidates)} beside it; "
      f"copy the merges file that came with it into {vocab.parent}, or point data.tokenizer at a tokenizer.json")


# ============================================================================ configuration


def read_config(directory: epath.Path) -> dict[str, Any]:
  """``tokenizer_config.json`` updated by ``special_tokens_map.json`` (either may be missing)."""
  config: dict[str, Any] = {}
  for name in CONFIG_FILES:
    file = directory / name
    if file.is_file():
      try:
        values = json.loads(file.read_text())
      except ValueError as e:
        raise ValueError(f"{file} is not valid JSON ({e}); fix or remove it") from e
      if isinstance(values, dict):
        config.update(values)
  return config


def _token_spec(value: Any) -> AddedToken | None:
  """A special token as a config gives it: a string, a dict with ``"content"``, or ``None``."""
  if value is None:
    return None
  if isinstance(value, str):
    return AddedToken(value, special=True, normalized=False)
  if isinstance(value, dict) and isinstance(value.get("content"), str):
    flags = {k: bool(value[k]) for k in ("lstrip", "rstrip", "single_word", "normalized") if k in value}
    return AddedToken(value["content"], **{"normalized": False, **flags}, special=True)
  raise ValueError(f"a special token in tokenizer_config.json / special_tokens_map.json is {value!r}; expected a "
                   f"string or {{\"content\": ...}}")


def _configured_roles(config: Mapping[str, Any]) -> dict[str, AddedToken | None]:
  """Roles the config names (``None`` for an explicit ``null``); roles it does not mention are absent."""
  return {role: _token_spec(config[f"{role}_token"]) for role in ROLES if f"{role}_token" in config}


def extra_tokens(config: Mapping[str, Any]) -> list[Any]:
  """The config's further special tokens (``additional_special_tokens``, ``extra_special_tokens``)."""
  out: list[Any] = []
  for key in ("additional_special_tokens", "extra_special_tokens"):
    value = config.get(key) or []
    out.extend(value.values() if isinstance(value, dict) else value)
  return out


def add_special_tokens(tokenizer: tokenizers.Tokenizer, values: Sequence[Any]) -> None:
  """Adds tokens as special (matched whole in text; an unknown one gets the next free id), except
  those that already are added tokens."""
  added = {str(t.content) for t in tokenizer.get_added_tokens_decoder().values()}
  tokens = [t for t in (_token_spec(v) for v in values) if t is not None and str(t.content) not in added]
  if tokens:
    tokenizer.add_special_tokens(tokens)


def _vocab_roles(config: Mapping[str, Any], defaults: Mapping[str, str],
                 tokenizer: tokenizers.Tokenizer) -> dict[str, str]:
  """Roles of a vocabulary-file tokenizer: the config's, else ``defaults``; all added as special."""
  configured = _configured_roles(config)
  specs = {role: configured[role] if role in configured else AddedToken(defaults[role], special=True, normalized=False)
           for role in ROLES if role in configured or role in defaults}
  added = [spec for spec in specs.values() if spec is not None]
  if added:
    tokenizer.add_special_tokens(added)
  return {role: str(spec.content) for role, spec in specs.items() if spec is not None}


def tokenizer_json_roles(tokenizer: tokenizers.Tokenizer, config: Mapping[str, Any]) -> dict[str, str]:
  """Roles of a ``tokenizer.json``: the config's (added as special when not yet added tokens), else
  conventional names among its special added tokens."""
  configured = _configured_roles(config)
  added = {str(t.content) for t in tokenizer.get_added_tokens_decoder().values()}
  new = [spec for spec in configured.values() if spec is not None and str(spec.content) not in added]
  if new:
    tokenizer.add_special_tokens(new)
  roles = {role: str(spec.content) for role, spec in configured.items() if spec is not None}
  specials = {str(t.content) for t in tokenizer.get_added_tokens_decoder().values() if t.special}
  for family in (GPT2_TOKENS, BERT_TOKENS, ROBERTA_TOKENS):
    for role, token in family.items():
      if role not in roles and role not in configured and token in specials:
        roles[role] = token
  return roles


# ============================================================================ pipelines


def _wordpiece(vocab_file: epath.Path, config: Mapping[str, Any]) -> tuple[tokenizers.Tokenizer, dict[str, str]]:
  """BERT's WordPiece pipeline for a ``vocab.txt``, as ``BertTokenizerFast`` builds it."""
  with _local_copies([vocab_file]) as (local,):
    vocab = models.WordPiece.read_file(local)
  unk = _configured_roles(config).get("unk", AddedToken(BERT_TOKENS["unk"]))
  if unk is None or str(unk.content) not in vocab:
    raise ValueError(f"{vocab_file} has no unknown token {str(unk.content) if unk else None!r}, which WordPiece needs; "
                     f"set \"unk_token\" in {vocab_file.parent / CONFIG_FILES[0]} to one of its tokens")
  tokenizer = tokenizers.Tokenizer(models.WordPiece(vocab, unk_token=str(unk.content),
                                                    continuing_subword_prefix=WORDPIECE_PREFIX,
                                                    max_input_chars_per_word=100))
  chinese = config.get("tokenize_chinese_chars", config.get("handle_chinese_chars", True))
  tokenizer.normalizer = normalizers.BertNormalizer(
      clean_text=True, handle_chinese_chars=bool(chinese), strip_accents=config.get("strip_accents"),
      lowercase=bool(config.get("do_lower_case", True)))
  tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
  tokenizer.decoder = decoders.WordPiece(prefix=WORDPIECE_PREFIX)
  return tokenizer, _vocab_roles(config, BERT_TOKENS, tokenizer)


def _byte_level_bpe(vocab_file: epath.Path,
                    config: Mapping[str, Any]) -> tuple[tokenizers.Tokenizer, dict[str, str]]:
  """GPT-2 / RoBERTa's byte-level BPE for a ``vocab.json`` and its ``merges.txt``."""
  merges_file = merges_for(vocab_file)
  with _local_copies([vocab_file, merges_file]) as (vocab_local, merges_local):
    vocab, merges = models.BPE.read_file(vocab_local, merges_local)
  tokenizer = tokenizers.Tokenizer(models.BPE(vocab, merges, dropout=None, continuing_subword_prefix="",
                                              end_of_word_suffix="", fuse_unk=False))
  # ByteLevel's own default is add_prefix_space=True; GPT-2 and RoBERTa use False.
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=bool(config.get("add_prefix_space", False)),
                                                     use_regex=True)
  tokenizer.decoder = decoders.ByteLevel()
  return tokenizer, _vocab_roles(config, ROBERTA_TOKENS if _is_roberta(vocab, config) else GPT2_TOKENS, tokenizer)


def _is_roberta(vocab: Mapping[str, int], config: Mapping[str, Any]) -> bool:
  """RoBERTa's special tokens (not GPT-2's) for a ``vocab.json``: the config's ``tokenizer_class`` says
  so, or the vocabulary has all of ``<s> <pad> </s> <unk>`` (RoBERTa's ids 0-3)."""
  named = str(config.get("tokenizer_class") or "").lower()
  if "gpt2" in named:
    return False
  return "roberta" in named or "bart" in named or all(t in vocab for t in ("<s>", "<pad>", "</s>", "<unk>"))


class _local_copies:
  """Local paths of some files (remote ones are copied to a temporary directory while in use)."""

  def __init__(self, files: Sequence[epath.Path]):
    self.files = files
    self.tmp: tempfile.TemporaryDirectory | None = None

  def __enter__(self) -> list[str]:
    if not any("://" in str(f) for f in self.files):
      return [str(f) for f in self.files]
    self.tmp = tempfile.TemporaryDirectory(prefix="tfx-tokenizer-")
    out = []
    for index, file in enumerate(self.files):
      local = os.path.join(self.tmp.name, f"{index}-{file.name}")
      with open(local, "wb") as f:
        f.write(file.read_bytes())
      out.append(local)
    return out

  def __exit__(self, *exc) -> None:
    if self.tmp is not None:
      self.tmp.cleanup()
