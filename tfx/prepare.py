"""Prepare a token store from a config's data section (see tfx.data.prepare).

    python -m tfx.prepare --config configs/quickstart.py --out DIR [--workers N] [--config.data.k=v ...]

DIR may be local or gs://bucket/path. Run it again after an interruption: finished shards are
kept. Then train with --config.data.source=prepared:DIR.
"""

import argparse
import sys

from tfx import config as config_lib, gcs
from tfx.data.prepare import prepare
from tfx.errors import UserError


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m tfx.prepare", description=__doc__.split("\n")[0])
  parser.add_argument("--config", required=True, help="config file whose data section to prepare")
  parser.add_argument("--out", required=True, help="store directory (local or gs://)")
  parser.add_argument("--workers", type=int, default=0, help="tokenizing processes (default: all cores)")
  parser.add_argument("--tokenizer", default="", help="a tokenizer to use: a SentencePiece .model, or a Hugging "
                      "Face tokenizer.json / vocab.txt / vocab.json (merges.txt beside it) / directory (default: "
                      "data.tokenizer, or train a SentencePiece model on a sample of the source)")
  parser.add_argument("--quiet", action="store_true", help="no progress bar")
  args, overrides = parser.parse_known_args(argv)
  try:
    config = config_lib.load_config(args.config, overrides)
    gcs.preflight(args.out, config.data.tokenizer, args.tokenizer)  # gs:// fails here, in seconds
    manifest = prepare(config.data, args.out, seed=config.train.seed, workers=args.workers,
                       tokenizer_path=args.tokenizer, progress=not args.quiet)
  except (UserError, ValueError, FileNotFoundError) as e:
    sys.exit(f"tfx.prepare: {e}")
  print(f"{args.out}: {manifest['documents']:,} documents, {manifest['splits']['train']['tokens']:,} train / "
        f"{manifest['splits']['eval']['tokens']:,} eval tokens; train on it with "
        f"--config.data.source=prepared:{args.out}")


if __name__ == "__main__":
  main()
