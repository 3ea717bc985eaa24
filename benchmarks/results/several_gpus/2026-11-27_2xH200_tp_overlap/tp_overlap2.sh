set -u
source .dev/setup.sh
P="--profile --use-pytorch-profiler --profile-step-start 7 --profile-step-end 9"
tps() { grep -h "iteration  *$1/" $2 | grep -o "tokens/s: [0-9]*" | tail -1; }
run() { # name iters extra env...
  local name=$1 iters=$2 extra=$3; shift 3
  env "$@" ITERS=$iters EXTRA_ARGS="$extra" bash examples/pretrain_gpt_1b_fp8.sh > /tmp/$name.log 2>&1
  local rc=$?
  echo "$name rc=$rc $(tps $iters /tmp/$name.log) losses: $(grep -o 'lm loss: [0-9.E+-]*' /tmp/$name.log | head -4 | tr '\n' ' ')" | tee -a $OUT/summary.txt
  [ $rc = 0 ] || tail -30 /tmp/$name.log >> $OUT/errors.txt
}
run tp2_fp8_overlap 20 "--tp-comm-overlap" GPUS=2 TP=2
run tp2_fp8 20 "" GPUS=2 TP=2
run gpu1_fp8 20 "" GPUS=1 CUDA_VISIBLE_DEVICES=0
run tp2_fp8_overlap_current 20 "--tp-comm-overlap" GPUS=2 TP=2 FP8_RECIPE=current
run prof_tp2_overlap 10 "$P --tp-comm-overlap --tensorboard-dir /tmp/prof_o" GPUS=2 TP=2
f=$(ls /tmp/prof_o/profile/rank0_*.json)
{ head -3 /tmp/prof_o/profile/rank0_*.txt; python3 .dev/nccl_split.py $f | head -6; } >> $OUT/profiles.txt
python3 benchmarks/profile_gaps.py $f > $OUT/gaps_o.txt 2>&1
cp $f $OUT/trace_o.json; gzip $OUT/trace_o.json
ls -la $OUT
cat $OUT/summary.txt; cat $OUT/profiles.txt; head -12 $OUT/gaps_o.txt; cat $OUT/errors.txt 2>/dev/null | tail -40
