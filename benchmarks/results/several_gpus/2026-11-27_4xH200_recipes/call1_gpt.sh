# 4 GPUs: the tp GPU tests, then the GPT-1.3B recipe as shipped at 4-GPU layouts
set -u
source .dev/setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader | wc -l
bash examples/prepare_sample_data.sh /tmp/w 32768 > /dev/null 2>&1
(bash examples/prepare_sample_data.sh /tmp/wl 32000 > /dev/null 2>&1; echo llama data rc=$? > $OUT/llama_data.txt) &
T=tests/training/test_cuda_graphs.py::test_graphed_tensor_data_and_pipeline_parallel_equal_eager_bitwise
echo "== gpu tests"; CUDA_VISIBLE_DEVICES=0,1 timeout 170 python3 -m pytest -q -p no:cacheprovider tests/parallel/test_collective_gemm.py "$T[tp2-sp-overlap-bf16]" "$T[tp2-sp-overlap-delayed]" > $OUT/tests.txt 2>&1; echo "tests rc=$?"; tail -1 $OUT/tests.txt
wait
tps() { grep -h "iteration  *$1/" $2 | grep -o "tokens/s: [0-9]*" | tail -1; }
run() { # name env...
  local name=$1; shift
  env "$@" ITERS=20 timeout 100 bash examples/pretrain_gpt_1b_fp8.sh > $OUT/$name.log 2>&1
  local rc=$?
  echo "$name rc=$rc $(tps 20 $OUT/$name.log) $(grep -o 'wall time: .*' $OUT/$name.log)" | tee -a $OUT/summary.txt
  [ $rc = 0 ] || tail -30 $OUT/$name.log >> $OUT/errors.txt
}
echo "== series"
run gpu1_delayed GPUS=1 CUDA_VISIBLE_DEVICES=0
for L in "tp2pp2 TP=2 PP=2" "pp2dp2 TP=1 PP=2" "tp2dp2 TP=2 PP=1" "dp4 TP=1 PP=1"; do
  set -- $L; n=$1; shift
  run ${n}_delayed GPUS=4 "$@"
  run ${n}_bf16 GPUS=4 PRECISION=bf16 "$@"
done
cat $OUT/errors.txt 2>/dev/null | tail -20
cat $OUT/summary.txt
