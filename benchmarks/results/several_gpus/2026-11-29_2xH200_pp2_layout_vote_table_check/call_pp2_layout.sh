# pp2: the balanced split (shipped: 3.5, 3, ..., 3, 2.5; rank 0 gets an attention half) against a layout giving
# rank 0 an MLP half instead (3, 3.5, 3.5, 3, 3, 3, 3, 2); ITERS=40, alternating, with one GPU first and last
set -u
T0=$SECONDS
source .dev/setup.sh >/dev/null 2>&1
bash examples/prepare_sample_data.sh /tmp/w 32768 > /dev/null 2>&1
mkdir -p $OUT/logs
tps() { grep -h "iteration  *40/" $1 | grep -o "tokens/s: [0-9]*\|lm loss: [0-9.E+-]*" | tr '\n' ' '; }
run() { local name=$1; shift
  [ $((SECONDS-T0)) -gt 480 ] && { echo "$name skipped (time)"; return; }
  env "$@" ITERS=40 timeout 110 bash examples/pretrain_gpt_1b_fp8.sh > $OUT/logs/$name.log 2>&1; echo "$name rc=$? $(tps $OUT/logs/$name.log) t=$((SECONDS-T0))" | tee -a $OUT/summary.txt; }
run gpu1 GPUS=1
for r in 1 2; do
  run pp2_balanced$r GPUS=2 PP=2
  run pp2_layout$r GPUS=2 PP=2 BALANCE_PIPELINE=0 "EXTRA_ARGS=--pipeline-stage-layers 3 3.5 3.5 3 3 3 3 2"
done
run gpu1_r2 GPUS=1
tar czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
# GPU tests written since the last GPU run: the stop vote never syncs; the fine-grained bench
[ $((SECONDS-T0)) -lt 540 ] && timeout $((590-SECONDS+T0)) python3 -m pytest -q -p no:cacheprovider tests/training/test_trainer.py::test_the_stop_vote_never_waits_for_the_gpu tests/benchmarks/test_bench_fine_grained.py::test_every_granularity_is_timed 2>&1 | tail -5 | tee -a $OUT/summary.txt
cat $OUT/summary.txt
