#!/usr/bin/env bash
# Session 19, last call: CUDA graphs under pipeline parallelism (branch pipeline-graphs): the GPU
# equality tests (graphed == eager bit for bit) for pp 2, interleaved, and dp 2 (regression), then
# GPT-1.3B tp 1 x pp 2 FP8 delayed eager vs graphed (mock data) on the same two GPUs.
mkdir -p /tmp/job; start=$(date +%s)
step() { echo "=== $(date +%T) +$(( $(date +%s) - start ))s $*" >> /tmp/job/steps.txt; }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
timeout 110 python -m pytest -q -m gpu tests/training/test_cuda_graphs.py -p no:cacheprovider \
    -k "pp2-delayed or pp2-vpp2-delayed or dp2-delayed" > /tmp/job/gpu_tests.log 2>&1; step "tests exit $?"
for g in "eager:" "graphed:--enable-cuda-graph"; do
    name=${g%%:*}; G=${g#*:}
    # shellcheck disable=SC2086
    timeout 60 torchrun --standalone --nproc-per-node 2 -m megafp8.train --model gpt-1.3b --seq-length 2048 \
        --max-position-embeddings 2048 --micro-batch-size 4 --global-batch-size 64 --train-iters 9 --lr 2e-4 \
        --mock-data --log-interval 1 --pipeline-model-parallel-size 2 --bf16 --fp8-format hybrid \
        --fp8-recipe delayed $G > /tmp/job/pp2_$name.log 2>&1
    step "pp2 $name exit $?"
done
timeout 60 python -m pytest -q -m gpu tests/training/test_cuda_graphs.py -p no:cacheprovider \
    -k "pp2-current-selective or pp2-bf16" > /tmp/job/gpu_tests2.log 2>&1; step "tests 2 exit $?"
