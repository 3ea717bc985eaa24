# The vectorized main_grad accumulation (branch vectorized-grad-accumulation rebased on c4054cf, tree .dev/builds/accum)
# against main (c4054cf, the working tree): GPU tests (main_grad, graphs, accumulation fusion, copy-engine GPU tests
# after their helper refactor), then alternating recipe runs (ITERS=40) one GPU x2 and tp 2 x1, the second one-GPU
# pair and the tp 2 pair profiled at steps 11-12 (before the mean's window 21-40).
# Predicted: one GPU +2.0-2.7% tokens/s, tp 2 +1.3-2.2%; losses the same (the sum is torch's to the bit).
set -u; T0=$SECONDS
source .dev/setup.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,driver_version --format=csv,noheader
(cd .dev/builds/accum && MEGAFP8_ROOT=$PWD timeout 240 python -m pytest -q -p no:cacheprovider -m gpu --durations=8 tests/parallel/test_main_grad.py \
   tests/training/test_cuda_graphs.py tests/fp8/test_gradient_accumulation_fusion.py tests/parallel/test_collective_gemm.py > $OUT/accum_gpu_tests.txt 2>&1)
echo "accum GPU tests rc=$? $(tail -1 $OUT/accum_gpu_tests.txt) t=$((SECONDS-T0))"
bash examples/prepare_sample_data.sh /tmp/w 32768 > /dev/null 2>&1
mkdir -p $OUT/logs
mean() { grep -h "iteration  *[0-9]*/" $1 | awk '{for(i=1;i<=NF;i++){if($i=="iteration")it=$(i+1); if($i=="tokens/s:")t=$(i+1)} split(it,a,"/"); if(a[1]+0>20){s+=t;n++}} END{if(n) printf "%.0f", s/n}'; }
PROF="--profile --use-pytorch-profiler --profile-step-start 10 --profile-step-end 12"
run() { local name=$1 dir=$2 extra=$3; shift 3
  [ $((SECONDS-T0)) -gt 520 ] && { echo "$name skipped (time)"; return; }
  rm -rf /tmp/r_$name
  (cd $dir && env MEGAFP8_ROOT=$PWD "$@" ITERS=40 WORKDIR=/tmp/r_$name DATA_PATH=/tmp/w/data/sample_text_document TOKENIZER_MODEL=/tmp/w/tokenizer \
     EXTRA_ARGS="$extra" timeout 120 bash examples/pretrain_gpt_1b_fp8.sh > $OUT/logs/$name.log 2>&1)
  echo "$name rc=$? mean21-40 $(mean $OUT/logs/$name.log) $(grep -h 'iteration  *40/' $OUT/logs/$name.log | grep -o 'lm loss: [0-9.E+-]*') t=$((SECONDS-T0))"
  for f in $(find /tmp/r_$name -path "*profile/rank*" 2>/dev/null); do
    case $f in *.json) [ "${f##*/rank0}" != "$f" ] && gzip -c $f > /tmp/trace_${name}.json.gz;;
               *.txt) cp $f $OUT/logs/${name}_$(basename $f);; esac; done; }
run gpu1_main . "" GPUS=1
run gpu1_accum .dev/builds/accum "" GPUS=1
run gpu1_main2 . "$PROF" GPUS=1
run gpu1_accum2 .dev/builds/accum "$PROF" GPUS=1
run tp2_main . "$PROF" GPUS=2 TP=2
run tp2_accum .dev/builds/accum "$PROF" GPUS=2 TP=2
tar czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
ls -la /tmp/trace_*.gz
for n in tp2_accum gpu1_accum2; do s=$(stat -c %s /tmp/trace_$n.json.gz 2>/dev/null || echo 0); [ $s -lt 16000000 ] && cp /tmp/trace_$n.json.gz $OUT/ 2>/dev/null; done
echo "done t=$((SECONDS-T0))"
