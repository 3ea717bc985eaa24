# issue 40: the busy-growth GPU test on the build without the fix (expected to fail), then the two-GPU table
# on the fixed build (recipe as shipped, ITERS=40): one GPU, dp2, pp2, tp2 FP8, tp2 bf16, tp2 FP8 and bf16 again
set -u; T0=$SECONDS
source .dev/setup.sh >/dev/null 2>&1
(cd .dev/builds/nofix && MEGAFP8_ROOT=$PWD timeout 60 python -m pytest -q -p no:cacheprovider tests/parallel/test_collective_gemm.py -m gpu -k queued_compute > $OUT/nofix_test.txt 2>&1)
echo "nofix busy-growth test rc=$? $(tail -1 $OUT/nofix_test.txt) t=$((SECONDS-T0))"
grep -ho "rank . stopped: [^\\]*\|rank . gathered [A-Za-z]*\|CUDASymmetricMemory::barrier: rank . failed[^\\]*" $OUT/nofix_test.txt | sort | uniq | head -6
bash examples/prepare_sample_data.sh /tmp/w 32768 > /dev/null 2>&1
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,driver_version --format=csv,noheader | tee $OUT/summary.txt
tps() { grep -h "iteration  *40/" $1 | grep -o "tokens/s: [0-9]*\|lm loss: [0-9.E+-]*" | tr '\n' ' '; }
run() { local name=$1; shift
  [ $((SECONDS-T0)) -gt 540 ] && { echo "$name skipped (time)" | tee -a $OUT/summary.txt; return; }
  (env "$@" ITERS=40 timeout 110 bash examples/pretrain_gpt_1b_fp8.sh > $OUT/logs/$name.log 2>&1)
  echo "$name rc=$? $(tps $OUT/logs/$name.log) t=$((SECONDS-T0))" | tee -a $OUT/summary.txt; }
run gpu1 GPUS=1
run dp2 GPUS=2
run pp2 GPUS=2 PP=2
run tp2 GPUS=2 TP=2
run tp2_bf16 GPUS=2 TP=2 PRECISION=bf16
run tp2_r2 GPUS=2 TP=2
run tp2_bf16_r2 GPUS=2 TP=2 PRECISION=bf16
tar czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
