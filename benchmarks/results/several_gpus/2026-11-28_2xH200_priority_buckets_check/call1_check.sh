# x2: the multi-GPU check's 2-GPU layouts at HEAD, then the tp GPU unit tests
source .dev/setup.sh >/dev/null; mkdir -p $OUT
python3 -c 'import torch; print("gpus", torch.cuda.device_count())'
T0=$SECONDS
python3 -m tests.multigpu.check_layouts --share 8 --time-limit 430 > $OUT/check_2gpu.log 2>&1; echo "check rc=$? t=$((SECONDS-T0))"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/parallel/test_collective_gemm.py tests/training/test_cuda_graphs.py -k "copy_engine or tp2-sp" > $OUT/gpu_tests.txt 2>&1; echo "gpu tests rc=$? $(tail -1 $OUT/gpu_tests.txt) t=$((SECONDS-T0))"
cp runs/check_layouts/check_layouts.json $OUT/ 2>/dev/null; grep -v "reading:\|tokenizing:" $OUT/check_2gpu.log | tail -40
