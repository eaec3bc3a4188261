"""`jsonl:PATH` tasks: JSON-lines records with a text, an optional second text and a label.

- PATH a directory: `train.jsonl` and `test.jsonl`, and `validation.jsonl` (or `dev.jsonl`); without
  a validation file, `finetune.validation_fraction` of train is held out by a stable hash of the
  example's text.
- PATH one file: it is split three ways by the stable hash of each example's text
  (`finetune.test_fraction`, `finetune.validation_fraction`, the rest is train), so duplicate
  texts always share a split.

Field names: `finetune.text_field`, `finetune.text_b_field` (optional: a pair task when the
train records have it) and `finetune.label_field`. Labels are strings or integers; the label
list is `finetune.labels` when given, else the sorted distinct labels of the train split
(integers in numeric order). A label outside that list is an error naming the file and line.
"""

from __future__ import annotations

import json
import os

from tfx.errors import DataError
from tfx.tasks.base import Example, Task, hash_order, hash_split

VALIDATION_NAMES = ("validation.jsonl", "dev.jsonl", "valid.jsonl")


class TaskDataError(DataError):
  """A task file that cannot be read as asked; the message names the file and line."""


def read_records(path: str, ft) -> list[tuple[str, str | None, object, str]]:
  """(text, text_b or None, raw label, 'PATH:LINE') for every record of a JSON-lines file."""
  out = []
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, start=1):
      if not line.strip():
        continue
      where = f"{path}:{number}"
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise TaskDataError(f"{where}: not valid JSON ({e.msg}); each line must be one JSON object") from None
      if not isinstance(record, dict):
        raise TaskDataError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
      for field in (ft.text_field, ft.label_field):
        if field not in record:
          raise TaskDataError(f"{where}: record has no field {field!r} (its fields: {', '.join(sorted(record))}); "
                              f"set finetune.text_field / finetune.label_field to the right names")
      text, text_b = record[ft.text_field], record.get(ft.text_b_field)
      for field, value in ((ft.text_field, text), (ft.text_b_field, text_b)):
        if value is not None and not isinstance(value, str):
          raise TaskDataError(f"{where}: field {field!r} is {type(value).__name__}, expected a string")
      label = record[ft.label_field]
      if not isinstance(label, (str, int)) or isinstance(label, bool):
        raise TaskDataError(f"{where}: label {label!r} must be a string or an integer")
      out.append((text, text_b, label, where))
  if not out:
    raise TaskDataError(f"{path} has no records")
  return out


def label_names(train_labels: list, ft) -> tuple[str, ...]:
  """finetune.labels if set, else the distinct train labels (integers numerically, else as strings)."""
  if ft.labels:
    return tuple(str(x) for x in ft.labels)
  distinct = set(train_labels)
  if all(isinstance(x, int) for x in distinct):
    return tuple(str(x) for x in sorted(distinct))
  return tuple(sorted(str(x) for x in distinct))


def to_examples(records, labels: tuple[str, ...], pair: bool, text_b_field: str) -> list[Example]:
  index = {name: i for i, name in enumerate(labels)}
  out = []
  for text, text_b, label, where in records:
    if str(label) not in index:
      raise TaskDataError(f"{where}: label {label!r} is not one of the task's labels {list(labels)} (the train "
                          f"split's, or finetune.labels); fix the record or set finetune.labels")
    if pair and text_b is None:
      raise TaskDataError(f"{where}: record has no field {text_b_field!r}, which the train records have "
                          f"(a pair task needs it in every record)")
    out.append(Example(text, index[str(label)], text_b if pair else None, group=where))
  return out


def _text_key(record) -> str:
  text, text_b = record[0], record[1]
  return text if text_b is None else f"{text}\x1f{text_b}"


def jsonl_task(path: str, ft) -> Task:
  """The task of `jsonl:PATH` (see the module docstring); `ft` is `config.finetune`."""
  if os.path.isdir(path):
    train_path, test_path = os.path.join(path, "train.jsonl"), os.path.join(path, "test.jsonl")
    for p in (train_path, test_path):
      if not os.path.isfile(p):
        raise TaskDataError(f"jsonl:{path} needs {os.path.basename(p)} in the directory (and validation.jsonl, or "
                            f"it is held out from train); or pass one .jsonl file to have it split by hash")
    records = {"train": read_records(train_path, ft), "test": read_records(test_path, ft)}
    validation = next((os.path.join(path, n) for n in VALIDATION_NAMES if os.path.isfile(os.path.join(path, n))), None)
    if validation:
      records["validation"] = read_records(validation, ft)
      how = f"{path}/{{train,{os.path.basename(validation)[:-6]},test}}.jsonl"
    else:
      train = records["train"]
      records["train"] = [r for r in train if hash_split(_text_key(r), ft.validation_fraction, 0.0) == "train"]
      records["validation"] = [r for r in train if hash_split(_text_key(r), ft.validation_fraction, 0.0) != "train"]
      how = f"{path}/{{train,test}}.jsonl, validation = {ft.validation_fraction:.0%} of train by text hash"
  elif os.path.isfile(path):
    everything = read_records(path, ft)
    records = {s: [] for s in ("train", "validation", "test")}
    for r in everything:
      records[hash_split(_text_key(r), ft.validation_fraction, ft.test_fraction)].append(r)
    how = f"{path} split by text hash (validation {ft.validation_fraction:.0%}, test {ft.test_fraction:.0%})"
  else:
    raise TaskDataError(f"jsonl:{path}: no such file or directory")
  pair = any(r[1] is not None for r in records["train"])
  labels = label_names([r[2] for r in records["train"]], ft)
  splits = {s: to_examples(rs, labels, pair, ft.text_b_field) for s, rs in records.items()}
  for split, cap in (("train", ft.max_train_examples), ("validation", ft.max_eval_examples),
                     ("test", ft.max_eval_examples)):
    if cap:  # the first `cap` in stable-hash order (a file sorted by label keeps its mix)
      splits[split] = hash_order(splits[split], key=lambda e: e.group)[:cap]
  return Task(f"jsonl:{path}", labels, splits, pair=pair, notes=how)
