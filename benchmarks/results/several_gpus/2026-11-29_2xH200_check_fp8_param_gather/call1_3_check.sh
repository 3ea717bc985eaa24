# x2: the 2-GPU check, every precision, share 8 (the tp2-delayed-graphs hang of 2026-11-28 appeared at share 8)
source .dev/setup.sh >/dev/null; mkdir -p $OUT
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
T0=$SECONDS
python3 -m tests.multigpu.check_layouts --share 8 --precisions bf16 delayed current rowwise blockwise --time-limit ${LIMIT:-470} > $OUT/check_2gpu.log 2>&1; echo "check rc=$? t=$((SECONDS-T0))"
cp runs/check_layouts/check_layouts.json $OUT/ 2>/dev/null
tar czf $OUT/logs.tgz -C runs/check_layouts logs/
grep -v "reading:\|tokenizing:" $OUT/check_2gpu.log | grep -v " ok$" | tail -25
