"""Tests for tfx.data.tokenizer: the sentencepiece model tfx trains, its special ids and sentinels,
round trips, and build_tokenizer's train-or-resume (CPU, offline). Fixtures: conftest.py."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tfx.data import Corpus, Tokenizer, build_tokenizer
from tfx.data import sources as sources_lib
from tests.conftest import SMALL_VOCAB, TRAIN_BYTES


def test_special_ids_are_named_and_distinct(tokenizer):
  assert tokenizer.vocab_size == SMALL_VOCAB
  named = {
      "<pad>": tokenizer.pad_id, "</s>": tokenizer.eos_id, "<unk>": tokenizer.unk_id,
      "<s>": tokenizer.bos_id, "<mask>": tokenizer.mask_id, "<cls>": tokenizer.cls_id,
      "<sep>": tokenizer.sep_id,
  }
  assert (tokenizer.pad_id, tokenizer.eos_id, tokenizer.unk_id, tokenizer.bos_id) == (0, 1, 2, 3)
  assert None not in named.values()
  assert len(set(named.values())) == len(named)
  for piece, i in named.items():
    assert tokenizer.id_to_piece(i) == piece
  sentinels = tokenizer.sentinel_ids
  assert len(sentinels) == 100
  assert [tokenizer.id_to_piece(i) for i in sentinels] == [
      f"<extra_id_{k}>" for k in range(100)]
  assert tokenizer.special_ids == tuple(sorted(set(named.values()) | set(sentinels)))
  assert len(tokenizer.special_ids) == 107
  assert tokenizer.piece_to_id("<no such piece>") is None


def test_sentinels_are_single_pieces_that_survive_roundtrip(tokenizer):
  sentinels = tokenizer.sentinel_ids
  text = "def f(x):\n    return <extra_id_0> + x<extra_id_17>y <extra_id_99>\n"
  ids = tokenizer.encode([text])[0]
  assert sentinels[0] in ids and sentinels[17] in ids and sentinels[99] in ids
  assert tokenizer.decode(ids) == text
  for k in (0, 5, 99):
    assert list(tokenizer.encode([f"<extra_id_{k}>"])[0]) == [sentinels[k]]
    assert tokenizer.decode([sentinels[k]]) == f"<extra_id_{k}>"


def test_control_symbols_never_come_from_text(tokenizer):
  ids = tokenizer.encode(["<mask> <cls> <sep> <s> </s> <pad>"])[0]
  controls = {tokenizer.mask_id, tokenizer.cls_id, tokenizer.sep_id, tokenizer.bos_id,
              tokenizer.eos_id, tokenizer.pad_id}
  assert not controls & set(ids.tolist())


def _relative(name: str) -> str:
  return os.path.relpath(name, sources_lib.stdlib_root()).replace(os.sep, "/")


def test_roundtrip_on_real_stdlib_files(tokenizer, stdlib_corpus):
  names = [_relative(n) for n in stdlib_corpus.names]
  # One file the tokenizer saw and several it did not (byte fallback covers rare chars).
  # re/_casefix.py and shlex.py are full of non-ASCII characters.
  picks = [0, names.index("os.py"), names.index("json/decoder.py"),
           names.index("re/_casefix.py"), names.index("shlex.py")]
  texts = [stdlib_corpus.documents[i] for i in picks]
  encoded = tokenizer.encode(texts)
  for text, ids in zip(texts, encoded):
    assert ids.dtype == np.int32 and ids.ndim == 1
    assert tokenizer.decode(ids) == text
    assert tokenizer.unk_id not in ids
    assert tokenizer.bos_id not in ids and tokenizer.eos_id not in ids
  # Whitespace survives: leading spaces, tabs, blank lines, trailing newline, non-ASCII.
  tricky = "  x = 1\n\n\tif y:\n        z  =  'é ü 日本'  \n"
  assert tokenizer.decode(tokenizer.encode([tricky])[0]) == tricky
  assert tokenizer.decode(np.asarray(tokenizer.encode([" lead"])[0])) == " lead"


def test_encode_rejects_a_bare_string(tokenizer):
  with pytest.raises(TypeError, match="list"):
    tokenizer.encode("hello")


def test_word_start_mask(tokenizer):
  mask = tokenizer.word_start_mask()
  assert mask.shape == (tokenizer.vocab_size,) and mask.dtype == bool
  for i in range(tokenizer.vocab_size):
    if tokenizer.id_to_piece(i).startswith("\u2581"):
      assert mask[i]
  assert mask[tokenizer.piece_to_id("\n")]
  assert not mask[tokenizer.piece_to_id("<0x41>")]
  assert 0 < mask.sum() < tokenizer.vocab_size
  ids = tokenizer.encode(["import os\nimport sys\n"])[0]
  words = [tokenizer.id_to_piece(i) for i in ids if mask[i]]
  assert any(w.startswith("\u2581os") or w == "\u2581" for w in words)


def test_training_is_deterministic(tokenizer, small_corpus, tmp_path):
  again = Tokenizer.train(small_corpus.documents, SMALL_VOCAB, str(tmp_path / "t.model"), seed=0,
                          max_bytes=TRAIN_BYTES)
  assert again.model_proto == tokenizer.model_proto
  with open(tmp_path / "t.model", "rb") as f:
    assert f.read() == tokenizer.model_proto


def test_too_small_vocab_is_a_clear_error(small_corpus):
  with pytest.raises(ValueError, match="data.vocab_size"):
    Tokenizer.train(small_corpus.documents[:10], 200, None)
  with pytest.raises(ValueError, match="data.vocab_size"):
    Tokenizer.train(["tiny corpus"], 5000, None)


def test_documents_of_one_long_line_train_the_tokenizer():
  """JSON-lines paragraphs and text without newlines are one line each: lines longer than
  SentencePiece's default sentence limit (4192 bytes, dropped silently) are cut into pieces, so
  their words are learned and a corpus of only such lines trains."""
  words = ["habitat", "forest", "river", "mountain", "valley", "meadow", "glacier", "canyon"]
  rng = np.random.default_rng(0)
  documents = [" ".join(rng.choice(words, size=900)) for _ in range(60)]  # ~6.5 kB, no newline
  assert min(len(d.encode()) for d in documents) > 4192
  tokenizer = Tokenizer.train(documents, 400, None)
  assert tokenizer.encode(["habitat"])[0].size == 1  # the word is one learned piece


def test_the_tokenizer_sample_spans_a_multibyte_corpus():
  """The stride over documents counts UTF-8 bytes like the budget does: with CJK text first and
  English after, both are sampled (a stride in characters ran out of bytes before the English)."""
  from tfx.data.tokenizer import _training_lines

  chinese = ["语言模型的训练数据" * 50] * 100  # 1350 bytes each
  english = ["language model training data " * 15] * 100  # 450 bytes each
  sample = list(_training_lines(chinese + english, max_bytes=100_000))
  assert sum(line.startswith("language") for line in sample) >= 40
  assert sum(len(line.encode()) for line in sample) <= 100_000


def test_load_missing_file_is_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="data.tokenizer"):
    Tokenizer.load(str(tmp_path / "missing.model"))
  with pytest.raises(FileNotFoundError, match="missing.model"):
    build_tokenizer(str(tmp_path / "missing.model"), Corpus(["x"], ["x"]), 1000, None)


def test_build_tokenizer_trains_then_resumes(tmp_path, tokenizer, small_corpus, monkeypatch):
  workdir = str(tmp_path / "run")
  built = build_tokenizer("", small_corpus, SMALL_VOCAB, workdir, max_bytes=TRAIN_BYTES)
  path = os.path.join(workdir, "tokenizer.model")
  assert os.path.isfile(path)
  assert built.model_proto == tokenizer.model_proto

  def no_training(*args, **kwargs):
    raise AssertionError("must load, not train")

  monkeypatch.setattr(Tokenizer, "train", no_training)
  resumed = build_tokenizer("", small_corpus, SMALL_VOCAB, workdir, max_bytes=TRAIN_BYTES)
  assert resumed.model_proto == built.model_proto
  explicit = build_tokenizer(path, small_corpus, 12345, None)
  assert explicit.model_proto == built.model_proto
