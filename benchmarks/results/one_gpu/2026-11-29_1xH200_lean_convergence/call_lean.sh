# one H200: the convergence study's lean group at the study's length (1500 steps of 64 x 1024
# tokens, GPT-125M) on a 600 MB corpus; RUNS names this call's runs (the data are prepared again
# each call, the same bytes: the md5 of the training tokens is printed to check it)
source .dev/setup.sh; mkdir -p $OUT
T0=$SECONDS
export CORPUS_MB=600
timeout 585 bash examples/convergence_study.sh /tmp/conv data > $OUT/data.log 2>&1; echo "data rc=$? t=$((SECONDS-T0))"
md5sum /tmp/conv/data/train_text_document.bin /tmp/conv/data/validation_text_document.bin | tee $OUT/data.md5
LEFT=$((585 - SECONDS + T0)); MINUTES=$(python3 -c "print($LEFT / 60)") timeout $LEFT bash examples/convergence_study.sh /tmp/conv $RUNS > $OUT/study.log 2>&1; echo "study rc=$? t=$((SECONDS-T0))"
tar czf $OUT/conv.tgz -C /tmp/conv report $(cd /tmp/conv && ls -d runs/*/*/metrics.jsonl 2>/dev/null) 2>/dev/null
grep -E "wall time|validation loss|saved checkpoint|failed" $OUT/study.log | tail -12; cat /tmp/conv/report/lean.md 2>/dev/null
