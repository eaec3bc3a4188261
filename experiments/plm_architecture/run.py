"""Permutation LM on XLNet's architecture vs on an ordinary encoder: the grid of README.md.

    python experiments/plm_architecture/run.py --workdir runs/plm_architecture [--steps 800] [--controls]

Every arm trains the same objective (XLNet row layout, span sampler, bi_data, the same
predictions per row) on the same stdlib streams with the same seed, model size and optimizer;
only the architecture changes. It prints one markdown table row per arm (eval loss and accuracy
over the query-stream predictions at the last step, without memory, plus train throughput).
"""

import argparse
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import jax  # noqa: E402

from tfx import train  # noqa: E402
from tfx.config import load_config  # noqa: E402
from tfx.metrics import read_metrics  # noqa: E402

# Shared: a small model on CPU, 128-token rows (reuse 64 + A/B 61 + SEP SEP CLS), 21 predictions.
COMMON = ["--config.model.num_layers=4", "--config.model.d_model=128", "--config.model.num_heads=4",
          "--config.model.d_ff=512", "--config.data.seq_len=128", "--config.data.vocab_size=2000",
          "--config.data.max_documents=0", "--config.objective.reuse_len=64", "--config.objective.perm_size=64",
          "--config.objective.num_predict=0", "--config.train.batch_size=16", "--config.optim.learning_rate=1e-3",
          "--config.optim.warmup_steps=50", "--config.model.dropout=0.0", "--config.model.attention_dropout=0.0"]

ARMS = {
    "xlnet (relative, memory 96)": ("xlnet_tiny.py", ["--config.model.mem_len=96", "--config.model.reuse_len=64"]),
    "xlnet (relative, no memory)": ("xlnet_tiny.py", ["--config.model.mem_len=0", "--config.model.reuse_len=64"]),
    "encoder (learned positions)": ("xlnet_encoder_tiny.py", ["--config.model.position=learned"]),
    "encoder (rotary positions)": ("xlnet_encoder_tiny.py", ["--config.model.position=rotary"]),
}

# Controls for the learned-position encoder (--controls): the same encoder with masked LM (its
# loss is over 15% masked tokens, so compare its curve, not its value), and the two-stream
# encoder pre-LN without the embedding norm.
CONTROLS = {
    "control: encoder MLM (learned positions)": ("bert_tiny.py", ["--config.model.position=learned"]),
    "control: encoder PLM, pre-LN (learned)": ("xlnet_encoder_tiny.py", [
        "--config.model.position=learned", "--config.model.norm=pre", "--config.model.embed_norm=false"]),
}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--steps", type=int, default=800)
  parser.add_argument("--controls", action="store_true", help="also run the CONTROLS arms")
  args = parser.parse_args()
  arms = {**ARMS, **(CONTROLS if args.controls else {})}
  steps = [f"--config.train.steps={args.steps}", f"--config.train.eval_every={args.steps // 4}",
           f"--config.train.checkpoint_every={args.steps}", "--config.train.log_every=50"]
  print("| arm | parameters | eval loss | eval accuracy | train tok/s |")
  print("|---|---:|---:|---:|---:|")
  tokenizer = []  # the first arm trains the sentencepiece model; the others reuse it
  for name, (config_file, overrides) in arms.items():
    config = load_config(os.path.join(ROOT, "configs", config_file), [*COMMON, *overrides, *steps, *tokenizer])
    workdir = os.path.join(args.workdir, "".join(c if c.isalnum() else "_" for c in name))
    tokenizer = tokenizer or [f"--config.data.tokenizer={os.path.join(workdir, 'tokenizer.model')}"]
    summary = train.run(config, workdir)
    parameters = sum(x.size for x in jax.tree.leaves(summary["state"].params))
    records = read_metrics(workdir)
    last = [r for r in records if r["split"] == "eval"][-1]
    speed = statistics.median(r["tokens_per_sec"] for r in records if r["split"] == "train" and r["step"] > min(50, args.steps // 2))
    print(f"| {name} | {parameters:,} | {last['loss']:.3f} | {last['accuracy']:.3f} | "
          f"{speed:,.0f} |", flush=True)


if __name__ == "__main__":
  main()
