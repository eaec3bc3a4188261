"""Masked LM plus a sentence-pair loss on the first token: BERT's next-sentence prediction (`nsp`,
Devlin et al. 2019) and ALBERT's sentence-order prediction (`sop`, Lan et al. 2020).

Rows are BERT's `[CLS] A [SEP] B [SEP]` with token types 0 (CLS, A, first SEP) and 1 (B, second
SEP), built on device from raw rows of `seq_len - 3` tokens by XLNet's raw-row layout hook
(`plm_sampling.xlnet_rows` with no reuse part, its CLS moved to the front): A is the raw row's
first a_len ~ U{1..n-1} tokens (n = seq_len - 3) and B the next n - a_len, so every row is full.

  nsp: with probability `negative_rate` B is instead a stretch of the next row of the batch at a
       random offset ("NotNext", label 1); otherwise B continues A ("IsNext", label 0).
  sop: B always continues A; with probability `negative_rate` the two are swapped,
       `[CLS] B [SEP] A [SEP]` (label 1), else in order (label 0).

Without sentence boundaries in the corpus the cut is uniform over token positions (as XLNet's rows
here), and a raw row may hold the end of one document and the start of the next: the row is one
text (attention spans it, as BERT's A/B pairs do). MLM (masked_lm's fields: 15%, 80/10/10, whole
words optional) is applied to the laid-out row; CLS and SEP are never selected. The sentence head
is BERT's pooler (dense + tanh on the first token's final hidden state) and a 2-way classifier
(`ClassifierHead`, pooling 'first'); it is the objective's own parameters
(`params["objective"]["sentence_head"]`, see `Objective.init_params`).

loss = MLM cross-entropy (mean over selected tokens) + sentence_weight * sentence cross-entropy
(mean over rows with any real token).
"""

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import optax

from tfx import flops, ops
from tfx.models.encoder import ClassifierHead
from tfx.objectives.base import Predictions, split_params
from tfx.objectives.masked_lm import MaskedLM, logits_and_hidden, selected_positions
from tfx.objectives.plm_sampling import xlnet_rows
from tfx.registry import OBJECTIVES

NSP, SOP = "nsp", "sop"


def swap_segments(row: dict[str, jax.Array], swap: jax.Array, t: int) -> dict[str, jax.Array]:
  """`[A, SEP, B, SEP, CLS]` rows -> `[B, SEP, A, SEP, CLS]` where swap [b] is True.

  Gathers every per-position array of `row` ([b, t]: tokens, segment_ids, is_func, source) by
  the swapped order; token types are 0 up to the new first SEP, 1 after it, 2 at CLS."""
  a_len = row["a_len"][:, None]  # [b, 1]
  b_len = (t - 3) - a_len
  p = jnp.arange(t)[None, :]  # [1, t]
  swapped = jnp.where(p < b_len, a_len + 1 + p,  # B first
                      jnp.where(p == b_len, a_len,  # the SEP after A's old place
                                jnp.where(p < t - 2, p - b_len - 1, p)))  # then A, then SEP, CLS
  index = jnp.where(swap[:, None], swapped, p)  # [b, t]
  out = dict(row)
  for key in ("tokens", "segment_ids", "is_func", "source"):
    out[key] = jnp.take_along_axis(row[key], index, axis=1)
  first_sep = jnp.where(swap, b_len[:, 0], a_len[:, 0])[:, None]  # [b, 1]
  out["token_types"] = jnp.where(p <= first_sep, 0, jnp.where(p == t - 1, 2, 1)).astype(jnp.int32)
  return out


def bert_pair_rows(tokens, segment_ids, rng, *, task: str, negative_rate: float, sep: int, cls: int, pad: int
                   ) -> dict[str, jax.Array]:
  """[CLS] A [SEP] B [SEP] rows from raw rows [b, t - 3] (see the module docstring).

  Returns `tokens`, `token_types` (0/1), `segment_ids` (1 real, 0 padding), `source` (the flat raw
  index of each position's token, -1 for CLS / SEP / padding), `positions` [b, t] int32, and
  `label` [b] int32 (1 = NotNext / swapped)."""
  b, raw = tokens.shape
  t = raw + 3
  row_rng, swap_rng = jax.random.split(rng)
  row = xlnet_rows(tokens, segment_ids, row_rng, reuse_len=0, sep=sep, cls=cls, pad=pad,
                   random_b_rate=negative_rate if task == NSP else 0.0)
  if task == NSP:
    label = row["random_b"]
  else:
    label = jax.random.bernoulli(swap_rng, negative_rate, (b,))
    row = swap_segments(row, label, t)
  # XLNet ends the row with CLS (type 2); BERT starts it with CLS (type 0).
  first = lambda x: jnp.roll(x, 1, axis=1)
  return {"tokens": first(row["tokens"]), "segment_ids": first(row["segment_ids"]),
          "token_types": first(jnp.where(row["token_types"] == 2, 0, row["token_types"])).astype(jnp.int32),
          "source": first(row["source"]), "positions": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
          "label": label.astype(jnp.int32)}


@dataclasses.dataclass(frozen=True)
class SentencePrediction(MaskedLM):
  """Masked LM on `[CLS] A [SEP] B [SEP]` rows plus a 2-way sentence-pair loss on the first token."""

  # Share of rows whose pair is a negative: B from another row (nsp) or A and B swapped (sop).
  negative_rate: float = 0.5
  # Weight of the sentence-pair loss against the MLM loss (BERT and ALBERT: 1, a plain sum).
  sentence_weight: float = 1.0

  task: ClassVar[str] = NSP

  def __post_init__(self):
    super().__post_init__()
    if not 0.0 <= self.negative_rate <= 1.0:
      raise ValueError(f"objective.negative_rate must be in [0, 1], got {self.negative_rate}")
    if self.ids.sep is None or self.ids.cls is None:
      raise ValueError(f"{self.task} needs <cls> and <sep> ids, but the tokenizer has none")

  def raw_length(self, seq_len: int) -> int:
    """CLS and two SEPs join seq_len - 3 raw tokens."""
    return seq_len - 3

  def check_seq_len(self, seq_len: int) -> None:
    if seq_len < 6:
      raise ValueError(f"{self.task} rows [CLS] A [SEP] B [SEP] need data.seq_len >= 6, got {seq_len}")

  def init_params(self, rng, model, seq_len):
    cfg = model.cfg
    head = ClassifierHead(2, pooling="first", init_std=cfg.init_std)
    hidden = jnp.zeros((1, 1, cfg.d_model), jnp.float32)
    return {"sentence_head": head.init({"params": rng}, hidden, jnp.ones((1, 1), jnp.int32))["params"]}

  def rows(self, batch, rng) -> dict[str, jax.Array]:
    return bert_pair_rows(jnp.asarray(batch["tokens"], jnp.int32), jnp.asarray(batch["segment_ids"], jnp.int32), rng,
                          task=self.task, negative_rate=self.negative_rate, sep=self.ids.sep, cls=self.ids.cls,
                          pad=self.ids.pad)

  def _forward(self, model, params, batch, rng, *, train, gather: bool = False):
    """(row, MLM logits [b, t, v] or None, final hidden states [b, t, e], targets, weights, kept,
    sentence logits [b, 2]). With `gather` (the loss's call), when masked_lm's `gather_slots`
    applies to the row, the MLM logits are left to the loss (None) and the hidden states are those
    of the first token ([CLS]) and then each row's selected tokens' slots only, [b, 1 + slots, e]:
    the encoder's last layer computes nothing else (`rows`; see `MaskedLM.rows_loss`); when it does
    not, the logits of every position come in the compute dtype (the loss reads them in float32
    itself, and bf16 ones get its one-pass gradient: `MaskedLM.loss`), else in float32."""
    encoder_params, own = split_params(params)
    row_rng, mask_rng, dropout_rng = jax.random.split(rng, 3)
    row = self.rows(batch, row_rng)
    inputs, targets, weights, kept = self.mask(row, mask_rng, return_kept=True)  # [b, t] each
    args = (inputs, row["segment_ids"], row["positions"])
    kwargs = dict(token_types=row["token_types"], train=train, rngs={"dropout": dropout_rng})
    slots = self.gather_slots(model, inputs.shape[1]) if gather else None
    if slots is not None:
      where = selected_positions(weights, slots)  # [b, slots]
      rows = jnp.concatenate([jnp.zeros_like(where[:, :1]), where], axis=1)  # [CLS] first: [b, 1 + slots]
      logits, hidden = None, model.apply({"params": encoder_params}, *args, return_hidden=True, rows=rows, **kwargs)
    else:
      logits, hidden = logits_and_hidden(model, encoder_params, *args, float32_logits=not gather,
                                         **kwargs)  # [b, t, v], [b, t, e]
    sentence_logits = ClassifierHead(2, pooling="first", init_std=model.cfg.init_std).apply(
        {"params": own["sentence_head"]}, hidden, row["segment_ids"])  # [b, 2]
    return row, logits, hidden, targets, weights, kept, sentence_logits

  def loss(self, model, params, batch, rng, *, train):
    row, logits, hidden, targets, weights, _, sentence_logits = self._forward(model, params, batch, rng,
                                                                              train=train, gather=True)
    if logits is None:  # gathered: hidden [b, 1 + slots, e], the head runs on the selected tokens' slots
      where = selected_positions(weights, hidden.shape[1] - 1)  # [b, slots], as `_forward` chose them
      mlm_loss, mlm = self.slots_loss(model, split_params(params)[0], hidden[:, 1:], targets, weights, where)
    else:
      mlm_loss, mlm = self.mlm_loss(model, None, logits, targets, weights, None)
    rows = jnp.any(row["segment_ids"] > 0, axis=1).astype(jnp.float32)  # [b], rows with text
    ce = optax.softmax_cross_entropy_with_integer_labels(sentence_logits, row["label"])  # [b]
    n = jnp.maximum(jnp.sum(rows), 1.0)
    sentence_loss = jnp.sum(ce * rows) / n
    correct = (jnp.argmax(sentence_logits, axis=-1) == row["label"]).astype(jnp.float32)
    loss = mlm_loss + self.sentence_weight * sentence_loss
    return loss, dict(mlm, loss=loss, mlm_loss=mlm_loss, sentence_loss=sentence_loss,
                      sentence_accuracy=jnp.sum(correct * rows) / n, sentence_rows=jnp.sum(rows))

  def metric_counts(self) -> dict[str, str]:
    return {"sentence_loss": "sentence_rows", "sentence_accuracy": "sentence_rows"}  # the rest: selected tokens

  def loss_terms(self) -> dict[str, float]:
    return {"mlm_loss": 1.0, "sentence_loss": self.sentence_weight}

  def predictions(self, model, params, batch, rng):
    """t + 1 slots per row: the MLM slots at the row's positions (source: the raw token placed
    there), then the sentence slot (its 2 logits in columns 0 and 1, source -1). Every slot may see
    the raw tokens placed in its row, which for nsp include the stretch of the next row."""
    row, logits, _, targets, weights, kept, sentence_logits = self._forward(model, params, batch, rng, train=False)
    b, t, v = logits.shape
    n_raw = batch["tokens"].size
    in_row = jnp.any(row["source"][:, :, None] == jnp.arange(n_raw)[None, None, :], axis=1)  # [b, b * raw]
    sentence = jnp.zeros((b, 1, v), logits.dtype).at[:, 0, :2].set(sentence_logits)
    has_text = jnp.any(row["segment_ids"] > 0, axis=1, keepdims=True).astype(jnp.float32)  # [b, 1]
    return Predictions(
        logits=jnp.concatenate([logits, sentence], axis=1),
        targets=jnp.concatenate([targets, row["label"][:, None]], axis=1),
        weights=jnp.concatenate([weights, has_text], axis=1),
        source=jnp.concatenate([row["source"], jnp.full((b, 1), -1, jnp.int32)], axis=1),
        sees_self=jnp.concatenate([kept, jnp.zeros((b, 1), bool)], axis=1),
        visible=jnp.broadcast_to(in_row[:, None, :], (b, t + 1, n_raw)))

  def loss_from_predictions(self, predictions: Predictions) -> jax.Array:
    """The MLM slots' cross entropy plus sentence_weight times the sentence slot's (its logits in
    columns 0 and 1), averaged over the rows with text."""
    p = predictions
    mlm, _ = ops.weighted_cross_entropy(p.logits[:, :-1], p.targets[:, :-1], p.weights[:, :-1], z_loss=self.z_loss)
    rows = p.weights[:, -1]  # [b]
    ce = optax.softmax_cross_entropy_with_integer_labels(p.logits[:, -1, :2].astype(jnp.float32), p.targets[:, -1])
    return mlm + self.sentence_weight * jnp.sum(ce * rows) / jnp.maximum(jnp.sum(rows), 1.0)

  def initial_loss(self, vocab_size: int) -> float:
    """ln(vocabulary) for the MLM plus sentence_weight * ln 2 for the pair classifier."""
    return math.log(vocab_size) + self.sentence_weight * math.log(2.0)

  def train_flops_per_row(self, model_cfg, seq_len: int) -> float:
    """The MLM encoder row plus the pooler and classifier on the first token."""
    e, last = model_cfg.d_model, self.last_layer_queries(model_cfg, seq_len)
    last = None if last is None else last + 1  # [CLS] and the slots
    return 3 * (flops.row_forward_flops(model_cfg, seq_len, self.head_positions(seq_len), last_layer_queries=last)
                + 2 * (e * e + 2 * e))


@OBJECTIVES.register("nsp")
@dataclasses.dataclass(frozen=True)
class NextSentencePrediction(SentencePrediction):
  """BERT's masked LM plus next-sentence prediction: is B the text that follows A, or another row's?"""

  task: ClassVar[str] = NSP

  @classmethod
  def check_config(cls, config) -> list[str]:
    problems = super().check_config(config)
    micro = config.train.batch_size // max(config.train.grad_accum, 1)
    if micro < 2 and config.objective.get("negative_rate", 0.5) > 0:
      problems.append(f"nsp takes a NotNext B from the next row of the batch, but a (micro-)batch of {micro} row "
                      f"has no other row: its NotNext B would be the row's own text; use train.batch_size / "
                      f"train.grad_accum >= 2")
    return problems


@OBJECTIVES.register("sop")
@dataclasses.dataclass(frozen=True)
class SentenceOrderPrediction(SentencePrediction):
  """ALBERT's masked LM plus sentence-order prediction: are two consecutive segments A, B in order or swapped?"""

  task: ClassVar[str] = SOP
