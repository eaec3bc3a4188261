"""BART text infilling (OBJECTIVES.md §3.2, tfx/objectives/text_infilling.py): the budget and the
span-length rule, Poisson(3) span lengths, one mask token per span and inserted masks, sentence
permutation, exact reconstruction, document isolation, padding, keys, information flow through the
real encoder-decoder, and configs/bart_tiny.py trained end to end with an exact resume."""

import functools
import math
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import ROOT
from tfx import flops
from tfx.objectives import SpecialIds, placeholder_ids
from tfx.objectives.causal_lm import shift_right_by_segment
from tfx.objectives.text_infilling import TextInfilling, infill, mask_budget, span_lengths
from tfx.registry import OBJECTIVES

VOCAB = 512
IDS = placeholder_ids(VOCAB)  # pad 0, eos 1, mask 4, specials 0..6, sentinels 412..511
END = 7  # the sentence end of these tests (tfx's tokenizer has "\n" there)
ORDINARY = np.arange(8, 400)


def packed_rows(rng, b, t, *, docs=(1, 3), end_rate=0.1, padded_rows=0.25):
  """[b, t] tokens and segment ids of packed documents, each ending in EOS unless the row cuts it;
  some rows end in padding. Sentence ends (END) at rate `end_rate`."""
  tokens = np.zeros((b, t), np.int32)
  seg = np.zeros((b, t), np.int32)
  for r in range(b):
    fill = t if rng.random() >= padded_rows else int(rng.integers(t // 2, t))
    k = int(rng.integers(docs[0], docs[1] + 1))
    cuts = sorted(rng.choice(np.arange(3, fill - 2), size=k - 1, replace=False).tolist()) if k > 1 else []
    bounds = [0, *cuts, fill]
    for d, (a, e) in enumerate(zip(bounds[:-1], bounds[1:]), start=1):
      tokens[r, a:e] = np.where(rng.random(e - a) < end_rate, END, rng.choice(ORDINARY, e - a))
      if e < t or rng.random() < 0.5:
        tokens[r, e - 1] = IDS.eos
      seg[r, a:e] = d
  return tokens, seg


def documents(seg):
  """[(row, start, end)] of every document (end = its last token)."""
  out = []
  for r in range(seg.shape[0]):
    for d in np.unique(seg[r][seg[r] > 0]):
      where = np.flatnonzero(seg[r] == d)
      out.append((r, int(where[0]), int(where[-1])))
  return out


@functools.cache
def jitted_infill(**kw):
  return jax.jit(lambda t, s, k: infill(t, s, k, ids=IDS, **kw))


def run_infill(tokens, seg, key, **kw):
  out = jitted_infill(**kw)(jnp.asarray(tokens), jnp.asarray(seg), key)
  return {k: np.asarray(v) for k, v in out.items()}


def test_registered_options_configs_and_checks():
  from tfx.config import load_config, validate

  assert OBJECTIVES.get("text_infilling") is TextInfilling and TextInfilling.families == ("encoder_decoder",)
  opts = {o.name: o for o in TextInfilling.options()}
  assert {"mask_ratio", "poisson_lambda", "random_ratio", "permute_sentences", "sentence_end_ids"} <= set(opts)
  assert all(o.doc for o in opts.values()) and opts["mask_ratio"].default == 0.3 and opts["permute_sentences"].default
  for name in ("bart_tiny.py", "bart_base.py"):
    config = load_config(os.path.join(ROOT, "configs", name))
    validate(config, num_devices=1)
    assert config.model.family == "encoder_decoder" and config.objective.name == "text_infilling"
  base = load_config(os.path.join(ROOT, "configs", "bart_base.py"))
  assert (base.model.num_layers, base.model.num_decoder_layers, base.model.d_model, base.model.d_ff) == (6, 6, 768, 3072)
  objective = TextInfilling.from_config(base.objective, IDS)
  assert objective.sentence_ends == (7,) and objective.raw_length(512) == 512
  from tfx.nn.layers import ModelConfig
  cfg = ModelConfig.from_config(base.model, vocab_size=50265, max_length=512)
  assert objective.train_flops_per_row(cfg, 512) == 3 * flops.seq2seq_forward_flops(cfg, 512, 512)
  for bad in ({"mask_ratio": 0.0}, {"poisson_lambda": 0.0}, {"random_ratio": 1.5}, {"sentence_end_ids": "x"},
              {"sentence_end_ids": "9999"}):
    with pytest.raises(ValueError):
      TextInfilling(IDS, **bad)
  with pytest.raises(ValueError, match="mask token"):
    TextInfilling(SpecialIds(vocab_size=VOCAB, pad=0, eos=1))


def test_budget_and_span_length_rule():
  np.testing.assert_array_equal(np.asarray(mask_budget(jnp.array([0, 1, 2, 3, 10, 11, 1000]), 0.3)),
                                [0, 1, 1, 1, 3, 4, 300])
  # One document of 12 tokens per row: body 11, budget 4.
  draws = jnp.array([[3, 0, 2, 5, 9, 9, 9, 9, 9, 9, 9, 9],   # 3, 0, then 2 cut to 1
                     [0, 0, 0, 0, 9, 9, 9, 9, 9, 9, 9, 9],   # at most 4 spans: the 4th takes the rest
                     [5, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1],   # one span cut to the budget
                     [1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0]])  # reaches the budget exactly
  start, end = jnp.zeros((4, 12), jnp.int32), jnp.full((4, 12), 11, jnp.int32)
  lengths, num = span_lengths(draws, start, end, jnp.full((4, 12), 4, jnp.int32))
  lengths, num = np.asarray(lengths), np.asarray(num)
  np.testing.assert_array_equal(num[:, 0], [3, 4, 1, 4])
  assert lengths[0, :4].tolist() == [3, 0, 1, 0] and lengths[1, :4].tolist() == [0, 0, 0, 4]
  assert lengths[2, :2].tolist() == [4, 0] and lengths[3, :4].tolist() == [1, 1, 1, 1]
  assert (lengths[:, 4:] == 0).all() and (lengths.sum(1) == 4).all()


def check_document(x, tokens, r, a, e, *, random_ok=False):
  """One document's encoder (unshuffled) against its raw tokens: every item is one encoder token,
  a span shows the mask (or a random ordinary id), kept tokens are the raw ones in order, the spans
  cover exactly the budget, the last token stays last. Returns the document's span lengths."""
  body = e - a
  budget = int(np.ceil(round(0.3 * body, 9)))
  doc = x["encoder_segment_ids"][r] == x["encoder_segment_ids"][r][x["encoder_source"][r] == e][0]
  enc, src = x["encoder_tokens"][r][doc], x["encoder_source"][r][doc]
  items = int(((x["item_length"][r, a:e] > 0) | x["is_span"][r, a:e]).sum())
  assert len(enc) == items + 1 and enc[-1] == tokens[r, e] and src[-1] == e
  c, spans, rebuilt = 0, [], []
  for j in range(items):
    if x["is_span"][r, a + j]:
      n = int(x["item_length"][r, a + j])
      spans.append(n)
      assert src[j] == -1 and (enc[j] == IDS.mask or (random_ok and enc[j] in ORDINARY)), enc[j]
      assert x["masked"][r, a + c:a + c + n].all()
      rebuilt += tokens[r, a + c:a + c + n].tolist()
      c += n
    else:
      assert x["item_length"][r, a + j] == 1 and src[j] == a + c and enc[j] == tokens[r, a + c]
      assert not x["masked"][r, a + c]
      rebuilt.append(int(enc[j]))
      c += 1
  assert c == body and rebuilt == tokens[r, a:e].tolist()  # the items rebuild the document exactly
  assert sum(spans) == budget == int(x["masked"][r, a:e + 1].sum()) and len(spans) == x["num_spans"][r, a]
  assert len(spans) <= max(budget, 0) and (len(spans) == 0 or spans[-1] > 0)
  return spans


def test_each_span_is_one_mask_insertions_and_reconstruction():
  tokens, seg = packed_rows(np.random.default_rng(0), 64, 96)
  x = run_infill(tokens, seg, jax.random.key(0), random_ratio=0.0, permute=False)
  zero = 0
  for r, a, e in documents(seg):
    spans = check_document(x, tokens, r, a, e)
    zero += spans.count(0)
    # nothing crosses a document: the encoder document shows only its own raw positions
    d = seg[r, a]
    src = x["encoder_source"][r][x["encoder_segment_ids"][r] == d]
    assert ((src == -1) | ((src >= a) & (src <= e))).all()
  assert zero > 0  # zero-length spans occur and are inserted masks
  real = x["encoder_segment_ids"] > 0
  assert (x["encoder_tokens"][~real] == IDS.pad).all() and (x["encoder_positions"][~real] == 0).all()
  assert not x["masked"][seg == 0].any() and real.sum(1).max() <= 96  # static: never longer than the row


def test_mask_ratio_poisson_lengths_and_random_ratio():
  """Over 2048 documents of 64 tokens: exactly ceil(0.3 · 63) = 19 masked per document; the first
  span of each document (a Poisson(3) draw, never cut at a budget of 19 but with p < 1e-5) follows
  Poisson(3); 10% of the spans show a random ordinary id."""
  b, t = 256, 128
  seg = np.repeat([[1] * 64 + [2] * 64], b, axis=0).astype(np.int32)
  rng = np.random.default_rng(1)
  tokens = rng.choice(ORDINARY, (b, t)).astype(np.int32)
  tokens[:, [63, 127]] = IDS.eos
  first, masked, spans, shown = [], 0, 0, 0
  for k in range(4):  # one compilation, four keys
    x = run_infill(tokens, seg, jax.random.key(10 + k), random_ratio=0.1, permute=False)
    masked += int(x["masked"].sum())
    for a in (0, 64):
      is_span = x["is_span"][:, a:a + 63]
      j = is_span.argmax(1)
      first += x["item_length"][np.arange(b), a + j].tolist()
    spans += int(x["is_span"].sum())
    enc_span = (x["encoder_source"] == -1) & (x["encoder_segment_ids"] > 0)
    shown += int((x["encoder_tokens"][enc_span] != IDS.mask).sum())
    assert not np.isin(x["encoder_tokens"][enc_span], [0, 1, 2, 3, 5, 6, *IDS.sentinels]).any()  # ordinary ids
  assert masked == 4 * b * 2 * 19 and abs(19 / 63 - 0.3) < 0.01
  first = np.asarray(first)
  assert abs(first.mean() - 3.0) < 0.15, first.mean()
  pmf = [math.exp(-3) * 3**k / math.factorial(k) for k in range(9)]
  emp = [(first == k).mean() for k in range(9)]
  assert max(abs(p - q) for p, q in zip(pmf, emp)) < 0.03, (emp, pmf)
  assert abs(shown / spans - 0.1) < 0.02, shown / spans


def split_sentences(tokens, source):
  """The sentences of an unshuffled encoder document body: cut after kept END tokens."""
  out, cur = [], []
  for tok, src in zip(tokens, source):
    cur.append((int(tok), int(src)))
    if tok == END and src >= 0:
      out.append(tuple(cur))
      cur = []
  return out + ([tuple(cur)] if cur else [])


def is_concatenation(seq, pieces):
  """Whether seq is the concatenation of all `pieces` in some order (backtracking)."""
  if not pieces:
    return not seq
  return any(seq[:len(p)] == p and is_concatenation(seq[len(p):], pieces[:i] + pieces[i + 1:])
             for i, p in enumerate(pieces) if len(p) <= len(seq))


def test_sentence_permutation_shuffles_whole_sentences():
  tokens, seg = packed_rows(np.random.default_rng(2), 48, 80, end_rate=0.15)
  key = jax.random.key(3)
  plain = run_infill(tokens, seg, key, random_ratio=0.0, permute=False, sentence_ends=(END,))
  shuffled = run_infill(tokens, seg, key, random_ratio=0.0, permute=True, sentence_ends=(END,))
  unsplit = run_infill(tokens, seg, key, random_ratio=0.0, permute=True)
  for k in ("encoder_tokens", "encoder_segment_ids", "encoder_source"):
    np.testing.assert_array_equal(unsplit[k], plain[k])  # no sentence ends: nothing moves
  np.testing.assert_array_equal(shuffled["masked"], plain["masked"])
  np.testing.assert_array_equal(shuffled["encoder_segment_ids"], plain["encoder_segment_ids"])
  moved = 0
  for r, a, e in documents(seg):
    d = seg[r, a]
    p = plain["encoder_segment_ids"][r] == d
    before = list(zip(plain["encoder_tokens"][r][p].tolist(), plain["encoder_source"][r][p].tolist()))
    after = list(zip(shuffled["encoder_tokens"][r][p].tolist(), shuffled["encoder_source"][r][p].tolist()))
    assert after[-1] == before[-1] == (int(tokens[r, e]), e)  # the last token stays last
    sentences = split_sentences(plain["encoder_tokens"][r][p][:-1], plain["encoder_source"][r][p][:-1])
    assert is_concatenation(tuple(after[:-1]), sentences), (before, after)
    assert sorted(after) == sorted(before)
    moved += after != before
  assert moved > len(documents(seg)) // 3
  np.testing.assert_array_equal(shuffled["encoder_positions"], plain["encoder_positions"])


def test_decoder_side_keys_and_jit():
  tokens, seg = packed_rows(np.random.default_rng(4), 8, 40)
  pos = np.zeros_like(seg)
  for r, a, e in documents(seg):
    pos[r, a:e + 1] = np.arange(e + 1 - a)
  tokens[seg == 0] = 77  # padding content never reaches the model
  batch = {"tokens": jnp.asarray(tokens), "segment_ids": jnp.asarray(seg), "positions": jnp.asarray(pos)}
  objective = TextInfilling(IDS, sentence_end_ids=str(END))
  f = jax.jit(objective.inputs)
  x, y, z = (jax.device_get(f(batch, jax.random.key(k))) for k in (0, 0, 1))
  clean = np.where(seg > 0, tokens, IDS.pad)
  np.testing.assert_array_equal(x["targets"], clean)
  np.testing.assert_array_equal(x["decoder_tokens"], shift_right_by_segment(jnp.asarray(clean), jnp.asarray(seg), IDS.eos))
  for r, a, e in documents(seg):
    assert x["decoder_tokens"][r, a] == IDS.eos and (x["decoder_tokens"][r, a + 1:e + 1] == tokens[r, a:e]).all()
  np.testing.assert_array_equal(x["decoder_segment_ids"], seg)
  np.testing.assert_array_equal(x["decoder_positions"], pos)
  np.testing.assert_array_equal(x["weights"], seg > 0)
  for r in range(8):  # the same documents on both sides, so cross-attention stays in a document
    assert set(np.unique(x["encoder_segment_ids"][r])) - {0} == set(np.unique(seg[r])) - {0}
  for k in x:
    np.testing.assert_array_equal(x[k], y[k])
  assert not np.array_equal(x["masked"], z["masked"])
  assert not np.array_equal(x["encoder_tokens"], z["encoder_tokens"])


def tiny_model(length):
  from tfx.config import load_config
  from tfx.models import build_model

  config = load_config(os.path.join(ROOT, "configs", "bart_tiny.py"))
  model = build_model(config.model, vocab_size=VOCAB, max_length=length)
  params = nn.unbox(jax.jit(model.init)(jax.random.key(0), **type(model).init_inputs(1, length))["params"])
  return model, params


def test_padding_and_information_flow_through_the_model():
  """Random ids in padding change neither loss nor gradients (bitwise) and an all-padding row predicts
  nothing. Perturbing each raw token (half the time into a sentence end) changes only predictions
  that may see it: kept tokens of the document, itself when kept, earlier targets."""
  t = 24
  tokens, seg = packed_rows(np.random.default_rng(5), 4, t, docs=(2, 2), end_rate=0.2, padded_rows=0.0)
  tokens[3], seg[3] = 0, 0
  tokens[2, 15:], seg[2, 15:] = 0, 0
  tokens[2, 14] = IDS.eos
  batch = {"tokens": tokens, "segment_ids": seg, "positions": np.zeros_like(seg)}
  objective = TextInfilling(IDS, sentence_end_ids=str(END))
  model, params = tiny_model(t)
  key = jax.random.key(6)
  grad = jax.jit(jax.value_and_grad(lambda p, b: objective.loss(model, p, b, key, train=False), has_aux=True))
  (l1, m1), g1 = grad(params, batch)
  noisy = dict(batch, tokens=np.where(seg == 0, np.random.default_rng(0).integers(0, VOCAB, (4, t)), tokens))
  (l2, _), g2 = grad(params, noisy)
  assert float(l1) == float(l2) and float(m1["num_tokens"]) == (seg > 0).sum()
  jax.tree.map(np.testing.assert_array_equal, g1, g2)

  predict = jax.jit(lambda b: objective.predictions(model, params, b, key))
  base = jax.device_get(predict(batch))
  assert (base.weights[3] == 0).all() and (base.source[seg == 0] == -1).all()
  loss_check = -np.sum(base.weights * np.take_along_axis(jax.nn.log_softmax(base.logits), base.targets[..., None], -1)[..., 0])
  np.testing.assert_allclose(loss_check / base.weights.sum(), float(l1), rtol=1e-5)
  visible = base.visible.reshape(4, t, 4 * t)
  rng = np.random.default_rng(7)
  hidden_dependencies = masked_dependencies = 0
  for q in np.flatnonzero((seg.reshape(-1) > 0) & (tokens.reshape(-1) != IDS.eos)):
    r, c = divmod(int(q), t)
    new = END if rng.random() < 0.5 and tokens[r, c] != END else int(rng.choice(ORDINARY[ORDINARY != tokens[r, c]]))
    perturbed = dict(batch, tokens=tokens.copy())
    perturbed["tokens"][r, c] = new
    changed = np.any(np.asarray(predict(perturbed).logits) != base.logits, axis=-1) & (base.weights > 0)
    for rr, j in zip(*np.nonzero(changed)):
      own = base.source[rr, j] == q
      assert (own and base.sees_self[rr, j]) or (not own and visible[rr, j, q]), (r, c, rr, j)
      hidden_dependencies += int(not base.sees_self[rr, j])
    masked_dependencies += int(changed[r][~base.sees_self[r] & (base.weights[r] > 0)].any())
  assert hidden_dependencies > 0 and masked_dependencies > 0  # the check is not vacuous


@pytest.mark.slow
def test_bart_tiny_trains_and_resumes_exactly(tmp_path, shared_tokenizer):
  """configs/bart_tiny.py through tfx.train.run (dropout on): 4 steps in one go, and 2 + 2 with a
  stop and a resume, give bitwise the same metrics and parameters."""
  from tfx import train
  from tfx.config import load_config
  from tfx.data.tokenizer import Tokenizer
  from tfx.metrics import read_metrics

  assert Tokenizer.load(shared_tokenizer).encode(["\n"])[0].tolist() == [7]  # the configs' sentence end
  overrides = [f"--config.data.tokenizer={shared_tokenizer}", "--config.data.max_documents=40",
               "--config.train.steps=4", "--config.train.log_every=1", "--config.train.eval_every=2",
               "--config.train.checkpoint_every=2", "--config.model.dropout=0.1", "--config.data.eval_batches=1"]
  config = lambda *extra: load_config(os.path.join(ROOT, "configs", "bart_tiny.py"), [*overrides, *extra])
  full = train.run(config(), str(tmp_path / "full"))
  part = tmp_path / "part"
  assert train.run(config("--config.train.stop_after=2"), str(part))["step"] == 2
  resumed = train.run(config(), str(part))
  assert resumed["step"] == 4
  timing = ("tokens_per_sec", "mfu")
  strip = lambda rows: [{k: v for k, v in row.items() if k not in timing} for row in rows]
  records = strip(read_metrics(str(tmp_path / "full")))
  assert strip(read_metrics(str(part))) == records
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(full["state"].params),
               jax.device_get(resumed["state"].params))
  losses = [r["loss"] for r in records if r["split"] == "train"]
  assert len(losses) == 4 and all(np.isfinite(losses)) and abs(losses[0] - math.log(1000)) < 1.0
