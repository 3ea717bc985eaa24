set -u
source benchmarks/results/several_gpus/2026-11-27_H200_copy_engines/setup.sh
losses() { grep -o 'lm loss: [0-9.E+-]*' $1 | sed 's/lm loss: //' | tr '\n' ' '; }
diag() { # name devices extra env...
  local name=$1 dev=$2 extra=$3; shift 3
  env CUDA_VISIBLE_DEVICES=$dev GPUS=2 TP=2 PRECISION=bf16 SEQ=1024 MBS=2 GBS=16 ITERS=6 WARMUP=2 LOG_INTERVAL=1 "$@" \
    EXTRA_ARGS="--num-layers 4 --hidden-size 1024 --num-attention-heads 16 --seed 1234 $extra" \
    timeout 100 bash examples/pretrain_gpt_1b_fp8.sh > /tmp/$name.log 2>&1
  echo "$name rc=$? $(losses /tmp/$name.log)" >> $OUT/diag.txt
}
bash examples/prepare_sample_data.sh /tmp/w 32768 > /dev/null 2>&1
diag ce_graphs 0,1 "--tp-comm-overlap" &
diag nccl_graphs 2,3 "--tp-comm-overlap --tp-comm-overlap-transport nccl" &
wait
cat $OUT/diag.txt
echo "reference (plain graphs, eager overlap): 8.425437E+00 8.163178E+00 at steps 5, 6"
timeout 80 python3 -m pytest -q -p no:cacheprovider "tests/training/test_cuda_graphs.py::test_graphed_tensor_data_and_pipeline_parallel_equal_eager_bitwise[tp2-sp-overlap-bf16]" > $OUT/test.txt 2>&1; echo "test rc=$?"
tail -n 2 $OUT/test.txt
