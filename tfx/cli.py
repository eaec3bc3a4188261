"""The `tfx` console script: `tfx train|prepare|generate|bench|...|check_attention ARGS...` (the same
as python -m tfx.X; COMMANDS lists them)."""

import sys

COMMANDS = ("train", "prepare", "generate", "bench", "bench_data", "convert", "quickstart", "compare", "finetune", "launch",
            "sweep", "checkpoints", "check_objective", "check_attention")


def main(argv: list[str] | None = None) -> None:
  argv = sys.argv[1:] if argv is None else argv
  if not argv or argv[0] not in COMMANDS:
    sys.exit(f"usage: tfx {{{'|'.join(COMMANDS)}}} [args...]   (e.g. tfx train --config configs/tiny.py --workdir runs/tiny)")
  import importlib

  importlib.import_module(f"tfx.{argv[0]}").main(argv[1:])


if __name__ == "__main__":
  main()
