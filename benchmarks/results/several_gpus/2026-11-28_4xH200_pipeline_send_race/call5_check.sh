source .dev/setup.sh >/dev/null
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/training/test_cuda_graphs.py -k "handed_out" > $OUT/gpu_test.log 2>&1; echo "gpu test rc=$?"; tail -2 $OUT/gpu_test.log
timeout 420 python3 -m tests.multigpu.check_layouts --share 8 --layouts tp2pp2 pp2dp2 tp2dp2 pp4 dp4 --output $OUT/check4 > $OUT/check4.log 2>&1; echo "check4 rc=$?"
timeout 150 python3 -m tests.multigpu.check_layouts --share 8 --layouts pp2 vpp4 --precisions delayed --kinds straight resumed --output $OUT/check2 > $OUT/check2.log 2>&1; echo "check2 rc=$?"
rm -rf $OUT/check4/data $OUT/check2/data $OUT/check4/runs $OUT/check2/runs
grep -A60 "^run " $OUT/check4.log | cut -c1-140; grep -A20 "^run " $OUT/check2.log | cut -c1-140
