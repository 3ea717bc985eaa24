# one H200: FP8 delayed at the 7b and 1b shapes with the optimizer replicated (the default),
# the distributed optimizer over one rank (bf16 weights, the default there) and the distributed
# optimizer with --fp8-param-gather: memory and step time of the gather path's casts, copies
# and transposes (one rank: the all-gather is a copy)
source .dev/setup.sh > /dev/null 2>&1; mkdir -p $OUT
R=$OUT/side_by_side
export PRECISIONS=delayed PEER_VARIANTS="" RESULTS=$R
for shape in 7b 1b; do
    bash benchmarks/side_by_side.sh $shape > /dev/null 2>&1
    EXTRA="--use-distributed-optimizer --overlap-param-gather" NAME="distributed optimizer" \
        bash benchmarks/side_by_side.sh $shape > /dev/null 2>&1
    EXTRA="--use-distributed-optimizer --overlap-param-gather --fp8-param-gather" \
        NAME="distributed optimizer, FP8 gather" bash benchmarks/side_by_side.sh $shape > /dev/null 2>&1
done
tar czf $OUT/side_by_side.tgz -C $OUT side_by_side
cat $R/7b.md $R/1b.md
