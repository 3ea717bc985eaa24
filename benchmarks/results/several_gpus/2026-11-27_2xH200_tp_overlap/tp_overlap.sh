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
run tp2_fp8 20 "" GPUS=2 TP=2
run tp2_fp8_overlap 20 "--tp-comm-overlap" GPUS=2 TP=2
run gpu1_fp8 20 "" GPUS=1 CUDA_VISIBLE_DEVICES=0
run tp2_bf16 20 "" GPUS=2 TP=2 PRECISION=bf16
run prof_tp2_overlap 10 "$P --tp-comm-overlap --tensorboard-dir /tmp/prof_o" GPUS=2 TP=2
run prof_tp2 10 "$P --tensorboard-dir /tmp/prof_p" GPUS=2 TP=2
for d in o p; do
  f=$(ls /tmp/prof_$d/profile/rank0_*.json)
  { echo "== $d"; head -3 /tmp/prof_$d/profile/rank0_*.txt; python3 .dev/nccl_split.py $f | head -6; } >> $OUT/profiles.txt
  python3 benchmarks/profile_gaps.py $f > $OUT/gaps_$d.txt 2>&1
done
cat $OUT/summary.txt; cat $OUT/profiles.txt; head -20 $OUT/gaps_p.txt; cat $OUT/errors.txt 2>/dev/null | tail -40
