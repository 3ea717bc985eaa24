# x2: pp 2 and dp 2 with NCCL's streams at high priority (TORCH_NCCL_HIGH_PRIORITY) and/or the GEMMs
# leaving 2 SMs free (sitecustomize, PP_SM_CARVEOUT); dp 2 bucket sizes. ITERS=40, mean of iterations 25-40.
set -u
T0=$SECONDS
source .dev/setup.sh
bash examples/prepare_sample_data.sh /tmp/w 32768 > /dev/null 2>&1
export PYTHONPATH=$PWD/.dev/pp_carve:$PYTHONPATH
mkdir -p $OUT/logs
mean() { grep -h "iteration  *\(25\|30\|35\|40\)/" $1 | grep -o "tokens/s: [0-9]*" | awk '{s+=$2;n++} END {if(n) printf "%d", s/n}'; }
run() { local name=$1; shift
  if [ $((SECONDS-T0)) -gt 525 ]; then echo "$name skipped (time)" | tee -a $OUT/summary.txt; return; fi
  env "$@" ITERS=40 timeout 80 bash examples/pretrain_gpt_1b_fp8.sh > $OUT/logs/$name.log 2>&1
  echo "$name rc=$? tokens/s $(mean $OUT/logs/$name.log) t=$((SECONDS-T0))" | tee -a $OUT/summary.txt; }
run gpu1 GPUS=1 CUDA_VISIBLE_DEVICES=0
run pp2_base GPUS=2 PP=2
run pp2_hp GPUS=2 PP=2 TORCH_NCCL_HIGH_PRIORITY=1
run pp2_carve2 GPUS=2 PP=2 PP_SM_CARVEOUT=2
run pp2_hp_carve2 GPUS=2 PP=2 TORCH_NCCL_HIGH_PRIORITY=1 PP_SM_CARVEOUT=2
run dp2_base GPUS=2
run dp2_hp GPUS=2 TORCH_NCCL_HIGH_PRIORITY=1
run dp2_b20M GPUS=2 EXTRA_ARGS="--ddp-bucket-size 20000000"
run dp2_b80M GPUS=2 EXTRA_ARGS="--ddp-bucket-size 80000000"
tar czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
cat $OUT/summary.txt
