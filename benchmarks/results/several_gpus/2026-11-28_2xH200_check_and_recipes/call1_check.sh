source benchmarks/results/several_gpus/2026-11-27_H200_copy_engines/setup.sh >/dev/null
nvidia-smi --query-gpu=name --format=csv,noheader | wc -l
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/training/test_cuda_graphs.py tests/parallel/test_collective_gemm.py > $OUT/gpu_tests.log 2>&1; echo "gpu tests rc=$?"; tail -2 $OUT/gpu_tests.log
timeout 400 python3 -m tests.multigpu.check_layouts --share 4 --output $OUT/check > $OUT/check.log 2>&1; echo "check rc=$?"
rm -rf $OUT/check/data $OUT/check/runs
grep -A60 "^run " $OUT/check.log | cut -c1-140
