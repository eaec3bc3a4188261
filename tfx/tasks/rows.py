"""Task examples as model rows: one right-padded row per example, laid out per model family.

    rows = encode_split(task.splits["train"], tokenizer, "encoder", length=64)
    batch = rows.take(train_indices(len(rows), batch_size, seed, step))  # a function of (seed, step)

Layouts (ROW_LAYOUTS; [SEP] is the tokenizer's sep id, else eos; [CLS] its cls, else bos, else eos):
  encoder           [CLS] a [SEP] b [SEP]      BERT; pooled at [CLS]
  decoder           [BOS] a [SEP] b [EOS]      GPT's extract token; pooled at the last real token
  encoder_decoder   a [SEP] b [EOS]            T5's encoder input; mean-pooled
  xlnet             a [SEP] b [SEP] [CLS]      XLNet; pooled at [CLS], the last real token
Token types: 0 for the first text (and what precedes it), 1 for the second (and what follows),
2 for XLNet's final [CLS]; families without token types ignore them. Texts longer than the row
are cut longest-first (the longer text loses tokens from its end), the special tokens are kept.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import numpy as np

from tfx.errors import UserError

# Row layout per family: (ids before the first text, between the texts, after the last text), by role.
ROW_LAYOUTS = {
    "encoder": (("cls",), ("sep",), ("sep",)),  # [CLS] a [SEP] b [SEP]       BERT
    "decoder": (("bos",), ("sep",), ("eos",)),  # [BOS] a [SEP] b [EOS]       GPT (pooled at [EOS])
    "encoder_decoder": ((), ("sep",), ("eos",)),  # a [SEP] b [EOS]           T5's encoder input
    "xlnet": ((), ("sep",), ("sep", "cls")),  # a [SEP] b [SEP] [CLS]        XLNet
}
DEFAULT_LAYOUT = ((), ("sep",), ("eos",))


@dataclasses.dataclass
class Rows:
  """One split as model rows: tokens, segment_ids (1 real / 0 pad), positions, token_types
  int32 [n, L]; labels int32 [n]; truncated: how many examples were cut to fit."""

  tokens: np.ndarray
  segment_ids: np.ndarray
  positions: np.ndarray
  token_types: np.ndarray
  labels: np.ndarray
  truncated: int

  def __len__(self) -> int:
    return len(self.labels)

  def take(self, index: np.ndarray) -> dict[str, np.ndarray]:
    """The batch of rows `index` (labels [b, 1], so every array splits over the batch axes)."""
    labels = np.where(index >= 0, self.labels[np.maximum(index, 0)], -1)
    index = np.maximum(index, 0)
    return {"tokens": self.tokens[index], "segment_ids": self.segment_ids[index], "positions": self.positions[index],
            "token_types": self.token_types[index], "labels": labels[:, None].astype(np.int32)}


def role_ids(tokenizer) -> dict[str, int]:
  """Special ids by role, with fallbacks: sep -> eos, bos -> eos, cls -> bos -> eos."""
  eos = tokenizer.eos_id
  if eos is None:
    raise UserError("the tokenizer has no end-of-sequence id; fine-tuning rows need one")
  bos = tokenizer.bos_id if tokenizer.bos_id is not None else eos
  return {"eos": eos, "bos": bos, "sep": tokenizer.sep_id if tokenizer.sep_id is not None else eos,
          "cls": tokenizer.cls_id if tokenizer.cls_id is not None else bos}


def fit_pair(len_a: int, len_b: int, budget: int) -> tuple[int, int]:
  """Longest-first truncation: (kept of a, kept of b) with kept sum <= budget (ties cut b first)."""
  if len_a + len_b <= budget:
    return len_a, len_b
  short = min(len_a, len_b)
  if short <= budget // 2:
    return (len_a, budget - len_a) if len_a == short else (budget - len_b, len_b)
  return budget - budget // 2, budget // 2


def layout_row(a: np.ndarray, b: np.ndarray | None, family: str, ids: dict[str, int], length: int):
  """(tokens, token_types, truncated) of one example, at most `length` long (texts cut longest-first)."""
  before, middle, after = (tuple(ids[r] for r in part) for part in ROW_LAYOUTS.get(family, DEFAULT_LAYOUT))
  budget = length - len(before) - len(after) - (len(middle) if b is not None else 0)
  if budget < 2:
    raise UserError(f"finetune.max_length={length} leaves no room for text after the special tokens")
  if b is None:
    ka, kb = min(len(a), budget), 0
    first, second = list(before) + list(a[:ka]), []
  else:
    ka, kb = fit_pair(len(a), len(b), budget)
    first, second = list(before) + list(a[:ka]) + list(middle), list(b[:kb])
  second += list(after)
  types = [0] * len(first) + [1 if b is not None else 0] * len(second)
  if family == "xlnet":
    types[-1] = 2  # XLNet's [CLS] has a segment of its own
  return first + second, types, ka + kb < len(a) + (0 if b is None else len(b))


def encode_split(examples, tokenizer, family: str, length: int) -> Rows:
  """The rows of a split (see `layout_row`), right-padded to `length`."""
  ids = role_ids(tokenizer)
  texts = tokenizer.encode([e.text for e in examples])
  pair = examples[0].text_b is not None
  texts_b = tokenizer.encode([e.text_b for e in examples]) if pair else [None] * len(examples)
  n = len(examples)
  out = {k: np.zeros((n, length), np.int32) for k in ("tokens", "segment_ids", "positions", "token_types")}
  truncated = 0
  for i, (a, b) in enumerate(zip(texts, texts_b)):
    tokens, types, cut = layout_row(np.asarray(a), None if b is None else np.asarray(b), family, ids, length)
    truncated += cut
    k = len(tokens)
    out["tokens"][i, :k], out["token_types"][i, :k] = tokens, types
    out["segment_ids"][i, :k], out["positions"][i, :k] = 1, np.arange(k)
  return Rows(**out, labels=np.array([e.label for e in examples], np.int32), truncated=int(truncated))


def train_indices(n: int, batch_size: int, seed: int, step: int) -> np.ndarray:
  """int [batch]: the examples of training step `step`: epoch after epoch, each in the order of a
  permutation drawn from (seed, epoch). A function of (seed, step) alone: resume is exact."""
  flat = step * batch_size + np.arange(batch_size)
  epochs, offsets = flat // n, flat % n
  out = np.empty(batch_size, np.int64)
  for epoch in np.unique(epochs):
    order = np.random.default_rng([seed, int(epoch)]).permutation(n)
    out[epochs == epoch] = order[offsets[epochs == epoch]]
  return out


def eval_batches(rows: Rows, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
  """Global batches of every row in order; the last one filled with label -1 (ignored) rows."""
  n = len(rows)
  for start in range(0, n, batch_size):
    index = np.arange(start, start + batch_size)
    yield rows.take(np.where(index < n, index, -1))
