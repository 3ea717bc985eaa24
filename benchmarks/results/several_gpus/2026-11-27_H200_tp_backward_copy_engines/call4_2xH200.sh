set -u
source benchmarks/results/several_gpus/2026-11-27_H200_copy_engines/setup.sh > /dev/null
bash examples/prepare_sample_data.sh /tmp/w 32768 > /dev/null 2>&1
tps() { grep -h "iteration  *$1/" $2 | grep -o "tokens/s: [0-9]*" | tail -1; }
run() { # name env...
  local name=$1; shift
  env "$@" ITERS=20 timeout 75 bash examples/pretrain_gpt_1b_fp8.sh > /tmp/$name.log 2>&1
  echo "$name rc=$? $(tps 20 /tmp/$name.log)" | tee -a $OUT/summary.txt
}
run pp2_vpp4 GPUS=2 PP=2 VPP=4
run gpu1 GPUS=1 CUDA_VISIBLE_DEVICES=0
run pp2_vpp2 GPUS=2 PP=2 VPP=2
