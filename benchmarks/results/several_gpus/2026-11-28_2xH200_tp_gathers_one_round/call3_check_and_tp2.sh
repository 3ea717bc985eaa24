# the multi-GPU check of this build, then one GPU / tp 2 FP8 / tp 2 bf16 again
set -u
source benchmarks/results/several_gpus/2026-11-27_H200_copy_engines/setup.sh >/dev/null
timeout 420 python3 -m tests.multigpu.check_layouts --share 4 > $OUT/check.txt 2>&1
echo "check rc=$?" | tee $OUT/summary.txt; tail -4 $OUT/check.txt | tee -a $OUT/summary.txt
bash examples/prepare_sample_data.sh /tmp/w 32768 > /dev/null 2>&1
tps() { grep -h "iteration  *20/" $1 | grep -o "tokens/s: [0-9]*\|lm loss: [0-9.E+-]*" | tr '\n' ' '; }
run() { local name=$1 extra=$2; shift 2
  env "$@" ITERS=20 EXTRA_ARGS="$extra" timeout 110 bash examples/pretrain_gpt_1b_fp8.sh > $OUT/$name.log 2>&1
  echo "$name rc=$? $(tps $OUT/$name.log)" | tee -a $OUT/summary.txt; }
run gpu1_delayed "" GPUS=1 CUDA_VISIBLE_DEVICES=0
run tp2_delayed "" GPUS=2 TP=2
run tp2_bf16 "" GPUS=2 TP=2 PRECISION=bf16
cat $OUT/summary.txt
