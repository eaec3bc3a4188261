"""Errors a user can act on. Entry points print their message (no traceback) and exit 1."""


class UserError(ValueError):
  """Something in the config, the data or the workdir that the user must fix; the message says how."""


class DataError(UserError):
  """The data source, the corpus or the tokenizer cannot be used."""


# Messages of OS errors that libraries (orbax, tensorstore) re-raise as other types.
_OS_TEXT = {"No space left on device": 28, "Read-only file system": 30, "Permission denied": 13,
            "Disk quota exceeded": 122}


def _os_error(error: BaseException):
  """(errno, filename, text) of the OSError in `error`'s chain, or found in its message; else None."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, OSError) and error.errno:
      return error.errno, error.filename, error.strerror or str(error)
    for text, errno in _OS_TEXT.items():
      if text in str(error):
        return errno, None, text
    error = error.__cause__ or error.__context__
  return None


def explain(error: BaseException, workdir: str = "") -> str:
  """One line for an error that reached an entry point: a UserError's own message, an OS error with
  what to do (disk full, read-only, no permission), or an internal error pointing at --debug."""
  if isinstance(error, UserError):
    return str(error)
  found = _os_error(error)
  where = workdir or "the workdir"
  if found is not None:
    errno, filename, text = found
    name = f" ({filename})" if filename else ""
    if errno in (28, 122):
      return (f"the disk holding {where} is full{name}: {text}. Free space (or use a --workdir on another "
              f"disk) and run the same command: it resumes from the last checkpoint, which is kept")
    if errno in (13, 30, 1):
      return f"cannot write to {where}{name}: {text}. Use a writable --workdir (or fix its permissions)"
    return f"{text}{name} ({type(error).__name__}); check {where} and run the same command to resume"
  first = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
  return (f"internal error: {type(error).__name__}: {first} (this is a bug in tfx; run again with --debug for "
          f"the traceback and report it)")
