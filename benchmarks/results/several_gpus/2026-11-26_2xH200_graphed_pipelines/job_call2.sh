#!/usr/bin/env bash
# Session 20, second call, nvidia-h200-x2 (~8 min): (1) the planner's inputs and a graphed pipeline on ONE host:
# GPT-1.3B maps tp 1 / tp 2, collectives over 2 ranks, tp1 x pp2 graphed and eager, validate_planner;
# (2) the 2x-LR FP8 gap: FP8 current scaling (no history) and delayed with a 1-step history, seed 1234, same batches.
mkdir -p /tmp/job /tmp/maps /tmp/lay_graphed /tmp/lay_eager; start=$(date +%s)
step() { echo "=== $(date +%T) +$(( $(date +%s) - start ))s $*" >> /tmp/job/steps.txt; }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
( CUDA_VISIBLE_DEVICES=1 taskset -c 16-31 bash examples/convergence_study.sh /tmp/study data > /tmp/job/data.log 2>&1
  step "study data exit $?" ) &
( taskset -c 16-31 bash examples/prepare_sample_data.sh /tmp/layouts 32768 > /tmp/job/sample.log 2>&1; step "sample data" ) &
CUDA_VISIBLE_DEVICES=0 taskset -c 0-15 python benchmarks/bench_layer_grid.py --model gpt-1.3b --seq-lengths 2048 \
    --micro-batches 1 2 4 8 --output /tmp/maps/gpt-1.3b_tp1.json > /tmp/job/map_tp1.log 2>&1; step "tp1 map exit $?"
wait; step "data ready"
torchrun --standalone --nproc-per-node 2 benchmarks/bench_layer_grid.py --model gpt-1.3b --seq-lengths 2048 \
    --micro-batches 1 2 4 8 --output /tmp/maps/gpt-1.3b_tp2.json > /tmp/job/map_tp2.log 2>&1; step "tp2 map exit $?"
torchrun --standalone --nproc-per-node 2 benchmarks/bench_collectives.py --output /tmp/maps/collectives.json > /tmp/job/coll.log 2>&1
step "collectives exit $?"
GRAPHS=all MODEL=gpt GPUS=2 LAYOUTS="1:2" ITERS=20 WORKDIR=/tmp/layouts RESULTS=/tmp/lay_graphed bash benchmarks/layouts_8gpu.sh > /tmp/job/lay_graphed.log 2>&1; step "graphed pp2 exit $?"
GRAPHS=1 MODEL=gpt GPUS=2 LAYOUTS="1:2" ITERS=20 WORKDIR=/tmp/layouts RESULTS=/tmp/lay_eager bash benchmarks/layouts_8gpu.sh > /tmp/job/lay_eager.log 2>&1; step "eager pp2 exit $?"
for d in lay_graphed lay_eager; do python benchmarks/layout_tables.py /tmp/$d/*.jsonl > /tmp/$d/layouts.md 2>&1; done
python benchmarks/validate_planner.py /tmp/lay_graphed /tmp/lay_eager --layer-maps /tmp/maps/gpt-1.3b_tp1.json \
    /tmp/maps/gpt-1.3b_tp2.json --collectives /tmp/maps/collectives.json > /tmp/job/validate.txt 2>&1; step "validate exit $?"
# 2x LR, seed 1234, the lr2x runs' flags; only the FP8 recipe changes.
lr2x() {  # GPU CORES NAME FP8-FLAGS...
    local gpu=$1 cores=$2 name=$3; shift 3
    CUDA_VISIBLE_DEVICES=$gpu taskset -c $cores torchrun --standalone --nproc-per-node 1 --master-port $((29600 + gpu)) -m megafp8.train \
      --model llama-120m --seq-length 1024 --micro-batch-size 32 --global-batch-size 64 --train-iters 500 \
      --lr 1.2e-3 --min-lr 1.2e-4 --lr-warmup-iters 50 --lr-decay-style cosine --weight-decay 0.1 --adam-beta2 0.95 \
      --clip-grad 1.0 --init-method-std 0.02 --seed 1234 --data-seed 1234 --bf16 --fp8-format hybrid "$@" \
      --log-fp8-layers --enable-cuda-graph --train-data-path /tmp/study/data/train_text_document \
      --valid-data-path /tmp/study/data/validation_text_document --tokenizer-type HuggingFaceTokenizer \
      --tokenizer-model /tmp/study/tokenizer --log-interval 10 --eval-interval 100 --eval-iters 10 \
      --tensorboard-dir /tmp/study/runs/lr2x/$name > /tmp/job/$name.log 2>&1
    step "$name exit $?"
}
lr2x 0 0-15 fp8_current --fp8-recipe current &
lr2x 1 16-31 fp8_delayed_hist1 --fp8-recipe delayed --fp8-amax-history-len 1 --fp8-amax-compute-algo max
wait
step "done"
