set -u
source benchmarks/results/several_gpus/2026-11-27_H200_copy_engines/setup.sh >/dev/null
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/parallel/test_collective_gemm.py tests/training/test_cuda_graphs.py -k "copy_engine or tp2-sp" > $OUT/gpu_tests.txt 2>&1
echo "gpu tests rc=$? $(tail -1 $OUT/gpu_tests.txt)"
timeout 420 python3 -m tests.multigpu.check_layouts --share 4 > $OUT/check.txt 2>&1
echo "check rc=$?"; tail -15 $OUT/check.txt
