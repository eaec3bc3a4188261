"""An objective's configuration is its dataclass fields.

    @dataclasses.dataclass(frozen=True)
    class MyObjective(Objective):
      # Share of the tokens that are predicted.
      rate: float = 0.15

`config.objective` holds `name` and the chosen objective's fields only: `rate` above, plus the
fields every objective inherits (`z_loss`). The comment lines right above a field (or its trailing
comment) are its documentation, printed by `python -m tfx.train --list-objectives`. A field that
is state rather than configuration (attached after construction, like `word_start`) is marked with
`internal()`.
"""

import ast
import dataclasses
import inspect
import textwrap
import tokenize
import typing
from typing import Any

CONFIG_TYPES = (bool, int, float, str)


def internal(default: Any = None) -> Any:
  """A dataclass field that is not configuration (never read from `config.objective`)."""
  return dataclasses.field(default=default, metadata={"config": False})


@dataclasses.dataclass(frozen=True)
class Option:
  """One configuration field of an objective."""

  name: str
  type: type
  default: Any
  doc: str


def options(cls) -> list[Option]:
  """The configuration fields of objective class `cls`, base-class fields first."""
  docs = field_docs(cls)
  hints = typing.get_type_hints(cls)
  out = []
  for f in dataclasses.fields(cls):
    if f.name == "ids" or not f.metadata.get("config", True):
      continue
    if f.default is dataclasses.MISSING:
      raise TypeError(f"objective {cls.__name__}: config field {f.name!r} needs a default")
    kind = hints.get(f.name, type(f.default))
    if kind not in CONFIG_TYPES:
      raise TypeError(f"objective {cls.__name__}: config field {f.name!r} has type {kind!r}; config fields are "
                      f"bool, int, float or str (mark other fields with tfx.objectives.internal())")
    out.append(Option(f.name, kind, f.default, f.metadata.get("doc") or docs.get(f.name, "")))
  return out


def field_docs(cls) -> dict[str, str]:
  """{field: its comment} from the source of `cls` and its base classes (subclasses win)."""
  docs: dict[str, str] = {}
  for klass in reversed(cls.__mro__):
    if not dataclasses.is_dataclass(klass) or klass is object:
      continue
    try:
      source = textwrap.dedent(inspect.getsource(klass))
    except (OSError, TypeError):
      continue
    lines = source.splitlines()
    tree = ast.parse(source)
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    for node in body:
      if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        doc = _comment_above(lines, node.lineno - 1) or _trailing_comment(lines[node.lineno - 1])
        if doc:
          docs[node.target.id] = doc
  return docs


def _comment_above(lines: list[str], index: int) -> str:
  out = []
  i = index - 1
  while i >= 0 and lines[i].strip().startswith("#"):
    out.insert(0, lines[i].strip()[1:].strip())
    i -= 1
  return " ".join(out)


def _trailing_comment(line: str) -> str:
  try:  # a '#' outside a string literal
    tokens = list(tokenize.generate_tokens(iter([line + "\n"]).__next__))
  except (tokenize.TokenError, SyntaxError):  # a line that does not tokenize alone has no usable comment
    return ""
  for tok in tokens:
    if tok.type == tokenize.COMMENT:
      return tok.string[1:].strip()
  return ""


def section(cls, values: dict[str, Any], *, name: str, strict: bool = True) -> dict[str, Any]:
  """`config.objective` for objective `cls`: {'name': name, every option: its value or default}.

  values: the section as given (without `name`). With `strict`, a key that is not an option of
  `cls` raises ValueError listing the options; otherwise it is dropped (a config.json written before
  objectives owned their fields holds every objective's fields).
  """
  opts = {o.name: o for o in options(cls)}
  unknown = sorted(set(values) - set(opts))
  if unknown and strict:
    raise ValueError(unknown_fields_message(name, unknown, opts.values()))
  out: dict[str, Any] = {"name": name}
  for key, opt in opts.items():
    out[key] = coerce(name, key, values[key], opt) if key in values else opt.default
  return out


def unknown_fields_message(name: str, unknown: list[str], opts) -> str:
  listed = ", ".join(f"{o.name} ({o.type.__name__}, default {o.default!r})" for o in opts)
  return (f"objective {name!r} has no field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
          f"its fields are: {listed or '(none)'}")


def coerce(name: str, key: str, value: Any, opt: Option) -> Any:
  """`value` as the option's type (ints are accepted for floats), or a ValueError."""
  if opt.type is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if opt.type is bool and not isinstance(value, bool) or not isinstance(value, opt.type) or (
      opt.type is int and isinstance(value, bool)):
    raise ValueError(f"objective.{key}={value!r} ({name}): expected a {opt.type.__name__}")
  return value


def describe(name: str, cls, families: tuple[str, ...]) -> str:
  """A few lines for `--list-objectives`: name, families, summary, fields with their comments."""
  summary = " ".join((inspect.getdoc(cls) or "").split("\n\n")[0].split())
  lines = [f"{name}  [{', '.join(families)}]", f"    {summary}"]
  for o in options(cls):
    lines.append(f"    {o.name}: {o.type.__name__} = {o.default!r}" + (f"  # {o.doc}" if o.doc else ""))
  return "\n".join(lines)
