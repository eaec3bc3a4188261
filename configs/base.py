"""The base config: every field tfx knows, each with its meaning and allowed values.

Every other config starts from `get_config()` here and changes fields; a field that does not
exist here cannot be set anywhere (unknown keys on the command line are errors, and so are
values of the wrong type).

    python -m tfx.train --config configs/base.py --workdir runs/base --config.train.steps=100
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()

  # ---------------------------------------------------------------- model
  c.model = ml_collections.ConfigDict()
  # Registered model family: 'decoder' (GPT), 'encoder' (BERT/RoBERTa) or 'encoder_decoder'
  # (T5, Vaswani). More families register themselves by name.
  c.model.family = "decoder"
  # Number of transformer blocks (of the encoder, for encoder_decoder).
  c.model.num_layers = 4
  # Decoder blocks of an encoder_decoder model (0 = the same as num_layers).
  c.model.num_decoder_layers = 0
  # Width of the residual stream.
  c.model.d_model = 256
  # Attention heads; must divide d_model unless head_dim is set.
  c.model.num_heads = 4
  # Width of each head (0 = d_model // num_heads); T5 v1.1 small has 6 heads of 64 on d_model 512.
  c.model.head_dim = 0
  # Hidden width of the MLP (for gated MLPs, of each of the two input projections).
  c.model.d_ff = 1024
  # Position information: 'learned' (absolute table of data.seq_len rows), 'sinusoidal'
  # (fixed absolute), 'rotary' (RoPE on queries and keys), or 'relative' (T5 bucketed
  # relative-position bias, one table per stack shared by its layers).
  c.model.position = "learned"
  # Base of the rotary frequencies (used when position == 'rotary').
  c.model.rope_base = 10000.0
  # T5 relative positions: number of buckets and the distance where the last bucket starts.
  c.model.relative_buckets = 32
  c.model.relative_max_distance = 128
  # T5 relative positions: 'columns' = distances are column offsets, one [1, heads, t, s] bias per
  # batch (as HF's T5): the same as the position ids' differences wherever attention is allowed,
  # because positions advance by one within a segment in every row tfx builds. 'positions' = from
  # the position ids, one [batch, heads, t, s] bias (for an objective whose positions skip inside a
  # segment). Generation with a KV cache always uses the position ids.
  c.model.relative_distance = "columns"
  # XLNet (Transformer-XL) memory: cached hidden states per layer (0 = no memory).
  c.model.mem_len = 0
  # XLNet: how many leading positions of a row go into the next step's memory (0 = seq_len/2).
  c.model.reuse_len = 0
  # XLNet: clip relative distances to +-clamp_len (-1 = off).
  c.model.clamp_len = -1
  # XLNet: separate attention biases (r_w, r_r, r_s) per layer (True) or one set shared.
  c.model.untie_r = True
  # Token-type (segment A/B) embeddings, BERT: 2; 0 = none.
  c.model.type_vocab_size = 0
  # LayerNorm on the summed embeddings (BERT, RoBERTa).
  c.model.embed_norm = False
  # Multiply token embeddings by sqrt(d_model) (original Transformer).
  c.model.embed_scale = False
  # Scale attention scores by 1/sqrt(head_dim); T5 folds the scale into its initialisation (False).
  c.model.scale_attention = True
  # With tied embeddings, scale the final hidden state by d_model**-0.5 before the output
  # projection (T5 v1.0, Mesh TensorFlow).
  c.model.scale_tied_logits = False
  # Layer norm placement: 'pre' (GPT-2, T5) or 'post' (original Transformer, BERT).
  c.model.norm = "pre"
  # Normalisation layer: 'layernorm' or 'rmsnorm'.
  c.model.norm_type = "layernorm"
  # Epsilon of the norms (GPT-2 1e-5, BERT 1e-12, T5 1e-6).
  c.model.norm_eps = 1e-6
  # MLP: 'gelu' (dense-gelu-dense, tanh approximation as GPT-2), 'gelu_exact' (erf, BERT),
  # 'relu', 'geglu' or 'swiglu' (gated; T5 v1.1 uses geglu).
  c.model.mlp = "gelu"
  # Biases on the dense layers.
  c.model.use_bias = True
  # Share the input embedding with the output projection.
  c.model.tie_embeddings = True
  # Dropout rate on embeddings and residual branches (0 = off).
  c.model.dropout = 0.0
  # Dropout rate on attention probabilities (0 = off). On a GPU only model.attention=pallas applies
  # it in a fused kernel (tfx/ops/flash_dropout.py); every other path runs XLA's attention for it.
  c.model.attention_dropout = 0.0
  # Dropout rate on the MLP's hidden layer, after the activation; -1 = model.dropout. T5 and XLNet
  # drop there (-1); BERT, RoBERTa, ELECTRA, DistilBERT and GPT-2 do not (their configs: 0.0).
  c.model.mlp_dropout = -1.0
  # Computation dtype: 'float32' or 'bfloat16' (parameters stay float32).
  c.model.dtype = "float32"
  # Run the layers as one nn.scan (faster compile, one set of stacked parameters).
  c.model.scan_layers = True
  # With scan_layers: layers per iteration of the scanned loop; 0 = all of them (the loop unrolled,
  # parameters still stacked, checkpoints unchanged); -1 = all of them when the step is traced for a
  # GPU, one elsewhere (tfx.ops.target.unrolled_layers). Unrolled, XLA drops the loop's stacked
  # buffers: compiled for an H100, BERT-base's own step moves 50.2 GB instead of 67.1, T5-base's
  # 70.5 instead of 103.6, for 15-75% more memory and about twice the compile time. On a CPU it gains
  # nothing (peer benchmark, 4 layers d256 x 8 rows of 256, 2026-11-28: GPT-2 1.04x HF's step
  # unrolled against 1.02x scanned, temporaries 397 against 261 MiB). Computes the same function: a
  # resume may change it.
  c.model.scan_unroll = -1
  # Rematerialisation policy name: 'none', 'full' (= 'nothing_saveable'), 'dots' (= 'dots_saveable'),
  # 'dots_no_batch' (= 'dots_with_no_batch_dims_saveable'), 'dots_attention', 'everything_saveable'
  # (tfx/nn/blocks.py). 'dots_attention' keeps the weight matmuls' outputs and the attention's own
  # residuals (its probabilities, not the q.k scores) and recomputes the other elementwise ops in the
  # backward pass: on CPU it is faster than 'dots_saveable' and 'none' at 0.6x the temporary memory
  # of 'none' (README, Performance); on an accelerator, the usual memory / speed middle. Computes
  # the same function (a resume may change it).
  c.model.remat = "dots_attention"
  # Attention implementation: 'auto' (cuDNN's fused kernel on a GPU for bf16/fp16 and head_dim
  # <= 128, XLA otherwise), 'xla', 'cudnn' (falls back to XLA where it cannot run), 'pallas' (Pallas
  # flash attention from segment ids on a GPU, for packed self-attention without a bias, with
  # attention dropout tfx's own kernel that drops inside it: tfx/ops/flash_dropout.py; XLA
  # elsewhere), 'splash' (splash attention from segment ids on a TPU, the same cases, rows a
  # multiple of 128 tokens; XLA elsewhere) or 'reference' (the einsum reference, for debugging).
  # The kernel chosen is logged once with the reason.
  c.model.attention = "auto"
  # cuDNN's packed layout for packed rows (a Hopper GPU or later; the self-attention of the decoder
  # and encoder families, no bias): each run of one segment id in a row (a document, a run of
  # padding) goes to cuDNN as a sequence of its own, so the kernel reads no [b, 1, t, t] mask and
  # skips the key blocks of the other documents. A batch with a row of more runs than this (or a
  # document split over two runs) attends with the mask instead. 0 = always the mask.
  c.model.packed_runs = 0
  # Causal self-attention on XLA's path (a CPU, a TPU without splash, a GPU without cuDNN or Pallas)
  # cut into this many query blocks, each attending only the keys up to its last row, so that the
  # scores above the diagonal blocks are never computed (4 blocks: 5/8 of them); 0 = automatic (4
  # from 256 tokens, 1 below: each block is a kernel of its own, compiled), 1 = none. The same
  # function up to float32 rounding (a resume may change it). cuDNN and the Pallas and splash
  # kernels skip those blocks themselves.
  c.model.causal_blocks = 0
  # Fuse the output projection with the token loss (the objectives that predict tokens from the final
  # hidden states: causal, prefix and span-corruption LMs, text infilling, UL2): each row is cut into
  # chunks of this many tokens, and each chunk's [b, chunk, vocab] logits, loss and gradients are
  # computed and dropped (tfx.ops.linear_cross_entropy), so the [b, t, vocab] logits and their
  # gradient never exist. For large vocabularies on an accelerator, where they bound the batch:
  # GPT-2-small (vocab 50304, rows of 1024, bf16, 8 rows) compiles to 9.0 instead of 11.7 GiB of
  # temporaries with 256. 0 = off (the logits are materialised): on CPU it is no faster. The same loss
  # and gradients to float32 rounding.
  c.model.loss_chunk = 0
  # Standard deviation of the normal initialiser of dense and embedding weights.
  c.model.init_std = 0.02

  # ---------------------------------------------------------------- objective
  c.objective = ml_collections.ConfigDict()
  # The objective: registered ('causal_lm' and 'prefix_lm' drive the decoder, 'masked_lm' the encoder,
  # 'span_corruption' the encoder_decoder, 'permutation_lm' xlnet or the encoder; `python -m tfx.train
  # --list-objectives` prints them all with their fields), or a class outside the package:
  # 'path/to/file.py:ClassName' or 'package.module:ClassName'. The objective decides inputs, targets and
  # weights. This section holds `name` and that objective's own fields only (its dataclass fields, with
  # their defaults): set them here or as --config.objective.FIELD=VALUE; any other field is an error.
  c.objective.name = "causal_lm"

  # ---------------------------------------------------------------- data
  c.data = ml_collections.ConfigDict()
  # 'stdlib' (the Python standard library's own source, offline everywhere),
  # 'text:GLOB' (local .txt/.py/... files, .jsonl / .jsonl.gz or .parquet with a `text_field`),
  # 'hf:NAME[:CONFIG]' (a hub dataset through `datasets`, streamed; needs the network), or
  # 'prepared:DIR' (a token store made by `python -m tfx.prepare`; DIR local or gs://).
  # A raw source is prepared into WORKDIR/data/ by the first run and read from there after.
  c.data.source = "stdlib"
  # Tokens per training row (the model's sequence length).
  c.data.seq_len = 128
  # Tokenizer vocabulary size when tfx trains the tokenizer. With a Hugging Face tokenizer it is the
  # model's embedding rows: at least the tokenizer's ids (largest id + 1), more pads the table.
  # (With a given sentencepiece model it is unused: the model's pieces are the rows.)
  c.data.vocab_size = 8000
  # '' = train a sentencepiece model on the corpus and save it to the workdir; or the path of a
  # sentencepiece .model, or of a Hugging Face tokenizer: tokenizer.json, vocab.txt (WordPiece),
  # vocab.json with merges.txt beside it (byte-level BPE), or a directory holding one of these.
  c.data.tokenizer = ""
  # JSON field or dataset column that holds the text.
  c.data.text_field = "text"
  # Keep only the first N documents (0 = all); for quick experiments and tests.
  c.data.max_documents = 0
  # Fraction of documents held out for evaluation (chosen independently of the seed).
  c.data.eval_fraction = 0.02
  # Number of global batches in one evaluation.
  c.data.eval_batches = 4
  # Bytes of text the tokenizer is trained on; 0 = max(2 MB, 1 kB per vocabulary entry).
  c.data.tokenizer_sample_bytes = 0
  # Where a raw source's token store is prepared: '' = WORKDIR/data/<key>; a directory shared by
  # runs (WORKDIR/data of a tfx.sweep) = DIR/<key>: runs with the same data settings tokenize the
  # corpus once (of runs that start together one prepares it under a lease, the others wait).
  c.data.store_root = ""
  # Preparing a raw source: tokenizing processes (0 = all cores) and MB of text per shard.
  c.data.prepare_workers = 0
  c.data.shard_mb = 64.0
  # Batches built ahead of the step in a background thread (0 = on the training thread).
  c.data.prefetch = 2
  # Checksums of the store's token files: 'background' (hashed while training runs; a damaged
  # file stops the run at its next step), 'open' (before the first batch) or 'off' (sizes only).
  c.data.verify_store = "background"
  # Resume even if the checkpoint was trained on another corpus, tokenizer or vocabulary
  # (says so in metrics.jsonl); otherwise such a resume is refused.
  c.data.allow_changed_corpus = False

  # ---------------------------------------------------------------- train
  c.train = ml_collections.ConfigDict()
  # Number of optimizer steps.
  c.train.steps = 1000
  # Global batch size (rows per optimizer step, over all hosts and devices).
  c.train.batch_size = 16
  # Split each batch into this many micro-batches and accumulate gradients.
  c.train.grad_accum = 1
  # Seed of parameters, data order and every per-step key.
  c.train.seed = 0
  # Log training metrics every N steps.
  c.train.log_every = 10
  # Evaluate on the held-out split every N steps (and at the end); 0 = only at the end.
  c.train.eval_every = 200
  # Objectives with memory (permutation_lm on xlnet with model.mem_len > 0): evaluate on held-out
  # text laid out as in training (contiguous streams, reversed ones too with bi_data), carrying the
  # memory from one eval batch to the next. False: each eval batch from an empty memory, forward text.
  c.train.eval_memory = False
  # Save a checkpoint every N steps (and at the end); 0 = only at the end.
  c.train.checkpoint_every = 500
  # How many checkpoints to keep.
  c.train.keep_checkpoints = 3
  # Save checkpoints asynchronously (training continues while the write happens).
  c.train.async_checkpoint = True
  # Stop after this many steps of this invocation (0 = run to train.steps); the run resumes
  # from its last checkpoint next time. Used to test preemption and resume.
  c.train.stop_after = 0
  # What a step with a NaN/Inf loss or gradient norm does: 'stop' (a record in metrics.jsonl, exit
  # non-zero, nothing bad saved), 'skip' (drop that update, count it) or 'rewind' (go back to the
  # last good checkpoint and continue with the next batches).
  c.train.on_nonfinite = "stop"
  # skip: stop after more than this many non-finite steps in a row; rewind: after this many rewinds
  # without a new good checkpoint.
  c.train.max_skipped = 10
  # Warn (a `loss_spike` record) when a step's loss exceeds this factor times the running median of
  # the last 100 losses (0 = off).
  c.train.spike_factor = 3.0
  # TEST HOOK, not a setting: the first attempt at this step sees NaN parameters, so its loss and
  # gradients are NaN (0 = off). Used by tests/test_faults.py to exercise train.on_nonfinite.
  c.train.poison_step = 0
  # Resume from this checkpoint step instead of the newest good one (0 = the newest). Later
  # checkpoints are moved to WORKDIR/checkpoints_set_aside/, not deleted.
  c.train.restore_step = 0
  # Resume although the config changes what the checkpoints mean (model, objective, seq_len, batch
  # size, seed, corpus); recorded in metrics.jsonl. Without it such a resume is refused.
  c.train.allow_config_change = False
  # Seconds after the last heartbeat when another run may take over this workdir's lock (a run on
  # the same host whose process is gone is taken over at once).
  c.train.lock_timeout = 120.0

  # ---------------------------------------------------------------- optim
  c.optim = ml_collections.ConfigDict()
  # Peak learning rate of AdamW.
  c.optim.learning_rate = 3e-4
  # Linear warmup steps from 0 to the peak.
  c.optim.warmup_steps = 100
  # Cosine decay to this fraction of the peak at train.steps.
  c.optim.final_lr_fraction = 0.1
  # Decoupled weight decay, applied to matrices (kernels, embeddings), not to biases, norm scales
  # or other vectors (tfx.steps.decay_mask).
  c.optim.weight_decay = 0.01
  # Clip the global gradient norm to this value (0 = off).
  c.optim.grad_clip = 1.0
  # Adam moments.
  c.optim.b1 = 0.9
  c.optim.b2 = 0.95
  c.optim.eps = 1e-8

  # ---------------------------------------------------------------- mesh
  c.mesh = ml_collections.ConfigDict()
  # Device mesh axes (data, fsdp, tensor); their product must equal the number of devices.
  # -1 means "the remaining devices" (at most one axis may be -1).
  # data: pure data parallel; fsdp: data parallel with parameters and optimizer state sharded
  # (ZeRO-3); tensor: heads / MLP / vocab split across devices (Megatron-style).
  c.mesh.data = -1
  c.mesh.fsdp = 1
  c.mesh.tensor = 1

  # ---------------------------------------------------------------- log
  c.log = ml_collections.ConfigDict()
  # TensorBoard event files in WORKDIR/tb/ beside metrics.jsonl (process 0; `tensorboard --logdir
  # WORKDIR/tb`, or a parent folder to compare runs). Same scalars as metrics.jsonl, named
  # train/<key>, eval/<key>, perf/<key> (tokens_per_sec, mfu, seconds*) and <split>/<key>.
  c.log.tensorboard = True
  # Weights & Biases project for the same scalars ('' = off). Needs `pip install wandb` and a login
  # (`wandb login`), or WANDB_MODE=offline. The run is named after the workdir and resumed by the
  # id kept in WORKDIR/wandb_id.txt.
  c.log.wandb_project = ""
  # Weights & Biases entity (user or team; '' = your default entity).
  c.log.wandb_entity = ""

  # ---------------------------------------------------------------- launch (python -m tfx.launch)
  # Where and how `python -m tfx.launch BACKEND` starts this run; tfx.train itself ignores it.
  c.launch = ml_collections.ConfigDict()
  # Name of the TPU VM / cluster / job ('' = tfx- plus the workdir's last folder).
  c.launch.name = ""
  # TPU slice type (v4-8, v5litepod-16, v5p-8, v6e-8, ...: one host per 4 chips, v5litepod-8 / v6e-8 and
  # smaller are one host) or GPUs per node as NAME:COUNT (H100:8; skypilot and slurm). The slice's device
  # and host counts are checked against the mesh and the global batch before anything is created.
  c.launch.accelerator = "v5litepod-8"
  # GPU nodes (skypilot, slurm; a TPU slice is one "node" whatever its host count).
  c.launch.num_nodes = 1
  # TPU software version ('' = the one Google documents for the accelerator's generation).
  c.launch.runtime_version = ""
  # Google Cloud project and zone (gcloud, xpk; '' = gcloud's configured default). SkyPilot: zone or ''.
  c.launch.project = ""
  c.launch.zone = ""
  # Spot / preemptible capacity (about a third of the price; preempted runs resume from the workdir).
  c.launch.spot = True
  # gcloud: request the TPU as a queued resource (waits for capacity instead of failing).
  c.launch.queued = False
  # skypilot: a managed job (sky jobs launch: relaunched after preemption until it finishes) or a plain
  # cluster (sky launch) stopped after idle_minutes of idleness.
  c.launch.managed = True
  c.launch.idle_minutes = 30
  # xpk: the GKE cluster, and how often a preempted workload is restarted.
  c.launch.cluster = ""
  c.launch.max_restarts = 10
  # slurm: partition ('' = the default), time limit, GPUs per node are in `accelerator`.
  c.launch.partition = ""
  c.launch.time = "24:00:00"
  # Persistent XLA compilation cache, so a restarted job does not compile again: 'auto' = WORKDIR/jax_cache
  # when the workdir is on gs:// (survives preemption), else ~/.cache/tfx/jax on the host; a path or
  # gs:// URL; '' = off.
  c.launch.compilation_cache = "auto"
  # libtpu flags (LIBTPU_INIT_ARGS): '' = libtpu's defaults; 'overlap' = the collective/compute overlap
  # flags MaxText sets for FSDP (async all-gather / reduce-scatter fusion); or the flags themselves.
  c.launch.libtpu_flags = ""
  # Seconds without a heartbeat after which a process counts as dead; the others then exit with one line
  # (status 75) instead of waiting in a collective.
  c.launch.heartbeat_timeout = 60
  # local: processes on this machine and fake CPU devices per process (checks a multi-host config).
  c.launch.processes = 2
  c.launch.devices_per_process = 4

  # ---------------------------------------------------------------- generation defaults
  c.generate = ml_collections.ConfigDict()
  # Tokens to generate after the prompt.
  c.generate.max_new_tokens = 64
  # 0 = greedy; otherwise sample from softmax(logits / temperature).
  c.generate.temperature = 0.0
  # Keep only the k most likely tokens (0 = off).
  c.generate.top_k = 0
  # Keep the smallest set of tokens whose probability reaches p (1.0 = off).
  c.generate.top_p = 1.0

  # ---------------------------------------------------------------- fine-tuning (python -m tfx.finetune)
  # A fine-tune takes the architecture, tokenizer and mesh of a pretrained run (--from RUN) and these
  # settings; its train.* / optim.* are derived from them.
  c.finetune = ml_collections.ConfigDict()
  # The task spec (set by --task): 'stdlib:package', 'stdlib:docstring', 'jsonl:PATH', 'hf:glue:NAME', ...
  c.finetune.task = ""
  # The pretrained run directory (set by --from); '' = none.
  c.finetune.from_workdir = ""
  # 'pretrained' (the backbone from the run's latest checkpoint) or 'scratch' (random, same architecture).
  c.finetune.init = "pretrained"
  # 'auto' (encoder: 'first', decoder and xlnet: 'last', encoder_decoder: 'mean'), 'first', 'mean' or 'last'.
  c.finetune.pooling = "auto"
  # Tokens per example row (0 = the pretraining data.seq_len; at most that with learned positions).
  c.finetune.max_length = 0
  # Optimizer steps, global batch size (examples), AdamW peak rate, linear warmup, decoupled weight decay
  # (cosine decay to optim.final_lr_fraction of the peak, as in pretraining).
  c.finetune.steps = 500
  c.finetune.batch_size = 16
  c.finetune.learning_rate = 1e-4
  c.finetune.warmup_steps = 50
  c.finetune.weight_decay = 0.01
  # Dropout on the pooled vector of the classifier head (the backbone's is model.dropout).
  c.finetune.dropout = 0.1
  # Seed of the head's initialisation, the example order and dropout (and of a scratch backbone).
  c.finetune.seed = 0
  # Log training metrics every N steps; evaluate on the validation split every N steps (and at the end).
  c.finetune.log_every = 10
  c.finetune.eval_every = 50
  # Early stopping: stop after this many evaluations without a better validation select_metric (0 = off).
  c.finetune.patience = 5
  # The validation metric that picks the best params: 'accuracy', 'macro_f1', 'mcc' (binary) or 'loss'.
  c.finetune.select_metric = "accuracy"
  # Save a checkpoint every N steps (0 = at every evaluation) and at the end.
  c.finetune.checkpoint_every = 0
  # Stop after this many steps of this invocation (0 = run to the end); the same command resumes.
  c.finetune.stop_after = 0
  # Caps on the examples of the train split and of each of validation / test (0 = all). stdlib:package
  # caps each class at cap // classes.
  c.finetune.max_train_examples = 0
  c.finetune.max_eval_examples = 0
  # Shares held out by stable hash when a task has no such split (one jsonl file, GLUE's hidden test
  # labels, stdlib tasks).
  c.finetune.validation_fraction = 0.15
  c.finetune.test_fraction = 0.15
  # jsonl: / hf: tasks: the fields of the text, the optional second text, and the label.
  c.finetune.text_field = "text"
  c.finetune.text_b_field = "text_b"
  c.finetune.label_field = "label"
  # The label names in class order (a JSON list); empty = the sorted labels of the train split.
  c.finetune.labels = ()
  # stdlib:package: the number of packages (classes); functions need at least min_function_lines lines.
  c.finetune.stdlib_classes = 20
  c.finetune.min_function_lines = 3

  return c
