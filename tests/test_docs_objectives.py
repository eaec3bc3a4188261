"""docs/objectives.md runs as written: its files are written, its commands run, its outputs checked.

How the tutorial is read:
- a ```python block whose first line is `# experiments/my_objective/NAME.py` is that file (every
  python block must name one);
- a ```bash block holds commands (`\\` continues a line); `# exit status N` after a command is the
  status it must exit with (default 0); other comments are dropped;
- a ```text block is (an excerpt of) the output of the last command before it: each of its lines,
  in order, must be a line of the command's stdout + stderr, compared with whitespace collapsed and
  every number masked (`6.2376` ~ `5.1`, `2.05K` ~ `154K`), so the shown output cannot drift from
  what the command prints in kind, only in value; `...` lines and lines of dashes are skipped.

What is substituted, so that nothing is written into the repository and the runs are quick (the
commands run from the repository root, as the tutorial says):
- `experiments/my_objective/` -> TMP/my_objective/ and a leading `runs/` -> TMP/runs/, in the
  commands and in the expected outputs alike;
- `python` -> this interpreter;
- every `tfx.train` command with a --workdir gets, appended (the last override wins), the
  session's shared tokenizer (tests/conftest.py), 60 documents and 4 steps with an eval every 2.

Commands run in the tutorial's order, two at a time (the machine's 2 cores); `tfx.compare` waits
for every command before it.
"""

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import ROOT

DOC = os.path.join(ROOT, "docs", "objectives.md")
FOLDER = "experiments/my_objective/"
QUICK = ("--config.data.max_documents=60", "--config.train.steps=4", "--config.train.log_every=2",
         "--config.train.eval_every=2", "--config.train.checkpoint_every=4")


def blocks(text: str) -> list[tuple[str, str]]:
  """The fenced blocks of a markdown text: (language, body)."""
  return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```$", text, re.M | re.S)]


def commands(body: str) -> list[tuple[str, int]]:
  """(command, expected exit status) for each command of a bash block."""
  out = []
  for line in body.replace("\\\n", " ").splitlines():
    code, _, comment = line.partition("#")
    if code.strip():
      status = re.search(r"exit status (\d+)", comment)
      out.append((" ".join(code.split()), int(status.group(1)) if status else 0))
  return out


def parse(text: str):
  """(files {name: source}, steps [[command, status, expected lines]]) of the tutorial."""
  files, steps = {}, []
  for lang, body in blocks(text):
    if lang == "python":
      first = body.splitlines()[0]
      assert first.startswith(f"# {FOLDER}") and first.endswith(".py"), f"python block without a file name: {first}"
      files[first[len(f"# {FOLDER}"):]] = body
    elif lang == "bash":
      steps += [[cmd, status, []] for cmd, status in commands(body)]
    elif lang == "text":
      assert steps, "an output block before any command"
      steps[-1][2] += body.splitlines()
  return files, steps


def normalize(line: str) -> str:
  return " ".join(re.sub(r"\d[\d,.]*", "#", line).split())


def substitute(text: str, tmp: str) -> str:
  text = text.replace(FOLDER, f"{tmp}/my_objective/")
  return re.sub(r"(?<![\w/.])runs/", f"{tmp}/runs/", text)


def assert_shows(expected: list[str], output: str, command: str) -> None:
  """Every expected line, in order, is a line of `output` (numbers masked)."""
  lines = [normalize(x) for x in output.splitlines()]
  at = 0
  for want in expected:
    if not want.strip() or want.strip() == "..." or set(want.strip()) == {"-"}:
      continue
    try:
      at = lines.index(normalize(want), at) + 1
    except ValueError:
      pytest.fail(f"the tutorial shows\n  {want}\nbut `{command}` printed:\n{output[-4000:]}")


@pytest.mark.slow
def test_the_objectives_tutorial_runs_as_written(tmp_path, shared_tokenizer):
  with open(DOC) as f:
    files, steps = parse(f.read())
  assert set(files) == {"token_dropout.py", "leaky.py"}
  kinds = [re.search(r"-m (\S+)", cmd).group(1) for cmd, _, _ in steps]
  assert {"tfx.check_objective", "tfx.train", "tfx.compare"} <= set(kinds), kinds

  tmp = str(tmp_path)
  (tmp_path / "my_objective").mkdir()
  for name, source in files.items():
    (tmp_path / "my_objective" / name).write_text(source)

  def argv(cmd: str) -> list[str]:
    args = substitute(cmd, tmp).split()
    assert args[0] == "python", cmd
    args[0] = sys.executable
    if args[2] == "tfx.train" and "--workdir" in args:
      args += [f"--config.data.tokenizer={shared_tokenizer}", *QUICK]
    return args

  def run(step):
    cmd, status, expected = step
    proc = subprocess.run(argv(cmd), cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    output = proc.stdout + proc.stderr
    assert proc.returncode == status, f"`{cmd}` exited {proc.returncode}, the tutorial says {status}:\n{output[-4000:]}"
    assert_shows([substitute(x, tmp) for x in expected], proc.stdout + "\n" + proc.stderr, cmd)

  with ThreadPoolExecutor(2) as pool:
    pending = []
    for step, kind in zip(steps, kinds):
      if kind == "tfx.compare":
        for future in pending:
          future.result()
      pending.append(pool.submit(run, step))
    for future in pending:
      future.result()

  # The runs the tutorial compares exist, and the objective's run recorded its file.
  assert (tmp_path / "runs" / "token_dropout" / "objective.json").exists()
  assert (tmp_path / "runs" / "compare.png").exists()
  assert not os.path.exists(os.path.join(ROOT, "experiments", "my_objective"))


def test_the_tutorial_parses():
  """Fast: the tutorial has its two files and the commands the slow test runs."""
  with open(DOC) as f:
    files, steps = parse(f.read())
  assert set(files) == {"token_dropout.py", "leaky.py"}
  for source in files.values():
    compile(source, "<tutorial>", "exec")
  assert [status for _, status, _ in steps].count(1) == 3  # the typo, the range check, the planted bug
  assert sum("leaky.py:DropAfterShift" in cmd and status == 1 for cmd, status, _ in steps) == 1


def test_readme_objectives_table_is_what_the_objectives_report():
  """README's objectives table: its snippet runs, and its raw tokens and GFLOP per row are what it prints."""
  with open(os.path.join(ROOT, "README.md")) as f:
    section = f.read().split("\n## Objectives\n", 1)[1].split("\n## ", 1)[0]
  snippet = next(body for lang, body in blocks(section) if lang == "python")
  proc = subprocess.run([sys.executable, "-c", snippet], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  printed = [line.split() for line in proc.stdout.splitlines()]  # name, config, raw tokens, GFLOP
  table = [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines()
           if line.startswith("| `") or line.startswith("| |")]
  assert len(table) == len(printed), (table, printed)
  name = ""
  for row, (objective, config, raw, gflop) in zip(table, printed):
    name = row[0].strip("`") or name  # a continuation row repeats the objective above it
    assert name == objective, (row, objective)
    assert (row[-2], row[-1]) == (raw, gflop), (row, config)
