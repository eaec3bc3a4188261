"""`make quickstart`: train configs/quickstart.py, evaluate, sample, and say where the run is.

    python -m tfx.quickstart --workdir runs/quickstart

Running it again on a finished run only prints the summary and a fresh sample (training
resumes from the last checkpoint and has nothing left to do).
"""

import argparse
import os
import sys

from tfx import config as config_lib, generate, train
from tfx.errors import UserError
from tfx.metrics import read_metrics

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "quickstart.py")
PROMPT = "def "
# A sample, not the argmax: greedy decoding of a small model collapses into repetition.
SAMPLING = dict(temperature=0.7, top_k=40, top_p=0.95, seed=0)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m tfx.quickstart", description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", default="runs/quickstart")
  parser.add_argument("--config", default=CONFIG)
  args, overrides = parser.parse_known_args(argv)
  try:
    config = config_lib.load_config(args.config, overrides)
    train.run(config, args.workdir)
    evals = [r for r in read_metrics(args.workdir) if r["split"] == "eval"]
    sample = generate.run(argparse.Namespace(
        workdir=args.workdir, prompt=PROMPT, max_new_tokens=None, num_samples=1, step=None, **SAMPLING))[0]
  except UserError as e:
    sys.exit(f"tfx.quickstart: {e}")
  print()
  print("=" * 72)
  print(f"eval loss: {evals[0]['loss']:.3f} at step {evals[0]['step']}  ->  "
        f"{evals[-1]['loss']:.3f} at step {evals[-1]['step']} (accuracy {evals[-1]['accuracy']:.3f})")
  print(f"sample after {PROMPT!r} (temperature {SAMPLING['temperature']}, top-k {SAMPLING['top_k']}, "
        f"top-p {SAMPLING['top_p']}):")
  print("-" * 72)
  print(PROMPT + sample)
  print("-" * 72)
  where = os.path.abspath(args.workdir)
  print(f"the run is in {where}: config.json, metrics.jsonl, tokenizer.model, checkpoints/, data/ (its token store)")
  print(f"sample more:  python -m tfx.generate --workdir {args.workdir} --prompt 'class ' --temperature 0.8 --top-p 0.95")


if __name__ == "__main__":
  main()
