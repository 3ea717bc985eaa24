# pp 2: stages that end inside a layer (the balanced split now) against the whole-layer split, VPP 2 and 4
set -u
source benchmarks/results/several_gpus/2026-11-27_H200_copy_engines/setup.sh
bash examples/prepare_sample_data.sh /tmp/w 32768 > /dev/null 2>&1
run() {  # name, env...
  local name=$1; shift
  env "$@" ITERS=20 timeout 280 bash examples/pretrain_gpt_1b_fp8.sh > $OUT/$name.log 2>&1
  echo "$name rc=$? $(grep -o 'pipeline split: [^(]*' $OUT/$name.log | head -1) $(grep 'iteration  *20/' $OUT/$name.log | grep -o 'tokens/s: [0-9]*')"
}
run gpu1 GPUS=1
run pp2_whole GPUS=2 PP=2 VPP=2 BALANCE_PIPELINE=0 EXTRA_ARGS="--decoder-first-pipeline-num-layers 7 --decoder-last-pipeline-num-layers 5"
run pp2_half GPUS=2 PP=2 VPP=2
run vpp4_whole GPUS=2 PP=2 VPP=4 BALANCE_PIPELINE=0 EXTRA_ARGS="--decoder-first-pipeline-num-layers 4 --decoder-last-pipeline-num-layers 2"
run vpp4_half GPUS=2 PP=2 VPP=4
