# 4 x H200: GPT-1.3B recipe as shipped at 4-GPU layouts (+ one GPU), then pp 2 probes on GPUs 0,1
set -u
T0=$SECONDS
source .dev/setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader | wc -l
git log --oneline -1 2>/dev/null
bash examples/prepare_sample_data.sh /tmp/w 32768 > /dev/null 2>&1
tps() { grep -h "iteration  *$1/" $2 | grep -o "tokens/s: [0-9]*" | tail -1; }
run() { # name env...
  local name=$1; shift
  env "$@" ITERS=20 timeout 100 bash examples/pretrain_gpt_1b_fp8.sh > $OUT/$name.log 2>&1
  local rc=$?
  echo "$name rc=$rc $(tps 20 $OUT/$name.log) $(grep -o 'wall time: .*' $OUT/$name.log) t=$((SECONDS-T0))" | tee -a $OUT/summary.txt
  [ $rc = 0 ] || tail -30 $OUT/$name.log >> $OUT/errors.txt
}
run gpu1_delayed GPUS=1 CUDA_VISIBLE_DEVICES=0
for L in "tp2pp2 TP=2 PP=2" "pp2dp2 TP=1 PP=2" "tp2dp2 TP=2 PP=1" "dp4 TP=1 PP=1"; do
  set -- $L; n=$1; shift
  run ${n}_delayed GPUS=4 "$@"
  run ${n}_bf16 GPUS=4 PRECISION=bf16 "$@"
done
# pp 2 probes: GEMMs leaving SMs to NCCL's send/receive kernels
export PYTHONPATH=$PWD/.dev/pp_carve:$PYTHONPATH
for c in 0 8 0 16; do
  [ $((SECONDS-T0)) -lt 440 ] && run pp2_carve$c GPUS=2 PP=2 PP_SM_CARVEOUT=$c CUDA_VISIBLE_DEVICES=0,1
done
if [ $((SECONDS-T0)) -lt 480 ]; then
  PROF="--profile --use-pytorch-profiler --profile-step-start 14 --profile-step-end 17 --profile-ranks 0 1"
  rm -rf runs/latest
  CUDA_VISIBLE_DEVICES=0,1 GPUS=2 PP=2 ITERS=17 EXTRA_ARGS="$PROF" timeout 100 bash examples/pretrain_gpt_1b_fp8.sh > $OUT/pp2_prof.log 2>&1; echo "pp2 prof rc=$?"
  python3 .dev/gaps.py runs/latest/profile/rank0_*.json runs/latest/profile/rank1_*.json > $OUT/gaps_pp2.txt 2>&1
  for f in runs/latest/profile/rank*_*.json; do gzip -c $f > $OUT/$(basename $f).gz; done
fi
cat $OUT/errors.txt 2>/dev/null | tail -20
cat $OUT/summary.txt
