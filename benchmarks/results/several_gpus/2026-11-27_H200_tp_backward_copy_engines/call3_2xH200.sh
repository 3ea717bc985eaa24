set -u
source benchmarks/results/several_gpus/2026-11-27_H200_copy_engines/setup.sh
bash examples/prepare_sample_data.sh /tmp/w 32768 > /dev/null 2>&1
T=tests/training/test_cuda_graphs.py::test_graphed_tensor_data_and_pipeline_parallel_equal_eager_bitwise
echo "== gpu tests"; timeout 150 python3 -m pytest -q -p no:cacheprovider tests/parallel/test_collective_gemm.py "$T[tp2-sp-overlap-bf16]" "$T[tp2-sp-overlap-delayed]" > $OUT/tests.txt 2>&1; echo "tests rc=$?"; tail -2 $OUT/tests.txt
tps() { grep -h "iteration  *$1/" $2 | grep -o "tokens/s: [0-9]*" | tail -1; }
run() { # name extra env...
  local name=$1 extra=$2; shift 2
  env "$@" ITERS=20 EXTRA_ARGS="$extra" timeout 100 bash examples/pretrain_gpt_1b_fp8.sh > /tmp/$name.log 2>&1
  local rc=$?
  echo "$name rc=$rc $(tps 20 /tmp/$name.log) $(grep -o 'wall time: .*' /tmp/$name.log)" | tee -a $OUT/summary.txt
  [ $rc = 0 ] || tail -30 /tmp/$name.log >> $OUT/errors.txt
}
echo "== series"
run gpu1_delayed "" GPUS=1 CUDA_VISIBLE_DEVICES=0
run tp2_delayed "" GPUS=2 TP=2
run tp2_bf16 "" GPUS=2 TP=2 PRECISION=bf16
echo "== check"
timeout 310 python3 -m tests.multigpu.check_layouts --share 4 --output /tmp/check > /tmp/check.log 2>&1
echo "check rc=$?"; cp /tmp/check/check_layouts.json $OUT/ 2>/dev/null; cp /tmp/check.log $OUT/check.log
grep -A45 "^run  " /tmp/check.log | tail -40
cat $OUT/errors.txt 2>/dev/null | tail -20
