"""Errors a user can act on. Entry points print their message (no traceback) and exit 1."""

import os
import sys


class UserError(ValueError):
  """Something in the config, the data or the workdir that the user must fix; the message says how."""


class DataError(UserError):
  """The data source, the corpus or the tokenizer cannot be used."""


# Messages of OS errors that libraries (orbax, tensorstore) re-raise as other types.
_OS_TEXT = {"No space left on device": 28, "Read-only file system": 30, "Permission denied": 13,
            "Disk quota exceeded": 122}


def _chain(error: BaseException | None):
  """`error`, then its cause (or the error it was raised while handling), and so on, each once."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    yield error
    error = error.__cause__ or error.__context__


def _os_error(error: BaseException):
  """(errno, filename, text) of the OSError in `error`'s chain, or found in its message; else None."""
  for link in _chain(error):
    if isinstance(link, OSError) and link.errno:
      return link.errno, link.filename, link.strerror or str(link)
    for text, errno in _OS_TEXT.items():
      if text in str(link):
        return errno, None, text
  return None


# XLA:GPU's Triton GEMM emitter finding no tiling for a matmul fused with its neighbours (a dimension
# no tile divides: NSP's and SOP's 113 rows a sequence, 112 masked slots and [CLS], in the last
# layer's output projection; T5-base's float32 decoder at 128 rows). XLA's limitation, not tfx's:
# with its Triton GEMMs off, cuBLAS runs every matmul and those steps compile
# (docs/performance/4-compile-only.md).
_TRITON_TILING = ("Couldn't find output tile sizes", "Failed to compute symbolic tile")


def _triton_tiling(error: BaseException) -> str | None:
  """The first line of XLA's runtime error in `error`'s chain if it is that tiling failure, else None."""
  for link in _chain(error):
    if type(link).__name__ in ("JaxRuntimeError", "XlaRuntimeError") and any(t in str(link) for t in _TRITON_TILING):
      first = str(link).strip().splitlines()[0]
      cut = first.rfind(" ", 0, 140)
      return first if len(first) <= 140 else first[:cut if cut > 0 else 140] + " ..."
  return None


def explain(error: BaseException, workdir: str = "") -> str:
  """One line for an error that reached an entry point: a UserError's own message, an OS error with
  what to do (disk full, read-only, no permission), XLA:GPU's Triton matmul tiling failure with its
  flag, or an internal error pointing at --debug."""
  if isinstance(error, UserError):
    return str(error)
  tiling = _triton_tiling(error)
  if tiling is not None:
    return ("XLA:GPU could not tile a matmul of this step for its Triton GEMM emitter (an XLA limitation "
            f"for a dimension no tile divides: {tiling}). Run the same "
            "command with XLA_FLAGS=\"$XLA_FLAGS --xla_gpu_enable_triton_gemm=false\" (cuBLAS for every matmul; "
            "a stopped run resumes from its last checkpoint)")
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


def _closed_loop_callback(unraisable) -> bool:
  """A tensorstore write finishing after orbax closed the asyncio loop of a failed async save: its
  completion callback calls `loop.call_soon_threadsafe` on the closed loop, and CPython reports that
  as an unraisable 'RuntimeError: Event loop is closed' traceback (several per failed save, printed
  while the run shuts down). The save's own error has already been raised and is explained."""
  error = unraisable.exc_value
  return isinstance(error, RuntimeError) and str(error) == "Event loop is closed"


def quiet_closed_loop_callbacks() -> None:
  """For the command line without --debug: drops the unraisable tracebacks of `_closed_loop_callback`
  (a full disk under an async save printed dozens of them before the one-line message); every other
  unraisable error goes to Python's default hook as before."""
  default = sys.__unraisablehook__

  def hook(unraisable):
    if not _closed_loop_callback(unraisable):
      default(unraisable)

  sys.unraisablehook = hook


def quiet_background(debug: bool) -> None:
  """An entry point's set-up without --debug: orbax logs a failed background save with its traceback
  and tensorstore's callbacks print theirs (the error itself is explained in one line instead)."""
  if debug:
    return
  from absl import logging as absl_logging

  absl_logging.set_verbosity(absl_logging.FATAL)
  quiet_closed_loop_callbacks()


def exit_with(prog: str, error: BaseException, workdir: str, command_line: bool) -> None:
  """Exits 1 with `error` explained in one line. On the command line the line is printed and stderr
  closed after it (orbax's background threads may still print while the interpreter shuts down);
  called from Python (`main(argv)`), it is SystemExit's message."""
  message = f"{prog}: {explain(error, workdir)}"
  if not command_line:
    sys.exit(message)
  print(message, file=sys.stderr, flush=True)
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, 2)
  sys.exit(1)
