# 4 x H200: Llama-2-7B recipe at pp2 x dp2 and tp2 x pp2, FP8 delayed and bf16; then planner maps
set -u
T0=$SECONDS
source .dev/setup.sh
bash examples/prepare_sample_data.sh /tmp/wl 32000 > /dev/null 2>&1
mkdir -p $OUT/logs
tps() { grep -h "iteration  *$1/" $2 | grep -o "tokens/s: [0-9]*" | tail -1; }
run() { local name=$1; shift
  env "$@" WORKDIR=/tmp/wl ITERS=10 LOG_INTERVAL=5 timeout 130 bash examples/pretrain_llama2_7b_fp8.sh > $OUT/logs/$name.log 2>&1
  local rc=$?
  echo "$name rc=$rc $(tps 10 $OUT/logs/$name.log) $(grep -o 'wall time: .*' $OUT/logs/$name.log) $(grep -o 'peak[^,]*' $OUT/logs/$name.log | tail -1) t=$((SECONDS-T0))" | tee -a $OUT/summary.txt
  [ $rc = 0 ] || tail -20 $OUT/logs/$name.log >> $OUT/errors.txt; }
run llama_pp2dp2_delayed GPUS=4 TP=1 PP=2
run llama_pp2dp2_bf16 GPUS=4 TP=1 PP=2 PRECISION=bf16
run llama_tp2pp2_delayed GPUS=4 TP=2 PP=2
run llama_tp2pp2_bf16 GPUS=4 TP=2 PP=2 PRECISION=bf16
M="--model gpt-1.3b --seq-lengths 2048 --micro-batches 2 4"
[ $((SECONDS-T0)) -lt 380 ] && { CUDA_VISIBLE_DEVICES=0 timeout 100 python3 benchmarks/bench_layer_grid.py $M --output $OUT/gpt-1.3b_tp1.json > $OUT/logs/map_tp1.log 2>&1; echo "map tp1 rc=$? t=$((SECONDS-T0))"; }
[ $((SECONDS-T0)) -lt 450 ] && { CUDA_VISIBLE_DEVICES=0,1 timeout 100 torchrun --standalone --nproc-per-node 2 benchmarks/bench_layer_grid.py $M --output $OUT/gpt-1.3b_tp2.json > $OUT/logs/map_tp2.log 2>&1; echo "map tp2 rc=$? t=$((SECONDS-T0))"; }
[ $((SECONDS-T0)) -lt 530 ] && { timeout 50 torchrun --standalone --nproc-per-node 4 benchmarks/bench_collectives.py --output $OUT/collectives.json > $OUT/logs/coll.log 2>&1; echo "coll rc=$? t=$((SECONDS-T0))"; }
tar czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
tail -c 3000 $OUT/errors.txt 2>/dev/null
cat $OUT/summary.txt
