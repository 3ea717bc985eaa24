# Gather blocks staged on the compute stream (branch staged-gather-blocks, the working tree) against the vectorized
# accumulation build (.dev/builds/accum, its parent): copy-engine GPU tests, then tp 2 FP8 alternating x2 pairs
# (ITERS=40, mean 21-40), tp 2 bf16 and one GPU on the new build. Predicted tp 2 FP8 +3-6%; bf16 gains too.
set -u; T0=$SECONDS
source .dev/setup.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
timeout 100 python -m pytest -q -p no:cacheprovider -m gpu tests/parallel/test_collective_gemm.py > $OUT/gpu_tests.txt 2>&1
echo "collective_gemm GPU tests rc=$? $(tail -1 $OUT/gpu_tests.txt) t=$((SECONDS-T0))"
bash examples/prepare_sample_data.sh /tmp/w 32768 > /dev/null 2>&1
mkdir -p $OUT/logs
mean() { grep -h "iteration  *[0-9]*/" $1 | awk '{for(i=1;i<=NF;i++){if($i=="iteration")it=$(i+1); if($i=="tokens/s:")t=$(i+1)} split(it,a,"/"); if(a[1]+0>20){s+=t;n++}} END{if(n) printf "%.0f", s/n}'; }
run() { local name=$1 dir=$2; shift 2
  [ $((SECONDS-T0)) -gt 450 ] && { echo "$name skipped (time)"; return; }
  (cd $dir && env MEGAFP8_ROOT=$PWD "$@" ITERS=40 DATA_PATH=/tmp/w/data/sample_text_document TOKENIZER_MODEL=/tmp/w/tokenizer \
     timeout 110 bash examples/pretrain_gpt_1b_fp8.sh > $OUT/logs/$name.log 2>&1)
  echo "$name rc=$? mean21-40 $(mean $OUT/logs/$name.log) $(grep -h 'iteration  *40/' $OUT/logs/$name.log | grep -o 'lm loss: [0-9.E+-]*') t=$((SECONDS-T0))"; }
run tp2_staged . GPUS=2 TP=2
run tp2_accum .dev/builds/accum GPUS=2 TP=2
run tp2_staged2 . GPUS=2 TP=2
run tp2_accum2 .dev/builds/accum GPUS=2 TP=2
run tp2_bf16_staged . GPUS=2 TP=2 PRECISION=bf16
run gpu1_staged . GPUS=1
tar czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
echo "done t=$((SECONDS-T0))"
