"""Classification tasks for fine-tuning: `load_task(spec, config.finetune) -> Task`.

Task specs:
  stdlib:package     offline: a stdlib function's source -> its top-level package (~20 classes)
  stdlib:docstring   offline pair task: does this docstring belong to this function? (50/50)
  jsonl:PATH         JSON lines: a directory with train/validation/test.jsonl, or one file split by hash
  hf:glue:NAME       GLUE through `datasets` (online); hf:NAME[:CONFIG] any hub dataset; hf:DIR a saved one

Every task has train / validation / test splits fixed by stable hashes (no seed), capped by
`finetune.max_train_examples` / `finetune.max_eval_examples`.
"""

from tfx.errors import UserError
from tfx.tasks.base import SPLITS, Example, Task, format_balance, stable_hash
from tfx.tasks.files import TaskDataError
from tfx.tasks.metrics import classification_metrics, majority_baseline

TASK_FORMS = "stdlib:package, stdlib:docstring, jsonl:PATH (file or directory), hf:glue:NAME, hf:NAME[:CONFIG] or hf:DIR"


def load_task(spec: str, ft) -> Task:
  """Builds and checks the task of `spec` with the options of `ft` (`config.finetune`).

  Raises:
    UserError: an unknown spec, unreadable data, or a split left empty (the message says what to fix).
  """
  from tfx.tasks.files import jsonl_task
  from tfx.tasks.hub import hub_task
  from tfx.tasks.stdlib import STDLIB_TASKS

  kind, _, rest = (spec or "").partition(":")
  try:
    if kind == "stdlib":
      if rest not in STDLIB_TASKS:
        raise UserError(f"unknown stdlib task {spec!r}; choose one of {', '.join('stdlib:' + k for k in STDLIB_TASKS)}")
      task = STDLIB_TASKS[rest](ft)
    elif kind == "jsonl":
      if not rest:
        raise UserError("task 'jsonl:' needs a path: jsonl:DIR (train/validation/test.jsonl) or jsonl:FILE")
      task = jsonl_task(rest, ft)
    elif kind == "hf":
      task = hub_task(rest, ft)
    else:
      raise UserError(f"unknown task {spec!r}; tasks are {TASK_FORMS}")
    task.check()
  except UserError:
    raise
  except (ValueError, OSError) as e:
    raise UserError(str(e)) from e
  return task


__all__ = ["SPLITS", "TASK_FORMS", "Example", "Task", "TaskDataError", "classification_metrics", "format_balance",
           "load_task", "majority_baseline", "stable_hash"]
