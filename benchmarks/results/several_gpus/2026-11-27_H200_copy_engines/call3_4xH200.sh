set -u
source benchmarks/results/several_gpus/2026-11-27_H200_copy_engines/setup.sh
losses() { grep -o 'lm loss: [0-9.E+-]*' $1 | sed 's/lm loss: //' | tr '\n' ' '; }
diag() { # name devices extra env...
  local name=$1 dev=$2 extra=$3; shift 3
  env "$@" CUDA_VISIBLE_DEVICES=$dev GPUS=2 TP=2 PRECISION=bf16 SEQ=1024 MBS=2 GBS=16 ITERS=6 WARMUP=2 LOG_INTERVAL=1 \
    EXTRA_ARGS="--num-layers 4 --hidden-size 1024 --num-attention-heads 16 --seed 1234 $extra" \
    timeout 120 bash examples/pretrain_gpt_1b_fp8.sh > /tmp/$name.log 2>&1
  echo "$name rc=$? $(losses /tmp/$name.log)" >> $OUT/diag.txt
}
bash examples/prepare_sample_data.sh /tmp/w 32768 > /dev/null 2>&1
diag plain_graphs 0,1 "" &
diag ce_graphs 2,3 "--tp-comm-overlap" &
wait
diag nccl_graphs 0,1 "--tp-comm-overlap --tp-comm-overlap-transport nccl" &
diag ce_eager 2,3 "--tp-comm-overlap --tp-comm-overlap-transport copy-engine" CUDA_GRAPH=0 &
wait
diag nccl_eager 0,1 "--tp-comm-overlap" CUDA_GRAPH=0 &
diag ce_graphs_fp8 2,3 "--tp-comm-overlap" PRECISION=fp8 &
wait
cat $OUT/diag.txt
export LOG_INTERVAL=10
tps() { grep -h "iteration  *$1/" $2 | grep -o "tokens/s: [0-9]*" | tail -1; }
run() { # name extra env...
  local name=$1 extra=$2; shift 2
  env "$@" ITERS=20 EXTRA_ARGS="$extra" timeout 110 bash examples/pretrain_gpt_1b_fp8.sh > /tmp/$name.log 2>&1
  local rc=$?
  echo "$name rc=$rc $(tps 20 /tmp/$name.log) $(grep -o 'wall time: .*' /tmp/$name.log)" | tee -a $OUT/summary.txt
  [ $rc = 0 ] || tail -30 /tmp/$name.log >> $OUT/errors.txt
}
run gpu1_delayed "" GPUS=1 CUDA_VISIBLE_DEVICES=0
run dp4_delayed "" GPUS=4
run pp2dp2_delayed "" GPUS=4 PP=2
run tp2dp2_delayed "--tp-comm-overlap" GPUS=4 TP=2
run tp2pp2_delayed "--tp-comm-overlap" GPUS=4 TP=2 PP=2
run tp2pp2_bf16 "" GPUS=4 TP=2 PP=2 PRECISION=bf16
cat $OUT/errors.txt 2>/dev/null | tail -20
cat $OUT/diag.txt $OUT/summary.txt
