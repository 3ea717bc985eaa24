# pp2 profile (balanced split, VPP=2) and four virtual stages per rank
set -u
source .dev/setup.sh
bash examples/prepare_sample_data.sh /tmp/w 32768 > /dev/null 2>&1
tps() { grep -h "iteration  *$1/" $2 | grep -o "tokens/s: [0-9]*" | tail -1; }
run() { # name env...
  local name=$1; shift
  env "$@" ITERS=20 timeout 110 bash examples/pretrain_gpt_1b_fp8.sh > $OUT/$name.log 2>&1
  local rc=$?
  echo "$name rc=$rc $(tps 20 $OUT/$name.log) $(grep -o 'pipeline split: [^(]*' $OUT/$name.log | head -1)" | tee -a $OUT/summary.txt
  [ $rc = 0 ] || tail -30 $OUT/$name.log >> $OUT/errors.txt
}
export CUDA_VISIBLE_DEVICES=0,1
run gpu1_delayed GPUS=1 CUDA_VISIBLE_DEVICES=0
run pp2_balanced_vpp4 GPUS=2 PP=2 VPP=4
run pp2_even_vpp4 GPUS=2 PP=2 VPP=4 BALANCE_PIPELINE=0
rm -rf runs/latest/profile
run pp2_balanced_profile GPUS=2 PP=2 EXTRA_ARGS="--profile --use-pytorch-profiler --profile-step-start 14 --profile-step-end 17 --profile-ranks 0 1"
cp runs/latest/profile/*.txt $OUT/ 2>/dev/null
rm -rf runs/latest/profile
run pp2_even_profile GPUS=2 PP=2 BALANCE_PIPELINE=0 EXTRA_ARGS="--profile --use-pytorch-profiler --profile-step-start 14 --profile-step-end 17 --profile-ranks 0 1"
for f in runs/latest/profile/*.txt; do cp $f $OUT/even_$(basename $f); done
cat $OUT/errors.txt 2>/dev/null | tail -20
for f in $OUT/*rank*.txt; do echo "== $f"; head -4 $f; done
cat $OUT/summary.txt
