"""Fine-tuning tasks and their metrics: hand-computed metrics, deterministic file-disjoint stdlib
splits, the 50/50 pair task, jsonl / hf: task reading and their errors. No model, no compilation."""

import collections
import hashlib
import json
import os

import ml_collections
import numpy as np
import pytest

from tfx.errors import UserError
from tfx.tasks import load_task, metrics
from tfx.tasks.base import Example, assign_groups, cap_per_class, hash_split, stable_hash
from tfx.tasks.hub import task_from_datasets
from tfx.tasks.rows import fit_pair, layout_row, role_ids, train_indices
from tfx.tasks.stdlib import package_of, parse_functions


def finetune_cfg(**changes) -> ml_collections.ConfigDict:
  """configs/base.py's finetune section with changes."""
  from configs import base

  ft = base.get_config().finetune
  for k, v in changes.items():
    ft[k] = v
  return ft


SMOKE = dict(max_train_examples=600, max_eval_examples=200)


# ----------------------------------------------------------------------------- metrics


def test_metrics_against_hand_computed_values():
  y = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2, 2])
  p = np.array([0, 1, 0, 1, 2, 2, 2, 0, 2, 2])
  cm = metrics.confusion_matrix(y, p, 3)
  np.testing.assert_array_equal(cm, [[2, 1, 0], [0, 1, 1], [1, 0, 4]])
  assert metrics.accuracy(y, p) == 0.7
  # F1 = 2TP / (2TP + FP + FN): class 0: 4/(4+1+1); class 1: 2/(2+1+1); class 2: 8/(8+1+1)
  assert metrics.macro_f1(y, p, 3) == pytest.approx((4 / 6 + 2 / 4 + 8 / 10) / 3)
  # binary: TP=3 TN=4 FP=1 FN=2 -> (12 - 2) / sqrt(4 * 5 * 5 * 6)
  yb = np.array([1, 1, 1, 1, 1, 0, 0, 0, 0, 0])
  pb = np.array([1, 1, 1, 0, 0, 0, 0, 0, 0, 1])
  assert metrics.matthews(yb, pb) == pytest.approx(10 / np.sqrt(4 * 5 * 5 * 6))
  assert set(metrics.classification_metrics(yb, pb, 2)) == {"accuracy", "macro_f1", "mcc"}
  assert set(metrics.classification_metrics(y, p, 3)) == {"accuracy", "macro_f1"}


def test_metrics_degenerate_cases():
  y = np.array([0, 0, 1, 1, 1])
  only = np.ones(5, int)  # one class predicted only
  assert metrics.accuracy(y, only) == 0.6
  assert metrics.macro_f1(y, only, 2) == pytest.approx((0.0 + 6 / 8) / 2)  # class 0 never predicted: F1 0
  assert metrics.matthews(y, only) == 0.0  # undefined (an empty column) -> 0
  assert metrics.matthews(y, y) == 1.0 and metrics.matthews(y, 1 - y) == -1.0
  # a class absent from labels and predictions (class 2 of 3) is left out of the macro average
  assert metrics.macro_f1(y, y, 3) == 1.0
  # absent from the labels but predicted: counts, with F1 0
  assert metrics.macro_f1(np.array([0, 0]), np.array([0, 2]), 3) == pytest.approx((2 / 3 + 0.0) / 2)
  baseline = metrics.majority_baseline(np.array([2, 2, 1]), y, 3)
  assert baseline["majority_class"] == 2 and baseline["accuracy"] == 0.0


def test_metrics_match_scikit_learn_when_installed():
  sk = pytest.importorskip("sklearn.metrics")
  rng = np.random.default_rng(0)
  for k in (2, 3, 5):
    y, p = rng.integers(0, k, 50), rng.integers(0, k - 1, 50)
    assert metrics.macro_f1(y, p, k) == pytest.approx(sk.f1_score(y, p, average="macro", zero_division=0))
    if k == 2:
      assert metrics.matthews(y, p) == pytest.approx(sk.matthews_corrcoef(y, p))


# ----------------------------------------------------------------------------- split helpers


def test_stable_hash_and_group_assignment():
  assert stable_hash("x") == int.from_bytes(hashlib.sha256(b"x").digest()[:8], "big")  # not the salted hash()
  sizes = {"big.py": 100, "a.py": 1, "b.py": 1}
  where = assign_groups(sizes, 0.15, 0.15)
  assert where["big.py"] == "train" and sorted(where.values()) == ["test", "train", "validation"]
  even = {f"f{i}.py": 10 for i in range(4)}  # no split left empty, whatever the sizes
  assert set(assign_groups(even, 0.15, 0.15).values()) == {"train", "validation", "test"}
  assert assign_groups(even, 0.15, 0.15) == assign_groups(dict(reversed(list(even.items()))), 0.15, 0.15)
  counts = collections.Counter(hash_split(str(i), 0.2, 0.1) for i in range(5000))
  assert abs(counts["test"] / 5000 - 0.1) < 0.02 and abs(counts["validation"] / 5000 - 0.2) < 0.02
  capped = cap_per_class([Example(str(i), i % 2, group=str(i)) for i in range(10)], 2, key=lambda e: e.group)
  assert collections.Counter(e.label for e in capped) == {0: 2, 1: 2}


def test_parse_functions():
  source = '''
def short():
  return 1

class K:
  def method(self, x):
    """Return x doubled, carefully."""
    y = x * 2
    return y

  def nested(self):
    def inner():
      return 2
    return inner()
'''
  fns = parse_functions(source, "pkg/mod.py", package_of("pkg/mod.py"), 3)
  assert [f.name for f in fns] == ["K.method", "K.nested"]  # short() has 2 lines; inner is not separate
  method = fns[0]
  assert method.package == "pkg" and method.source.startswith("def method(self, x):\n")
  assert method.docstring == "Return x doubled, carefully."
  assert method.body == "def method(self, x):\n  y = x * 2\n  return y"
  assert fns[1].docstring is None and package_of("argparse.py") == "argparse"


# ----------------------------------------------------------------------------- stdlib tasks


def test_stdlib_package_task():
  ft = finetune_cfg(**SMOKE)
  task = load_task("stdlib:package", ft)
  again = load_task("stdlib:package", finetune_cfg(**SMOKE))
  assert task.splits == again.splits and task.labels == again.labels  # deterministic
  assert 10 <= task.num_classes <= 20 and list(task.labels) == sorted(task.labels) and not task.pair
  files = {s: {e.group.split(":")[0] for e in task.splits[s]} for s in task.splits}
  assert not (files["train"] & files["validation"]) and not (files["train"] & files["test"])
  assert not (files["validation"] & files["test"])  # held out by file
  texts = [e.text for s in task.splits.values() for e in s]
  assert len(texts) == len(set(texts))
  for e in task.splits["train"][:50]:  # the label is the top-level package of the file
    assert task.labels[e.label] == package_of(e.group.split(":")[0])
  balance = task.balance()
  cap = SMOKE["max_train_examples"] // task.num_classes
  assert max(balance["train"].values()) <= cap and sum(balance["train"].values()) >= 0.8 * cap * task.num_classes
  assert all(n >= 1 for split in balance.values() for n in split.values())  # every class in every split
  assert sum(balance["test"].values()) <= SMOKE["max_eval_examples"]


def test_stdlib_docstring_task_is_balanced_and_file_disjoint():
  task = load_task("stdlib:docstring", finetune_cfg(**SMOKE))
  assert task.pair and task.labels == ("mismatch", "match")
  assert task.splits == load_task("stdlib:docstring", finetune_cfg(**SMOKE)).splits
  for split, examples in task.splits.items():
    counts = collections.Counter(e.label for e in examples)
    assert abs(counts[0] - counts[1]) <= 1, (split, counts)
  files = {s: {e.group.split(":")[0] for e in task.splits[s]} for s in task.splits}
  assert not (files["train"] & files["test"]) and not (files["validation"] & files["test"])
  assert not (files["train"] & files["validation"])
  assert len(task.splits["train"]) == SMOKE["max_train_examples"]
  # a match pairs a function's own docstring with its body, which no longer contains it
  match = next(e for e in task.splits["test"] if e.label == 1)
  assert match.text not in match.text_b and match.text_b.startswith(("def ", "async def "))


# ----------------------------------------------------------------------------- jsonl tasks


def write_jsonl(path, records):
  with open(path, "w") as f:
    for r in records:
      f.write(json.dumps(r) + "\n")


def test_jsonl_directory_with_custom_fields(tmp_path):
  rec = lambda i, y: {"sentence": f"text {i}", "other": f"second {i}", "gold": y}
  write_jsonl(tmp_path / "train.jsonl", [rec(i, ["neg", "pos"][i % 2]) for i in range(20)])
  write_jsonl(tmp_path / "validation.jsonl", [rec(i, "pos") for i in range(20, 24)])
  write_jsonl(tmp_path / "test.jsonl", [rec(i, "neg") for i in range(24, 30)])
  ft = finetune_cfg(text_field="sentence", text_b_field="other", label_field="gold")
  task = load_task(f"jsonl:{tmp_path}", ft)
  assert task.labels == ("neg", "pos") and task.pair
  assert [len(task.splits[s]) for s in ("train", "validation", "test")] == [20, 4, 6]
  first = next(e for e in task.splits["train"] if e.text == "text 3")
  assert first.text_b == "second 3" and first.label == 1
  # integer labels in numeric order; one file split by text hash, deterministically
  write_jsonl(tmp_path / "all.jsonl", [{"text": f"t{i}", "label": i % 3 * 5} for i in range(300)])
  single = load_task(f"jsonl:{tmp_path / 'all.jsonl'}", finetune_cfg())
  assert single.labels == ("0", "5", "10") and not single.pair
  assert sum(len(v) for v in single.splits.values()) == 300
  assert 20 < len(single.splits["test"]) < 80 and single.splits == load_task(
      f"jsonl:{tmp_path / 'all.jsonl'}", finetune_cfg()).splits


def test_jsonl_errors(tmp_path):
  write_jsonl(tmp_path / "train.jsonl", [{"text": "a", "label": "x"}, {"text": "b", "label": "y"}])
  write_jsonl(tmp_path / "test.jsonl", [{"text": "c", "label": "z"}])
  with pytest.raises(UserError, match=r"test.jsonl:1: label 'z' is not one of the task's labels \['x', 'y'\]"):
    load_task(f"jsonl:{tmp_path}", finetune_cfg())
  write_jsonl(tmp_path / "test.jsonl", [{"sentence": "c", "label": "x"}])
  with pytest.raises(UserError, match=r"test.jsonl:1: record has no field 'text'.*finetune.text_field"):
    load_task(f"jsonl:{tmp_path}", finetune_cfg())
  os.makedirs(tmp_path / "empty")
  with pytest.raises(UserError, match="needs train.jsonl"):
    load_task(f"jsonl:{tmp_path / 'empty'}", finetune_cfg())
  with pytest.raises(UserError, match="unknown task"):
    load_task("csv:x", finetune_cfg())
  with pytest.raises(UserError, match="stdlib:package, stdlib:docstring"):
    load_task("stdlib:modules", finetune_cfg())


# ----------------------------------------------------------------------------- hf: tasks


def glue_like(datasets, test_labels):
  features = datasets.Features({"sentence": datasets.Value("string"),
                                "label": datasets.ClassLabel(names=["negative", "positive"])})
  make = lambda n, labels: datasets.Dataset.from_dict(
      {"sentence": [f"s{i} {labels[i % len(labels)]}" for i in range(n)], "label": [labels[i % len(labels)]
                                                                                  for i in range(n)]}, features=features)
  return datasets.DatasetDict(train=make(100, [0, 1]), validation=make(20, [0, 1]), test=make(10, test_labels))


def test_hf_task_from_a_saved_dataset_directory(tmp_path, monkeypatch):
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  datasets = pytest.importorskip("datasets")
  glue_like(datasets, [0, 1]).save_to_disk(str(tmp_path / "saved"))
  ft = finetune_cfg(text_field="sentence")
  task = load_task(f"hf:{tmp_path / 'saved'}", ft)
  assert task.labels == ("negative", "positive") and not task.pair
  assert [len(task.splits[s]) for s in ("train", "validation", "test")] == [100, 20, 10]
  # GLUE-style hidden test labels (-1): validation becomes test, validation is held out of train
  hidden = task_from_datasets(glue_like(datasets, [-1]), "glue:sst2", ft, "sentence")
  assert len(hidden.splits["test"]) == 20 and "not public" in hidden.notes
  assert len(hidden.splits["train"]) + len(hidden.splits["validation"]) == 100 and hidden.splits["validation"]
  with pytest.raises(UserError, match="regression"):
    load_task("hf:glue:stsb", ft)


# ----------------------------------------------------------------------------- model rows


def test_row_layouts_and_truncation():
  ids = {"eos": 1, "bos": 3, "sep": 6, "cls": 5}
  a, b = np.array([10, 11, 12]), np.array([20, 21])
  assert layout_row(a, b, "encoder", ids, 16)[:2] == ([5, 10, 11, 12, 6, 20, 21, 6], [0] * 5 + [1] * 3)
  assert layout_row(a, None, "decoder", ids, 16)[:2] == ([3, 10, 11, 12, 1], [0] * 5)
  assert layout_row(a, b, "encoder_decoder", ids, 16)[0] == [10, 11, 12, 6, 20, 21, 1]
  assert layout_row(a, b, "xlnet", ids, 16)[:2] == ([10, 11, 12, 6, 20, 21, 6, 5], [0] * 4 + [1] * 3 + [2])
  tokens, _, cut = layout_row(np.arange(100, 130), np.arange(200, 204), "encoder", ids, 16)
  assert len(tokens) == 16 and cut and tokens[-5:] == [200, 201, 202, 203, 6]  # the longer text is cut
  assert fit_pair(30, 4, 13) == (9, 4) and fit_pair(30, 30, 13) == (7, 6)
  assert fit_pair(3, 4, 13) == (3, 4)

  class NoSep:
    eos_id, bos_id, sep_id, cls_id = 1, None, None, None

  assert role_ids(NoSep()) == {"eos": 1, "bos": 1, "sep": 1, "cls": 1}


def test_train_order_is_a_function_of_seed_and_step():
  n, batch = 10, 4
  steps = [train_indices(n, batch, 7, s) for s in range(5)]  # 20 draws = 2 epochs
  flat = np.concatenate(steps)
  assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
  np.testing.assert_array_equal(train_indices(n, batch, 7, 3), steps[3])
  assert not np.array_equal(train_indices(n, batch, 8, 0), steps[0])
