"""The offline task suite, built from the Python standard library's own source.

The functions come from the same files as the `stdlib` pretraining corpus
(`tfx.data.sources.stdlib_files`: the running interpreter's standard library minus test
packages), parsed with `ast`: every function at module level and every method of a module-level
class, dedented, with at least `finetune.min_function_lines` lines. Functions whose source text
occurs more than once are dropped (all copies), so no text is in two splits or two classes.

- `stdlib:package`: a function's source -> the top-level package it belongs to (`email`,
  `asyncio`, ...). The classes are the `finetune.stdlib_classes` packages with the most functions
  among those with at least 3 files that have functions (so that every split can hold whole
  files of every class). Files are held out whole: within each class, the largest files first
  (ties in stable-hash order) each go to the split furthest below its share of the functions,
  and the last files fill any split still empty (`tfx.tasks.base.assign_groups`). Caps per class: `max_train_examples // classes`
  and `max_eval_examples // classes` (0 = no cap), the first in stable-hash order.
- `stdlib:docstring`: (docstring, function without its docstring) -> 'match' if they come from
  the same function, 'mismatch' if the docstring is another function's from a different file of
  the same split. Files go to splits by the stable hash of their path; the first half of each
  split's functions (in stable-hash order) keep their docstring, the second half get another's:
  50/50 exactly up to one example. Caps: `max_train_examples` / `max_eval_examples` in all.

Overlap with pretraining: a model pretrained on `data.source=stdlib` has read every file these
tasks are built from, test files included (its own 2% held-out documents are chosen by another
rule). It has seen the raw text, never the labels: which package a function sits in is not part
of a file's text (relative imports and names may hint at it, for scratch models too), and the
docstring task's mismatched pairs never occur in the corpus. A pretrained model may still
recognise memorised functions; the tasks measure transfer from *this* corpus, not to unseen
code. The suite depends on the interpreter's version (3.11 and 3.12 have different files).
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import functools
import os
import textwrap

from tfx.data.sources import stdlib_files, stdlib_root
from tfx.tasks.base import Example, Task, assign_groups, cap_per_class, hash_order, hash_split

MIN_FILES_PER_CLASS = 3
MIN_DOCSTRING_CHARS = 20
MATCH_LABELS = ("mismatch", "match")


@dataclasses.dataclass(frozen=True)
class Function:
  """A function or method of the standard library.

  Attributes:
    file: path relative to the standard library, '/'-separated.
    package: the top-level package (directory) or module the file belongs to.
    name: 'func' or 'Class.method'.
    lineno: line of its `def`.
    source: its dedented source, from `def` to its last line (decorators excluded).
    docstring: its cleaned docstring, or None.
    body: the dedented source without the docstring's lines (only when `docstring` is set
      and stands on lines of its own), else None.
  """

  file: str
  package: str
  name: str
  lineno: int
  source: str
  docstring: str | None
  body: str | None

  @property
  def key(self) -> str:
    return f"{self.file}:{self.lineno}:{self.name}"


def _top_level_functions(tree: ast.Module):
  """(qualified name, node) of module-level functions and methods of module-level classes."""
  for node in tree.body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      yield node.name, node
    elif isinstance(node, ast.ClassDef):
      for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
          yield f"{node.name}.{item.name}", item


def _without_docstring(node, lines: list[str]) -> str | None:
  """The function's lines minus its docstring statement, dedented; None if that cannot be cut cleanly."""
  first = node.body[0]
  if len(node.body) < 2 or first.lineno <= node.lineno or node.body[1].lineno <= first.end_lineno:
    return None
  kept = lines[node.lineno - 1:first.lineno - 1] + lines[first.end_lineno:node.end_lineno]
  return textwrap.dedent("\n".join(kept))


def parse_functions(text: str, file: str, package: str, min_lines: int) -> list[Function]:
  """The functions of one file's source (none if it does not parse)."""
  try:
    tree = ast.parse(text)
  except (SyntaxError, ValueError):
    return []
  lines = text.splitlines()
  out = []
  for name, node in _top_level_functions(tree):
    if node.end_lineno - node.lineno + 1 < min_lines:
      continue
    docstring = ast.get_docstring(node, clean=True)
    body = _without_docstring(node, lines) if docstring else None
    source = textwrap.dedent("\n".join(lines[node.lineno - 1:node.end_lineno]))
    out.append(Function(file, package, name, node.lineno, source, docstring, body))
  return out


def package_of(relative_path: str) -> str:
  """'email/mime/text.py' -> 'email'; 'argparse.py' -> 'argparse'."""
  parts = relative_path.split("/")
  return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


@functools.lru_cache(maxsize=4)
def stdlib_functions(min_lines: int = 3, root: str | None = None) -> tuple[Function, ...]:
  """Every function of the standard library's files, in file order (cached per process)."""
  root = root or stdlib_root()
  out: list[Function] = []
  for path in stdlib_files(root):
    rel = os.path.relpath(path, root).replace(os.sep, "/")
    try:
      with open(path, encoding="utf-8") as f:
        text = f.read()
    except (UnicodeDecodeError, OSError):
      continue
    out.extend(parse_functions(text, rel, package_of(rel), min_lines))
  return tuple(out)


def _unique(functions, text_of) -> list[Function]:
  """The functions whose text_of(f) occurs once (duplicated texts are dropped, every copy)."""
  counts = collections.Counter(text_of(f) for f in functions)
  return [f for f in functions if counts[text_of(f)] == 1]


def choose_packages(functions: list[Function], num_classes: int) -> list[str]:
  """The `num_classes` packages with the most functions among those with >= 3 files (sorted by name)."""
  files: dict[str, set[str]] = collections.defaultdict(set)
  counts: collections.Counter = collections.Counter()
  for f in functions:
    files[f.package].add(f.file)
    counts[f.package] += 1
  eligible = [p for p in counts if len(files[p]) >= MIN_FILES_PER_CLASS]
  eligible.sort(key=lambda p: (-counts[p], p))
  return sorted(eligible[:num_classes])


def package_task(ft, *, root: str | None = None) -> Task:
  """`stdlib:package` (see the module docstring); `ft` is `config.finetune`."""
  functions = _unique(stdlib_functions(ft.min_function_lines, root), lambda f: f.source)
  labels = choose_packages(functions, ft.stdlib_classes)
  if len(labels) < 2:
    raise ValueError(f"stdlib:package found {len(labels)} package(s) with {MIN_FILES_PER_CLASS}+ files of functions "
                     f"in {root or stdlib_root()}; it needs at least 2")
  index = {p: i for i, p in enumerate(labels)}
  splits: dict[str, list[Example]] = {"train": [], "validation": [], "test": []}
  for package in labels:
    mine = [f for f in functions if f.package == package]
    sizes = collections.Counter(f.file for f in mine)
    where = assign_groups(dict(sizes), ft.validation_fraction, ft.test_fraction)
    for f in mine:
      splits[where[f.file]].append(Example(f.source, index[package], group=f.key))
  k = len(labels)
  caps = {"train": ft.max_train_examples // k, "validation": ft.max_eval_examples // k,
          "test": ft.max_eval_examples // k}
  for split, cap in caps.items():
    if (ft.max_train_examples if split == "train" else ft.max_eval_examples) and not cap:
      cap = 1  # a cap below one per class still keeps one of each
    splits[split] = cap_per_class(splits[split], cap, key=lambda e: e.group)
  notes = (f"{len(functions)} distinct stdlib functions ({ft.min_function_lines}+ lines) of {k} packages, "
           f"files held out whole; per-class caps train {caps['train'] or 'none'}, eval {caps['validation'] or 'none'}")
  return Task("stdlib:package", tuple(labels), splits, pair=False, notes=notes)


def _pairs(functions: list[Function]) -> list[Example]:
  """First half (hash order) keep their own docstring (match), the second half get the docstring of
  another function from a different file (mismatch)."""
  n = len(functions)
  half = (n + 1) // 2
  out = []
  for i, f in enumerate(functions):
    if i < half:
      out.append(Example(f.docstring, 1, text_b=f.body, group=f.key))
      continue
    j = (i + half) % n  # a partner from the other half, then onwards until another file
    for step in range(n):
      other = functions[(j + step) % n]
      if other.file != f.file and other.docstring != f.docstring:
        out.append(Example(other.docstring, 0, text_b=f.body, group=f.key))
        break
  return out


def docstring_task(ft, *, root: str | None = None) -> Task:
  """`stdlib:docstring` (see the module docstring); `ft` is `config.finetune`."""
  functions = [f for f in stdlib_functions(ft.min_function_lines, root)
               if f.body is not None and len(f.docstring) >= MIN_DOCSTRING_CHARS]
  functions = _unique(_unique(functions, lambda f: f.docstring), lambda f: f.body)
  by_split: dict[str, list[Function]] = {"train": [], "validation": [], "test": []}
  for f in functions:
    by_split[hash_split(f.file, ft.validation_fraction, ft.test_fraction)].append(f)
  splits = {}
  for split, mine in by_split.items():
    cap = ft.max_train_examples if split == "train" else ft.max_eval_examples
    mine = hash_order(mine, key=lambda f: f.key)
    splits[split] = _pairs(mine[:cap] if cap else mine)
  notes = (f"{len(functions)} stdlib functions with a docstring of {MIN_DOCSTRING_CHARS}+ characters, files "
           f"hashed to splits; mismatches take a docstring from another file of the same split")
  return Task("stdlib:docstring", MATCH_LABELS, splits, pair=True, notes=notes)


STDLIB_TASKS = {"package": package_task, "docstring": docstring_task}
