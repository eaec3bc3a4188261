"""From a published-style checkpoint to a result and back, as a researcher does it.

A small random HF BERT (WordPiece) and GPT-2 (byte-level BPE), each saved with its fast
tokenizer the way hub checkpoints ship them, are imported with `--verify` (the tokenizer comes
along with no flag), trained for a few steps on a text corpus (masked LM / causal LM), sampled
from (GPT-2), exported with `--verify`, and re-imported with `--verify`. The tokenizer tfx uses
tokenizes exactly as HF's fast tokenizer at every stage.
"""

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests import hf_vocabs  # noqa: E402
from tfx import convert, generate, train  # noqa: E402
from tfx.data.tokenizer import load_tokenizer  # noqa: E402

TEXT = ("The quick brown fox jumps over the lazy dog. Café naïve résumé.\n"
        "def tokenize(texts): return [encode(t) for t in texts]  # 東京\n")


def _corpus(tmp_path) -> str:
  rng = np.random.default_rng(0)
  words = TEXT.replace("\n", " ").split()
  path = tmp_path / "corpus.jsonl"
  with open(path, "w") as f:
    for _ in range(120):
      f.write(json.dumps({"text": " ".join(rng.choice(words, size=int(rng.integers(8, 40))))}) + "\n")
  return f"text:{path}"


def _perturbed(model):
  g = torch.Generator().manual_seed(1)
  with torch.no_grad():
    for p in model.parameters():
      p.add_(torch.randn(p.shape, generator=g) * 0.05)
  return model.eval()


def _same_ids(tfx_tok, hf_tok) -> None:
  want = hf_tok(TEXT, add_special_tokens=False)["input_ids"]
  assert tfx_tok.encode([TEXT])[0].tolist() == want


def _train_args(run: str, source: str, steps: int) -> list[str]:
  return ["--config", os.path.join(run, "config.py"), "--workdir", run, f"--config.train.steps={steps}",
          f"--config.data.source={source}", "--config.train.batch_size=4", "--config.train.log_every=1",
          "--config.train.eval_every=2", "--config.train.checkpoint_every=2", "--config.data.eval_batches=1",
          "--config.optim.warmup_steps=1"]


def _losses(run: str) -> list[float]:
  with open(os.path.join(run, "metrics.jsonl")) as f:
    return [r["loss"] for r in map(json.loads, f) if r.get("split") == "train" and "loss" in r]


def _roundtrip(tmp_path, src: str, hf_cls, capsys) -> tuple[str, str]:
  """--from-hf --verify, then returns (run, its tokenizer path)."""
  run = str(tmp_path / "run")
  convert.main(["--from-hf", src, "--workdir", run, "--verify"])
  out = capsys.readouterr().out
  assert "verify: max relative logit error" in out and "tokenizer.hf.json" in out, out
  with open(os.path.join(run, "config.json")) as f:
    tok_path = json.load(f)["data"]["tokenizer"]
  assert tok_path.endswith("tokenizer.hf.json") and os.path.isfile(tok_path)
  return run, tok_path


def _export_and_reimport(tmp_path, run: str, hf_cls, capsys) -> None:
  out_dir = str(tmp_path / "exported")
  convert.main(["--to-hf", out_dir, "--workdir", run, "--verify"])
  printed = capsys.readouterr().out
  assert "verify: max relative logit error" in printed and "tokenizer.json" in printed
  hf_cls.from_pretrained(out_dir)  # loads in transformers
  _same_ids(load_tokenizer(out_dir), transformers.AutoTokenizer.from_pretrained(out_dir))
  convert.main(["--from-hf", out_dir, "--workdir", str(tmp_path / "reimported"), "--verify"])
  assert "verify: max relative logit error" in capsys.readouterr().out


@pytest.mark.slow
def test_bert_with_its_wordpiece_tokenizer(tmp_path, capsys):
  src = str(tmp_path / "bert")
  hf_vocabs.save_vocab(hf_vocabs.wordpiece(300), src)
  hf_tok = transformers.BertTokenizerFast.from_pretrained(src)  # reads vocab.txt
  hf_tok.save_pretrained(src)  # tokenizer.json, vocab.txt, special_tokens_map.json, tokenizer_config.json
  hf = _perturbed(transformers.BertForMaskedLM(transformers.BertConfig(
      vocab_size=len(hf_tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
      max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)))
  hf.save_pretrained(src)

  run, tok_path = _roundtrip(tmp_path, src, transformers.BertForMaskedLM, capsys)
  tok = load_tokenizer(tok_path)
  _same_ids(tok, hf_tok)
  assert (tok.mask_id, tok.cls_id, tok.sep_id, tok.pad_id) == (
      hf_tok.mask_token_id, hf_tok.cls_token_id, hf_tok.sep_token_id, hf_tok.pad_token_id)

  train.main(_train_args(run, _corpus(tmp_path), steps=4))  # masked LM, the imported config's objective
  losses = _losses(run)
  assert len(losses) == 4 and all(np.isfinite(losses))
  _export_and_reimport(tmp_path, run, transformers.BertForMaskedLM, capsys)


@pytest.mark.slow
def test_gpt2_with_its_byte_level_bpe(tmp_path, capsys):
  src = str(tmp_path / "gpt2")
  hf_vocabs.save_vocab(hf_vocabs.byte_level(hf_vocabs.GPT2_SPECIALS, 400), src)
  hf_tok = transformers.GPT2TokenizerFast.from_pretrained(src)  # reads vocab.json + merges.txt
  hf_tok.save_pretrained(src)
  eot = hf_tok.convert_tokens_to_ids("<|endoftext|>")
  hf = _perturbed(transformers.GPT2LMHeadModel(transformers.GPT2Config(
      vocab_size=len(hf_tok), n_embd=32, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
      attn_pdrop=0.0, bos_token_id=eot, eos_token_id=eot)))
  hf.save_pretrained(src)

  run, tok_path = _roundtrip(tmp_path, src, transformers.GPT2LMHeadModel, capsys)
  tok = load_tokenizer(tok_path)
  _same_ids(tok, hf_tok)
  assert tok.eos_id == tok.bos_id == eot

  train.main(_train_args(run, _corpus(tmp_path), steps=4))  # causal LM
  assert all(np.isfinite(_losses(run)))
  generate.main(["--workdir", run, "--prompt", "The quick", "--max-new-tokens", "6", "--temperature", "0"])
  sample = capsys.readouterr().out
  assert sample.strip(), "no sample printed"
  _export_and_reimport(tmp_path, run, transformers.GPT2LMHeadModel, capsys)
