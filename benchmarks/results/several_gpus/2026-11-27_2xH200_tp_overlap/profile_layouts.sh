set -u
source .dev/setup.sh
P="--profile --use-pytorch-profiler --profile-step-start 7 --profile-step-end 9"
run() { # name env...
  local name=$1; shift
  env "$@" ITERS=10 EXTRA_ARGS="$P --tensorboard-dir /tmp/prof_$name" bash examples/pretrain_gpt_1b_fp8.sh > $OUT/$name.log 2>&1
  echo "$name rc=$?"
  cp /tmp/prof_$name/profile/rank0_*.txt $OUT/${name}_rank0.txt 2>/dev/null
  python3 benchmarks/profile_gaps.py /tmp/prof_$name/profile/rank0_*.json > $OUT/${name}_gaps.txt 2>&1
  python3 .dev/nccl_split.py /tmp/prof_$name/profile/rank0_*.json >> $OUT/${name}_rank0.txt 2>&1
}
run tp2 GPUS=2 TP=2
run dp2 GPUS=2
run pp2 GPUS=2 PP=2
run gpu1 GPUS=1 CUDA_VISIBLE_DEVICES=0
for n in gpu1 dp2 pp2 tp2; do echo "== $n"; grep -h "tokens/s\|throughput" $OUT/$n.log | tail -2; head -3 $OUT/${n}_rank0.txt; tail -25 $OUT/${n}_rank0.txt; done
