"""What a classification task is: labelled examples in train / validation / test splits.

Every split rule here is a function of the data alone (a stable SHA-256 of a key, never Python's
salted `hash()` nor a seed), so the same task spec gives the same splits on every machine and run.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Callable, Iterable, Sequence

SPLITS = ("train", "validation", "test")


@dataclasses.dataclass(frozen=True)
class Example:
  """One labelled example.

  Attributes:
    text: the (first) text.
    label: the class index, 0 <= label < num_classes.
    text_b: the second text of a sentence-pair task, else None.
    group: examples of one group (e.g. one source file) always share a split; also their id.
  """

  text: str
  label: int
  text_b: str | None = None
  group: str = ""


@dataclasses.dataclass
class Task:
  """A classification task: named labels and three splits of examples.

  Attributes:
    name: the task spec it was built from (e.g. 'stdlib:package', 'jsonl:data/sst').
    labels: class names; example.label indexes this tuple.
    splits: 'train', 'validation', 'test' -> examples.
    pair: whether examples have a second text (sentence-pair classification).
    notes: how the task was built (sources, split rule, caps), printed with the class balance.
  """

  name: str
  labels: tuple[str, ...]
  splits: dict[str, list[Example]]
  pair: bool = False
  notes: str = ""

  @property
  def num_classes(self) -> int:
    return len(self.labels)

  def balance(self) -> dict[str, dict[str, int]]:
    """split -> label name -> number of examples (every label listed, 0 included)."""
    out = {}
    for split in SPLITS:
      counts = collections.Counter(e.label for e in self.splits[split])
      out[split] = {name: counts.get(i, 0) for i, name in enumerate(self.labels)}
    return out

  def check(self) -> None:
    """Raises ValueError unless every split is non-empty and every label is in range."""
    if len(self.labels) < 2:
      raise ValueError(f"task {self.name!r} has {len(self.labels)} label(s); classification needs at least 2")
    for split in SPLITS:
      examples = self.splits.get(split)
      if not examples:
        raise ValueError(f"task {self.name!r} has no {split} examples; give it more data or other split fractions")
      bad = [e.label for e in examples if not 0 <= e.label < len(self.labels)]
      if bad:
        raise ValueError(f"task {self.name!r}: {split} label {bad[0]} is outside 0..{len(self.labels) - 1}")
      if self.pair and any(e.text_b is None for e in examples):
        raise ValueError(f"task {self.name!r} is a pair task but a {split} example has no second text")


def stable_hash(key: str) -> int:
  """A 64-bit hash of `key` that is the same in every process and on every machine."""
  return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big")


def unit_hash(key: str) -> float:
  """`stable_hash` mapped to [0, 1)."""
  return stable_hash(key) / 2.0**64


def hash_split(key: str, validation_fraction: float, test_fraction: float) -> str:
  """'test', 'validation' or 'train' for `key`, by where its unit hash falls."""
  u = unit_hash(key)
  if u < test_fraction:
    return "test"
  if u < test_fraction + validation_fraction:
    return "validation"
  return "train"


def hash_order(items: Iterable, key: Callable[[object], str]) -> list:
  """`items` sorted by the stable hash of key(item) (ties by the key): a fixed shuffle."""
  return sorted(items, key=lambda x: (stable_hash(key(x)), key(x)))


def assign_groups(group_sizes: dict[str, int], validation_fraction: float, test_fraction: float) -> dict[str, str]:
  """group -> split, holding out whole groups; no split is empty when there are >= 3 groups.

  Largest groups first (ties in stable-hash order), each goes to the split furthest below its
  target share of all the examples; once only as many groups remain as splits are still empty,
  they go to those. Deterministic and independent of any seed.
  """
  targets = {"train": 1.0 - validation_fraction - test_fraction, "validation": validation_fraction,
             "test": test_fraction}
  total = sum(group_sizes.values())
  counts = dict.fromkeys(SPLITS, 0)
  filled = dict.fromkeys(SPLITS, 0)
  order = sorted(hash_order(group_sizes, key=str), key=lambda g: -group_sizes[g])  # stable: hash order on ties
  out = {}
  for i, group in enumerate(order):
    empty = [s for s in SPLITS if not filled[s]]
    candidates = empty if empty and len(order) - i <= len(empty) else SPLITS
    split = max(candidates, key=lambda s: targets[s] * total - counts[s])
    out[group] = split
    counts[split] += group_sizes[group]
    filled[split] += 1
  return out


def cap_per_class(examples: Sequence[Example], cap: int, key: Callable[[Example], str]) -> list[Example]:
  """At most `cap` examples of each label (0 = no cap), the first ones in stable-hash order of key."""
  ordered = hash_order(examples, key)
  if not cap:
    return ordered
  seen: collections.Counter = collections.Counter()
  out = []
  for e in ordered:
    if seen[e.label] < cap:
      out.append(e)
      seen[e.label] += 1
  return out


def format_balance(task: Task) -> str:
  """A small table: one row per label, one column per split (counts and shares)."""
  balance = task.balance()
  width = max(len(n) for n in task.labels)
  lines = [f"  {'label':<{width}}  " + "  ".join(f"{s:>16}" for s in SPLITS)]
  totals = {s: max(sum(balance[s].values()), 1) for s in SPLITS}
  for name in task.labels:
    cells = [f"{balance[s][name]:>7} ({balance[s][name] / totals[s]:>5.1%})" for s in SPLITS]
    lines.append(f"  {name:<{width}}  " + "  ".join(f"{c:>16}" for c in cells))
  lines.append(f"  {'total':<{width}}  " + "  ".join(f"{sum(balance[s].values()):>16}" for s in SPLITS))
  return "\n".join(lines)
