# issue 40: the planner's calibration of this machine and code, for validate_planner.py against the new two-GPU
# table (layer maps at tp 1 and 2, collectives over two ranks). ~200 s.
set -u; T0=$SECONDS
source .dev/setup.sh >/dev/null 2>&1
# the planner's calibration of this machine and code (layer maps at tp 1 and 2, collectives over two ranks)
M="--model gpt-1.3b --seq-lengths 2048 --micro-batches 2 4"; mkdir -p $OUT/maps
[ $((SECONDS-T0)) -lt 300 ] && { CUDA_VISIBLE_DEVICES=0 timeout 100 python3 benchmarks/bench_layer_grid.py $M --output $OUT/maps/gpt-1.3b_tp1.json > $OUT/maps/map_tp1.log 2>&1; echo "map tp1 rc=$? t=$((SECONDS-T0))"; }
[ $((SECONDS-T0)) -lt 400 ] && { timeout 100 torchrun --standalone --nproc-per-node 2 benchmarks/bench_layer_grid.py $M --output $OUT/maps/gpt-1.3b_tp2.json > $OUT/maps/map_tp2.log 2>&1; echo "map tp2 rc=$? t=$((SECONDS-T0))"; }
[ $((SECONDS-T0)) -lt 500 ] && { timeout 50 torchrun --standalone --nproc-per-node 2 benchmarks/bench_collectives.py --output $OUT/maps/collectives.json > $OUT/maps/coll.log 2>&1; echo "coll rc=$? t=$((SECONDS-T0))"; }
tar czf $OUT/maps.tgz -C $OUT maps && rm -rf $OUT/maps
