"""`hf:` tasks through the `datasets` library: GLUE by name, any hub dataset, or a saved directory.

- `hf:glue:NAME` (cola, sst2, mrpc, qqp, mnli, qnli, rte, wnli): GLUE from the hub, with each
  task's text fields and label names. Needs the network (or a warm cache).
- `hf:NAME[:CONFIG]`: any hub dataset; fields `finetune.text_field`, `finetune.text_b_field`
  (optional), `finetune.label_field`.
- `hf:DIR`: a local `DatasetDict` saved with `save_to_disk` (offline), the same fields.

Splits: `train`; validation = `validation` (or `validation_matched`, `dev`, `valid`); test = `test`
when its labels are public. GLUE's test labels are hidden (-1), so there (and whenever a dataset
has no labelled test split) the validation split becomes the test split and
`finetune.validation_fraction` of train, by the stable hash of the text, becomes validation.
Label names come from a `ClassLabel` feature, else as for jsonl tasks.
"""

from __future__ import annotations

import os

from tfx.tasks.base import Task, hash_order, hash_split
from tfx.tasks.files import TaskDataError, label_names, to_examples

# GLUE task -> (text field, second text field or None). stsb (regression) and ax (unlabelled) are refused.
GLUE = {
    "cola": ("sentence", None), "sst2": ("sentence", None), "mrpc": ("sentence1", "sentence2"),
    "qqp": ("question1", "question2"), "mnli": ("premise", "hypothesis"), "qnli": ("question", "sentence"),
    "rte": ("sentence1", "sentence2"), "wnli": ("sentence1", "sentence2"),
}
GLUE_HUB_NAME = "nyu-mll/glue"
VALIDATION_SPLITS = ("validation", "validation_matched", "dev", "valid")


def _load(spec: str):
  """(DatasetDict, name, text field, text_b field or None) for the part of `hf:SPEC` after 'hf:'."""
  try:
    import datasets  # Lazy: slow to import, and reads HF_* variables.
  except ImportError as e:
    raise TaskDataError(f"task 'hf:{spec}' needs the 'datasets' package ({e})") from e
  if os.path.isdir(spec):
    try:
      return datasets.load_from_disk(spec), spec, None, None
    except Exception as e:  # noqa: BLE001  (datasets raises several types)
      raise TaskDataError(f"hf:{spec} is a directory but not a dataset saved with save_to_disk ({e})") from e
  name, _, config = spec.partition(":")
  fields = (None, None)
  if name == "glue":
    if config not in GLUE:
      why = {"stsb": " (a regression task)", "ax": " (a test-only diagnostic set without labels)"}.get(config, "")
      raise TaskDataError(f"hf:glue:{config} is not a GLUE classification task{why}; choose one of {', '.join(GLUE)}")
    fields = GLUE[config]
    name = GLUE_HUB_NAME
  from tfx.data.sources import _hub_offline_message, _looks_offline

  try:
    loaded = datasets.load_dataset(name, config or None)
  except Exception as e:  # noqa: BLE001
    if _looks_offline(e):
      raise TaskDataError(_hub_offline_message(name, f"{type(e).__name__}: {e}") + "; for an offline task use "
                          "stdlib:package, stdlib:docstring, jsonl:PATH or hf:DIR (a dataset saved with "
                          "save_to_disk)") from e
    raise TaskDataError(f"could not load hf:{spec}: {type(e).__name__}: {e}") from e
  return loaded, f"{name}:{config}" if config else name, *fields


def _records(dataset, where: str, text_field: str, text_b_field: str | None, label_field: str):
  missing = [f for f in (text_field, label_field) if f not in dataset.column_names]
  if missing:
    raise TaskDataError(f"{where} has no column {missing[0]!r}; its columns are {dataset.column_names}; set "
                        f"finetune.text_field / finetune.label_field")
  texts = dataset[text_field]
  texts_b = dataset[text_b_field] if text_b_field and text_b_field in dataset.column_names else [None] * len(texts)
  return [(t, b, y, f"{where}#{i}") for i, (t, b, y) in enumerate(zip(texts, texts_b, dataset[label_field]))]


def task_from_datasets(dd, name: str, ft, text_field: str | None = None, text_b_field: str | None = None) -> Task:
  """The task of a DatasetDict (see the module docstring for the split rule)."""
  text_field = text_field or ft.text_field
  text_b_field = text_b_field or ft.text_b_field
  if "train" not in dd:
    raise TaskDataError(f"hf:{name} has no 'train' split (splits: {', '.join(dd)})")
  feature = dd["train"].features.get(ft.label_field)
  class_names = tuple(feature.names) if hasattr(feature, "names") else None
  records = {"train": _records(dd["train"], f"hf:{name}/train", text_field, text_b_field, ft.label_field)}
  validation = next((s for s in VALIDATION_SPLITS if s in dd), None)
  if validation:
    records["validation"] = _records(dd[validation], f"hf:{name}/{validation}", text_field, text_b_field, ft.label_field)
  test_labelled = "test" in dd and all(y is not None and y != -1 for y in dd["test"][ft.label_field])
  if test_labelled:
    records["test"] = _records(dd["test"], f"hf:{name}/test", text_field, text_b_field, ft.label_field)
    how = f"hf:{name} train / {validation or 'held out of train'} / test"
  else:
    how = (f"hf:{name} test labels are not public: its {validation} split is the test split" if validation
           else f"hf:{name} has no labelled test split: {ft.test_fraction:.0%} of train is the test split")
    records["test"] = records.pop("validation", None) or []
  if "validation" not in records:
    key = lambda r: r[0] if r[1] is None else f"{r[0]}\x1f{r[1]}"
    test_fraction = 0.0 if records["test"] else ft.test_fraction
    train = records["train"]
    where = {id(r): hash_split(key(r), ft.validation_fraction, test_fraction) for r in train}
    records["train"] = [r for r in train if where[id(r)] == "train"]
    records["validation"] = [r for r in train if where[id(r)] == "validation"]
    if not test_fraction == 0.0:
      records["test"] = [r for r in train if where[id(r)] == "test"]
    how += f"; validation = {ft.validation_fraction:.0%} of train by text hash"
  pair = any(r[1] is not None for r in records["train"])
  if class_names:
    labels = class_names
    records = {s: [(t, b, class_names[y] if isinstance(y, int) and 0 <= y < len(class_names) else y, w)
                   for t, b, y, w in rs] for s, rs in records.items()}
  else:
    labels = label_names([r[2] for r in records["train"]], ft)
  splits = {s: to_examples(rs, labels, pair, text_b_field) for s, rs in records.items()}
  for split, cap in (("train", ft.max_train_examples), ("validation", ft.max_eval_examples),
                     ("test", ft.max_eval_examples)):
    if cap:
      splits[split] = hash_order(splits[split], key=lambda e: e.group)[:cap]
  return Task(f"hf:{name}", labels, splits, pair=pair, notes=how)


def hub_task(spec: str, ft) -> Task:
  """The task of `hf:SPEC` (SPEC without the 'hf:' prefix)."""
  if not spec:
    raise TaskDataError("task 'hf:' needs a dataset: hf:glue:sst2, hf:NAME[:CONFIG] or hf:DIR")
  dd, name, text_field, text_b_field = _load(spec)
  return task_from_datasets(dd, name, ft, text_field, text_b_field)
