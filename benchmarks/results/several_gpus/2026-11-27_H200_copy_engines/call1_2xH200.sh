set -u
source benchmarks/results/several_gpus/2026-11-27_H200_copy_engines/setup.sh
export LOG_INTERVAL=10
timeout 150 torchrun --standalone --nproc-per-node 2 benchmarks/results/several_gpus/2026-11-27_H200_copy_engines/ce_probe.py > $OUT/probe.txt 2>&1; echo "probe rc=$?" >> $OUT/probe.txt
grep -v "^W1127\|^\*\*\*\*" $OUT/probe.txt | tail -20
timeout 200 python3 -m pytest -q -x tests/training/test_cuda_graphs.py -k "overlap" -p no:cacheprovider > $OUT/gpu_tests.txt 2>&1; echo "gpu tests rc=$?" | tee -a $OUT/summary.txt
tail -5 $OUT/gpu_tests.txt
tps() { grep -h "iteration  *$1/" $2 | grep -o "tokens/s: [0-9]*" | tail -1; }
run() { # name extra env...
  local name=$1 extra=$2; shift 2
  env "$@" ITERS=20 EXTRA_ARGS="$extra" timeout 120 bash examples/pretrain_gpt_1b_fp8.sh > /tmp/$name.log 2>&1
  local rc=$?
  echo "$name rc=$rc $(tps 20 /tmp/$name.log) $(grep -o 'wall time: .*' /tmp/$name.log)" | tee -a $OUT/summary.txt
  [ $rc = 0 ] || tail -30 /tmp/$name.log >> $OUT/errors.txt
}
run gpu1_delayed "" GPUS=1 CUDA_VISIBLE_DEVICES=0
run dp2_delayed "" GPUS=2
run dp2_delayed_distopt_pg "--use-distributed-optimizer --overlap-param-gather" GPUS=2
run pp2_delayed "" GPUS=2 PP=2
run pp2_delayed_vpp6 "--num-layers-per-virtual-pipeline-stage 6" GPUS=2 PP=2
run pp2_delayed_last11 "--decoder-last-pipeline-num-layers 11" GPUS=2 PP=2
run tp2_delayed_overlap "--tp-comm-overlap" GPUS=2 TP=2
run tp2_bf16_overlap "--tp-comm-overlap" GPUS=2 TP=2 PRECISION=bf16
cat $OUT/errors.txt 2>/dev/null | tail -20
cat $OUT/summary.txt
