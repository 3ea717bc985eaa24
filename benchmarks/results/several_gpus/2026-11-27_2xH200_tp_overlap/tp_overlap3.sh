set -u
source .dev/setup.sh
tps() { grep -h "iteration  *$1/" $2 | grep -o "tokens/s: [0-9]*" | tail -1; }
run() { # name iters extra env...
  local name=$1 iters=$2 extra=$3; shift 3
  env "$@" ITERS=$iters EXTRA_ARGS="$extra" bash examples/pretrain_gpt_1b_fp8.sh > /tmp/$name.log 2>&1
  local rc=$?
  echo "$name rc=$rc $(tps $iters /tmp/$name.log) losses: $(grep -o 'lm loss: [0-9.E+-]*' /tmp/$name.log | head -2 | tr '\n' ' ')" | tee -a $OUT/summary.txt
  [ $rc = 0 ] || tail -30 /tmp/$name.log >> $OUT/errors.txt
}
run ov_c16 20 "--tp-comm-overlap" GPUS=2 TP=2
run ov_c0 20 "--tp-comm-overlap" GPUS=2 TP=2 MEGAFP8_SM_CARVEOUT=0
run ov_c16_noLL 20 "--tp-comm-overlap" GPUS=2 TP=2 NCCL_PROTO=^LL
run plain_noLL 20 "" GPUS=2 TP=2 NCCL_PROTO=^LL
run plain 20 "" GPUS=2 TP=2
run gpu1 20 "" GPUS=1 CUDA_VISIBLE_DEVICES=0
cat $OUT/errors.txt 2>/dev/null | tail -30
