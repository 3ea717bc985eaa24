# one H200: GPU tests (lean states incl. the FP8 first moment), then side by side at 7b and 1b: FP8 delayed default,
# lean states with a bf16 first moment, lean states with an FP8 first moment, the torchao peer
source .dev/setup.sh; mkdir -p $OUT
T0=$SECONDS
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/training/test_adamw_kernel.py tests/fp8/test_gradient_accumulation_fusion.py > $OUT/gpu_tests.txt 2>&1; echo "gpu tests rc=$? $(tail -1 $OUT/gpu_tests.txt) t=$((SECONDS-T0))"
grep -E "^FAILED|^E  " $OUT/gpu_tests.txt | head -12
LEAN="--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 --main-grads-dtype bf16 --store-param-remainders"
export RESULTS=$OUT/side_by_side RUN_TIMEOUT=140
for shape in 7b 1b; do
  PRECISIONS=delayed PEER_VARIANTS=float8_tensorwise bash benchmarks/side_by_side.sh $shape > $OUT/sbs_${shape}_default.txt 2>&1; echo "$shape default rc=$? t=$((SECONDS-T0))"
  EXTRA="$LEAN" NAME="lean states" PRECISIONS=delayed PEER_VARIANTS="" bash benchmarks/side_by_side.sh $shape > $OUT/sbs_${shape}_lean.txt 2>&1; echo "$shape lean rc=$? t=$((SECONDS-T0))"
  EXTRA="$LEAN --exp-avg-dtype fp8" NAME="lean states, fp8 exp_avg" PRECISIONS=delayed PEER_VARIANTS="" bash benchmarks/side_by_side.sh $shape > $OUT/sbs_${shape}_lean_fp8.txt 2>&1; echo "$shape lean fp8 rc=$? t=$((SECONDS-T0))"
done
tar czf $OUT/side_by_side.tgz -C $OUT side_by_side
grep -v "not run" $RESULTS/7b.md $RESULTS/1b.md
