"""Pretraining objectives at matched compute, scored downstream (T5 Table 4, XLNet's PLM vs MLM).

    python -m tfx.sweep experiments/objectives/sweep.py --workdir runs/objectives [--smoke]

Five arms, each pretrained on the stdlib corpus for the same training FLOPs (tfx.flops: the
objective's own count) and then fine-tuned on the offline `stdlib:package` task (which top-level
package a function belongs to); a sixth arm fine-tunes the causal-LM architecture from random
initialisation, so the table says whether pretraining helped at all. Parameters are matched:
the single-stack families have 2L layers, the encoder-decoder L + L.
"""

from tfx.sweep import Arm, Finetune, Sweep


def get_sweep(smoke: bool) -> Sweep:
  if smoke:  # about 20 minutes on 2 CPU cores; 3 seeds (the real size has 5)
    layers, d, steps, seeds, budget_steps = 2, 64, 200, (0, 1, 2), 200
    size = ["model.d_ff=128", "data.seq_len=64", "data.vocab_size=1000", "data.max_documents=0",
            "train.batch_size=16", "train.log_every=50", "train.eval_every=100", "train.checkpoint_every=200"]
    tune = ("finetune.steps=200", "finetune.batch_size=32", "finetune.learning_rate=1e-3", "finetune.eval_every=50",
            "finetune.log_every=50", "finetune.patience=0")
  else:  # a GPU or a TPU host: about 2 h for all runs on one H100 (not measured here)
    layers, d, steps, seeds, budget_steps = 6, 512, 20000, (0, 1, 2, 3, 4), 20000
    size = ["model.d_ff=2048", "model.num_heads=8", "data.seq_len=512", "data.vocab_size=32000",
            "data.max_documents=0", "train.batch_size=128", "train.log_every=100", "train.eval_every=1000",
            "train.checkpoint_every=2000", "model.dtype=bfloat16"]
    tune = ("finetune.steps=3000", "finetune.batch_size=32", "finetune.learning_rate=1e-4", "finetune.eval_every=250")
  common = (f"model.d_model={d}", f"train.steps={steps}", "model.dropout=0.0", "model.attention_dropout=0.0", *size)
  single = (f"model.num_layers={2 * layers}",)
  # The budget: the causal LM arm's FLOPs for `budget_steps` steps (computed by tfx.sweep from
  # the config, so every arm trains the same FLOPs whatever its objective costs per row).
  from tfx.config import load_config  # noqa: PLC0415
  from tfx.sweep import ROOT, _per_step  # noqa: PLC0415
  import os  # noqa: PLC0415

  base = load_config(os.path.join(ROOT, "configs", "tiny.py"), [f"--config.{o}" for o in (*common, *single)])
  budget = _per_step(base)[1] * budget_steps
  return Sweep(
      name="objectives",
      question="Which pretraining objective gives the best downstream model at the same compute?",
      config="configs/tiny.py",
      common=common,
      arms=(
          Arm("causal LM", (*single, "objective.name=causal_lm")),
          Arm("prefix LM", (*single, "objective.name=prefix_lm")),
          Arm("BERT-style MLM", (*single,), config="configs/bert_tiny.py"),
          Arm("span corruption (15%, mean 3)", (f"model.num_layers={layers}", "objective.noise_density=0.15",
                                                 "objective.mean_span_length=3.0"), config="configs/t5_tiny.py"),
          Arm("permutation LM", (*single,), config="configs/xlnet_tiny.py"),
      ),
      seeds=seeds, baseline="causal LM", match="flops", budget=budget,
      finetune=Finetune(task="stdlib:package", overrides=tune),
  )
