# Pipeline transfers overlapped with compute (--overlap-p2p-communication, the default) against
# waiting for each exchange (--no-overlap-p2p-communication), GPT-1.3B recipe as shipped
set -u
source .dev/setup.sh
bash examples/prepare_sample_data.sh /tmp/w 32768 > /dev/null 2>&1
tps() { grep -h "iteration  *$1/" $2 | grep -o "tokens/s: [0-9]*" | tail -1; }
run() { # name env...
  local name=$1; shift
  local start=$(date +%s)
  env "$@" ITERS=20 timeout 150 bash examples/pretrain_gpt_1b_fp8.sh > /tmp/$name.log 2>&1
  local rc=$?
  echo "$name rc=$rc $(tps 20 /tmp/$name.log) $(( $(date +%s) - start ))s" | tee -a $OUT/summary.txt
  [ $rc = 0 ] || tail -30 /tmp/$name.log >> $OUT/summary.txt
}
WAIT="--no-overlap-p2p-communication"
run gpu1 GPUS=1 CUDA_VISIBLE_DEVICES=0
run pp2_wait GPUS=2 PP=2 CUDA_VISIBLE_DEVICES=0,1 EXTRA_ARGS="$WAIT"
run pp2_overlap GPUS=2 PP=2 CUDA_VISIBLE_DEVICES=0,1
run pp2_vpp4_wait GPUS=2 PP=2 VPP=4 CUDA_VISIBLE_DEVICES=0,1 EXTRA_ARGS="$WAIT"
run pp2_vpp4_overlap GPUS=2 PP=2 VPP=4 CUDA_VISIBLE_DEVICES=0,1
run pp2dp2_overlap GPUS=4 PP=2
run pp2_bf16_overlap GPUS=2 PP=2 PRECISION=bf16 CUDA_VISIBLE_DEVICES=0,1
