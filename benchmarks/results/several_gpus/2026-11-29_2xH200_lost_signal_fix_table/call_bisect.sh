# issue 40: the graphed FP8 delayed tp 2 first-step stop (lost copy-engine barrier signal), bisected on 2 x H200:
# each variant = tp2 FP8 delayed, straight kinds, 8 repeats at 8 runs per GPU (~1-1.5 min). ~8 min in all.
set -u; T0=$SECONDS
source .dev/setup.sh >/dev/null 2>&1
SITE=$(python3 -c "import site; print(site.getsitepackages()[0])")
cp .dev/trace_copy_engines.py "$SITE/" && echo "import trace_copy_engines" > "$SITE/trace_copy_engines.pth"
one() { local name=$1 dir=$2; shift 2
  [ $((SECONDS-T0)) -gt 470 ] && { echo "$name skipped (time)"; return; }
  (cd $dir && env MEGAFP8_ROOT=$PWD "$@" timeout 140 python -m tests.multigpu.check_layouts --layouts tp2 \
     --precisions delayed --kinds straight --share 8 --repeat 8 --time-limit 100 --output /tmp/chk_$name > $OUT/$name.txt 2>&1)
  local rc=$?
  mkdir -p $OUT/logs_$name && cp /tmp/chk_$name/logs/tp2-delayed-graphs*.log $OUT/logs_$name/ 2>/dev/null
  echo "$name rc=$rc $(grep -h 'check_layouts:.*passed' $OUT/$name.txt) FAIL lines: $(grep -c FAIL $OUT/$name.txt) t=$((SECONDS-T0))"; }
one head_traced . MEGAFP8_TRACE_COPY_ENGINES=1
one head .
one head_sync .dev/builds/head_sync
one head_no_pool . TORCH_SYMMMEM_IMPLICIT_POOL=0
one head_ws1024 . CUBLASLT_WORKSPACE_SIZE=1024
one before_vote .dev/builds/8507d86
[ $((SECONDS-T0)) -lt 520 ] && timeout 60 torchrun --nproc-per-node 2 .dev/late_zeroing2.py 2>&1 | grep "^rank" | tee $OUT/late_zeroing2.txt
(cd $OUT && tar czf logs.tgz logs_* && rm -rf logs_*)
