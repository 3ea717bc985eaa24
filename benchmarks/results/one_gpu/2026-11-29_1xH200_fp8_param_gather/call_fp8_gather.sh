# one H200: the FP8 gather runs of call_dp1.sh again, after the fix of the slices' first cast
# (call_dp1.sh's failed at start-up: a Triton cast of a flat slice as one row exceeded its grid)
source .dev/setup.sh > /dev/null 2>&1; mkdir -p $OUT
R=$OUT/side_by_side
export PRECISIONS=delayed PEER_VARIANTS="" RESULTS=$R
for shape in 7b 1b; do
    EXTRA="--use-distributed-optimizer --overlap-param-gather --fp8-param-gather" \
        NAME="distributed optimizer, FP8 gather" bash benchmarks/side_by_side.sh $shape > /dev/null 2>&1
done
grep -h "FP8 gather" $R/7b.md $R/1b.md | head -4; grep -h -A3 "Traceback" $R/*.log | tail -5
