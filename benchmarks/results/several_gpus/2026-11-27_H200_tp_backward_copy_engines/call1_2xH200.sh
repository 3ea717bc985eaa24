set -u
source benchmarks/results/several_gpus/2026-11-27_H200_copy_engines/setup.sh
bash examples/prepare_sample_data.sh /tmp/w 32768 > /dev/null 2>&1
echo "== collective gemm bench"; timeout 90 torchrun --standalone --nproc-per-node 2 benchmarks/bench_collective_gemm.py --output $OUT/gemms.json > $OUT/gemms.txt 2>&1; echo "rc=$?"; tail -12 $OUT/gemms.txt
T=tests/training/test_cuda_graphs.py::test_graphed_tensor_data_and_pipeline_parallel_equal_eager_bitwise
echo "== gpu tests"; timeout 150 python3 -m pytest -q -p no:cacheprovider "$T[tp2-sp-overlap-bf16]" "$T[tp2-sp-overlap-delayed]" tests/training/test_bench_collective_gemm.py > $OUT/tests.txt 2>&1; echo "tests rc=$?"; tail -3 $OUT/tests.txt
tps() { grep -h "iteration  *$1/" $2 | grep -o "tokens/s: [0-9]*" | tail -1; }
prof() { # name extra env...
  local name=$1 extra=$2; shift 2
  rm -rf runs/latest
  env "$@" ITERS=13 EXTRA_ARGS="--profile --use-pytorch-profiler --profile-step-start 10 --profile-step-end 12 $extra" timeout 120 bash examples/pretrain_gpt_1b_fp8.sh > /tmp/$name.log 2>&1
  echo "$name rc=$? $(tps 10 /tmp/$name.log)"
  for f in runs/latest/profile/rank0*.txt; do head -4 $f | tee $OUT/prof_$name.txt; sed -n 5,60p $f >> $OUT/prof_$name.txt; done
}
echo "== profiles"
prof gpu1 "" GPUS=1 CUDA_VISIBLE_DEVICES=0
prof tp2ce "--tp-comm-overlap" GPUS=2 TP=2
prof tp2plain "" GPUS=2 TP=2
echo "== check"
timeout 200 python3 -m tests.multigpu.check_layouts --layouts tp2 vpp2 dp2 --tp-comm-overlap --overlap-param-gather --kinds straight resumed sigterm --share 3 --output /tmp/check > /tmp/check.log 2>&1
echo "check rc=$?"; cp /tmp/check/check_layouts.json $OUT/ 2>/dev/null; grep -A40 "^run  " /tmp/check.log | tail -30
