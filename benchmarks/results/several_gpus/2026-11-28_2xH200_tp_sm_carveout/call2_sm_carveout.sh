# tp2 FP8: GEMM SM carveout for the copy-engine transfers' kernels
set -u
source benchmarks/results/several_gpus/2026-11-27_H200_copy_engines/setup.sh >/dev/null
bash examples/prepare_sample_data.sh /tmp/w 32768 > /dev/null 2>&1
python3 -c "import torch; print(hasattr(torch._C, '_set_sm_carveout_experimental'))"
tps() { grep -h "iteration  *$1/" $2 | grep -o "tokens/s: [0-9]*" | tail -1; }
run() { local name=$1 extra=$2; shift 2
  env "$@" ITERS=20 EXTRA_ARGS="$extra" timeout 110 bash examples/pretrain_gpt_1b_fp8.sh > $OUT/$name.log 2>&1
  echo "$name rc=$? $(tps 20 $OUT/$name.log)" | tee -a $OUT/summary.txt; }
for c in 0 2 8 16; do run tp2_carve$c "--tp-comm-sm-carveout $c" GPUS=2 TP=2; done
rm -rf runs/latest /tmp/w/runs/latest
env GPUS=2 TP=2 ITERS=13 EXTRA_ARGS="--tp-comm-sm-carveout 8 --profile --use-pytorch-profiler --profile-step-start 10 --profile-step-end 12" timeout 120 bash examples/pretrain_gpt_1b_fp8.sh > $OUT/prof.log 2>&1
for f in $(find runs /tmp/w -path "*profile/rank0*" 2>/dev/null); do case $f in *.json) gzip -c $f > $OUT/prof_tp2_rank0.json.gz;; *.txt) cp $f $OUT/prof_tp2_rank0.txt; head -4 $f | cut -c1-300;; esac; done
cat $OUT/summary.txt
