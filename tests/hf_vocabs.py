"""Tiny Hugging Face vocabularies built with the `tokenizers` trainers (no network, no downloads).

`wordpiece()` is a BERT-uncased-style WordPiece pipeline, `byte_level(specials)` a GPT-2 / RoBERTa-style
byte-level BPE; both are `tokenizers.Tokenizer` objects (the references tfx's loader is compared with)
and `save_*` writes their vocabulary files the way BERT / GPT-2 / RoBERTa checkpoints ship them.
"""

from __future__ import annotations

import json
import os

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
GPT2_SPECIALS = ["<|endoftext|>"]
ROBERTA_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]

_PROSE = (
    "The quick brown fox jumps over the lazy dog. A tokenizer splits text into pieces; the model "
    "learns an embedding for every piece. Whole-word masking hides every piece of a word at once, "
    "so the model cannot guess the rest of a word from its first half. Training runs for many steps, "
    "and evaluation measures the loss on held-out documents."
)
_CODE = (
    "def tokenize(texts: list[str]) -> list[list[int]]:\n"
    "    \"\"\"Encodes every text.\"\"\"\n"
    "    return [encode(t) for t in texts]  # one list per text\n"
    "\n"
    "class Model:\n"
    "\tdef __init__(self, size=128):\n"
    "\t\tself.size = size * 2 ** 3\n"
    "if x >= 10 and y != 'abc':\n    print(f\"{x!r} {y:>8}\")\n"
)
_UNICODE = (
    "Café naïve résumé façade coöperate Ångström Zürich São Paulo München. "
    "Ünïcödé ÀÉÎÕÜ ñandú crème brûlée. "
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다. "
    "Emoji 😀🚀 and symbols — “quotes” ‘single’ … € £ ¥ © ™ ½ ∑ √ π."
)
CORPUS = [line for block in (_PROSE, _CODE, _UNICODE) for line in block.split("\n")] * 3

# Texts the tests tokenize: unicode, accents, newlines, tabs, code, CJK, special tokens in text,
# words the vocabulary has never seen, leading and repeated spaces, an empty text.
SAMPLE_TEXTS = [
    "Hello, World! The QUICK brown fox; unbelievable antidisestablishmentarianism.",
    "  leading spaces\n\ttabs\tand\r\nwindows newlines\n\n\nblank lines   trailing   ",
    "def f(x):\n    return {'a': [1, 2.5e-3, -7], \"b\": x ** 2}  # comment\n",
    "Café naïve résumé — ÉCOLE Ångström; Crème BRÛLÉE façade",
    "東京は日本の首都です。北京 서울 日本語のテキスト mixed 中文 and English",
    "emoji 😀🚀👍🏽 math ∑ √ π ≤ ≥ ≠ zero-width\u200bjoiner \u00a0nbsp",
    "[CLS] masked [MASK] word [SEP] [PAD] <s> roberta </s> <mask> <pad> <|endoftext|> gpt",
    "x",
    "",
]


def wordpiece(vocab_size: int = 300) -> Tokenizer:
  """A trained BERT-uncased-style WordPiece pipeline (special tokens [PAD] [UNK] [CLS] [SEP] [MASK] = 0..4)."""
  tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
  tok.normalizer = normalizers.BertNormalizer(lowercase=True)
  tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
  tok.decoder = decoders.WordPiece(prefix="##")
  tok.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=BERT_SPECIALS,
                                                            show_progress=False))
  return tok


def byte_level(specials: list[str], vocab_size: int = 400) -> Tokenizer:
  """A trained GPT-2 / RoBERTa-style byte-level BPE (no prefix space), with `specials` first."""
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  return tok


def save_vocab(tok: Tokenizer, directory: str, config: dict | None = None,
               special_tokens_map: dict | None = None) -> str:
  """Writes `vocab.txt` (WordPiece) or `vocab.json` + `merges.txt` (BPE), and the given JSON configs."""
  os.makedirs(directory, exist_ok=True)
  tok.model.save(directory)
  write_configs(directory, config, special_tokens_map)
  return directory


def save_tokenizer_json(tok: Tokenizer, directory: str, config: dict | None = None,
                        special_tokens_map: dict | None = None) -> str:
  """Writes `tokenizer.json` (and the given JSON configs)."""
  os.makedirs(directory, exist_ok=True)
  tok.save(os.path.join(directory, "tokenizer.json"))
  write_configs(directory, config, special_tokens_map)
  return directory


def write_configs(directory: str, config: dict | None = None, special_tokens_map: dict | None = None) -> None:
  for name, value in (("tokenizer_config.json", config), ("special_tokens_map.json", special_tokens_map)):
    if value is not None:
      with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
        json.dump(value, f)
