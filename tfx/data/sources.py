"""Text sources: turn a ``data.source`` string into a stream (or a list) of documents.

Accepted forms (see :func:`load_documents`):

- ``stdlib``: the ``.py`` files of the running interpreter's standard library
    (minus test packages), one document per file, sorted by relative path.
- ``text:GLOB``: local files matched by ``glob.glob(GLOB, recursive=True)``.
    ``.jsonl`` / ``.json`` (and ``.jsonl.gz`` / ``.json.gz``) files are read as JSON lines (one
    document per line, taken from ``text_field``), ``.parquet`` files one row at a time (the
    ``text_field`` column, as FineWeb and the hub's Parquet exports ship); any other file is one document.
- ``hf:NAME`` or ``hf:NAME:CONFIG``: the ``train`` split of a Hugging Face hub
    dataset (needs network access, or a warm local cache); ``tfx.prepare`` streams it.

Everything except ``hf:`` is offline and deterministic: the same source gives
the same documents in the same order on every run and every host.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import gzip
import json
import os
import sysconfig
import zlib
from typing import Iterable, Iterator

ACCEPTED_FORMS = ("'stdlib', 'text:GLOB' (e.g. 'text:data/**/*.txt'), 'hf:NAME[:CONFIG]', or 'prepared:DIR' (a "
                  "token store made by python -m tfx.prepare)")

# Directory names whose contents are never part of the ``stdlib`` corpus.
_STDLIB_EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)
_JSON_LINES_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
_PARQUET_SUFFIX = ".parquet"
_PARQUET_BATCH_ROWS = 1024  # rows decoded at a time: a few MB of text, whatever the file's row groups


@dataclasses.dataclass
class Corpus:
  """A list of text documents and where they came from.

  Attributes:
      documents: the document texts, in a deterministic order.
      names: one name per document: a file path, ``PATH:LINE`` for a JSON-lines
          record, ``PATH#ROW`` (from 0) for a Parquet row, or ``hf:NAME#index`` for a hub record.
      skipped: reason -> number of inputs skipped for that reason (``"empty"``,
          ``"undecodable"``).
      source: the source string the corpus was loaded from.
  """

  documents: list[str]
  names: list[str]
  skipped: dict[str, int] = dataclasses.field(default_factory=dict)
  source: str = ""

  def __len__(self) -> int:
    return len(self.documents)

  @property
  def num_bytes(self) -> int:
    """Total UTF-8 size of the documents, in bytes."""
    return sum(len(d.encode("utf-8")) for d in self.documents)


def load_documents(source: str, *, text_field: str = "text", max_documents: int = 0) -> Corpus:
  """Loads the documents of a data source.

  Args:
      source: ``"stdlib"``, ``"text:GLOB"`` or ``"hf:NAME[:CONFIG]"``.
      text_field: the field holding the text in JSON-lines and Parquet files and hub datasets.
      max_documents: if > 0, keep only the first ``max_documents`` documents.

  Returns:
      A :class:`Corpus` whose documents are all non-empty (not whitespace-only).

  Raises:
      ValueError: unknown source form, a glob matching nothing, a malformed
          JSON-lines record, an unreachable hub dataset, or a source that leaves no
          documents once empty / undecodable inputs are skipped.
  """
  if not isinstance(source, str) or not source:
    raise ValueError(
        f"data source must be a non-empty string; accepted forms: {ACCEPTED_FORMS}")
  if max_documents < 0:
    raise ValueError(f"max_documents must be >= 0 (0 = all), got {max_documents}")
  skipped: collections.Counter[str] = collections.Counter()
  records = iter_documents(source, text_field=text_field, skipped=skipped)
  names: list[str] = []
  documents: list[str] = []
  for name, text in records:
    if max_documents and len(documents) >= max_documents:
      break
    names.append(name)
    documents.append(text)
  skipped_dict = {k: v for k, v in sorted(skipped.items()) if v}
  if not documents:
    raise ValueError(
        f"data source {source!r} produced no documents ({skipped['empty']} files empty, "
        f"{skipped['undecodable']} undecodable); point data.source at non-empty UTF-8 "
        f"text")
  return Corpus(documents=documents, names=names, skipped=skipped_dict, source=source)


def iter_documents(source: str, *, text_field: str = "text", skipped: collections.Counter | None = None,
                   streaming: bool = False) -> Iterator[tuple[str, str]]:
  """Streams ``(name, text)`` for every non-empty document of a source, in a fixed order.

  Nothing is held in memory beyond one file (one line for JSON-lines files, which may be
  gzip-compressed: ``.jsonl.gz``; 1024 rows for Parquet files). The source form is checked before the
  first document.

  Args:
      source: ``"stdlib"``, ``"text:GLOB"`` or ``"hf:NAME[:CONFIG]"``.
      text_field: the field holding the text in JSON-lines and Parquet files and hub datasets.
      skipped: a counter that receives the number of empty / undecodable inputs.
      streaming: ``hf:`` sources are streamed (``datasets``' ``streaming=True``: records arrive
          as they download, nothing is stored first) instead of downloaded whole.
  """
  if not isinstance(source, str) or not source:
    raise ValueError(
        f"data source must be a non-empty string; accepted forms: {ACCEPTED_FORMS}")
  skipped = collections.Counter() if skipped is None else skipped
  if source == "stdlib":
    return _read_files(stdlib_files(), skipped)
  if source.startswith("text:"):
    return _read_glob(source[len("text:"):], text_field, skipped)
  if source.startswith("hf:"):
    return _read_hub(source[len("hf:"):], text_field, skipped, streaming=streaming)
  raise ValueError(f"unknown data source {source!r}; accepted forms: {ACCEPTED_FORMS}")


def source_bytes(source: str) -> int | None:
  """Total size in bytes of a local source's files (for progress and ETA); None for ``hf:``."""
  if source == "stdlib":
    return sum(os.path.getsize(p) for p in stdlib_files())
  if source.startswith("text:"):
    return sum(_file_bytes(p) for p in glob.glob(source[len("text:"):], recursive=True) if os.path.isfile(p))
  return None


def _file_bytes(path: str) -> int:
  """A file's size; for a Parquet file the uncompressed size of its columns, which is nearer to the text
  it holds than the compressed file."""
  if path.lower().endswith(_PARQUET_SUFFIX):
    try:
      import pyarrow.parquet as pq

      meta = pq.ParquetFile(path).metadata
      return sum(meta.row_group(g).total_byte_size for g in range(meta.num_row_groups))
    except Exception:  # noqa: BLE001  (a damaged file is named when it is read, not when progress is sized)
      pass
  return os.path.getsize(path)


def stdlib_root() -> str:
  """Returns the directory of the running interpreter's standard library."""
  return sysconfig.get_paths()["stdlib"]


def stdlib_files(root: str | None = None) -> list[str]:
  """Lists the standard library's ``.py`` files, minus test packages.

  Args:
      root: the standard library directory (default: :func:`stdlib_root`).

  Returns:
      Absolute paths sorted by their path relative to ``root`` (with ``/``
      separators), so the order is the same on every run.
  """
  root = root or stdlib_root()
  found: list[tuple[str, str]] = []
  for dirpath, dirnames, filenames in os.walk(root):
    rel_dir = os.path.relpath(dirpath, root)
    parts = [] if rel_dir == "." else rel_dir.split(os.sep)
    if any(p in _STDLIB_EXCLUDED_DIRS for p in parts):
      dirnames[:] = []
      continue
    dirnames[:] = [d for d in dirnames if d not in _STDLIB_EXCLUDED_DIRS]
    for filename in filenames:
      if filename.endswith(".py"):
        rel = "/".join(parts + [filename])
        found.append((rel, os.path.join(dirpath, filename)))
  found.sort()
  return [path for _, path in found]


def _is_blank(text: str) -> bool:
  return not text.strip()


def _read_files(paths: Iterable[str], skipped: collections.Counter) -> Iterator[tuple[str, str]]:
  """Yields ``(path, text)`` for each file, skipping empty and non-UTF-8 ones."""
  for path in paths:
    text = _read_text(path, skipped)
    if text is not None:
      yield path, text


def _read_text(path: str, skipped: collections.Counter) -> str | None:
  with open(path, "rb") as f:
    raw = f.read()
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError:
    skipped["undecodable"] += 1
    return None
  if _is_blank(text):
    skipped["empty"] += 1
    return None
  return text


def _read_glob(pattern: str, text_field: str,
               skipped: collections.Counter) -> Iterator[tuple[str, str]]:
  if not pattern:
    raise ValueError(
        "data source 'text:' needs a glob after the colon, e.g. 'text:data/*.txt'")
  paths = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
  if not paths:
    raise ValueError(
        f"glob {pattern!r} (data.source='text:{pattern}') matched no files "
        f"(working directory: {os.getcwd()})")
  return _read_glob_files(paths, text_field, skipped)


def _read_glob_files(paths: list[str], text_field: str,
                     skipped: collections.Counter) -> Iterator[tuple[str, str]]:
  for path in paths:
    if path.lower().endswith(_JSON_LINES_SUFFIXES):
      yield from _read_json_lines(path, text_field, skipped)
    elif path.lower().endswith(_PARQUET_SUFFIX):
      yield from _read_parquet(path, text_field, skipped)
    else:
      text = _read_text(path, skipped)
      if text is not None:
        yield path, text


def _read_json_lines(path: str, text_field: str,
                     skipped: collections.Counter) -> Iterator[tuple[str, str]]:
  """Yields ``(PATH:LINE, text)`` for each record of a JSON-lines file, one line at a time; a
  damaged ``.gz`` is a ValueError naming the file (not an EOFError, nor an OSError that reads as
  a full disk)."""
  try:
    yield from _json_records(path, text_field, skipped)
  except (EOFError, gzip.BadGzipFile, zlib.error) as e:
    raise ValueError(f"{path}: damaged or not gzip-compressed ({type(e).__name__}: {e}); download it again, or "
                     f"decompress it and drop the .gz suffix") from None


def _json_records(path: str, text_field: str, skipped: collections.Counter) -> Iterator[tuple[str, str]]:
  opener = gzip.open if path.lower().endswith(".gz") else open
  with opener(path, "rb") as f:
    for line_number, raw in enumerate(f, start=1):
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError:
        skipped["undecodable"] += 1
        continue
      if not line.strip():
        continue
      where = f"{path}, line {line_number}"
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(
            f"{where}: not valid JSON ({e.msg}); each line must be one JSON object (the "
            f"shards prepared before this line are kept: fix the line and run again)") from None
      if not isinstance(record, dict) or text_field not in record:
        raise ValueError(
            f"{where}: record has no field {text_field!r}; set data.text_field to the field "
            f"that holds the text")
      value = record[text_field]
      if not isinstance(value, str):
        raise ValueError(
            f"{where}: field {text_field!r} is {type(value).__name__}, expected a string")
      if _is_blank(value):
        skipped["empty"] += 1
        continue
      yield f"{path}:{line_number}", value


def _read_parquet(path: str, text_field: str, skipped: collections.Counter) -> Iterator[tuple[str, str]]:
  """Yields ``(PATH#ROW, text)`` for each row of a Parquet file's ``text_field`` column, 1024 rows at a
  time (only that column is read). A null or blank value counts as empty; a file that is not Parquet, a
  missing column or one that does not hold strings is a ValueError naming the file."""
  import pyarrow as pa
  import pyarrow.parquet as pq

  def damaged(e: Exception) -> ValueError:
    return ValueError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e}); download it again, or "
                      f"give it another suffix if it is not Parquet")

  try:
    parquet = pq.ParquetFile(path)
  except (pa.ArrowException, OSError) as e:
    raise damaged(e) from None
  schema = parquet.schema_arrow
  if text_field not in schema.names:
    raise ValueError(f"{path}: has no column {text_field!r}; its columns are {schema.names}; set data.text_field "
                     f"to the column that holds the text")
  kind = schema.field(text_field).type
  if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
    raise ValueError(f"{path}: column {text_field!r} holds {kind}, expected strings; set data.text_field to the "
                     f"column that holds the text")
  values = (value for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=[text_field])
            for value in batch.column(0).to_pylist())  # str | None per row, read a batch at a time
  try:
    for row, value in enumerate(values):
      if value is None or _is_blank(value):
        skipped["empty"] += 1
        continue
      yield f"{path}#{row}", value
  except (pa.ArrowException, OSError) as e:
    raise damaged(e) from None


def _hub_offline_message(name: str, detail: str) -> str:
  return (f"hub dataset {name!r} could not be reached ({detail}); the machine looks offline or "
          f"HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set. Use data.source=stdlib or "
          f"data.source='text:GLOB' for local files instead")


def _read_hub(spec: str, text_field: str, skipped: collections.Counter, *,
              streaming: bool = False) -> Iterator[tuple[str, str]]:
  name, _, config = spec.partition(":")
  if not name:
    raise ValueError(
        "data source 'hf:' needs a dataset name, e.g. 'hf:wikitext:wikitext-2-raw-v1'")
  try:
    import datasets  # Lazy: importing datasets is slow and reads HF_* variables.
  except ImportError as e:
    raise ValueError(f"data source 'hf:{spec}' needs the 'datasets' package ({e})") from e
  try:
    dataset = datasets.load_dataset(name, config or None, split="train", streaming=streaming)
  except Exception as e:  # pylint: disable=broad-except
    if _looks_offline(e):
      raise ValueError(_hub_offline_message(name, f"{type(e).__name__}: {e}")) from e
    raise ValueError(
        f"could not load hub dataset 'hf:{spec}': {type(e).__name__}: {e}") from e
  columns = dataset.column_names
  if columns is not None and text_field not in columns:
    raise ValueError(
        f"hub dataset 'hf:{spec}' has no column {text_field!r}; its columns are "
        f"{dataset.column_names}; set data.text_field")
  return _hub_records(name, dataset, text_field, skipped)


def _hub_records(name: str, dataset, text_field: str,
                 skipped: collections.Counter) -> Iterator[tuple[str, str]]:
  # A streamed dataset yields records as they arrive; a downloaded one gives its column at once.
  texts = dataset[text_field] if hasattr(dataset, "__getitem__") else (r[text_field] for r in dataset)
  for index, text in enumerate(texts):
    if not isinstance(text, str) or _is_blank(text):
      skipped["empty"] += 1
      continue
    yield f"hf:{name}#{index}", text


def _looks_offline(error: BaseException) -> bool:
  """Whether a ``load_dataset`` failure is due to no network / offline mode."""
  if any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
         for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
    return True
  markers = ("offline", "connection", "network", "name resolution", "timed out", "timeout",
             "couldn't reach", "could not reach", "unreachable", "max retries")
  chain: BaseException | None = error
  while chain is not None:
    if isinstance(chain, (ConnectionError, TimeoutError)):
      return True
    text = f"{type(chain).__name__} {chain}".lower()
    if any(m in text for m in markers):
      return True
    chain = chain.__cause__ or chain.__context__
  return False
