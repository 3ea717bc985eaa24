# Where the pp 2 ranks wait: a torch.profiler profile of steps 15-17, with the overlap (default)
set -u
source .dev/setup.sh
bash examples/prepare_sample_data.sh /tmp/w 32768 > /dev/null 2>&1
rm -rf runs/latest
R=benchmarks/results/several_gpus/2026-11-27_4xH200_p2p_overlap
GPUS=2 PP=2 ITERS=20 CUDA_VISIBLE_DEVICES=0,1 EXTRA_ARGS="--profile --use-pytorch-profiler --profile-step-start 14 --profile-step-end 17 --profile-ranks 0 1" \
  timeout 200 bash examples/pretrain_gpt_1b_fp8.sh > /tmp/prof.log 2>&1; echo "rc=$?"
P=runs/latest/profile
ls $P
cp $P/rank0_*.txt $OUT/profile_rank0.txt; cp $P/rank1_*.txt $OUT/profile_rank1.txt
python $R/timeline.py $P/rank0_*.json $P/rank1_*.json > $OUT/timeline.txt
grep totals $OUT/timeline.txt; head -3 $OUT/profile_rank0.txt $OUT/profile_rank1.txt
