# megafp8 beside the in-repository peer, GPT-1.3B shape, one GPU: benchmarks/side_by_side.sh's runs
# (FP8 current left out for time), the most important pair first
set -u
source benchmarks/results/several_gpus/2026-11-27_H200_copy_engines/setup.sh
export RESULTS=$OUT
SHAPE_FLAGS=$(python3 benchmarks/peer_gpt.py --shape 1b --trainer-flags)
mf() { timeout 100 python3 -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/bench_layouts.py --output $OUT/1b.jsonl --label 1b --precisions $1 -- $SHAPE_FLAGS --bf16 --enable-cuda-graph --train-iters 20 --log-interval 10 --lr 1e-4 --mock-data > $OUT/1b_megafp8_$1.log 2>&1; echo "megafp8 $1 rc=$?"; }
peer() { timeout 100 python3 benchmarks/peer_gpt.py --shape 1b --variant $1 --output $OUT/1b.jsonl > $OUT/1b_peer_$1.log 2>&1; echo "peer $1 rc=$?"; }
mf delayed; peer float8_tensorwise; mf bf16; peer bf16_compile
python3 benchmarks/side_by_side_table.py $OUT/1b.jsonl | tee $OUT/1b.md
