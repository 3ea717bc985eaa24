# issue 40: the whole multi-GPU check on the build as committed, then a profile of the tp 2 FP8 step (steps 11-12)
# and the copy engines' bandwidth with one pull split over 1, 2 and 4 streams (.dev/ce_streams.py: ce_streams.py here). ~430 s (check, FP8 and bf16 tp 2 profiles, pull bandwidth).
set -u; T0=$SECONDS
source .dev/setup.sh >/dev/null 2>&1
python -m tests.multigpu.check_layouts --share 8 --time-limit 230 --output /tmp/check > $OUT/check.txt 2>&1
echo "check rc=$? $(tail -1 $OUT/check.txt) t=$((SECONDS-T0))"
bash examples/prepare_sample_data.sh /tmp/w 32768 > /dev/null 2>&1
rm -rf runs; GPUS=2 TP=2 ITERS=13 DATA_PATH=/tmp/w/data/sample_text_document TOKENIZER_MODEL=/tmp/w/tokenizer \
  EXTRA_ARGS="--profile --use-pytorch-profiler --profile-step-start 10 --profile-step-end 12" timeout 120 bash examples/pretrain_gpt_1b_fp8.sh > $OUT/tp2_profile.log 2>&1
echo "tp2 profile rc=$? t=$((SECONDS-T0))"
mkdir -p $OUT/prof; cp runs/latest/profile/rank0_steps11-12.txt $OUT/prof/tp2_profile_rank0.txt 2>/dev/null
gzip -c runs/latest/profile/rank0_steps11-12.json > $OUT/tp2_trace_rank0.json.gz 2>/dev/null
# bf16 tp 2 (its gathers keep their own block: placed on the copy stream beside the GEMM, as the FP8 staging was)
rm -rf runs; GPUS=2 TP=2 ITERS=13 PRECISION=bf16 DATA_PATH=/tmp/w/data/sample_text_document TOKENIZER_MODEL=/tmp/w/tokenizer \
  EXTRA_ARGS="--profile --use-pytorch-profiler --profile-step-start 10 --profile-step-end 12" timeout 120 bash examples/pretrain_gpt_1b_fp8.sh > $OUT/prof/tp2_bf16_profile.log 2>&1
echo "tp2 bf16 profile rc=$? t=$((SECONDS-T0))"
cp runs/latest/profile/rank0_steps11-12.txt $OUT/prof/tp2_bf16_profile_rank0.txt 2>/dev/null
gzip -c runs/latest/profile/rank0_steps11-12.json > $OUT/tp2_bf16_trace_rank0.json.gz 2>/dev/null
mv $OUT/tp2_profile.log $OUT/prof/ 2>/dev/null; tar czf $OUT/prof.tgz -C $OUT prof && rm -rf $OUT/prof
timeout 60 torchrun --nproc-per-node 2 .dev/ce_streams.py > $OUT/ce_streams.txt 2>&1; echo "ce_streams rc=$?"; cat $OUT/ce_streams.txt | tail -8
