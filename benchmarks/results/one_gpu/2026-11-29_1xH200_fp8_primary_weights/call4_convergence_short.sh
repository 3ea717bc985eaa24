# one H200: a shortened convergence study (300 steps, a 300 MB corpus): GPT-125M bf16 and FP8
# delayed (FP8 primary weights, the default), and the lean group (bf16 moments, FP8 first moment,
# bf16 gradients), same batches
source .dev/setup.sh; mkdir -p $OUT
T0=$SECONDS
export ITERS=300 CORPUS_MB=300 EVAL_INTERVAL=100 MINUTES=8.3
timeout 540 bash examples/convergence_study.sh /tmp/conv gpt/bf16 gpt/fp8_delayed lean > $OUT/study.log 2>&1; echo "study rc=$? t=$((SECONDS-T0))"
bash examples/convergence_study.sh /tmp/conv report > $OUT/report.log 2>&1
tar czf $OUT/conv.tgz -C /tmp/conv report $(cd /tmp/conv && ls -d runs/*/*/metrics.jsonl 2>/dev/null) 2>/dev/null
grep -E "^\||iteration +300|validation" $OUT/report.log | tail -30; tail -5 $OUT/study.log
