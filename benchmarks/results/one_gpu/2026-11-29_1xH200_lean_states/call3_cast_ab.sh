# one H200: 7B shape FP8 delayed, default vs lean states, each with the optimizer's fused FP8 weight casts and without
# (NO_PASS_CAST=1: the plain pass, the forward casts), 20 iterations, tokens/s of iterations 11-20. It ran on the
# tree of the lean states' change with a one-line patch in megafp8/training/trainer.py's _build_optimizer:
#   fp8_linears=fp8_linears if self.recipe is not None and not os.environ.get("NO_PASS_CAST") else (),
source .dev/setup.sh >/dev/null; mkdir -p $OUT
LEAN="--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 --main-grads-dtype bf16 --store-param-remainders"
SHAPE=$(python benchmarks/peer_gpt.py --shape 7b --trainer-flags)
for rep in 1 2; do for v in default lean; do for cast in pass forward; do
  extra=""; [ $v = lean ] && extra="$LEAN"; env=""; [ $cast = forward ] && env="NO_PASS_CAST=1"
  env $env timeout 120 python -m megafp8.train $SHAPE --bf16 --fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --enable-cuda-graph --train-iters 20 --log-interval 10 \
    --lr 1e-4 --mock-data $extra > $OUT/${v}_${cast}_$rep.log 2>&1
  echo "$rep $v $cast: $(grep 'iteration 20/' $OUT/${v}_${cast}_$rep.log | grep -o 'tokens/s: [0-9]*\|ms/iter: [0-9]*\|memory (GiB): [0-9.]*' | tr '\n' ' ')"
done; done; done
