# the signal-pad zeroing race: the new GPU test on the tree before the fix (expected to fail) and
# after it; then the multi-GPU check
source .dev/setup.sh >/dev/null 2>&1
T=tests/parallel/test_collective_gemm.py::test_a_workspace_zeroed_late_loses_no_signal
cp tests/parallel/test_collective_gemm.py .dev/builds/8507d86/tests/parallel/
(cd .dev/builds/8507d86 && MEGAFP8_ROOT=$PWD timeout 90 python -m pytest -q -p no:cacheprovider $T > $OUT/test_before_fix.txt 2>&1; echo "before fix: rc=$? $(grep -o 'rank [01][: ][a-z]* [A-Za-z]*' $OUT/test_before_fix.txt | sort -u | tr '\n' '|')")
timeout 90 python -m pytest -q -p no:cacheprovider $T > $OUT/test_after_fix.txt 2>&1; echo "after fix: rc=$? $(tail -1 $OUT/test_after_fix.txt)"
timeout 330 python -m tests.multigpu.check_layouts --share 8 --time-limit 285 > $OUT/check.txt 2>&1; echo "check rc=$?"
grep -E "^(1gpu|dp2|pp2|tp2|vpp4)|check_layouts:" $OUT/check.txt
