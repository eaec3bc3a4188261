"""Import and export Hugging Face checkpoints (config.json + safetensors; no torch needed).

    python -m tfx.convert --from-hf DIR --workdir OUT     # HF save_pretrained dir -> tfx run dir
    python -m tfx.convert --to-hf DIR --workdir RUN       # trained tfx run -> HF dir

Supported architectures (both directions):

- `BertForMaskedLM` -> `encoder` family: post-LN, `embed_norm`, token types, MLM head
  (`head_dense` + activation + `head_norm` + tied projection + `output_bias`). BERT's `gelu` is
  the exact (erf) GELU (`mlp='gelu_exact'`), LayerNorm eps 1e-12.
- `RobertaForMaskedLM` -> `encoder` family. RoBERTa numbers positions from `pad_token_id + 1`
  (= 2): HF position p holds token p - 2 of the sequence. tfx positions start at 0, so the
  imported table is HF's rows 2.. (tfx position i == HF position i + 2), and `data.seq_len` is
  `max_position_embeddings - 2`; export puts the two unused rows back (as zeros).
- A token-type table with a single row (RoBERTa) adds the same vector at every position: it
  is folded into the position table on import (`type_vocab_size=0`); export writes a zero
  one-row table.
- `GPT2LMHeadModel` -> `decoder` family: pre-LN, learned positions, `gelu_new` (= tanh GELU,
  `mlp='gelu'`), eps 1e-5; the fused Conv1D `c_attn` ([in, 3*out]) is split into query / key /
  value.
- `T5ForConditionalGeneration` -> `encoder_decoder` family: rmsnorm, no biases, relative
  position buckets, unscaled attention. v1.0 (`relu`, tied, logits scaled by d_model**-0.5:
  `scale_tied_logits=True`) and v1.1 (`gated-gelu` = `geglu`, untied `lm_head`).
- `XLNetLMHeadModel` -> `xlnet` family (objective `permutation_lm`): two-stream relative
  attention with memory, tied LM head plus bias, per-layer or shared r_*_bias (see the XLNet
  section below).

HF Linear weights are [out, in]; tfx DenseGeneral kernels are [in..., out...] with the heads
split out ([e, h, d] for query/key/value, [h, d, e] for the attention output). Parameters are
stacked along a leading `layers` axis when `model.scan_layers=True` (the default, as native
tfx models), or stored per layer (`<stack>/layer_{i}/...`) otherwise.

The package: one module per family, each holding its tensor layout and its config.json mapping
in both directions (`bert` for BERT and RoBERTa, `gpt2`, `t5` with T5's tokenizer, `xlnet`); the
shared pieces (`layouts`: tensor rules and the layout machinery; `configs`: configs/base.py,
activations, architecture detection; `tensors`: safetensors reading, flat trees); `audit` (every
config.json field: mapped, refused, or known not to matter); `hf_import` (`from_hf`, `import_hf`
with the account of every tensor and field); `export` (`to_hf`); `verify` (HF vs tfx logits,
`--verify`); `run` (the command line: `import_run`, `main`).

Nothing imports silently wrong: a checkpoint tensor that is neither mapped nor known-unused, a
config.json field that is not audited, or a field value tfx cannot represent fails the import
with its name.
"""

from tfx.convert.export import to_hf
from tfx.convert.t5 import t5_tokenizer_proto
from tfx.convert.hf_import import Imported, from_hf, import_hf
from tfx.convert.layouts import ARCHITECTURES, MODEL_FIELDS, ConvertError
from tfx.convert.run import _load_params, import_run, main
from tfx.convert.tensors import _flatten
from tfx.convert.verify import verify
from tfx.convert.xlnet import XLNET

__all__ = ["ARCHITECTURES", "MODEL_FIELDS", "XLNET", "ConvertError", "Imported", "from_hf", "import_hf", "import_run",
           "main", "t5_tokenizer_proto", "to_hf", "verify"]
