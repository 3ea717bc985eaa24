# one H200: side by side at 7b and 1b: our bf16, FP8 delayed with its defaults (FP8 primary
# weights), FP8 delayed with bf16 weights (--no-fp8-primary-weights), the torchao peer; at 7b also
# FP8 primary weights with bf16 moments and gradients (lean states without remainders)
source .dev/setup.sh; mkdir -p $OUT
T0=$SECONDS
export RESULTS=$OUT/side_by_side RUN_TIMEOUT=150
for shape in 7b 1b; do
  PRECISIONS="bf16 delayed" PEER_VARIANTS=float8_tensorwise bash benchmarks/side_by_side.sh $shape > $OUT/sbs_${shape}_default.txt 2>&1; echo "$shape default rc=$? t=$((SECONDS-T0))"
  EXTRA="--no-fp8-primary-weights" NAME="bf16 weights" PRECISIONS=delayed PEER_VARIANTS="" bash benchmarks/side_by_side.sh $shape > $OUT/sbs_${shape}_bf16w.txt 2>&1; echo "$shape bf16 weights rc=$? t=$((SECONDS-T0))"
done
EXTRA="--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 --main-grads-dtype bf16" NAME="bf16 states" PRECISIONS=delayed PEER_VARIANTS="" bash benchmarks/side_by_side.sh 7b > $OUT/sbs_7b_bf16_states.txt 2>&1; echo "7b bf16 states rc=$? t=$((SECONDS-T0))"
cp $RESULTS/7b.md $RESULTS/1b.md $OUT/
tar czf $OUT/side_by_side.tgz -C $OUT side_by_side && rm -r $OUT/side_by_side
grep -hv "not run" $OUT/7b.md $OUT/1b.md
