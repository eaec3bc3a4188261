"""Classification metrics, computed in numpy on the host from integer labels and predictions.

Conventions (those of scikit-learn with `zero_division=0`, so results can be compared):
- macro-F1 averages the per-class F1 = 2 TP / (2 TP + FP + FN) over the classes that occur in
  the labels *or* the predictions; a class that occurs in neither is left out, and one that is
  never predicted (or never correct) counts 0.
- Matthews correlation (binary tasks, class 1 positive) is 0 when it is undefined (a row or a
  column of the confusion matrix is empty, e.g. one class predicted only).
"""

from __future__ import annotations

import math

import numpy as np


def confusion_matrix(labels: np.ndarray, predictions: np.ndarray, num_classes: int) -> np.ndarray:
  """int64 [k, k]: entry (i, j) counts examples of class i predicted as j."""
  labels, predictions = np.asarray(labels, np.int64), np.asarray(predictions, np.int64)
  if labels.shape != predictions.shape:
    raise ValueError(f"labels {labels.shape} and predictions {predictions.shape} differ in shape")
  out = np.zeros((num_classes, num_classes), np.int64)
  np.add.at(out, (labels, predictions), 1)
  return out


def accuracy(labels: np.ndarray, predictions: np.ndarray) -> float:
  labels, predictions = np.asarray(labels), np.asarray(predictions)
  return float(np.mean(labels == predictions)) if labels.size else float("nan")


def per_class_f1(cm: np.ndarray) -> np.ndarray:
  """float64 [k]: 2 TP / (2 TP + FP + FN) per class; 0 where the denominator is 0."""
  tp = np.diag(cm).astype(np.float64)
  fp = cm.sum(axis=0) - tp
  fn = cm.sum(axis=1) - tp
  denominator = 2 * tp + fp + fn
  return np.where(denominator > 0, 2 * tp / np.maximum(denominator, 1), 0.0)


def macro_f1(labels: np.ndarray, predictions: np.ndarray, num_classes: int) -> float:
  """Mean per-class F1 over the classes present in the labels or the predictions."""
  cm = confusion_matrix(labels, predictions, num_classes)
  present = (cm.sum(axis=0) + cm.sum(axis=1)) > 0
  return float(per_class_f1(cm)[present].mean()) if present.any() else float("nan")


def matthews(labels: np.ndarray, predictions: np.ndarray) -> float:
  """Matthews correlation of a binary task (labels 0 / 1); 0 when undefined."""
  cm = confusion_matrix(labels, predictions, 2).astype(np.float64)
  (tn, fp), (fn, tp) = cm
  denominator = math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
  return float((tp * tn - fp * fn) / denominator) if denominator else 0.0


def classification_metrics(labels: np.ndarray, predictions: np.ndarray, num_classes: int) -> dict[str, float]:
  """accuracy, macro_f1, and mcc for binary tasks."""
  out = {"accuracy": accuracy(labels, predictions), "macro_f1": macro_f1(labels, predictions, num_classes)}
  if num_classes == 2:
    out["mcc"] = matthews(labels, predictions)
  return out


def majority_baseline(train_labels: np.ndarray, labels: np.ndarray, num_classes: int) -> dict[str, float]:
  """Metrics of always predicting the most frequent train class (the lowest index on ties)."""
  majority = int(np.argmax(np.bincount(np.asarray(train_labels, np.int64), minlength=num_classes)))
  predictions = np.full(np.shape(labels), majority, np.int64)
  return dict(classification_metrics(labels, predictions, num_classes), majority_class=majority)
