# The vectorized main_grad accumulation (tree .dev/builds/accum = branch rebased on c4054cf) against main (c4054cf):
# tp 2 FP8 alternating A/B (ITERS=40, mean of 21-40), the first pair profiled at steps 11-12; then the whole
# multi-GPU check on the accum tree (it changes the graphs' warm-up). Predicted tp 2 +1.3-2.2%.
set -u; T0=$SECONDS
source .dev/setup.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
bash examples/prepare_sample_data.sh /tmp/w 32768 > /dev/null 2>&1
mkdir -p $OUT/logs
mean() { grep -h "iteration  *[0-9]*/" $1 | awk '{for(i=1;i<=NF;i++){if($i=="iteration")it=$(i+1); if($i=="tokens/s:")t=$(i+1)} split(it,a,"/"); if(a[1]+0>20){s+=t;n++}} END{if(n) printf "%.0f", s/n}'; }
PROF="--profile --use-pytorch-profiler --profile-step-start 10 --profile-step-end 12"
run() { local name=$1 dir=$2 extra=$3; shift 3
  rm -rf $dir/runs
  (cd $dir && env MEGAFP8_ROOT=$PWD "$@" ITERS=40 DATA_PATH=/tmp/w/data/sample_text_document TOKENIZER_MODEL=/tmp/w/tokenizer \
     EXTRA_ARGS="$extra" timeout 120 bash examples/pretrain_gpt_1b_fp8.sh > $OUT/logs/$name.log 2>&1)
  echo "$name rc=$? mean21-40 $(mean $OUT/logs/$name.log) $(grep -h 'iteration  *40/' $OUT/logs/$name.log | grep -o 'lm loss: [0-9.E+-]*') t=$((SECONDS-T0))"
  for f in $dir/runs/latest/profile/rank*; do
    case $f in *rank0*.json) gzip -c $f > /tmp/trace_${name}.json.gz;;
               *.txt) cp $f $OUT/logs/${name}_$(basename $f);; esac; done 2>/dev/null; }
run tp2_main . "$PROF" GPUS=2 TP=2
run tp2_accum .dev/builds/accum "$PROF" GPUS=2 TP=2
run tp2_main2 . "" GPUS=2 TP=2
run tp2_accum2 .dev/builds/accum "" GPUS=2 TP=2
LEFT=$((560 - (SECONDS - T0)))
(cd .dev/builds/accum && MEGAFP8_ROOT=$PWD python -m tests.multigpu.check_layouts --share 8 --time-limit $LEFT --output /tmp/check > $OUT/check.txt 2>&1)
echo "check rc=$? $(grep -h -i 'passed\|failed' $OUT/check.txt | tail -2) t=$((SECONDS-T0))"
tar czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
for n in tp2_accum tp2_main; do s=$(stat -c %s /tmp/trace_$n.json.gz 2>/dev/null || echo 99999999); [ $s -lt 16000000 ] && cp /tmp/trace_$n.json.gz $OUT/; done
ls -la /tmp/trace_*.gz; echo "done t=$((SECONDS-T0))"
