"""Config drift: what a resume may change, checked before anything in the workdir is written.

A resume compares the new config with the run's WORKDIR/config.json (only when the run has a
checkpoint: without one nothing can be misread). Changes fall in three kinds:

  meaning   the checkpoint would mean something else: model.* (but model.attention, model.remat,
            model.scan_unroll, model.relative_distance and model.loss_chunk, which compute the
            same function on tfx's rows), objective.*, data.seq_len, train.batch_size,
            train.seed. Refused unless --config.train.allow_config_change=true.
  corpus    what the model reads: data.source, tokenizer, vocab_size, max_documents, text_field,
            eval_fraction, tokenizer_sample_bytes. Refused unless data.allow_changed_corpus
            (the store's own identity check then names what changed) or train.allow_config_change.
  safe      everything else (steps, cadences, schedule length, checkpointing, logging, mesh, the
            guard's policy): allowed.

Allowed changes are written as one `config_changed` event record (with `override: true` when
train.allow_config_change let a refused one through). After the restore succeeded the loop writes
config.json and keeps the history as config.<step>.json.
"""

from typing import Any

import jax
import ml_collections
from etils import epath

from tfx import config as config_lib
from tfx.config import ConfigError
from tfx.data import store
from tfx.errors import DataError

SAME_FUNCTION_MODEL_KEYS = ("model.attention", "model.remat", "model.scan_unroll", "model.relative_distance",
                            "model.loss_chunk")
MEANING_KEYS = ("data.seq_len", "train.batch_size", "train.seed")
CORPUS_KEYS = ("data.source", "data.tokenizer", "data.vocab_size", "data.max_documents", "data.text_field",
               "data.eval_fraction", "data.tokenizer_sample_bytes")


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(flatten(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = list(value) if isinstance(value, tuple) else value
  return out


def kind(key: str) -> str:
  if key in SAME_FUNCTION_MODEL_KEYS:
    return "safe"
  if key.startswith(("model.", "objective.")) or key in MEANING_KEYS:
    return "meaning"
  if key in CORPUS_KEYS:
    return "corpus"
  return "safe"


# Settings of one invocation, not of the run: never a difference.
INVOCATION_KEYS = ("train.stop_after", "train.restore_step", "train.allow_config_change", "data.allow_changed_corpus",
                   "train.poison_step")


def differences(old: dict, new: dict) -> dict[str, tuple[Any, Any]]:
  """{key: (old, new)} of the leaves that differ; keys the old config lacks (fields added to tfx
  since the run started) take their defaults and are not differences, nor are INVOCATION_KEYS."""
  a, b = flatten(old), flatten(new)
  keys = sorted(set(a) | set(b))
  return {k: (a.get(k), b.get(k)) for k in keys
          if k in a and a.get(k) != b.get(k) and k not in INVOCATION_KEYS}


def check(config: ml_collections.ConfigDict, workdir, checkpoint_steps: tuple[int, ...]) -> dict[str, tuple[Any, Any]]:
  """The allowed differences between `config` and the run's config.json; raises ConfigError (or
  DataError for corpus changes only) listing the refused ones and the override.

  When the only checkpoint is step 0 (a model imported by `tfx.convert --from-hf`: no step has been
  trained), nothing but the model's own keys can be misread: the data, batch, seed and objective
  of its first training run are the user's to choose."""
  path = epath.Path(workdir) / "config.json"
  if not checkpoint_steps or not path.exists():
    return {}
  try:
    old = config_lib.from_json(path.read_text()).to_dict()
  except ValueError as e:
    raise ConfigError(f"{path} is not valid JSON ({e}); restore it from config.<step>.json beside it") from None
  diffs = differences(old, config.to_dict())
  override = config.train.get("allow_config_change", False)
  untrained = max(checkpoint_steps) == 0
  refused = {k: v for k, v in diffs.items()
             if (untrained and kind(k) == "meaning" and k.startswith("model.")) or
             (not untrained and kind(k) == "meaning") or
             (not untrained and kind(k) == "corpus" and not config.data.get("allow_changed_corpus", False))}
  if refused and not override:
    listed = "; ".join(f"{k}: {v[0]!r} -> {v[1]!r}" for k, v in refused.items())
    if all(kind(k) == "corpus" for k in refused):
      raise DataError(f"this run's checkpoints were trained on another corpus: {listed}. Restore the old data "
                      f"settings, use a new --workdir, or pass --config.data.allow_changed_corpus=true to continue "
                      f"on the new corpus")
    raise ConfigError(f"resuming {workdir} with a config that changes what its checkpoints mean: {listed}. "
                      f"Restore those settings, use a new --workdir, or pass "
                      f"--config.train.allow_config_change=true to resume anyway (recorded in metrics.jsonl)")
  return diffs


def record(writer, progress, step: int, diffs: dict, config) -> None:
  """One `config_changed` event and one console line for the allowed differences."""
  if not diffs:
    return
  override = any(kind(k) != "safe" for k in diffs) and config.train.get("allow_config_change", False)
  writer.event(step, "config_changed", changes={k: list(v) for k, v in diffs.items()}, override=bool(override))
  listed = ", ".join(f"{k} {v[0]!r} -> {v[1]!r}" for k, v in diffs.items())
  progress.note(f"config changed since the last run{' (train.allow_config_change)' if override else ''}: {listed}")


def write_config(config, workdir, step: int | None = None) -> None:
  """WORKDIR/config.json, and config.<step>.json to keep the history (process 0)."""
  if jax.process_index() != 0:
    return
  text = config_lib.to_json(config).encode()
  # whole or not at all: a kill mid-write must not leave a torn config.json that blocks every resume
  store.write_atomic(epath.Path(workdir) / "config.json", text)
  if step is not None:
    store.write_atomic(epath.Path(workdir) / f"config.{step}.json", text)
