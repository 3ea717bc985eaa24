# The pair cast's slices per tile (PARTS): GPU bytes at 4, the sweep, then the 7b side by side
export CUDA_VISIBLE_DEVICES=0
# at PARTS 1 and at PARTS 4 (edited in this device copy only) — one call, ~8 min
source .dev/setup.sh >/dev/null 2>&1
timeout 90 python -W ignore -c "
from megafp8.fp8 import fine_grained_kernels as fk
from tests.fp8.test_fine_grained import check_fused_casts, check_fused_activations
for p in (4, 8):
    fk.PARTS = p; check_fused_casts('cuda'); check_fused_activations('cuda'); print('PARTS', p, 'bytes ok')
" 2>&1 | tail -3
(cd benchmarks && timeout 130 python bench_fine_grained.py --model 7b --sweep-parts --json $OUT/parts_7b.json > $OUT/parts_7b.txt 2>&1); cat $OUT/parts_7b.txt
RESULTS=$OUT/sbs RUN_TIMEOUT=100 PRECISIONS="rowwise blockwise" PEER_VARIANTS="" timeout 150 bash benchmarks/side_by_side.sh 7b > $OUT/sbs.log 2>&1
sed -i 's/^PARTS = 1$/PARTS = 4/' megafp8/fp8/fine_grained_kernels.py && grep -n "^PARTS" megafp8/fp8/fine_grained_kernels.py
RESULTS=$OUT/sbs RUN_TIMEOUT=100 PRECISIONS="rowwise blockwise" PEER_VARIANTS="" NAME=parts4 timeout 160 bash benchmarks/side_by_side.sh 7b >> $OUT/sbs.log 2>&1
git checkout megafp8/fp8/fine_grained_kernels.py 2>/dev/null || sed -i 's/^PARTS = 4$/PARTS = 1/' megafp8/fp8/fine_grained_kernels.py
cat $OUT/sbs/7b.jsonl | python -c "
import sys, json
for l in sys.stdin:
    d = json.loads(l); print(d.get('label'), d.get('precision'), round(d.get('tokens_per_sec_per_gpu')), round(d.get('iteration_time_ms'), 1))"
