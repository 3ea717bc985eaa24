# one H200, side by side at 7b, alternating: lean states with an FP8 first moment, FP8 delayed with
# its defaults, the lean run again (the kernel of this tree: the FP8 moment in 1-D blocks)
source .dev/setup.sh; mkdir -p $OUT
T0=$SECONDS
export RESULTS=$OUT/side_by_side RUN_TIMEOUT=100
LEAN="--exp-avg-dtype fp8 --exp-avg-sq-dtype bf16 --main-grads-dtype bf16 --store-param-remainders"
EXTRA="$LEAN" NAME="lean states, fp8 exp_avg" PRECISIONS=delayed PEER_VARIANTS="" bash benchmarks/side_by_side.sh 7b > $OUT/sbs_1.txt 2>&1; echo "lean rc=$? t=$((SECONDS-T0))"
PRECISIONS=delayed PEER_VARIANTS="" bash benchmarks/side_by_side.sh 7b > $OUT/sbs_2.txt 2>&1; echo "default rc=$? t=$((SECONDS-T0))"
EXTRA="$LEAN" NAME="lean states, fp8 exp_avg, again" PRECISIONS=delayed PEER_VARIANTS="" bash benchmarks/side_by_side.sh 7b > $OUT/sbs_3.txt 2>&1; echo "lean again rc=$? t=$((SECONDS-T0))"
grep -h "^| megafp8" $RESULTS/7b.md
