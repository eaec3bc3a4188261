"""Registries: how the tools find model families and objectives by name.

A registry maps a name to an object (a class or a factory). Registering a name twice is an
error, and asking for an unknown name lists the known ones, so a typo in a config fails with
a message that says what exists.

A name may also point outside the package, so that an experiment can carry its own plug-in:

    objective.name = "experiments/my_study/my_objective.py:MyObjective"   # a file
    objective.name = "my_package.objectives:MyObjective"                  # an importable module

The class is loaded once per process (a file becomes the module `tfx_user.<stem>_<hash>`), and
checked against the registry's interface (`Registry(kind, base=...)`).
"""

import hashlib
import importlib
import importlib.util
import os
import sys
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class Registry:
  """A named table of plug-ins of one kind (`family`, `objective`, ...)."""

  def __init__(self, kind: str, base: Callable[[], type] | None = None):
    self.kind = kind
    self._items: dict[str, Any] = {}
    self._base = base  # () -> the class every plug-in must subclass (imported lazily)

  def register(self, name: str) -> Callable[[T], T]:
    """Decorator: `@FAMILIES.register("decoder")`."""

    def wrap(obj: T) -> T:
      if name in self._items:
        raise ValueError(f"{self.kind} {name!r} is registered twice")
      self._items[name] = obj
      return obj

    return wrap

  def get(self, name: str) -> Any:
    """The plug-in registered as `name`, or the class `name` points to (`file.py:Class`, `module:Class`)."""
    if is_spec(name):
      return self._check(name, load_spec(name, self.kind))
    if name not in self._items:
      known = ", ".join(sorted(self._items)) or "(none)"
      raise ValueError(f"unknown {self.kind} {name!r}; known: {known} (or a class outside the package: "
                       f"path/to/file.py:ClassName or package.module:ClassName)")
    return self._items[name]

  def names(self) -> list[str]:
    return sorted(self._items)

  def items(self) -> list[tuple[str, Any]]:
    return sorted(self._items.items())

  def __contains__(self, name: str) -> bool:
    if is_spec(name):
      try:
        self.get(name)
      except ValueError:
        return False
      return True
    return name in self._items

  def _check(self, spec: str, obj: Any) -> Any:
    base = self._base() if self._base else None
    if base is not None and not (isinstance(obj, type) and issubclass(obj, base)):
      raise ValueError(f"{self.kind} {spec!r} is not a subclass of {base.__module__}.{base.__qualname__}; "
                       f"a {self.kind} must subclass it")
    return obj


def is_spec(name: str) -> bool:
  """Whether `name` points outside the registry (`path.py:Class` or `module:Class`)."""
  return ":" in name


def split_spec(spec: str) -> tuple[str, str]:
  """'a/b.py:Cls' -> ('a/b.py', 'Cls'); 'pkg.mod:Cls' -> ('pkg.mod', 'Cls')."""
  where, _, attr = spec.rpartition(":")
  return where, attr


def spec_is_file(spec: str) -> bool:
  where, _ = split_spec(spec)
  return where.endswith(".py") or os.sep in where or "/" in where


def load_spec(spec: str, kind: str = "plug-in") -> Any:
  """The object `spec` names; a ValueError that says what is wrong when it cannot be loaded."""
  where, attr = split_spec(spec)
  if not where or not attr or not attr.isidentifier():
    raise ValueError(f"{kind} {spec!r}: expected path/to/file.py:ClassName or package.module:ClassName")
  if spec_is_file(spec):
    module = _load_file(where, kind, spec)
  else:
    try:
      module = importlib.import_module(where)
    except ImportError as e:
      raise ValueError(f"{kind} {spec!r}: cannot import module {where!r} ({e}); is it installed or on PYTHONPATH?"
                       ) from None
  if not hasattr(module, attr):
    names = sorted(n for n, v in vars(module).items() if isinstance(v, type) and not n.startswith("_"))
    raise ValueError(f"{kind} {spec!r}: {where} has no {attr!r}; its classes: {', '.join(names) or '(none)'}")
  return getattr(module, attr)


def _load_file(path: str, kind: str, spec: str):
  full = os.path.abspath(path)
  if not os.path.isfile(full):
    raise ValueError(f"{kind} {spec!r}: file {path!r} does not exist (paths are relative to the current directory "
                     f"{os.getcwd()})")
  stem = os.path.splitext(os.path.basename(full))[0]
  name = f"tfx_user.{''.join(c if c.isalnum() else '_' for c in stem)}_{hashlib.sha1(full.encode()).hexdigest()[:8]}"
  if name in sys.modules:
    return sys.modules[name]
  # The file may import its neighbours (`from my_helpers import ...`): its folder joins the path.
  folder = os.path.dirname(full)
  if folder not in sys.path:
    sys.path.append(folder)
  module_spec = importlib.util.spec_from_file_location(name, full)
  module = importlib.util.module_from_spec(module_spec)
  sys.modules[name] = module  # dataclasses and pickle-free reloading look modules up by name
  try:
    module_spec.loader.exec_module(module)
  except Exception as e:  # a user's file: say which one failed and why, not where in tfx
    del sys.modules[name]
    raise ValueError(f"{kind} {spec!r}: importing {path} failed: {type(e).__name__}: {e}") from e
  return module


def file_sha256(path: str) -> str:
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()


def _family_base():
  from tfx.models.base import Family

  return Family


def _objective_base():
  from tfx.objectives.base import Objective

  return Objective


# Model families: name -> tfx.models.Family subclass (a linen Module factory).
FAMILIES = Registry("model family", base=_family_base)
# Objectives: name -> tfx.objectives.Objective subclass.
OBJECTIVES = Registry("objective", base=_objective_base)


def load_builtins() -> None:
  """Imports the built-in families and objectives so that they register themselves."""
  import tfx.models  # noqa: F401
  import tfx.objectives  # noqa: F401
