set -u
source benchmarks/results/several_gpus/2026-11-27_H200_copy_engines/setup.sh
export LOG_INTERVAL=10
T=tests/training/test_cuda_graphs.py::test_graphed_tensor_data_and_pipeline_parallel_equal_eager_bitwise
(timeout 170 python3 -m pytest -q -p no:cacheprovider tests/parallel/test_collective_gemm.py -k copy_engine "$T[tp2-sp-overlap-delayed]" "$T[tp2-sp-delayed]" > $OUT/tests_a.txt 2>&1; echo "tests_a rc=$?" >> $OUT/summary.txt) &
(CUDA_VISIBLE_DEVICES=2,3 timeout 170 python3 -m pytest -q -p no:cacheprovider "$T[dp2-overlap-param-gather-delayed]" "$T[pp2-vpp2-delayed]" > $OUT/tests_b.txt 2>&1; echo "tests_b rc=$?" >> $OUT/summary.txt) &
wait
tail -3 $OUT/tests_a.txt $OUT/tests_b.txt
tps() { grep -h "iteration  *$1/" $2 | grep -o "tokens/s: [0-9]*" | tail -1; }
run() { # name extra env...
  local name=$1 extra=$2; shift 2
  env "$@" ITERS=20 EXTRA_ARGS="$extra" timeout 110 bash examples/pretrain_gpt_1b_fp8.sh > /tmp/$name.log 2>&1
  local rc=$?
  echo "$name rc=$rc $(tps 20 /tmp/$name.log) $(grep -o 'wall time: .*' /tmp/$name.log)" | tee -a $OUT/summary.txt
  [ $rc = 0 ] || tail -30 /tmp/$name.log >> $OUT/errors.txt
}
run gpu1_delayed "" GPUS=1 CUDA_VISIBLE_DEVICES=0
run tp2_delayed_ce "--tp-comm-overlap" GPUS=2 TP=2 CUDA_VISIBLE_DEVICES=0,1
run tp2_delayed_nccl "--tp-comm-overlap --tp-comm-overlap-transport nccl" GPUS=2 TP=2 CUDA_VISIBLE_DEVICES=0,1
run tp2_bf16_ce "--tp-comm-overlap" GPUS=2 TP=2 PRECISION=bf16 CUDA_VISIBLE_DEVICES=0,1
run pp2_delayed_vpp2default "" GPUS=2 PP=2 CUDA_VISIBLE_DEVICES=0,1
timeout 230 python3 -m tests.multigpu.check_layouts --layouts tp2 vpp2 dp2 tp2pp2 pp2dp2 --tp-comm-overlap --overlap-param-gather --kinds straight resumed sigterm --share 6 --output /tmp/check > /tmp/check.log 2>&1
echo "check rc=$?" | tee -a $OUT/summary.txt
cp /tmp/check/check_layouts.json $OUT/ 2>/dev/null; grep -A60 "^run  " /tmp/check.log | tail -45 > $OUT/check_table.txt
tail -8 $OUT/check_table.txt
cat $OUT/errors.txt 2>/dev/null | tail -20
cat $OUT/summary.txt
