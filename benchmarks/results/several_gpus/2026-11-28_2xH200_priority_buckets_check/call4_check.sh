# x2: the 2-GPU check again at share 8 (tp2-delayed-graphs hung in call 1), the logs kept
source .dev/setup.sh >/dev/null; mkdir -p $OUT
T0=$SECONDS
python3 -m tests.multigpu.check_layouts --share 8 --time-limit 370 > $OUT/check_2gpu.log 2>&1; echo "check rc=$? t=$((SECONDS-T0))"
cp runs/check_layouts/check_layouts.json $OUT/ 2>/dev/null
tar czf $OUT/tp2_logs.tgz -C runs/check_layouts logs/
grep -v "reading:\|tokenizing:" $OUT/check_2gpu.log | grep -v " ok$" | tail -20
for f in runs/check_layouts/logs/tp2-delayed-graphs*.log; do echo "== $f"; grep -n "Thread\|File \"/" $f | grep -v "threading.py\|selectors\|queue.py" | head -40; done 2>/dev/null | head -120
