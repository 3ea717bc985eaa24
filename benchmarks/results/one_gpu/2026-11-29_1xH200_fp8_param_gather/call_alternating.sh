# one H200, right after call_fp8_gather.sh on the same machine: at the 7b shape, the distributed
# optimizer over one rank with bf16 weights and with --fp8-param-gather, alternating, twice
source .dev/setup.sh > /dev/null 2>&1; mkdir -p $OUT; export PRECISIONS=delayed PEER_VARIANTS="" RESULTS=$OUT/sbs
for n in 1 2; do
    EXTRA="--use-distributed-optimizer --overlap-param-gather" NAME="distributed optimizer $n" \
        bash benchmarks/side_by_side.sh 7b > /dev/null 2>&1
    EXTRA="--use-distributed-optimizer --overlap-param-gather --fp8-param-gather" \
        NAME="distributed optimizer, FP8 gather $n" bash benchmarks/side_by_side.sh 7b > /dev/null 2>&1
done
grep "distributed" $OUT/sbs/7b.md | head -4
