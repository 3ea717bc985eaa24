#!/usr/bin/env bash
# Session 20, third call, nvidia-h200-x2 (~8.5 min): (1) Llama-2-7B tp1 x pp2 FP8 delayed, graphed vs eager
# (speed and peak memory of the graph pools per micro-batch slot) before the recipes graph pipelines;
# (2) a 1-step amax history at the study's own rate (llama group, 1500 steps) and at 4x (500 steps).
mkdir -p /tmp/job /tmp/lay_graphed /tmp/lay_eager; start=$(date +%s)
step() { echo "=== $(date +%T) +$(( $(date +%s) - start ))s $*" >> /tmp/job/steps.txt; }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
( CUDA_VISIBLE_DEVICES=1 taskset -c 24-31 bash examples/convergence_study.sh /tmp/study data > /tmp/job/data.log 2>&1
  step "study data exit $?" ) &
T="taskset -c 0-23"
GRAPHS=all MODEL=llama GPUS=2 LAYOUTS="1:2" PRECISIONS=delayed WORKDIR=/tmp/layouts RESULTS=/tmp/lay_graphed $T bash benchmarks/layouts_8gpu.sh > /tmp/job/lay_graphed.log 2>&1; step "llama graphed pp2 exit $?"
GRAPHS=1 MODEL=llama GPUS=2 LAYOUTS="1:2" PRECISIONS=delayed WORKDIR=/tmp/layouts RESULTS=/tmp/lay_eager $T bash benchmarks/layouts_8gpu.sh > /tmp/job/lay_eager.log 2>&1; step "llama eager pp2 exit $?"
for d in lay_graphed lay_eager; do python benchmarks/layout_tables.py /tmp/$d/*.jsonl > /tmp/$d/layouts.md 2>&1; done
wait; step "data ready"
run() {  # GPU CORES NAME PEAK_LR MIN_LR WARMUP ITERS
    CUDA_VISIBLE_DEVICES=$1 taskset -c $2 torchrun --standalone --nproc-per-node 1 --master-port $((29600 + $1)) -m megafp8.train \
      --model llama-120m --seq-length 1024 --micro-batch-size 32 --global-batch-size 64 --train-iters $7 \
      --lr $4 --min-lr $5 --lr-warmup-iters $6 --lr-decay-style cosine --weight-decay 0.1 --adam-beta2 0.95 \
      --clip-grad 1.0 --init-method-std 0.02 --seed 1234 --data-seed 1234 --bf16 --fp8-format hybrid \
      --fp8-recipe delayed --fp8-amax-history-len 1 --fp8-amax-compute-algo max --log-fp8-layers --enable-cuda-graph \
      --train-data-path /tmp/study/data/train_text_document --valid-data-path /tmp/study/data/validation_text_document \
      --tokenizer-type HuggingFaceTokenizer --tokenizer-model /tmp/study/tokenizer --log-interval 10 \
      --eval-interval 100 --eval-iters 10 --tensorboard-dir /tmp/study/runs/$3 > /tmp/job/${3//\//_}.log 2>&1
    step "$3 exit $?"
}
run 0 0-15 llama/fp8_delayed_hist1 6e-4 6e-5 150 1500 &
run 1 16-31 lr4x/fp8_delayed_hist1 2.4e-3 2.4e-4 50 500
wait
step "done"
