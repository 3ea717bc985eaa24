# the 2-GPU series of the recipe as shipped (main), mean tokens/s of iterations 25-40; then the tp GPU tests
set -u
T0=$SECONDS
source .dev/setup.sh
bash examples/prepare_sample_data.sh /tmp/w 32768 > /dev/null 2>&1
mkdir -p $OUT/logs
nvidia-smi --query-gpu=index,clocks.sm,temperature.gpu,power.draw --format=csv -l 5 > $OUT/logs/smi.csv 2>&1 &
SMI=$!
mean() { grep -h "iteration  *\(25\|30\|35\|40\)/" $1 | grep -o "tokens/s: [0-9]*" | awk '{s+=$2;n++} END {if(n) printf "%d", s/n}'; }
info() { grep -h "iteration  *40/" $1 | grep -o "lm loss: [0-9.E+-]*\|memory (GiB): [0-9.]*" | tr '\n' ' '; }
run() { local name=$1; shift
  env CUDA_VISIBLE_DEVICES=0,1 "$@" ITERS=40 timeout 150 bash examples/pretrain_gpt_1b_fp8.sh > $OUT/logs/$name.log 2>&1
  echo "$name rc=$? tokens/s $(mean $OUT/logs/$name.log) $(info $OUT/logs/$name.log) t=$((SECONDS-T0))" | tee -a $OUT/summary.txt; }
run gpu1_delayed GPUS=1
run dp2_delayed GPUS=2
run tp2_delayed GPUS=2 TP=2
run tp2_bf16 GPUS=2 TP=2 PRECISION=bf16
run pp2_delayed GPUS=2 PP=2
CUDA_VISIBLE_DEVICES=0,1 timeout 200 python3 -m pytest -q -m gpu tests/parallel/test_collective_gemm.py tests/parallel/test_cuda_graphs.py > $OUT/logs/gpu_tests.log 2>&1
echo "gpu tests rc=$? $(tail -1 $OUT/logs/gpu_tests.log) t=$((SECONDS-T0))" | tee -a $OUT/summary.txt
kill $SMI
tar czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
cat $OUT/summary.txt
