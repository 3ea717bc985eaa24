# pp 2 A/B on GPUs 0,1: base (HEAD) vs the forward's output posted before the backward; then the 2-GPU series of the new build
set -u
T0=$SECONDS
source .dev/setup.sh
bash examples/prepare_sample_data.sh /tmp/w 32768 > /dev/null 2>&1
mkdir -p $OUT/logs
tps() { grep -h "iteration  *20/" $1 | grep -o "tokens/s: [0-9]*\|lm loss: [0-9.E+-]*" | tr '\n' ' '; }
run() { local tree=$1 name=$2; shift 2
  python3 -m pip install -q --no-deps --no-build-isolation -e $tree >/dev/null 2>&1
  (cd $tree && env "$@" ITERS=20 timeout 100 bash examples/pretrain_gpt_1b_fp8.sh > $OUT/logs/$name.log 2>&1; echo "$name rc=$? $(tps $OUT/logs/$name.log) t=$((SECONDS-T0))" | tee -a $OUT/summary.txt); }
export CUDA_VISIBLE_DEVICES=0,1
run . gpu1 GPUS=1 CUDA_VISIBLE_DEVICES=0
for round in 1 2; do
  run .dev/base pp2_base$round GPUS=2 PP=2
  run . pp2_new$round GPUS=2 PP=2
done
run . dp2 GPUS=2
run . tp2 GPUS=2 TP=2
run . tp2_bf16 GPUS=2 TP=2 PRECISION=bf16
[ $((SECONDS-T0)) -lt 520 ] && run . pp2_vpp6 GPUS=2 PP=2 VPP=6
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
tar czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
cat $OUT/summary.txt
