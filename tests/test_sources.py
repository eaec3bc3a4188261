"""Tests for tfx.data.sources: the corpora a run reads (the stdlib corpus, text / jsonl / parquet
globs, the hub) and their errors (CPU, offline). The shared corpus fixtures are in conftest.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tfx.data import load_documents
from tfx.data import sources as sources_lib

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _relative(name: str) -> str:
  return os.path.relpath(name, sources_lib.stdlib_root()).replace(os.sep, "/")


def test_stdlib_corpus_is_sorted_real_and_free_of_tests(stdlib_corpus):
  corpus = stdlib_corpus
  assert len(corpus.documents) > 300
  assert len(corpus.documents) == len(corpus.names)
  assert corpus.num_bytes > 2_000_000
  relative = [_relative(n) for n in corpus.names]
  assert relative == sorted(relative)
  assert len(set(relative)) == len(relative)
  assert all(r.endswith(".py") for r in relative)
  banned = {"test", "tests", "idle_test", "site-packages"}
  for r in relative:
    assert not banned & set(r.split("/")[:-1]), r
  assert "os.py" in relative and "json/decoder.py" in relative
  assert all(d.strip() for d in corpus.documents)
  # Empty __init__.py files are skipped and counted, not silently lost.
  assert set(corpus.skipped) <= {"empty", "undecodable"}


def test_stdlib_corpus_is_deterministic(stdlib_corpus):
  again = load_documents("stdlib")
  assert again.names == stdlib_corpus.names
  assert again.documents == stdlib_corpus.documents
  first = load_documents("stdlib", max_documents=5)
  assert first.documents == stdlib_corpus.documents[:5]
  assert first.names == stdlib_corpus.names[:5]


def _write(path, content):
  path.parent.mkdir(parents=True, exist_ok=True)
  if isinstance(content, bytes):
    path.write_bytes(content)
  else:
    path.write_text(content, encoding="utf-8")
  return path


def test_text_glob_reads_text_and_jsonl(tmp_path):
  _write(tmp_path / "b.txt", "second file\n")
  _write(tmp_path / "a.txt", "first file")
  _write(tmp_path / "sub" / "c.jsonl",
         json.dumps({"text": "record one", "id": 1}) + "\n\n"
         + json.dumps({"text": "record two"}) + "\n")
  _write(tmp_path / "d.json", json.dumps({"body": "x", "text": "record three"}) + "\n")
  corpus = load_documents(f"text:{tmp_path}/**/*")
  assert corpus.documents == ["first file", "second file\n", "record three", "record one",
                              "record two"]
  assert corpus.names[0] == str(tmp_path / "a.txt")
  assert corpus.names[3] == f"{tmp_path / 'sub' / 'c.jsonl'}:1"
  assert corpus.names[4] == f"{tmp_path / 'sub' / 'c.jsonl'}:3"
  assert corpus.skipped == {}
  other_field = load_documents(f"text:{tmp_path}/*.json", text_field="body")
  assert other_field.documents == ["x"]
  assert load_documents(f"text:{tmp_path}/**/*", max_documents=2).documents == [
      "first file", "second file\n"]


def test_parquet_rows_are_documents(tmp_path):
  """A `.parquet` file is read a batch of rows at a time, only its text column (C4 / FineWeb style,
  several row groups, a null and a blank row); its size for progress is the uncompressed columns'."""
  import pyarrow as pa
  import pyarrow.parquet as pq

  texts = [f"row {i}: " + "words " * (i % 5 + 1) for i in range(2500)]
  texts[3], texts[7] = None, "  \n"
  table = pa.table({"id": list(range(2500)), "text": texts, "url": ["u"] * 2500})
  pq.write_table(table, tmp_path / "shard-0.parquet", row_group_size=700)
  _write(tmp_path / "notes.txt", "a plain file")
  corpus = load_documents(f"text:{tmp_path}/*")
  want = [t for t in texts if t is not None and t.strip()]
  assert corpus.documents == ["a plain file", *want]
  shard = tmp_path / "shard-0.parquet"
  assert corpus.names[1] == f"{shard}#0" and corpus.names[4] == f"{shard}#4"  # row 3 is null
  assert corpus.skipped == {"empty": 2}
  assert sources_lib.source_bytes(f"text:{tmp_path}/*.parquet") > os.path.getsize(tmp_path / "shard-0.parquet")


def test_bad_parquet_names_file_and_column(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq

  pq.write_table(pa.table({"content": ["some text"], "n": [1]}), tmp_path / "a.parquet")
  with pytest.raises(ValueError, match=r"a\.parquet: has no column 'text'; its columns are \['content', 'n'\]"):
    load_documents(f"text:{tmp_path}/a.parquet")
  assert load_documents(f"text:{tmp_path}/a.parquet", text_field="content").documents == ["some text"]
  with pytest.raises(ValueError, match=r"a\.parquet: column 'n' holds int64, expected strings"):
    load_documents(f"text:{tmp_path}/a.parquet", text_field="n")
  _write(tmp_path / "b.parquet", b"PAR1 this is not parquet at all")
  with pytest.raises(ValueError, match=r"b\.parquet: not a readable Parquet file"):
    load_documents(f"text:{tmp_path}/b.parquet")
  whole = (tmp_path / "a.parquet").read_bytes()
  _write(tmp_path / "c.parquet", whole[:len(whole) // 2])  # a cut-off download
  with pytest.raises(ValueError, match=r"c\.parquet: not a readable Parquet file"):
    load_documents(f"text:{tmp_path}/c.parquet")


def test_glob_matching_nothing_names_the_glob(tmp_path):
  pattern = f"{tmp_path}/nothing-here/*.txt"
  with pytest.raises(ValueError, match="nothing-here") as info:
    load_documents(f"text:{pattern}")
  assert pattern in str(info.value)
  assert "matched no files" in str(info.value)


def test_empty_and_undecodable_files_are_skipped_and_counted(tmp_path):
  _write(tmp_path / "good.txt", "hello")
  _write(tmp_path / "empty.txt", "")
  _write(tmp_path / "blank.txt", "  \n\t\n")
  _write(tmp_path / "latin1.txt", "caf\xe9 cr\xe8me".encode("latin-1"))
  corpus = load_documents(f"text:{tmp_path}/*.txt")
  assert corpus.documents == ["hello"]
  assert corpus.skipped == {"empty": 2, "undecodable": 1}


def test_corpus_with_no_documents_is_an_error(tmp_path):
  _write(tmp_path / "empty.txt", "")
  _write(tmp_path / "blank.txt", "\n\n")
  _write(tmp_path / "bad.txt", b"\xff\xfe\xfa")
  with pytest.raises(ValueError) as info:
    load_documents(f"text:{tmp_path}/*.txt")
  message = str(info.value)
  assert "produced no documents" in message
  assert "2 files empty" in message and "1 undecodable" in message


def test_bad_jsonl_line_names_file_and_line(tmp_path):
  path = _write(tmp_path / "data.jsonl", '{"text": "ok"}\n{"text": "ok too"}\n{not json\n')
  with pytest.raises(ValueError) as info:
    load_documents(f"text:{path}")
  assert str(path) in str(info.value) and "line 3" in str(info.value)
  path = _write(tmp_path / "data.jsonl", '{"text": "ok"}\n{"content": "no text field"}\n')
  with pytest.raises(ValueError) as info:
    load_documents(f"text:{path}")
  assert str(path) in str(info.value) and "line 2" in str(info.value)
  assert "'text'" in str(info.value)


@pytest.mark.parametrize("source", ["wikipedia", "file:/tmp/x.txt", "", "STDLIB"])
def test_unknown_source_lists_accepted_forms(source):
  with pytest.raises(ValueError) as info:
    load_documents(source)
  message = str(info.value)
  assert "stdlib" in message and "text:GLOB" in message and "hf:NAME" in message


def test_hub_source_offline_gives_actionable_error(tmp_path):
  env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
             HF_HOME=str(tmp_path / "hf_home"), PYTHONPATH=REPO_ROOT)
  script = textwrap.dedent("""
      from tfx.data import load_documents
      try:
          load_documents("hf:some-user/some-dataset-that-is-not-cached:cfg")
      except ValueError as e:
          print("ERROR:", e)
      else:
          print("NO ERROR")
  """)
  result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120, cwd=REPO_ROOT)
  assert result.returncode == 0, result.stderr
  out = result.stdout
  assert "ERROR:" in out, out
  assert "could not be reached" in out
  assert "data.source=stdlib" in out and "text:GLOB" in out
