# issue 40's two-GPU table in one call (recipe as shipped, ITERS=40): one GPU, pp2 (with the build before the
# stop-vote fix bd04e60 between two pp2 runs of HEAD), dp2, tp2 FP8 and bf16
set -u
T0=$SECONDS
source .dev/setup.sh >/dev/null 2>&1
bash examples/prepare_sample_data.sh /tmp/w 32768 > /dev/null 2>&1
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,driver_version --format=csv,noheader | tee $OUT/summary.txt
tps() { grep -h "iteration  *40/" $1 | grep -o "tokens/s: [0-9]*\|lm loss: [0-9.E+-]*" | tr '\n' ' '; }
run() { local name=$1 dir=$2; shift 2
  [ $((SECONDS-T0)) -gt 500 ] && { echo "$name skipped (time)" | tee -a $OUT/summary.txt; return; }
  (cd $dir && env MEGAFP8_ROOT=$PWD "$@" ITERS=40 timeout 110 bash examples/pretrain_gpt_1b_fp8.sh > $OUT/logs/$name.log 2>&1)
  echo "$name rc=$? $(tps $OUT/logs/$name.log) t=$((SECONDS-T0))" | tee -a $OUT/summary.txt; }
run gpu1 . GPUS=1
run pp2 . GPUS=2 PP=2
run pp2_before_vote_fix .dev/builds/8507d86 GPUS=2 PP=2
run pp2_r2 . GPUS=2 PP=2
run dp2 . GPUS=2
run tp2 . GPUS=2 TP=2
run tp2_bf16 . GPUS=2 TP=2 PRECISION=bf16
tar czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
