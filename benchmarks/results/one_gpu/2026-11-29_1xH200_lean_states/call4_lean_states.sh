# one H200, the record of lean optimizer states: GPU tests; side by side at the 7B and 1b shapes (FP8 delayed default,
# FP8 delayed with every lean state, the torchao peer); Llama-2-7B on one GPU with lean states, MBS 1-3
source .dev/setup.sh; mkdir -p $OUT
T0=$SECONDS
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/training/test_adamw_kernel.py tests/fp8/test_gradient_accumulation_fusion.py > $OUT/gpu_tests.txt 2>&1; echo "gpu tests rc=$? $(tail -1 $OUT/gpu_tests.txt) t=$((SECONDS-T0))"
LEAN="--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 --main-grads-dtype bf16 --store-param-remainders"
export RESULTS=$OUT/side_by_side RUN_TIMEOUT=140
for shape in 7b 1b; do
  PRECISIONS=delayed PEER_VARIANTS=float8_tensorwise bash benchmarks/side_by_side.sh $shape > $OUT/sbs_${shape}_default.txt 2>&1; echo "$shape default rc=$? t=$((SECONDS-T0))"
  EXTRA="$LEAN" NAME="lean states" PRECISIONS=delayed PEER_VARIANTS="" bash benchmarks/side_by_side.sh $shape > $OUT/sbs_${shape}_lean.txt 2>&1; echo "$shape lean rc=$? t=$((SECONDS-T0))"
done
for mbs in 1 2 3; do
  timeout 100 python -m megafp8.train --model llama2-7b --seq-length 4096 --micro-batch-size $mbs --global-batch-size $((2*mbs)) --bf16 \
    --fp8-format hybrid --recompute-granularity selective --enable-cuda-graph --train-iters 6 --log-interval 3 --lr 3e-4 --mock-data $LEAN > $OUT/llama_lean_mbs$mbs.log 2>&1
  echo "llama lean mbs $mbs rc=$? t=$((SECONDS-T0)) $(grep 'iteration 6/\|OutOfMemoryError' $OUT/llama_lean_mbs$mbs.log | head -1 | cut -c1-250)"
done
cat $RESULTS/7b.md $RESULTS/1b.md | grep -v "not run"
