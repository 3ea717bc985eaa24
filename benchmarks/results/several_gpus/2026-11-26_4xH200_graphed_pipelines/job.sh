#!/usr/bin/env bash
# Session 20 on nvidia-h100-x4 (or H200 x4), ~12 min: (1) the CUDA-graph GPU tests, pipelines
# included (bit for bit against eager), on GPUs 0-1; beside them on GPUs 2-3 the study data and
# the lr groups' new FP8 same-batch runs (fp8_delayed_init1235) plus a 2x FP8 run with a 16-step
# amax history (the 2x gap's suspect); (2) on all four GPUs GPT-1.3B tp 2 x pp 2 and pp 2 x dp 2,
# eager and graphed (GRAPHS=all), bf16 / delayed / current, one machine.
# Launch: run(command="JOB=next_job_s20.sh bash probe/next_start.sh 560", carry=["probe",".whl"],
#         kind="nvidia-h100-x4"), then bash probe/next_poll.sh 575 (with carry) until done.
mkdir -p /tmp/job /tmp/lay_eager /tmp/lay_graphed; start=$(date +%s)
step() { echo "=== $(date +%T) +$(( $(date +%s) - start ))s $*" >> /tmp/job/steps.txt; }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
( export CUDA_VISIBLE_DEVICES=2
  taskset -c 32-63 bash examples/convergence_study.sh /tmp/study data > /tmp/job/data.log 2>&1; step "study data exit $?"
  export TRAIN_DATA=/tmp/study/data/train_text_document VALID_DATA=/tmp/study/data/validation_text_document \
         TOKENIZER_MODEL=/tmp/study/tokenizer
  for g in lr2x lr4x; do for r in bf16 fp8_delayed bf16_seed1235 bf16_init1235; do
      mkdir -p /tmp/study/runs/$g/$r; echo 500 > /tmp/study/runs/$g/$r/latest_checkpointed_iteration.txt; done; done
  CUDA_VISIBLE_DEVICES=2 taskset -c 32-47 bash examples/convergence_study.sh /tmp/study lr2x > /tmp/job/lr2x.log 2>&1 &
  CUDA_VISIBLE_DEVICES=3 taskset -c 48-63 bash examples/convergence_study.sh /tmp/study lr4x > /tmp/job/lr4x.log 2>&1
  wait; step "fp8 same-batch runs done"
  # 2x, FP8 delayed, seed 1234 on the same batches, amax history 16 (the lr2x fp8_delayed run's flags otherwise)
  CUDA_VISIBLE_DEVICES=2 taskset -c 32-47 torchrun --standalone --nproc-per-node 1 -m megafp8.train \
      --model llama-120m --seq-length 1024 --micro-batch-size 32 --global-batch-size 64 --train-iters 500 \
      --lr 1.2e-3 --min-lr 1.2e-4 --lr-warmup-iters 50 --lr-decay-style cosine --weight-decay 0.1 --adam-beta2 0.95 \
      --clip-grad 1.0 --init-method-std 0.02 --seed 1234 --data-seed 1234 --bf16 --fp8-format hybrid \
      --fp8-recipe delayed --fp8-amax-history-len 16 --fp8-amax-compute-algo max --log-fp8-layers --enable-cuda-graph \
      --train-data-path $TRAIN_DATA --valid-data-path $VALID_DATA --tokenizer-type HuggingFaceTokenizer \
      --tokenizer-model $TOKENIZER_MODEL --log-interval 10 --eval-interval 100 --eval-iters 10 \
      --tensorboard-dir /tmp/study/runs/lr2x/fp8_delayed_hist16 > /tmp/job/hist16.log 2>&1
  step "hist16 exit $?" ) &
CUDA_VISIBLE_DEVICES=0,1 taskset -c 0-31 python -m pytest -q -m gpu tests/training/test_cuda_graphs.py \
    -p no:cacheprovider > /tmp/job/gpu_tests.log 2>&1; step "graph tests exit $?"
( taskset -c 0-31 bash examples/prepare_sample_data.sh /tmp/layouts 32768 > /tmp/job/sample.log 2>&1 ); step "sample data"
wait; step "GPUs 2-3 free"
T="taskset -c 0-63"
GRAPHS=all MODEL=gpt GPUS=4 LAYOUTS="2:2 1:2" ITERS=20 WORKDIR=/tmp/layouts RESULTS=/tmp/lay_graphed $T bash benchmarks/layouts_8gpu.sh > /tmp/job/lay_graphed.log 2>&1; step "graphed layouts exit $?"
GRAPHS=1 MODEL=gpt GPUS=4 LAYOUTS="2:2 1:2" ITERS=20 WORKDIR=/tmp/layouts RESULTS=/tmp/lay_eager $T bash benchmarks/layouts_8gpu.sh > /tmp/job/lay_eager.log 2>&1; step "eager layouts exit $?"
for d in lay_graphed lay_eager; do python benchmarks/layout_tables.py /tmp/$d/*.jsonl > /tmp/$d/layouts.md 2>&1; done
# The planner's inputs on this machine, then the check of graphed and eager pipelines against it.
mkdir -p /tmp/maps
CUDA_VISIBLE_DEVICES=0 taskset -c 0-15 python benchmarks/bench_layer_grid.py --model gpt-1.3b --seq-lengths 2048 \
    --micro-batches 1 2 4 8 --output /tmp/maps/gpt-1.3b_tp1.json > /tmp/job/map_tp1.log 2>&1; step "tp1 map exit $?"
CUDA_VISIBLE_DEVICES=0,1 taskset -c 0-31 torchrun --standalone --nproc-per-node 2 benchmarks/bench_layer_grid.py \
    --model gpt-1.3b --seq-lengths 2048 --micro-batches 1 2 4 8 --output /tmp/maps/gpt-1.3b_tp2.json > /tmp/job/map_tp2.log 2>&1
step "tp2 map exit $?"
$T torchrun --standalone --nproc-per-node 4 benchmarks/bench_collectives.py --output /tmp/maps/collectives.json > /tmp/job/coll.log 2>&1
python benchmarks/validate_planner.py /tmp/lay_graphed /tmp/lay_eager --layer-maps /tmp/maps/gpt-1.3b_tp1.json \
    /tmp/maps/gpt-1.3b_tp2.json --collectives /tmp/maps/collectives.json > /tmp/job/validate.txt 2>&1; step "validate exit $?"
step "done"
