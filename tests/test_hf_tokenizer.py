"""Hugging Face tokenizers as tfx's second backend: the ids of the `tokenizers` library, roles, word
starts, the saved form, the errors, and training runs with a WordPiece and a byte-level BPE tokenizer.

The references are `tokenizers.Tokenizer` objects built here (tests/hf_vocabs.py); transformers is
compared with in tests/parity/test_hf_tokenizer_parity.py.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer as RustTokenizer, models, normalizers, pre_tokenizers

from tests import hf_vocabs as V
from tests.conftest import ROOT, tiny_config
from tfx.data import store
from tfx.data.hf_tokenizer import FILENAME, FORMAT, HFTokenizer
from tfx.data.prepare import prepare
from tfx.data.tokenizer import Tokenizer, fit_vocab_size, load_tokenizer, tokenizer_from_bytes
from tfx.errors import DataError


def reference_ids(reference: RustTokenizer, texts=V.SAMPLE_TEXTS) -> list[list[int]]:
  return [e.ids for e in reference.encode_batch(texts, add_special_tokens=False)]


def tfx_ids(tok, texts=V.SAMPLE_TEXTS) -> list[list[int]]:
  out = tok.encode(texts)
  assert all(a.dtype == np.int32 and a.ndim == 1 for a in out)
  return [a.tolist() for a in out]


@pytest.fixture(scope="module")
def wordpiece():
  return V.wordpiece()


@pytest.fixture(scope="module")
def gpt2():
  return V.byte_level(V.GPT2_SPECIALS)


@pytest.fixture(scope="module")
def roberta():
  return V.byte_level(V.ROBERTA_SPECIALS)


@pytest.fixture(scope="module")
def bert_dir(wordpiece, tmp_path_factory):
  """vocab.txt with the tokenizer_config.json BERT-uncased ships."""
  return V.save_vocab(wordpiece, str(tmp_path_factory.mktemp("bert")), {"do_lower_case": True})


@pytest.fixture(scope="module")
def gpt2_dir(gpt2, tmp_path_factory):
  return V.save_vocab(gpt2, str(tmp_path_factory.mktemp("gpt2")))


@pytest.fixture(scope="module")
def roberta_dir(roberta, tmp_path_factory):
  return V.save_vocab(roberta, str(tmp_path_factory.mktemp("roberta")))


# ============================================================================ the ids


def test_vocab_txt_gives_the_wordpiece_ids(wordpiece, bert_dir):
  expected = reference_ids(wordpiece)
  assert any(V.BERT_SPECIALS.index("[UNK]") in ids for ids in expected)  # unknown characters are exercised
  for path in (bert_dir, os.path.join(bert_dir, "vocab.txt")):
    tok = load_tokenizer(path)
    assert isinstance(tok, HFTokenizer)
    assert tfx_ids(tok) == expected
    assert tok.vocab_size == wordpiece.get_vocab_size()


def test_vocab_txt_options_come_from_tokenizer_config(wordpiece, tmp_path):
  """Cased, accents kept, no CJK splitting: the pipeline follows tokenizer_config.json."""
  directory = V.save_vocab(wordpiece, str(tmp_path), {"do_lower_case": False, "strip_accents": False,
                                                      "tokenize_chinese_chars": False})
  reference = RustTokenizer(models.WordPiece.from_file(os.path.join(directory, "vocab.txt"), unk_token="[UNK]"))
  reference.normalizer = normalizers.BertNormalizer(lowercase=False, strip_accents=False, handle_chinese_chars=False)
  reference.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
  reference.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in V.BERT_SPECIALS])
  expected = reference_ids(reference)
  assert expected != reference_ids(V.wordpiece())
  assert tfx_ids(load_tokenizer(directory)) == expected


@pytest.mark.parametrize("name", ["gpt2", "roberta"])
def test_vocab_json_and_merges_give_the_byte_level_ids(name, request):
  reference, directory = request.getfixturevalue(name), request.getfixturevalue(f"{name}_dir")
  for path in (directory, os.path.join(directory, "vocab.json")):
    tok = load_tokenizer(path)
    assert tfx_ids(tok) == reference_ids(reference)
    assert tok.decode(tok.encode([V.SAMPLE_TEXTS[2]])[0]) == V.SAMPLE_TEXTS[2]  # byte-level is lossless


def test_add_prefix_space_comes_from_tokenizer_config(gpt2, tmp_path):
  directory = V.save_vocab(gpt2, str(tmp_path), {"add_prefix_space": True})
  reference = RustTokenizer(models.BPE.from_file(os.path.join(directory, "vocab.json"),
                                                 os.path.join(directory, "merges.txt")))
  reference.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
  reference.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
  assert reference_ids(reference) != reference_ids(gpt2)
  assert tfx_ids(load_tokenizer(directory)) == reference_ids(reference)


def test_megatron_style_file_names(gpt2, gpt2_dir, tmp_path):
  """gpt2-vocab.json finds gpt2-merges.txt beside it."""
  shutil.copy(os.path.join(gpt2_dir, "vocab.json"), tmp_path / "gpt2-vocab.json")
  shutil.copy(os.path.join(gpt2_dir, "merges.txt"), tmp_path / "gpt2-merges.txt")
  assert tfx_ids(load_tokenizer(str(tmp_path / "gpt2-vocab.json"))) == reference_ids(gpt2)


@pytest.mark.parametrize("name", ["wordpiece", "gpt2", "roberta"])
def test_tokenizer_json_gives_the_same_ids(name, request, tmp_path):
  reference = request.getfixturevalue(name)
  directory = V.save_tokenizer_json(reference, str(tmp_path))
  for path in (directory, os.path.join(directory, "tokenizer.json")):
    assert tfx_ids(load_tokenizer(path)) == reference_ids(reference)


def test_a_directory_prefers_tokenizer_json(wordpiece, gpt2, tmp_path):
  """tokenizer.json beats vocab.txt (a BERT checkpoint ships both; here they disagree on purpose)."""
  V.save_vocab(wordpiece, str(tmp_path))
  V.save_tokenizer_json(gpt2, str(tmp_path))
  assert tfx_ids(load_tokenizer(str(tmp_path))) == reference_ids(gpt2)


def test_encode_decode_basics(bert_dir):
  tok = load_tokenizer(bert_dir)
  with pytest.raises(TypeError, match="list"):
    tok.encode("hello")
  with pytest.raises(ValueError, match="one sequence"):
    tok.decode(np.zeros((2, 3), np.int32))
  ids = tok.encode(["The quick brown fox jumps."])[0]
  assert tok.decode(ids) == "the quick brown fox jumps."
  assert tok.decode(np.concatenate([[tok.cls_id], ids, [tok.sep_id, tok.pad_id]])) == tok.decode(ids)  # specials skipped
  assert tok.id_to_piece(tok.mask_id) == "[MASK]" and tok.piece_to_id("[MASK]") == tok.mask_id
  assert tok.piece_to_id("no such token") is None


def test_sentinels_survive_decode_as_with_sentencepiece(tmp_path):
  """A T5-style tokenizer.json (its <extra_id_k> are special added tokens): decode keeps the
  sentinels (a span-corruption target reads as its spans) and drops only pad and eos."""
  from tokenizers import decoders, trainers

  rust = RustTokenizer(models.Unigram())
  rust.pre_tokenizer, rust.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
  rust.train_from_iterator(V.CORPUS, trainers.UnigramTrainer(vocab_size=300, special_tokens=["<pad>", "</s>", "<unk>"],
                                                             unk_token="<unk>", show_progress=False))
  rust.add_special_tokens([AddedToken(f"<extra_id_{k}>", special=True) for k in range(99, -1, -1)])
  rust.save(str(tmp_path / "tokenizer.json"))
  tok = load_tokenizer(str(tmp_path))
  text = "the model <extra_id_0> every piece <extra_id_1> evaluation"
  ids = tok.encode([text])[0]
  assert {tok.sentinel_ids[0], tok.sentinel_ids[1]} <= set(ids.tolist())
  assert tok.decode(np.concatenate([ids, [tok.eos_id, tok.pad_id]])) == text
  with pytest.raises(IndexError):
    tok.id_to_piece(tok.vocab_size)


# ============================================================================ special tokens


def test_bert_roles(wordpiece, bert_dir):
  tok = load_tokenizer(bert_dir)
  ids = {t: wordpiece.token_to_id(t) for t in V.BERT_SPECIALS}
  assert (tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id) == tuple(ids.values())
  assert tok.eos_id == tok.sep_id and tok.bos_id == tok.cls_id  # no eos / bos: [SEP] ends, [CLS] starts
  assert tok.sentinel_ids == ()
  assert tok.special_ids == tuple(sorted(ids.values()))
  assert tok.encode(["a [MASK] b"])[0].tolist().count(tok.mask_id) == 1  # special tokens are matched whole


def test_gpt2_roles(gpt2_dir):
  tok = load_tokenizer(gpt2_dir)
  end = tok.piece_to_id("<|endoftext|>")
  assert tok.bos_id == tok.eos_id == tok.unk_id == end
  assert (tok.pad_id, tok.mask_id, tok.cls_id, tok.sep_id) == (None,) * 4
  assert tok.special_ids == (end,)


def test_roberta_roles(roberta, roberta_dir):
  tok = load_tokenizer(roberta_dir)
  get = roberta.token_to_id
  assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.unk_id, tok.mask_id) == (get("<s>"), get("</s>"), get("<pad>"),
                                                                           get("<unk>"), get("<mask>"))
  assert (tok.cls_id, tok.sep_id) == (get("<s>"), get("</s>"))


def test_roles_from_config_files(roberta, tmp_path):
  """special_tokens_map.json wins over tokenizer_config.json; dict values; null removes a role; a role
  token missing from the vocabulary is added with the next id, as transformers does."""
  directory = V.save_vocab(
      roberta, str(tmp_path), config={"eos_token": "<unk>", "mask_token": None, "pad_token": "<pad>"},
      special_tokens_map={"eos_token": {"content": "</s>", "lstrip": False}, "pad_token": "<my-pad>",
                          "additional_special_tokens": ["<extra_id_0>", "<extra_id_1>"]})
  tok = load_tokenizer(directory)
  n = roberta.get_vocab_size()
  assert tok.eos_id == roberta.token_to_id("</s>")
  assert tok.mask_id is None
  assert tok.pad_id == n and tok.id_to_piece(n) == "<my-pad>"
  assert tok.sentinel_ids == (n + 1, n + 2)
  assert tok.vocab_size == n + 3
  assert {n, n + 1, n + 2} <= set(tok.special_ids)
  assert tok.encode(["a<extra_id_1>b"])[0].tolist().count(n + 2) == 1


def test_vocab_json_family_follows_tokenizer_class(roberta, tmp_path):
  """A RoBERTa-looking vocabulary that tokenizer_config.json calls GPT-2's gets GPT-2's roles
  (<|endoftext|>, added with the next id, as GPT2TokenizerFast does)."""
  tok = load_tokenizer(V.save_vocab(roberta, str(tmp_path), {"tokenizer_class": "GPT2Tokenizer"}))
  n = roberta.get_vocab_size()
  assert tok.bos_id == tok.eos_id == tok.unk_id == n and tok.mask_id is None and tok.vocab_size == n + 1


def test_tokenizer_json_roles_by_convention_and_config(wordpiece, tmp_path):
  plain = load_tokenizer(V.save_tokenizer_json(wordpiece, str(tmp_path / "plain")))
  assert (plain.cls_id, plain.sep_id, plain.mask_id) == (2, 3, 4)
  configured = load_tokenizer(V.save_tokenizer_json(wordpiece, str(tmp_path / "configured"),
                                                    config={"eos_token": "[PAD]", "sep_token": None}))
  assert configured.eos_id == 0 and configured.sep_id is None and configured.cls_id == 2


# ============================================================================ word starts


def test_wordpiece_word_starts(bert_dir):
  tok = load_tokenizer(bert_dir)
  mask = tok.word_start_mask()
  assert mask.shape == (tok.vocab_size,) and mask.dtype == bool
  for i in range(tok.vocab_size):
    piece = tok.id_to_piece(i)
    assert mask[i] == (not piece.startswith("##") or i in tok.special_ids), piece
  ids = tok.encode(["unbelievable tokenizer"])[0]
  words = "".join(("|" if mask[i] else "") + tok.id_to_piece(i).removeprefix("##") for i in ids)
  assert words == "|unbelievable|tokenizer"


def test_byte_level_word_starts(gpt2_dir):
  tok = load_tokenizer(gpt2_dir)
  mask = tok.word_start_mask()
  for i in range(tok.vocab_size):
    piece = tok.id_to_piece(i)
    starts = piece.startswith(("\u0120", "\u0109")) or "\u010a" in piece or i in tok.special_ids
    assert mask[i] == starts, piece
  assert mask[tok.piece_to_id("\u010a")]  # "\n"
  words: list[str] = []
  for i in tok.encode(["the model learns\nevery piece"])[0]:
    if mask[i] or not words:
      words.append("")
    words[-1] += tok.decode([i])
  assert words == ["the", " model", " learns", "\nevery", " piece"]  # a line's first word joins its newline


def test_padded_rows_are_not_word_starts(bert_dir):
  tok = load_tokenizer(bert_dir).with_vocab_size(512)
  mask = tok.word_start_mask()
  assert mask.shape == (512,) and not mask[tok.num_ids:].any()
  assert tok.id_to_piece(511) == "" and tok.decode([5, 511]) == tok.decode([5])


# ============================================================================ the saved form


@pytest.mark.parametrize("name", ["bert_dir", "gpt2_dir", "roberta_dir"])
def test_saved_form_roundtrip(name, request, tmp_path):
  directory = request.getfixturevalue(name)
  tok = load_tokenizer(directory)
  blob = tok.model_proto
  saved = json.loads(blob)
  assert saved["format"] == FORMAT and saved["special_tokens"] == tok.special_tokens
  assert "vocab_size" not in saved and saved["tokenizer"]["model"]["type"] in ("WordPiece", "BPE")
  assert load_tokenizer(directory).model_proto == blob  # deterministic
  again = tokenizer_from_bytes(blob, path="x")
  assert isinstance(again, HFTokenizer) and again.model_proto == blob
  assert tfx_ids(again) == tfx_ids(tok)
  assert (again.special_ids, again.eos_id, again.bos_id, again.vocab_size) == (tok.special_ids, tok.eos_id,
                                                                               tok.bos_id, tok.vocab_size)
  assert (again.word_start_mask() == tok.word_start_mask()).all()
  assert HFTokenizer(again.tokenizer, again.special_tokens).model_proto == blob  # re-serialising is stable
  (tmp_path / tok.filename).write_bytes(blob)
  for path in (tmp_path / tok.filename, tmp_path):
    assert load_tokenizer(str(path)).model_proto == blob
  padded = tok.with_vocab_size(tok.vocab_size + 9)
  assert json.loads(padded.model_proto)["vocab_size"] == tok.vocab_size + 9
  assert tokenizer_from_bytes(padded.model_proto).vocab_size == tok.vocab_size + 9


def test_sentencepiece_still_dispatches(shared_tokenizer, tmp_path):
  sp = load_tokenizer(shared_tokenizer)
  assert isinstance(sp, Tokenizer) and sp.filename == "tokenizer.model"
  assert sp.model_proto == open(shared_tokenizer, "rb").read()
  assert isinstance(tokenizer_from_bytes(sp.model_proto), Tokenizer)
  assert fit_vocab_size(sp, 12345) is sp  # a SentencePiece model's pieces are the rows
  shutil.copy(shared_tokenizer, tmp_path / "spiece.model")
  assert load_tokenizer(str(tmp_path)).model_proto == sp.model_proto


def test_gs_paths(bert_dir, gpt2_dir):
  """vocab.txt and vocab.json + merges.txt directories on gs:// (a local GCS emulator) give the local ids."""
  from tests.gcs_emulator import start_emulator

  code = (
      "import json, os, sys\n"
      "from etils import epath\n"
      "from tfx.data.tokenizer import load_tokenizer\n"
      "out = []\n"
      "for local, remote in json.loads(sys.argv[1]):\n"
      "  for name in os.listdir(local):\n"
      "    (epath.Path(remote) / name).write_bytes(open(os.path.join(local, name), 'rb').read())\n"
      "  out.append([ids.tolist() for ids in load_tokenizer(remote).encode(json.loads(sys.argv[2]))])\n"
      "print(json.dumps(out))\n")
  pairs = [(bert_dir, "gs://tfx-test/bert"), (gpt2_dir, "gs://tfx-test/gpt2/")]
  with start_emulator("tfx-test") as env:
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(pairs), json.dumps(V.SAMPLE_TEXTS)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, **env})
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert json.loads(proc.stdout) == [tfx_ids(load_tokenizer(bert_dir)), tfx_ids(load_tokenizer(gpt2_dir))]


# ============================================================================ errors


def test_errors_say_what_to_do(gpt2_dir, bert_dir, tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist.*tokenizer.json"):
    load_tokenizer(str(tmp_path / "nope"))
  (tmp_path / "empty").mkdir()
  (tmp_path / "empty" / "README.md").write_text("hi")
  with pytest.raises(ValueError, match="holds no tokenizer.*README.md.*vocab.txt"):
    load_tokenizer(str(tmp_path / "empty"))
  (tmp_path / "config.json").write_text('{"hidden_size": 8, "model_type": "bert"}')
  with pytest.raises(ValueError, match="not a tokenizer"):
    load_tokenizer(str(tmp_path / "config.json"))
  (tmp_path / "notes.bin").write_bytes(b"\x00\x01 not a model")
  with pytest.raises(ValueError, match="neither a SentencePiece model.*vocab.json"):
    load_tokenizer(str(tmp_path / "notes.bin"))
  lonely = tmp_path / "lonely"
  lonely.mkdir()
  shutil.copy(os.path.join(gpt2_dir, "vocab.json"), lonely / "vocab.json")
  with pytest.raises(FileNotFoundError, match="no merges.txt beside it"):
    load_tokenizer(str(lonely))
  with pytest.raises(ValueError, match="merges file"):
    load_tokenizer(os.path.join(gpt2_dir, "merges.txt"))
  with pytest.raises(ValueError, match="is not a tokenizer"):
    tokenizer_from_bytes(b"\x0a\x03garbage")
  with pytest.raises(ValueError, match="tfx-hf-tokenizer/9"):
    tokenizer_from_bytes(json.dumps({"format": "tfx-hf-tokenizer/9", "tokenizer": {}}).encode())
  tok = load_tokenizer(bert_dir)
  with pytest.raises(ValueError, match=f"has {tok.vocab_size} ids.*data.vocab_size=100.*data.vocab_size={tok.vocab_size}"):
    fit_vocab_size(tok, 100)


def test_no_eos_nor_sep_is_refused(gpt2, wordpiece, tmp_path):
  directory = V.save_vocab(gpt2, str(tmp_path / "a"), {"eos_token": None})
  with pytest.raises(ValueError, match="neither an eos nor a sep"):
    load_tokenizer(directory)
  bare = RustTokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
  with pytest.raises(ValueError, match="neither an eos nor a sep"):
    load_tokenizer(V.save_tokenizer_json(bare, str(tmp_path / "b")))
  with pytest.raises(ValueError, match="unknown token"):
    load_tokenizer(V.save_vocab(wordpiece, str(tmp_path / "c"), {"unk_token": "<nope>"}))


# ============================================================================ training runs


def quick(tokenizer: str, *overrides: str):
  return tiny_config(f"--config.data.tokenizer={tokenizer}", "--config.data.max_documents=30",
                     "--config.data.seq_len=32", "--config.train.steps=4", "--config.train.log_every=2",
                     "--config.train.eval_every=0", "--config.train.checkpoint_every=4", "--config.data.eval_batches=1",
                     "--config.data.prepare_workers=1", *overrides)


def check_run_records_tokenizer(workdir, tokenizer_path: str) -> HFTokenizer:
  """The store and the run keep tokenizer.hf.json, the manifest records it, load_trained reads it."""
  from tfx import train

  tok = load_tokenizer(tokenizer_path)
  (store_dir,) = (workdir / "data").iterdir()
  manifest = store.read_manifest(store_dir)
  assert manifest["tokenizer"] == {"file": FILENAME, "vocab_size": tok.vocab_size,
                                   "sha256": store.sha256_bytes(tok.model_proto)}
  assert (store_dir / FILENAME).read_bytes() == tok.model_proto == (workdir / FILENAME).read_bytes()
  assert not (workdir / "tokenizer.model").exists()
  config, loaded, model, _ = train.load_trained(str(workdir))
  assert model.cfg.vocab_size == config.data.vocab_size == loaded.vocab_size
  assert loaded.num_ids == tok.vocab_size and loaded.special_ids == tok.special_ids
  return loaded


def test_masked_lm_run_with_a_wordpiece_directory(bert_dir, tmp_path):
  """BERT-style: vocab.txt, masked_lm ([MASK], whole words from "##"), the table padded to 320 rows."""
  from tfx import train

  workdir = tmp_path / "run"
  config = quick(bert_dir, "--config.model.family=encoder", "--config.objective.name=masked_lm",
                 "--config.objective.whole_word=true", "--config.data.vocab_size=320")
  result = train.run(config, str(workdir))
  assert result["step"] == 4 and np.isfinite(result["last_eval"]["loss"])
  exp = result["experiment"]
  assert exp.objective.ids.mask == exp.tokenizer.mask_id and exp.objective.ids.vocab_size == 320
  check_run_records_tokenizer(workdir, bert_dir)
  ids = load_tokenizer(bert_dir).vocab_size
  with pytest.raises(DataError, match=f"data.vocab_size={ids} or more"):  # fewer rows than the tokenizer's ids
    train.build(quick(bert_dir, "--config.data.vocab_size=100"), str(tmp_path / "small"))


def test_causal_lm_run_with_byte_level_bpe_and_generate(gpt2_dir, tmp_path, capsys):
  """GPT-2-style: vocab.json + merges.txt, causal_lm (<|endoftext|> starts and ends), then tfx.generate."""
  from tfx import generate, train

  workdir = tmp_path / "run"
  vocab_json = os.path.join(gpt2_dir, "vocab.json")
  result = train.run(quick(vocab_json, "--config.data.vocab_size=400"), str(workdir))
  assert result["step"] == 4 and np.isfinite(result["last_eval"]["loss"])
  check_run_records_tokenizer(workdir, vocab_json)
  # The run's tokenizer.hf.json is a tokenizer in its own right (tfx.convert --from-hf points
  # data.tokenizer at such a copy): a store prepared with it has the same tokens.
  (first,) = (workdir / "data").iterdir()
  copy = prepare(quick(str(workdir / FILENAME)).data, tmp_path / "store", progress=False)
  assert copy["content_checksum"] == store.read_manifest(first)["content_checksum"]
  again = train.run(quick(vocab_json, "--config.data.vocab_size=400", "--config.train.steps=6"), str(workdir))
  assert again["step"] == 6  # resumed: same store, same tokenizer
  capsys.readouterr()
  generate.main(["--workdir", str(workdir), "--prompt", "def tokenize(", "--max-new-tokens", "5", "--num-samples", "2"])
  out = capsys.readouterr().out
  assert out.count("--- sample") == 2  # two decoded continuations (a 6-step model may well print blanks)
