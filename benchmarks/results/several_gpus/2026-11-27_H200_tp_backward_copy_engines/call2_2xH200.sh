set -u
source benchmarks/results/several_gpus/2026-11-27_H200_copy_engines/setup.sh
bash examples/prepare_sample_data.sh /tmp/w 32768 > /dev/null 2>&1
T=tests/training/test_cuda_graphs.py::test_graphed_tensor_data_and_pipeline_parallel_equal_eager_bitwise
echo "== gpu tests"; timeout 170 python3 -m pytest -q -p no:cacheprovider tests/parallel/test_collective_gemm.py -k copy_engine "$T[tp2-sp-overlap-bf16]" "$T[tp2-sp-overlap-delayed]" > $OUT/tests.txt 2>&1; echo "tests rc=$?"; tail -3 $OUT/tests.txt
tps() { grep -h "iteration  *$1/" $2 | grep -o "tokens/s: [0-9]*" | tail -1; }
run() { # name extra env...
  local name=$1 extra=$2; shift 2
  env "$@" ITERS=20 EXTRA_ARGS="$extra" timeout 110 bash examples/pretrain_gpt_1b_fp8.sh > /tmp/$name.log 2>&1
  local rc=$?
  echo "$name rc=$rc $(tps 20 /tmp/$name.log) $(grep -o 'wall time: .*' /tmp/$name.log)" | tee -a $OUT/summary.txt
  [ $rc = 0 ] || tail -30 /tmp/$name.log >> $OUT/errors.txt
}
echo "== series"
run gpu1_delayed "" GPUS=1 CUDA_VISIBLE_DEVICES=0
run tp2_delayed "" GPUS=2 TP=2
run tp2_bf16 "" GPUS=2 TP=2 PRECISION=bf16
run dp2_delayed "" GPUS=2
run pp2_delayed "" GPUS=2 PP=2
echo "== profile"
rm -rf runs/latest
env GPUS=2 TP=2 ITERS=13 EXTRA_ARGS="--profile --use-pytorch-profiler --profile-step-start 10 --profile-step-end 12" timeout 120 bash examples/pretrain_gpt_1b_fp8.sh > /tmp/prof.log 2>&1
echo "prof rc=$? $(tps 10 /tmp/prof.log)"
for f in runs/latest/profile/rank0*.txt; do head -4 $f | tee $OUT/prof_tp2.txt; sed -n 5,60p $f >> $OUT/prof_tp2.txt; done
grep -h "tp-comm\|transport\|distributed optimizer" /tmp/tp2_delayed.log /tmp/dp2_delayed.log | head -5
cat $OUT/errors.txt 2>/dev/null | tail -30
