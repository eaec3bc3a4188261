"""Permutation LM on XLNet's architecture vs on an ordinary encoder (README.md), on the sweep runner.

    python -m tfx.sweep experiments/plm_architecture/sweep.py --workdir runs/plm_architecture [--smoke]

Every arm trains the same objective (XLNet row layout, span sampler, bi_data, the same predictions
per row) on the same stdlib streams with the same model size and optimizer, over three seeds;
only the architecture changes. The table compares eval loss over the query-stream predictions
(the same objective, so the losses are comparable), without memory.
"""

from tfx.sweep import Arm, Sweep

SHARED = ("model.num_layers=4", "model.d_model=128", "model.num_heads=4", "model.d_ff=512", "data.seq_len=128",
          "data.vocab_size=2000", "data.max_documents=0", "objective.reuse_len=64", "objective.perm_size=64",
          "objective.num_predict=0", "train.batch_size=16", "optim.learning_rate=1e-3", "optim.warmup_steps=50",
          "model.dropout=0.0", "model.attention_dropout=0.0", "train.log_every=50")


def get_sweep(smoke: bool) -> Sweep:
  steps = 40 if smoke else 800
  size = ("model.num_layers=2", "model.d_model=64", "model.d_ff=128", "data.max_documents=200") if smoke else ()
  common = (*SHARED, *size, f"train.steps={steps}", f"train.eval_every={steps // 4}",
            f"train.checkpoint_every={steps}", f"train.log_every={min(50, steps // 4)}")
  return Sweep(
      name="plm_architecture",
      question="At a fixed objective (permutation LM), how much does the architecture matter?",
      config="configs/xlnet_tiny.py", common=common, seeds=(0, 1, 2), baseline="xlnet (relative, no memory)",
      arms=(
          Arm("xlnet (relative, memory 96)", ("model.mem_len=96", "model.reuse_len=64")),
          Arm("xlnet (relative, no memory)", ("model.mem_len=0", "model.reuse_len=64")),
          Arm("encoder (learned positions)", ("model.position=learned",), config="configs/xlnet_encoder_tiny.py"),
          Arm("encoder (rotary positions)", ("model.position=rotary",), config="configs/xlnet_encoder_tiny.py"),
      ))
