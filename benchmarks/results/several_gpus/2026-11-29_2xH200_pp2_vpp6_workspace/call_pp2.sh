# pp2: VPP 4 (shipped) vs 6; and cuBLASLt without workspace (no memset before each FP8 GEMM) at 1 GPU and pp2
set -u
T0=$SECONDS
source .dev/setup.sh >/dev/null 2>&1
bash examples/prepare_sample_data.sh /tmp/w 32768 > /dev/null 2>&1
mkdir -p $OUT/logs
tps() { grep -h "iteration  *20/" $1 | grep -o "tokens/s: [0-9]*\|lm loss: [0-9.E+-]*" | tr '\n' ' '; }
run() { local name=$1; shift
  [ $((SECONDS-T0)) -gt 500 ] && { echo "$name skipped (time)"; return; }
  env "$@" ITERS=20 timeout 100 bash examples/pretrain_gpt_1b_fp8.sh > $OUT/logs/$name.log 2>&1; echo "$name rc=$? $(tps $OUT/logs/$name.log) t=$((SECONDS-T0))" | tee -a $OUT/summary.txt; }
run gpu1 GPUS=1
run pp2_v4 GPUS=2 PP=2
run pp2_v6 GPUS=2 PP=2 VPP=6
run gpu1_ws0 GPUS=1 CUBLASLT_WORKSPACE_SIZE=0
run pp2_v4_ws0 GPUS=2 PP=2 CUBLASLT_WORKSPACE_SIZE=0
run pp2_v6_ws0 GPUS=2 PP=2 VPP=6 CUBLASLT_WORKSPACE_SIZE=0
run pp2_v4_r2 GPUS=2 PP=2
run pp2_v6_r2 GPUS=2 PP=2 VPP=6
run gpu1_r2 GPUS=1
tar czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
