# The pipeline split's alternatives at pp 2, then the multi-GPU check on every 2- and 4-GPU layout
set -u
source .dev/setup.sh
bash examples/prepare_sample_data.sh /tmp/w 32768 > /dev/null 2>&1
tps() { grep -h "iteration  *$1/" $2 | grep -o "tokens/s: [0-9]*" | tail -1; }
run() { # name env...
  local name=$1; shift
  env "$@" ITERS=20 timeout 110 bash examples/pretrain_gpt_1b_fp8.sh > /tmp/$name.log 2>&1
  local rc=$?
  echo "$name rc=$rc $(tps 20 /tmp/$name.log) $(grep -o 'pipeline split: [^(]*' /tmp/$name.log | head -1)" | tee -a $OUT/summary.txt
  [ $rc = 0 ] || tail -30 /tmp/$name.log >> $OUT/summary.txt
}
run gpu1_delayed GPUS=1 CUDA_VISIBLE_DEVICES=0
run pp2_vpp2_7665 GPUS=2 PP=2 CUDA_VISIBLE_DEVICES=0,1
run pp2_vpp2_6774 GPUS=2 PP=2 BALANCE_PIPELINE=0 CUDA_VISIBLE_DEVICES=0,1 EXTRA_ARGS="--decoder-first-pipeline-num-layers 6 --decoder-last-pipeline-num-layers 4"
run pp2_vpp3_544443 GPUS=2 PP=2 VPP=3 CUDA_VISIBLE_DEVICES=0,1
