# 7b FP8 delayed fell from 63,372 tokens/s (record of 884e227) to 57.9-59.4k (records from 3f267c2 on)
# while bf16 and torchao held: time the 7b FP8 delayed step at the builds in between, one GPU.
source .dev/setup.sh >/dev/null 2>&1
TOP=$PWD; T0=$SECONDS
# the host: side by side runs one micro-batch a step, so host time per step shows in FP8 delayed most
lscpu | grep -m1 "Model name"; nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
python -c "import time; t=time.perf_counter(); sum(range(10**7)); print(f'python loop 1e7: {time.perf_counter()-t:.3f} s')"
one() { local dir=$1 name=$2 precisions=${3:-delayed}
  if [ $((SECONDS-T0)) -gt 500 ]; then echo "$name skipped (time)"; return; fi
  (cd $dir && MEGAFP8_ROOT=$PWD RESULTS=$OUT/$name RUN_TIMEOUT=100 PRECISIONS="$precisions" PEER_VARIANTS="" \
     timeout 130 bash benchmarks/side_by_side.sh 7b > $OUT/$name.log 2>&1)
  echo "$name $(grep -h -E '(bf16|FP8 delayed) \|' $OUT/$name/7b.md | grep -v 'not run' | tr '\n' ' ') t=$((SECONDS-T0))"; }
one . head "bf16 delayed"
for c in 884e227 abf9a83 8477087 4f42bdf; do one .dev/builds/$c $c; done
one . head_again
