set -u
source .dev/setup.sh
export LOG_INTERVAL=1
run() { # name extra env...
  local name=$1 extra=$2; shift 2
  env "$@" ITERS=6 EXTRA_ARGS="$extra" bash examples/pretrain_gpt_1b_fp8.sh > /tmp/$name.log 2>&1
  local rc=$?
  echo "$name rc=$rc losses: $(grep -o 'lm loss: [0-9.E+-]*' /tmp/$name.log | head -6 | sed 's/lm loss: //' | tr '\n' ' ')" | tee -a $OUT/summary.txt
  [ $rc = 0 ] || tail -30 /tmp/$name.log >> $OUT/errors.txt
}
run tp2_plain "" GPUS=2 TP=2
run tp2_overlap "--tp-comm-overlap" GPUS=2 TP=2
run tp2_overlap_eager "--tp-comm-overlap" GPUS=2 TP=2 CUDA_GRAPH=0
run tp2_plain_eager "" GPUS=2 TP=2 CUDA_GRAPH=0
timeout 240 python3 -m tests.multigpu.check_layouts --layouts tp2 dp2 pp2 --kinds straight --share 6 --output /tmp/check > /tmp/check.log 2>&1
echo "check rc=$?" | tee -a $OUT/summary.txt
cp /tmp/check/check_layouts.json $OUT/ 2>/dev/null; tail -25 /tmp/check.log | tee $OUT/check_tail.txt
cat $OUT/errors.txt 2>/dev/null | tail -30
