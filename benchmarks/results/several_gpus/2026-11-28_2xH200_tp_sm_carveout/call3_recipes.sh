# the recipe as shipped at this build: one GPU, tp 2 (carveout default 2, and 4), tp 2 bf16, pp 2, dp 2
set -u
source benchmarks/results/several_gpus/2026-11-27_H200_copy_engines/setup.sh >/dev/null
bash examples/prepare_sample_data.sh /tmp/w 32768 > /dev/null 2>&1
tps() { grep -h "iteration  *$1/" $2 | grep -o "tokens/s: [0-9]*" | tail -1; }
run() { local name=$1 extra=$2; shift 2
  env "$@" ITERS=20 EXTRA_ARGS="$extra" timeout 110 bash examples/pretrain_gpt_1b_fp8.sh > $OUT/$name.log 2>&1
  echo "$name rc=$? $(tps 20 $OUT/$name.log)" | tee -a $OUT/summary.txt; }
run gpu1_delayed "" GPUS=1 CUDA_VISIBLE_DEVICES=0
run tp2_delayed "" GPUS=2 TP=2
run tp2_bf16 "" GPUS=2 TP=2 PRECISION=bf16
run pp2_delayed "" GPUS=2 PP=2
run dp2_delayed "" GPUS=2
run tp2_delayed_carve4 "--tp-comm-sm-carveout 4" GPUS=2 TP=2
cat $OUT/summary.txt
