set -u
source .dev/setup.sh
bash examples/prepare_sample_data.sh /tmp/wl 32000 > /dev/null 2>&1
tps() { grep -h "iteration  *$1/" $2 | grep -o "tokens/s: [0-9]*" | tail -1; }
run() { local name=$1; shift
  env "$@" WORKDIR=/tmp/wl ITERS=10 LOG_INTERVAL=5 timeout 130 bash examples/pretrain_llama2_7b_fp8.sh > $OUT/$name.log 2>&1
  local rc=$?
  echo "$name rc=$rc $(tps 10 $OUT/$name.log) $(grep -o 'wall time: .*' $OUT/$name.log) $(grep -o 'peak[^,]*' $OUT/$name.log | tail -1)" | tee -a $OUT/summary.txt
  [ $rc = 0 ] || tail -20 $OUT/$name.log >> $OUT/errors.txt; }
run llama_pp2dp2_delayed GPUS=4 TP=1 PP=2
run llama_pp2dp2_bf16 GPUS=4 TP=1 PP=2 PRECISION=bf16
run llama_tp2pp2_delayed GPUS=4 TP=2 PP=2
run llama_tp2pp2_bf16 GPUS=4 TP=2 PP=2 PRECISION=bf16
tail -c 3000 $OUT/errors.txt 2>/dev/null
