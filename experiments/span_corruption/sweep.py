"""Span corruption's corruption rate and mean span length (T5 paper, Tables 6 and 7).

    python -m tfx.sweep experiments/span_corruption/sweep.py --workdir runs/span_corruption [--smoke]

One factor at a time around T5's default (15% of tokens corrupted, spans of mean length 3): the
rate over 10/15/25/50% at mean length 3, and the mean length over 2/3/5/10 at 15%. Every arm is
the same encoder-decoder trained on the same number of input tokens, then fine-tuned on the
offline `stdlib:package` task. T5 found the rate to matter little below 50% and mean length 3
about best; at this scale expect the downstream differences to be within the intervals.
"""

from tfx.sweep import Arm, Finetune, Sweep

RATES = (0.10, 0.15, 0.25, 0.50)
LENGTHS = (2.0, 3.0, 5.0, 10.0)


def get_sweep(smoke: bool) -> Sweep:
  if smoke:  # minutes on 2 CPU cores
    size = ("data.seq_len=64", "data.vocab_size=1000", "data.max_documents=200", "train.batch_size=8",
            "train.log_every=10", "train.eval_every=20", "train.checkpoint_every=60")
    seeds, budget = (0, 1, 2), 60 * 8 * 64
    tune = ("finetune.steps=200", "finetune.batch_size=32", "finetune.learning_rate=1e-3", "finetune.eval_every=50",
            "finetune.log_every=50", "finetune.patience=0")
  else:  # a GPU: about 1 h per arm and seed on one H100 (not measured here)
    # seq_len 256: at a 50% rate and mean length 3 the 383 raw tokens make 64 spans (100 sentinels)
    size = ("model.num_layers=6", "model.d_model=512", "model.d_ff=2048", "model.num_heads=8", "data.seq_len=256",
            "data.vocab_size=32000", "data.max_documents=0", "train.batch_size=128", "train.log_every=100",
            "train.eval_every=1000", "train.checkpoint_every=2000", "model.dtype=bfloat16")
    seeds, budget = (0, 1, 2), 20000 * 128 * 384
    tune = ("finetune.steps=3000", "finetune.batch_size=32", "finetune.eval_every=250")
  arms = [Arm(f"rate {r:.0%}, mean 3", (f"objective.noise_density={r}", "objective.mean_span_length=3.0"))
          for r in RATES]
  arms += [Arm(f"rate 15%, mean {m:g}", ("objective.noise_density=0.15", f"objective.mean_span_length={m}"))
           for m in LENGTHS if m != 3.0]
  return Sweep(name="span_corruption",
               question="How do span corruption's rate and mean span length change the downstream model?",
               config="configs/t5_tiny.py", common=("model.dropout=0.0", "model.attention_dropout=0.0", *size),
               arms=tuple(arms), seeds=seeds, baseline="rate 15%, mean 3", match="tokens", budget=budget,
               finetune=Finetune(task="stdlib:package", overrides=tune, scratch=False))
