"""Registries: how `train` finds model families and objectives by name.

A registry maps a name to an object (a class or a factory). Registering a name twice is an
error, and asking for an unknown name lists the known ones, so a typo in a config fails with
a message that says what exists.
"""

from typing import Any, Callable, TypeVar

T = TypeVar("T")


class Registry:
  """A named table of plug-ins of one kind (`family`, `objective`, ...)."""

  def __init__(self, kind: str):
    self.kind = kind
    self._items: dict[str, Any] = {}

  def register(self, name: str) -> Callable[[T], T]:
    """Decorator: `@FAMILIES.register("decoder")`."""

    def wrap(obj: T) -> T:
      if name in self._items:
        raise ValueError(f"{self.kind} {name!r} is registered twice")
      self._items[name] = obj
      return obj

    return wrap

  def get(self, name: str) -> Any:
    if name not in self._items:
      known = ", ".join(sorted(self._items)) or "(none)"
      raise ValueError(f"unknown {self.kind} {name!r}; known {self.kind}s: {known}")
    return self._items[name]

  def names(self) -> list[str]:
    return sorted(self._items)

  def __contains__(self, name: str) -> bool:
    return name in self._items


# Model families: name -> tfx.models.Family subclass (a linen Module factory).
FAMILIES = Registry("model family")
# Objectives: name -> tfx.objectives.Objective subclass.
OBJECTIVES = Registry("objective")


def load_builtins() -> None:
  """Imports the built-in families and objectives so that they register themselves."""
  import tfx.models  # noqa: F401
  import tfx.objectives  # noqa: F401
