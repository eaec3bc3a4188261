#!/usr/bin/env bash
# The accelerator half of the performance work as prepared device calls (a lent GPU, or a TPU VM).
#
#   make gpu-wheels                                   # here, once: pure-Python wheels the device image lacks
#   bash benchmarks/gpu/session.sh OUT [STEP ...]     # there, from anywhere in the repository
#
# Steps (all of them, in this order, when none is named), each under its own time limit so that
# one that hangs or fails leaves the next its time:
#   env          python, jax and its devices, nvidia-smi                                     30 s
#   attention    a GPU's model.attention kernels (auto cudnn pallas xla) against float32   120 s
#                (python -m tfx.check_attention)
#   reductions   the one-pass reductions a GPU's program takes (LayerNorm's statistics,   60 s
#                the bf16 loss's max and sum) against the two-pass ones and float64, and
#                the float32 bias gradient (benchmarks/gpu/check_reductions.py)
#   suite        the accelerator table: GPT-2-small, BERT-base, T5-base, XLNet-base at    420 s
#                32 rows per device (layers unrolled), each then traced for three more steps
#                (OUT/suite_traces/<model>, summed by kind in suite.json), then GPT-2's compile
#                time at 12 and 48 scanned layers
#   t5_128       T5-base at the issue's 128 x 512 (its 0.25 s goal), layers scanned        120 s
#   t5_128u      the same unrolled (the suite's layout), which did not finish in 120 s on  300 s
#                an H100 (compile-only here: 33 s); the log shows how far it got
#   scanned      GPT-2, BERT and T5 with their layers scanned (model.scan_unroll=1, the    240 s
#                configs' default and the suite's until 2026-11-27), against the suite's rows
#   kernels      GPT-2-small with model.attention=pallas, then xla (the suite's row is   150 s
#                cuDNN, the default on a GPU: same batch, same machine)
#   loss_chunk   GPT-2-small with the output projection fused into the loss (256 tokens  100 s
#                a chunk; the suite's row is without)
#   packed       GPT-2-small with cuDNN's packed layout (model.packed_runs) against the     200 s
#                mask: on the suite's rows of one document (runs 0 and 1,
#                OUT/packed_1.json) and on rows of 4 packed documents (runs 0 and 8,
#                OUT/packed_4.json; `tfx.bench --documents 4`)
#   bias         cuDNN attention at T5's encoder shape with its bias and the padding as a  90 s
#                mask (today), as sequence lengths, and unmasked; at GPT-2's, the packed
#                causal mask with and without its bias gradient, and causal only: times and
#                agreement (benchmarks/gpu/cudnn_bias.py, OUT/bias_t5.json, OUT/bias_gpt2.json)
#   xla_flags    GPT-2-small under XLA:GPU options that move the same bytes differently    150 s
#                (compiled for an H100 here): every fusion emitted by Triton
#                (fusion_block_level_rewriter), cuDNN's layer norm (the forward norms: -1.2 GB
#                of 110): OUT/xla_flags_1.json, _2.json against the suite's row
#   baseline     the suite's four rows (no depth) run by an older tree of the project, the 240 s
#                folder in TFX_GPU_BASELINE (`git archive REV tfx configs | tar -x -C DIR`):
#                its program against this one's on the same machine
#   profile      three steps of each suite model traced (OUT/profile/<model>) and their   300 s
#                kernels summed by kind (python -m tfx.bench_profile); each HLO kernel's time
#                joined with its bytes (ms, GB, TB/s: profile.json's profile.bytes)
#   dropout      BERT-base's, BART-base's and XLNet-base's own configs (attention dropout  450 s
#                0.1, layers unrolled on a GPU; bf16, 32 rows) with model.attention=auto
#                (XLA's attention with dropout) and pallas (tfx's Pallas kernels drawing the
#                dropout; BART's cross attention too since stop 65, XLNet's relative terms as
#                the kernel's bias since stop 66): OUT/dropout.json, OUT/dropout_bart.json,
#                OUT/dropout_xlnet.json
#   finetune     BERT-base's fine-tuning step (tfx.finetune's: a two-class classifier      90 s
#                pooling [CLS], whose last layer runs at [CLS] alone; 32 rows of 128, bf16,
#                no dropout): python -m tfx.bench --finetune, its MFU (OUT/finetune.json)
#   peer         tfx against Hugging Face's Flax GPT-2, BERT and T5 on the GPU, side by   330 s
#                side (benchmarks/hf_flax/bench_peer.py: bf16, the `base` size, tfx's
#                layers unrolled as in the suite; OUT/peer.json). transformers 4.57.6 and
#                its imports travel as wheels of their own (`make gpu-wheels` puts them in
#                benchmarks/gpu/peer_wheels, or the folder in TFX_GPU_PEER_WHEELS), unpacked
#                for this step only
# The batch is fixed (32 rows) rather than searched: the suite's search compiles each model up to
# seven times, more than one device session holds. 32 rows fit an H100 with room: compiled for one
# here (`make gpu-compile`), every model's step at 64 rows fits (XLNet's the largest, 57 GiB) and
# GPT-2's with XLA's attention takes 18 GiB at 16. On an H200 (2026-11-27, layers scanned) the
# first six steps took 336 s together and the profile 130 s; on an H100 (the same day, unrolled)
# env 4 s, suite 342 s (the four models' compiles 13-43 s), baseline 135 s. A session's 15 minutes
# of device time hold about two such calls (a machine's start counts too): `env attention suite`
# (the check covers T5's lengths, XLNet's per-row bias and, since stop 58, cuDNN's packed layout),
# then `baseline t5_128 packed bias` (xla_flags or t5_128u alone, if time is left). The limits are
# each step's worst case.
# Each step writes OUT/<step>.log and OUT/<step>.json; the last lines printed are
# OUT/summary.txt, each step's exit status and seconds (124: over its limit).
# TFX_GPU_ARCHIVE=FILE: after each step, OUT (less the traces) is also packed into FILE (.tgz), so that
# a call killed at its limit still returns the finished steps as one file (a device call returns at
# most 8 files).
# TFX_GPU_TINY=1: every step at toy sizes, on whatever device (tests/test_gpu_session.py, on a CPU).
set -u
[ $# -ge 1 ] || { echo "usage: $0 OUT [STEP ...]" >&2; exit 2; }
out=$1
shift
steps=("$@")
all_steps=(env attention reductions suite t5_128 t5_128u scanned kernels loss_chunk packed profile bias xla_flags
           baseline dropout finetune peer)
[ ${#steps[@]} -gt 0 ] || steps=("${all_steps[@]}")
for step in "${steps[@]}"; do
  [[ " ${all_steps[*]} " == *" $step "* ]] || { echo "unknown step $step (${all_steps[*]})" >&2; exit 2; }
done
base=
if [[ " ${steps[*]} " == *" baseline "* ]]; then
  [ -d "${TFX_GPU_BASELINE:-}" ] || { echo "baseline: TFX_GPU_BASELINE must name an older tree's folder" >&2; exit 2; }
  base=$(cd "$TFX_GPU_BASELINE" && pwd)
fi
mkdir -p "$out"
out=$(cd "$out" && pwd)
py=${PYTHON:-python3}
[[ $py != */* ]] || py=$(cd "$(dirname "$py")" && pwd)/$(basename "$py")  # the baseline runs elsewhere
cd "$(dirname "$0")/../.."
: > "$out/summary.txt"

# The device image has jax, flax, optax, orbax and sentencepiece but not every import of the
# benchmark path (ml-collections): those travel as wheels (benchmarks/gpu/wheels, or the folder in
# TFX_GPU_WHEELS) and are unpacked, not installed.
deps=$(mktemp -d)
trap 'rm -rf "$deps"' EXIT
for wheel in "${TFX_GPU_WHEELS:-benchmarks/gpu/wheels}"/*.whl; do
  [ -e "$wheel" ] && "$py" -m zipfile -e "$wheel" "$deps"
done
outer_path=${PYTHONPATH:-}
export PYTHONPATH="$PWD:$deps${outer_path:+:$outer_path}"
peer_path=$PYTHONPATH
if [[ " ${steps[*]} " == *" peer "* ]]; then  # the peer step's own imports, after the other wheels
  mkdir "$deps/peer"
  for wheel in "${TFX_GPU_PEER_WHEELS:-benchmarks/gpu/peer_wheels}"/*.whl; do
    [ -e "$wheel" ] && "$py" -m zipfile -e "$wheel" "$deps/peer"
  done
  peer_path="$PYTHONPATH:$deps/peer"
fi

size=(--batch 32)
t5=(--batch 128)
peer=(--dtype bfloat16 --sizes base --reps 10 --compiles 1 --tfx-override=--config.model.scan_unroll=0)
finetune=(--config.finetune.batch_size=32 --config.finetune.max_length=128)
dropout=(--config.train.batch_size=32)
dropout_xlnet=()  # XLNet's own, after the others'
check=()
reductions=()
bias=()
if [ -n "${TFX_GPU_TINY:-}" ]; then
  bias=(--implementation xla --batch 4 --length 64 --heads 2 --head-dim 16 --steps 2)
  size=(--tiny --batch 2 --steps 2 --warmup 1)
  t5=(--batch 4)
  check=(--length 32)
  reductions=(--tiny)
  peer=(--dtype bfloat16 --models gpt2,t5 --sizes small --reps 2 --compiles 1)
  finetune=(--config.finetune.batch_size=2 --config.finetune.max_length=64 --config.model.num_layers=2
            --config.model.d_model=64 --config.model.num_heads=2 --config.model.d_ff=128 --config.data.vocab_size=1024
            --steps 2 --warmup 1)
  dropout=(--config.train.batch_size=2 --config.data.seq_len=64 --config.model.num_layers=2 --config.model.d_model=64
           --config.model.num_heads=2 --config.model.d_ff=128 --config.data.vocab_size=1024 --steps 2 --warmup 1
           --config.model.num_decoder_layers=1)
  dropout_xlnet=(--config.model.mem_len=32 --config.model.reuse_len=32 --config.objective.reuse_len=32
                 --config.objective.perm_size=32 --config.objective.num_predict=12)
fi

run() {  # run NAME LIMIT_SECONDS COMMAND...
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  timeout --kill-after=10 "$limit" "$@" > "$out/$name.log" 2>&1
  rc=$?
  printf '%-11s rc=%-4s %4ss of %ss\n' "$name" "$rc" "$(( SECONDS - start ))" "$limit" >> "$out/summary.txt"
  echo "== $name (rc=$rc)"
  tail -n 20 "$out/$name.log"
  if [ -n "${TFX_GPU_ARCHIVE:-}" ]; then
    tar -czf "$TFX_GPU_ARCHIVE.part" --exclude=./profile --exclude=./suite_traces -C "$out" . &&
      mv "$TFX_GPU_ARCHIVE.part" "$TFX_GPU_ARCHIVE"
  fi
}

bench=("$py" -m tfx.bench --suite accel "${size[@]}")
for step in "${steps[@]}"; do
  case $step in
    env) run env 30 bash -c "$py -c 'import sys, jax, flax, optax, ml_collections
print(sys.version); print(\"jax\", jax.__version__, jax.devices())
print(\"flax\", flax.__version__, \"optax\", optax.__version__)
print(\"ml_collections from\", ml_collections.__file__)'
           nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || true" ;;
    attention) run attention 120 "$py" -m tfx.check_attention --implementations auto,cudnn,pallas,xla "${check[@]}" \
                 --json "$out/attention.json" ;;
    reductions) run reductions 60 "$py" benchmarks/gpu/check_reductions.py "${reductions[@]}" \
                  --json "$out/reductions.json" ;;
    suite) run suite 420 "${bench[@]}" --profile "$out/suite_traces" --json "$out/suite.json" ;;
    t5_128) run t5_128 120 "${bench[@]}" --only t5_base --skip-depth "${t5[@]}" --config.model.scan_unroll=1 \
              --json "$out/t5_128.json" ;;
    t5_128u) run t5_128u 300 env TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=gpu_compiler=1 \
               "${bench[@]}" --only t5_base --skip-depth "${t5[@]}" --json "$out/t5_128u.json" ;;
    scanned) run scanned 240 "${bench[@]}" --only gpt2_small,bert_base,t5_base --skip-depth \
               --sweep model.scan_unroll=1 --json "$out/scanned.json" ;;
    kernels) run kernels 150 "${bench[@]}" --only gpt2_small --skip-depth --sweep model.attention=pallas,xla \
               --json "$out/kernels.json" ;;
    packed) run packed 200 bash -c 'for docs in 1 4; do
                if [ "$docs" = 1 ]; then runs=0,1; else runs=0,8; fi
                "$@" --documents "$docs" --sweep "model.packed_runs=$runs" --json "$0/packed_$docs.json" || exit
              done' "$out" "${bench[@]}" --only gpt2_small --skip-depth ;;
    profile) run profile 300 "${bench[@]}" --skip-depth --steps 3 --warmup 1 --profile "$out/profile" \
               --json "$out/profile.json" ;;
    loss_chunk) run loss_chunk 100 "${bench[@]}" --only gpt2_small --skip-depth --sweep model.loss_chunk=256 \
                  --json "$out/loss_chunk.json" ;;
    bias) run bias 90 bash -c 'for case in t5 gpt2; do "$0" benchmarks/gpu/cudnn_bias.py --case $case "${@:2}" \
                --json "$1/bias_$case.json" || exit; done' "$py" "$out" "${bias[@]}" ;;
    xla_flags) run xla_flags 150 bash -c 'i=0
                 for flag in --xla_gpu_experimental_enable_fusion_block_level_rewriter=true \
                             --xla_gpu_enable_cudnn_layer_norm=true; do
                   i=$((i + 1)); echo "== XLA_FLAGS=${XLA_FLAGS:-} $flag"
                   XLA_FLAGS="${XLA_FLAGS:-} $flag" "$@" --json "$0/xla_flags_$i.json" || exit
                 done' "$out" "${bench[@]}" --only gpt2_small --skip-depth ;;
    dropout) run dropout 450 bash -c 'py=$0 out=$1 common=(); shift 2
               while [ "$1" != -- ]; do common+=("$1"); shift; done; shift  # then XLNet extras
               for pair in bert_base:dropout bart_base:dropout_bart xlnet_base:dropout_xlnet; do
                 extra=(); [ "${pair%%:*}" = xlnet_base ] && extra=("$@")
                 "$py" -m tfx.bench --config "configs/${pair%%:*}.py" --sweep model.attention=auto,pallas \
                   --config.model.dtype=bfloat16 "${common[@]}" "${extra[@]}" --json "$out/${pair#*:}.json" || exit
               done' "$py" "$out" "${dropout[@]}" -- "${dropout_xlnet[@]}" ;;
    finetune) run finetune 90 "$py" -m tfx.bench --config configs/bert_base.py --finetune 2 \
                --config.model.dtype=bfloat16 --config.model.dropout=0.0 --config.model.attention_dropout=0.0 \
                "${finetune[@]}" --json "$out/finetune.json" ;;
    peer) run peer 330 env PYTHONPATH="$peer_path" "$py" benchmarks/hf_flax/bench_peer.py "${peer[@]}" \
            --json "$out/peer.json" ;;
    baseline) run baseline 240 env PYTHONPATH="$base:$deps${outer_path:+:$outer_path}" \
                bash -c 'cd "$0" && exec "$@"' "$base" \
                "${bench[@]}" --skip-depth --json "$out/baseline.json" ;;
  esac
done
echo "== summary ($out)"
cat "$out/summary.txt"
