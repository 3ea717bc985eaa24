# GPU tests, then the recipe as shipped: one GPU, tp 2 FP8 / bf16, pp 2, dp 2; then pp 2 at VPP 6 and 8
set -u
source benchmarks/results/several_gpus/2026-11-27_H200_copy_engines/setup.sh >/dev/null
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/parallel/test_collective_gemm.py tests/training/test_cuda_graphs.py -k "copy_engine or tp2-sp" > $OUT/gpu_tests.txt 2>&1
echo "gpu tests rc=$? $(tail -1 $OUT/gpu_tests.txt)" | tee $OUT/summary.txt
bash examples/prepare_sample_data.sh /tmp/w 32768 > /dev/null 2>&1
tps() { grep -h "iteration  *20/" $1 | grep -o "tokens/s: [0-9]*\|lm loss: [0-9.E+-]*" | tr '\n' ' '; }
run() { local name=$1 extra=$2; shift 2
  env "$@" ITERS=20 EXTRA_ARGS="$extra" timeout 110 bash examples/pretrain_gpt_1b_fp8.sh > $OUT/$name.log 2>&1
  echo "$name rc=$? $(tps $OUT/$name.log)" | tee -a $OUT/summary.txt; }
run gpu1_delayed "" GPUS=1 CUDA_VISIBLE_DEVICES=0
run tp2_delayed "" GPUS=2 TP=2
run tp2_bf16 "" GPUS=2 TP=2 PRECISION=bf16
run pp2_delayed "" GPUS=2 PP=2
run dp2_delayed "" GPUS=2
run pp2_vpp6 "" GPUS=2 PP=2 VPP=6
run pp2_vpp8 "" GPUS=2 PP=2 VPP=8
cat $OUT/summary.txt
