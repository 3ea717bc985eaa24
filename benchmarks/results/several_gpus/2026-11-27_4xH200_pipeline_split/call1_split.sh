# GPU tests of the moved modules, then the pipeline split at GPT-1.3B (recipe as shipped, 20 iterations)
set -u
source .dev/setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader | wc -l
(bash examples/prepare_sample_data.sh /tmp/w 32768 > $OUT/data.txt 2>&1; echo data rc=$? >> $OUT/data.txt) &
T=tests/training/test_cuda_graphs.py::test_graphed_tensor_data_and_pipeline_parallel_equal_eager_bitwise
echo "== gpu tests"
CUDA_VISIBLE_DEVICES=0,1 timeout 200 python3 -m pytest -q -p no:cacheprovider tests/parallel/test_collective_gemm.py \
  tests/parallel/test_graph_bookkeeping.py "$T[tp2-sp-overlap-bf16]" "$T[tp2-sp-overlap-delayed]" \
  tests/fp8/test_health.py > $OUT/tests.txt 2>&1; echo "tests rc=$?"; tail -1 $OUT/tests.txt
wait; tail -1 $OUT/data.txt
tps() { grep -h "iteration  *$1/" $2 | grep -o "tokens/s: [0-9]*" | tail -1; }
run() { # name env...
  local name=$1; shift
  env "$@" ITERS=20 timeout 110 bash examples/pretrain_gpt_1b_fp8.sh > $OUT/$name.log 2>&1
  local rc=$?
  echo "$name rc=$rc $(tps 20 $OUT/$name.log) $(grep -o 'pipeline split: [^(]*' $OUT/$name.log | head -1) $(grep -o 'wall time: [^,]*' $OUT/$name.log)" | tee -a $OUT/summary.txt
  [ $rc = 0 ] || tail -30 $OUT/$name.log >> $OUT/errors.txt
}
echo "== series"
run gpu1_delayed GPUS=1 CUDA_VISIBLE_DEVICES=0
run pp2_even_delayed GPUS=2 PP=2 BALANCE_PIPELINE=0 CUDA_VISIBLE_DEVICES=0,1
run pp2_balanced_delayed GPUS=2 PP=2 CUDA_VISIBLE_DEVICES=0,1
run pp2_balanced_bf16 GPUS=2 PP=2 PRECISION=bf16 CUDA_VISIBLE_DEVICES=0,1
run pp2dp2_balanced_delayed GPUS=4 PP=2
run pp2dp2_balanced_bf16 GPUS=4 PP=2 PRECISION=bf16
run tp2pp2_balanced_delayed GPUS=4 TP=2 PP=2
cat $OUT/errors.txt 2>/dev/null | tail -20
cat $OUT/summary.txt
