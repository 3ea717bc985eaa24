# GPU tests of the working tree, then tp 2 FP8, three builds alternated, each an installed source tree:
# .dev/base: 96e4fbb (git archive); .dev/merged: the draft of 0d2ca64 (rows and columns in one
# barrier round); . : that draft with the push reduce-scatter (the GEMM of a peer's block writing
# into the peer's buffer), not landed
set -u
source benchmarks/results/several_gpus/2026-11-27_H200_copy_engines/setup.sh >/dev/null
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/parallel/test_collective_gemm.py tests/training/test_cuda_graphs.py -k "copy_engine or tp2-sp" > $OUT/gpu_tests.txt 2>&1
echo "gpu tests rc=$? $(tail -1 $OUT/gpu_tests.txt)"
bash examples/prepare_sample_data.sh /tmp/w 32768 > /dev/null 2>&1
tps() { grep -h "iteration  *$1/" $2 | grep -o "tokens/s: [0-9]*\|lm loss: [0-9.E+-]*" | tr '\n' ' '; }
run() { local tree=$1 name=$2
  python3 -m pip install -q --no-deps --no-build-isolation -e $tree >/dev/null 2>&1
  (cd $tree && GPUS=2 TP=2 ITERS=15 timeout 80 bash examples/pretrain_gpt_1b_fp8.sh > $OUT/$name.log 2>&1; echo "$name rc=$? $(tps 15 $OUT/$name.log)" | tee -a $OUT/summary.txt); }
for round in 1 2; do
  run .dev/base base$round; run .dev/merged merged$round; run . full$round
done
cat $OUT/summary.txt
