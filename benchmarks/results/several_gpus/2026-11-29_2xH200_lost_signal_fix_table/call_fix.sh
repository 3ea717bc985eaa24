# issue 40: the lost copy-engine signal. The busy-growth GPU test on the build without the fix (expected to
# fail) and with it, the collective-GEMM GPU tests, tp2 FP8 delayed x8, then the whole 2-GPU check.
set -u; T0=$SECONDS
source .dev/setup.sh >/dev/null 2>&1
(cd .dev/builds/nofix && MEGAFP8_ROOT=$PWD timeout 100 python -m pytest -q -p no:cacheprovider tests/parallel/test_collective_gemm.py -m gpu -k busy > $OUT/nofix_test.txt 2>&1)
echo "nofix busy-growth test rc=$? $(tail -1 $OUT/nofix_test.txt) t=$((SECONDS-T0))"
grep -h "rank . stopped\|rank . gathered\|CUDASymmetricMemory::barrier" $OUT/nofix_test.txt | sort | uniq | head -6
timeout 150 python -m pytest -q -p no:cacheprovider tests/parallel/test_collective_gemm.py -m gpu > $OUT/fix_tests.txt 2>&1
echo "fixed collective-gemm GPU tests rc=$? $(tail -1 $OUT/fix_tests.txt) t=$((SECONDS-T0))"
timeout 300 python -m tests.multigpu.check_layouts --share 8 --time-limit 280 --output /tmp/chk_all > $OUT/check.txt 2>&1
echo "whole check rc=$? $(grep -h 'check_layouts:' $OUT/check.txt | tr '\n' ' ') t=$((SECONDS-T0))"
grep FAIL $OUT/check.txt | head
REST=$((570 - SECONDS + T0))
[ $REST -gt 80 ] && { timeout $REST python -m tests.multigpu.check_layouts --layouts tp2 --precisions delayed --kinds straight --share 8 \
   --repeat 8 --time-limit $((REST - 20)) --output /tmp/chk_tp2 > $OUT/tp2_x8.txt 2>&1
  echo "tp2 delayed x8 rc=$? $(grep -h 'check_layouts:' $OUT/tp2_x8.txt | tr '\n' ' ') t=$((SECONDS-T0))"; }
mkdir -p $OUT/check_logs && cp /tmp/chk_all/logs/*.log $OUT/check_logs/ 2>/dev/null; (cd $OUT && tar czf check_logs.tgz check_logs && rm -rf check_logs)
