# tp2 with the bias in the own block's GEMM and 2-D column gathers: GPU tests, recipe series, profile, base
set -u
source benchmarks/results/several_gpus/2026-11-27_H200_copy_engines/setup.sh >/dev/null
bash examples/prepare_sample_data.sh /tmp/w 32768 > /dev/null 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/parallel/test_collective_gemm.py tests/parallel/test_gpu_parallel.py tests/training/test_cuda_graphs.py -k "copy_engine or nccl or overlap" > $OUT/gpu_tests.txt 2>&1
echo "gpu tests rc=$? $(tail -1 $OUT/gpu_tests.txt)" | tee $OUT/summary.txt
tps() { grep -h "iteration  *$1/" $2 | grep -o "tokens/s: [0-9]*" | tail -1; }
run() { local name=$1 extra=$2; shift 2
  env "$@" ITERS=20 EXTRA_ARGS="$extra" timeout 110 bash examples/pretrain_gpt_1b_fp8.sh > $OUT/$name.log 2>&1
  echo "$name rc=$? $(tps 20 $OUT/$name.log)" | tee -a $OUT/summary.txt; }
run gpu1_delayed "" GPUS=1 CUDA_VISIBLE_DEVICES=0
run tp2_delayed "" GPUS=2 TP=2
run tp2_bf16 "" GPUS=2 TP=2 PRECISION=bf16
rm -rf runs/latest /tmp/w/runs/latest
env GPUS=2 TP=2 ITERS=13 EXTRA_ARGS="--profile --use-pytorch-profiler --profile-step-start 10 --profile-step-end 12" timeout 120 bash examples/pretrain_gpt_1b_fp8.sh > $OUT/prof.log 2>&1
for f in $(find runs /tmp/w -path "*profile/rank0*" 2>/dev/null); do case $f in *.json) gzip -c $f > $OUT/prof_tp2_rank0.json.gz;; *.txt) cp $f $OUT/prof_tp2_rank0.txt; head -4 $f | cut -c1-300;; esac; done
# the previous build, 0c13c87, unpacked from `git archive` into /tmp/base
python3 -m pip install -q --no-deps --no-build-isolation -e /tmp/base >/dev/null 2>&1
(cd /tmp/base && env GPUS=2 TP=2 ITERS=20 timeout 110 bash examples/pretrain_gpt_1b_fp8.sh > $OUT/tp2_delayed_base.log 2>&1; echo "tp2_delayed_base rc=$? $(tps 20 $OUT/tp2_delayed_base.log)" | tee -a $OUT/summary.txt)
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
run tp2_delayed_again "" GPUS=2 TP=2
cat $OUT/summary.txt
