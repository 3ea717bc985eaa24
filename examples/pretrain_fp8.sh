#!/usr/bin/env bash
# The body of the pretraining recipes (pretrain_gpt_1b_fp8.sh, pretrain_llama2_7b_fp8.sh): one
# node, FP8 HYBRID (delayed scaling with Transformer Engine's history of 1024 and max, or current
# scaling), FP8 E4M3 with rowwise or blockwise scaling (FP8_RECIPE; FP8_FORMAT overrides the
# format), or the bf16 baseline. The recipe sets MODEL (a preset), MODEL_ARGS (its extra flags),
# SAMPLE_VOCAB (the tokenizer size for the sample corpus) and its size defaults; everything below
# can be overridden from the environment. A run resumes from its own checkpoints (--save and --load
# are the same folder). Without a GPU it stops at once, unless CPU=1 (with a shrunk model). The
# flags are checked before anything is prepared or launched (a mistake: one line, exit status 2).
# Data from DATA_PATH (Megatron's --data-path syntax, with TOKENIZER_MODEL a tokenizer.json or
# its folder) or, when unset, the embedded sample corpus, prepared under $WORKDIR.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${MODEL:?set by the recipe script}" "${WORKDIR:?set by the recipe script}"
MODEL_ARGS=${MODEL_ARGS:-}; SAMPLE_VOCAB=${SAMPLE_VOCAB:-32768}
CUDA_GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
GPUS=${GPUS:-$((CUDA_GPUS > 0 ? CUDA_GPUS : 1))}
TP=${TP:-1}; PP=${PP:-1}
# With pipeline stages, the interleaved 1F1B schedule of VPP virtual stages per rank: it divides
# the pipeline's bubble by VPP (measured at GPT-1.3B pp 2: two 1.04x plain 1F1B, four 1.01x two;
# docs/tuning.md): four at PP=2, two beyond (not measured there).
# VPP=1: plain 1F1B (needed where the micro-batches per step are not a multiple of PP).
VPP=${VPP:-$((PP == 2 ? 4 : 2))}
# With pipeline stages, the last stage (which also runs the output layer and loss) gets fewer
# layers and the first more, so every rank has about the same work (--balance-pipeline-split; a
# stage may end after a layer's attention; GPT-1.3B at pp 2 x 4 virtual stages: 3.5, 3, ..., 3,
# 2.5 layers, 1.008x whole layers; docs/tuning.md).
BALANCE_PIPELINE=${BALANCE_PIPELINE:-1}
# With tensor parallelism, its sequence-parallel all-gathers and reduce-scatters overlapped with
# the GEMMs (--tp-comm-overlap: on the copy engines under CUDA graphs; GPT-1.3B at tp 2: 1.27x without it).
# With data parallelism, the distributed optimizer (sharded states) with its parameter all-gather
# overlapped with the next forward. 0 turns either off.
TP_COMM_OVERLAP=${TP_COMM_OVERLAP:-1}; DISTRIBUTED_OPTIMIZER=${DISTRIBUTED_OPTIMIZER:-1}
DP=$((GPUS / (TP * PP)))
MBS=${MBS:-4}; GBS=${GBS:-$((MBS * DP * 8))}
SEQ=${SEQ:-2048}; ITERS=${ITERS:-500}
LR=${LR:-2e-4}; MIN_LR=${MIN_LR:-2e-5}; WARMUP=${WARMUP:-$((ITERS / 10))}
PRECISION=${PRECISION:-fp8}; FP8_RECIPE=${FP8_RECIPE:-delayed}
case $FP8_RECIPE in  # the fine-grained recipes' own format is E4M3 (docs/fp8.md)
    rowwise | blockwise) FP8_FORMAT=${FP8_FORMAT:-e4m3} ;;
    *) FP8_FORMAT=${FP8_FORMAT:-hybrid} ;;
esac
SAVE=${SAVE-$WORKDIR/checkpoints}  # SAVE= (empty): no checkpoints, for benchmarks
LOG_INTERVAL=${LOG_INTERVAL:-10}
EXTRA_ARGS=${EXTRA_ARGS:-}
# CUDA graphs of the layers: on by default on GPUs, pipelines included (chosen by measurement:
# FP8 at tp 2 x pp 2 runs 1.92x its eager speed, bit for bit the same; benchmarks/RESULTS.md).
# CUDA_GRAPH=0 turns them off.
CUDA_GRAPH=${CUDA_GRAPH:-1}
GRAPH_ARGS=()
if [ "$CUDA_GRAPH" = 1 ] && [ "$CUDA_GPUS" -gt 0 ]; then
    GRAPH_ARGS=(--enable-cuda-graph)
fi

if [ "${CPU:-0}" != 1 ] && [ "$CUDA_GPUS" -eq 0 ]; then
    cat >&2 <<EOF
$(basename "${RECIPE:-$0}"): $MODEL needs NVIDIA GPUs, and this machine has none (torch sees no CUDA device).
On a CPU, run the 4-layer GPT of examples/quickstart.sh instead, or shrink this recipe and set CPU=1:
  CPU=1 SEQ=128 MBS=2 GBS=4 ITERS=20 EXTRA_ARGS="--num-layers 2 --hidden-size 128 --num-attention-heads 4" \\
      bash ${RECIPE:-$0}
EOF
    exit 1
fi

SAMPLE_DATA=0
if [ -z "${DATA_PATH:-}" ]; then
    # The embedded default: a SlimPajama-format sample from the Python stdlib (not SlimPajama),
    # prepared below once the flags are checked.
    SAMPLE_DATA=1
    DATA_PATH="$WORKDIR/data/sample_text_document"
    TOKENIZER_MODEL="$WORKDIR/tokenizer"
fi
if [ -z "${TOKENIZER_MODEL:-}" ]; then
    echo "$(basename "${RECIPE:-$0}"): DATA_PATH needs TOKENIZER_MODEL (its tokenizer.json or the folder of it)" >&2
    exit 2
fi

PRECISION_ARGS=(--bf16)
if [ "$PRECISION" = fp8 ]; then
    PRECISION_ARGS+=(--fp8-format "$FP8_FORMAT" --fp8-recipe "$FP8_RECIPE")
    if [ "$FP8_RECIPE" = delayed ]; then
        PRECISION_ARGS+=(--fp8-amax-history-len 1024 --fp8-amax-compute-algo max)
    fi
fi

# shellcheck disable=SC2206  # MODEL_ARGS, DATA_PATH and EXTRA_ARGS are word lists on purpose
ARGS=(--model "$MODEL" --seq-length "$SEQ" $MODEL_ARGS
      --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP")
if [ "$PP" -gt 1 ]; then
    ARGS+=(--num-virtual-stages-per-pipeline-rank "$VPP")
    if [ "$BALANCE_PIPELINE" = 1 ]; then
        ARGS+=(--balance-pipeline-split)
    fi
fi
if [ "$TP" -gt 1 ]; then
    ARGS+=(--sequence-parallel)
    if [ "$TP_COMM_OVERLAP" = 1 ]; then
        ARGS+=(--tp-comm-overlap)
    fi
fi
if [ "$DP" -gt 1 ] && [ "$DISTRIBUTED_OPTIMIZER" = 1 ]; then
    ARGS+=(--use-distributed-optimizer --overlap-param-gather)
fi
# shellcheck disable=SC2206  # as above
ARGS+=(--micro-batch-size "$MBS" --global-batch-size "$GBS" --train-iters "$ITERS"
       --lr "$LR" --min-lr "$MIN_LR" --lr-warmup-iters "$WARMUP" --lr-decay-style cosine
       --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 --init-method-std 0.02
       "${PRECISION_ARGS[@]}" ${GRAPH_ARGS[@]+"${GRAPH_ARGS[@]}"}
       --data-path $DATA_PATH --split 969,30,1
       --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL"
       --log-interval "$LOG_INTERVAL" --eval-interval 1000 --eval-iters 10
       ${SAVE:+--save "$SAVE" --load "$SAVE" --save-interval 1000} $EXTRA_ARGS)

# The trainer's checks of the flags, for the GPUS ranks torchrun will start, before anything is
# prepared or launched: a mistake is the trainer's one line and exit status 2 (under torchrun its
# report of the failed ranks would follow that line, and the status would be 1).
WORLD_SIZE=$GPUS python -m megafp8.train --check-args "${ARGS[@]}" >/dev/null

if [ "$SAMPLE_DATA" = 1 ]; then
    bash examples/prepare_sample_data.sh "$WORKDIR" "$SAMPLE_VOCAB"
fi

# exec: a signal to this script's process (a scheduler's SIGTERM) reaches torchrun, which passes it
# on to the ranks; they save and stop at the next step boundary.
exec torchrun --standalone --nproc-per-node "$GPUS" -m megafp8.train "${ARGS[@]}"
