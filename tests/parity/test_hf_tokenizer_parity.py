"""tfx's Hugging Face tokenizer backend against transformers' fast tokenizers.

Tiny vocabularies trained here (tests/hf_vocabs.py, no downloads) are saved the way BERT, GPT-2 and
RoBERTa checkpoints ship them (vocab.txt; vocab.json + merges.txt; with and without
tokenizer_config.json / special_tokens_map.json). transformers' BertTokenizerFast, GPT2TokenizerFast
and RobertaTokenizerFast load each directory with `from_pretrained` (in transformers 5,
`BertTokenizerFast(vocab_file=...)` no longer reads the file: it builds a 5-token vocabulary), and
tfx's `load_tokenizer` must give the same ids (add_special_tokens=False) and the same special ids.
The directories those tokenizers `save_pretrained` must load in tfx with the same ids too.

Needs transformers (`make test-parity`); skipped without it.
"""

import os

import pytest

transformers = pytest.importorskip("transformers")

from tests import hf_vocabs as V  # noqa: E402
from tfx.data.tokenizer import load_tokenizer, tokenizer_from_bytes  # noqa: E402

ROLES = ("cls", "sep", "mask", "pad", "unk")
# " <mask>" with lstrip as roberta-base's special_tokens_map.json has it: the space joins the mask.
ROBERTA_MAP = {"mask_token": {"content": "<mask>", "lstrip": True, "rstrip": False, "normalized": False,
                              "single_word": False}, "bos_token": "<s>", "eos_token": "</s>"}
CASES = {
    # name: (transformers class, trained vocabulary, tokenizer_config.json, special_tokens_map.json)
    "bert-uncased": ("BertTokenizerFast", "wordpiece", None, None),
    "bert-cased": ("BertTokenizerFast", "wordpiece", {"do_lower_case": False}, None),
    "bert-keep-accents": ("BertTokenizerFast", "wordpiece", {"do_lower_case": True, "strip_accents": False,
                                                             "tokenize_chinese_chars": False}, None),
    "gpt2": ("GPT2TokenizerFast", "gpt2", None, None),
    "gpt2-prefix-space": ("GPT2TokenizerFast", "gpt2", {"add_prefix_space": True}, None),
    "roberta": ("RobertaTokenizerFast", "roberta", None, None),
    "roberta-lstrip-mask": ("RobertaTokenizerFast", "roberta", {"add_prefix_space": False}, ROBERTA_MAP),
}
TEXTS = V.SAMPLE_TEXTS + [" <mask> and <mask>", "a [MASK]b [mask] c", "<|endoftext|><|endoftext|> x"]


@pytest.fixture(scope="module")
def vocabularies():
  return {"wordpiece": V.wordpiece(), "gpt2": V.byte_level(V.GPT2_SPECIALS),
          "roberta": V.byte_level(V.ROBERTA_SPECIALS)}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, vocabularies, tmp_path_factory):
  """(name, directory with the vocabulary files, the transformers tokenizer loaded from it)."""
  class_name, vocabulary, config, special_tokens_map = CASES[request.param]
  directory = V.save_vocab(vocabularies[vocabulary], str(tmp_path_factory.mktemp(request.param)), config,
                           special_tokens_map)
  reference = getattr(transformers, class_name).from_pretrained(directory)
  return request.param, directory, reference


def hf_ids(reference, texts=TEXTS) -> list[list[int]]:
  return [reference(t, add_special_tokens=False)["input_ids"] for t in texts]


def tfx_ids(tok, texts=TEXTS) -> list[list[int]]:
  return [ids.tolist() for ids in tok.encode(texts)]


def check_special_ids(tok, reference) -> None:
  for role in ROLES:
    assert getattr(tok, f"{role}_id") == getattr(reference, f"{role}_token_id"), role
  # tfx's eos / bos fall back to sep / cls when the tokenizer has none (BERT).
  eos, bos = reference.eos_token_id, reference.bos_token_id
  assert tok.eos_id == (eos if eos is not None else reference.sep_token_id)
  assert tok.bos_id == (bos if bos is not None else reference.cls_token_id)
  assert set(tok.special_ids) == set(reference.all_special_ids)


def test_vocabulary_files_tokenize_as_transformers(case):
  name, directory, reference = case
  tok = load_tokenizer(directory)
  assert tfx_ids(tok) == hf_ids(reference), name
  assert tok.vocab_size == len(reference)
  check_special_ids(tok, reference)
  for ids in hf_ids(reference):
    assert tok.decode(ids) == reference.decode(ids, skip_special_tokens=True)
  assert tfx_ids(tokenizer_from_bytes(tok.model_proto)) == hf_ids(reference)


def test_save_pretrained_directories_load_in_tfx(case, tmp_path):
  name, _, reference = case
  reference.save_pretrained(str(tmp_path))
  assert os.path.exists(tmp_path / "tokenizer.json"), os.listdir(tmp_path)
  tok = load_tokenizer(str(tmp_path))
  assert tfx_ids(tok) == hf_ids(reference), name
  check_special_ids(tok, reference)
  again = type(reference).from_pretrained(str(tmp_path))  # the saved directory, read back by transformers
  assert hf_ids(again) == hf_ids(reference)
