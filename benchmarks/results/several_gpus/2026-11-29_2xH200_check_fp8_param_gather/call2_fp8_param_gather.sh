# x2: issue 42's GPU check (dp2 with the distributed optimizer and --fp8-param-gather), then dp 2 as
# shipped against --fp8-param-gather alternating (ITERS=40, mean tokens/s of iterations 25-40, memory).
set -u
T0=$SECONDS
source .dev/setup.sh >/dev/null
mkdir -p $OUT/logs
python3 -m tests.multigpu.check_layouts --layouts dp2 pp2 --precisions delayed --fp8-param-gather --share 4 --time-limit 150 --output /tmp/chk > $OUT/check_fp8_gather.log 2>&1; echo "check rc=$? t=$((SECONDS-T0))"
grep -v "reading:\|tokenizing:" $OUT/check_fp8_gather.log | tail -14
bash examples/prepare_sample_data.sh /tmp/w 32768 > /dev/null 2>&1
mean() { grep -h "iteration  *\(25\|30\|35\|40\)/" $1 | grep -o "tokens/s: [0-9]*" | awk '{s+=$2;n++} END {if(n) printf "%d", s/n}'; }
mem() { grep -h "iteration  *40/" $1 | grep -o "memory (GiB): [0-9.]*" | tail -1; }
run() { local name=$1; shift
  if [ $((SECONDS-T0)) -gt 520 ]; then echo "$name skipped (time)" | tee -a $OUT/summary.txt; return; fi
  env "$@" ITERS=40 timeout 90 bash examples/pretrain_gpt_1b_fp8.sh > $OUT/logs/$name.log 2>&1
  echo "$name rc=$? tokens/s $(mean $OUT/logs/$name.log) $(mem $OUT/logs/$name.log) t=$((SECONDS-T0))" | tee -a $OUT/summary.txt; }
run gpu1 GPUS=1 CUDA_VISIBLE_DEVICES=0
run dp2_base GPUS=2
run dp2_fp8gather GPUS=2 EXTRA_ARGS=--fp8-param-gather
run dp2_base_b GPUS=2
run dp2_fp8gather_b GPUS=2 EXTRA_ARGS=--fp8-param-gather
tar czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
cat $OUT/summary.txt
