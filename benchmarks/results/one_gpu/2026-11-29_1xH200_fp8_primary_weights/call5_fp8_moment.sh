# one H200: the plain optimizer pass over the 7B shape's FP8 weights with lean states, bf16 or FP8
# first moment, this tree's kernel (an FP8 moment block a row) and the one before; then side by
# side at 7b: FP8 delayed with its defaults, lean states with an FP8 first moment, the torchao peer
source .dev/setup.sh; mkdir -p $OUT
T0=$SECONDS
timeout 120 python3 benchmarks/results/one_gpu/2026-11-29_1xH200_fp8_primary_weights/moment_bench.py .dev/adamw_kernel_before.py > $OUT/moment_bench.txt 2>&1; echo "bench rc=$? t=$((SECONDS-T0))"; cat $OUT/moment_bench.txt | grep ms
export RESULTS=$OUT/side_by_side RUN_TIMEOUT=120
PRECISIONS=delayed PEER_VARIANTS=float8_tensorwise bash benchmarks/side_by_side.sh 7b > $OUT/sbs_7b_default.txt 2>&1; echo "7b default rc=$? t=$((SECONDS-T0))"
EXTRA="--exp-avg-dtype fp8 --exp-avg-sq-dtype bf16 --main-grads-dtype bf16 --store-param-remainders" NAME="lean states, fp8 exp_avg" PRECISIONS=delayed PEER_VARIANTS="" bash benchmarks/side_by_side.sh 7b > $OUT/sbs_7b_lean_fp8.txt 2>&1; echo "7b lean fp8 rc=$? t=$((SECONDS-T0))"
cp $RESULTS/7b.md $OUT/
tar czf $OUT/side_by_side.tgz -C $OUT side_by_side && rm -r $OUT/side_by_side
grep -hv "not run" $OUT/7b.md
