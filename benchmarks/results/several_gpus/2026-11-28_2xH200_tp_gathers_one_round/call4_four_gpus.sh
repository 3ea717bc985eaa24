# a short 4-GPU reading of the recipe (FP8 delayed only): one GPU, tp2 x dp2, pp2 x dp2, tp2 x pp2, dp4
set -u
source benchmarks/results/several_gpus/2026-11-27_H200_copy_engines/setup.sh >/dev/null
bash examples/prepare_sample_data.sh /tmp/w 32768 > /dev/null 2>&1
tps() { grep -h "iteration  *10/" $1 | grep -o "tokens/s: [0-9]*" | tr '\n' ' '; }
run() { local name=$1; shift
  env "$@" ITERS=10 timeout 45 bash examples/pretrain_gpt_1b_fp8.sh > $OUT/$name.log 2>&1
  echo "$name rc=$? $(tps $OUT/$name.log)" | tee -a $OUT/summary.txt; }
run gpu1 GPUS=1 CUDA_VISIBLE_DEVICES=0
run tp2_dp2 GPUS=4 TP=2
run pp2_dp2 GPUS=4 PP=2
run tp2_pp2 GPUS=4 TP=2 PP=2
run dp4 GPUS=4
