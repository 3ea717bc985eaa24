# pp 2 A/B on 4 GPUs as two pairs in parallel (GPUs 0,1 and 2,3), each variant once on each pair,
# the pairs' orders reversed: base (bfab77c), head (main), branch group 2, 4, 8; one-GPU refs first.
set -u
T0=$SECONDS
source .dev/setup.sh
bash examples/prepare_sample_data.sh /tmp/w 32768 > /dev/null 2>&1
mkdir -p $OUT/logs
nvidia-smi --query-gpu=index,clocks.sm,temperature.gpu,power.draw --format=csv -l 5 > $OUT/logs/smi.csv 2>&1 &
SMI=$!
tree() { # a copy of a tree whose megafp8/ holds models, parallel, data (no editable install needed)
  local src=$1 dst=/tmp/t_$2; mkdir -p $dst
  (cd $src && tar c --exclude=./.dev --exclude=./tests --exclude=./benchmarks/results --exclude=./runs --exclude=./.whl --exclude=./.git . ) | tar x -C $dst
  for p in models parallel data; do ln -sfn ../$p $dst/megafp8/$p; done; }
tree . head; tree .dev/base base; tree .dev/branch branch
python3 -m pip uninstall -y megafp8 >/dev/null 2>&1
mean() { grep -h "iteration  *\(25\|30\|35\|40\)/" $1 | grep -o "tokens/s: [0-9]*" | awk '{s+=$2;n++} END {if(n) printf "%d (n=%d)", s/n, n}'; }
loss() { grep -h "iteration  *40/" $1 | grep -o "lm loss: [0-9.E+-]*"; }
run() { local pair=$1 t=$2 name=$3; shift 3
  (cd /tmp/t_$t && env CUDA_VISIBLE_DEVICES=$pair "$@" ITERS=40 timeout 150 bash examples/pretrain_gpt_1b_fp8.sh > $OUT/logs/$name.log 2>&1; echo "$name rc=$? mean25-40 $(mean $OUT/logs/$name.log) $(loss $OUT/logs/$name.log) t=$((SECONDS-T0))" | tee -a $OUT/summary.txt); }
G4="EXTRA_ARGS=--microbatch-group-size-per-virtual-pipeline-stage 4"
G8="EXTRA_ARGS=--microbatch-group-size-per-virtual-pipeline-stage 8"
pairA() { run 0 head gpu1_A GPUS=1
  run 0,1 base base_A GPUS=2 PP=2; run 0,1 head head_A GPUS=2 PP=2; run 0,1 branch g2_A GPUS=2 PP=2
  run 0,1 branch g4_A GPUS=2 PP=2 "$G4"; run 0,1 branch g8_A GPUS=2 PP=2 "$G8"; }
pairB() { run 2 head gpu1_B GPUS=1
  run 2,3 branch g8_B GPUS=2 PP=2 "$G8"; run 2,3 branch g4_B GPUS=2 PP=2 "$G4"; run 2,3 branch g2_B GPUS=2 PP=2
  run 2,3 head head_B GPUS=2 PP=2; run 2,3 base base_B GPUS=2 PP=2; }
pairA & PA=$!; pairB & PB=$!; wait $PA $PB
kill $SMI
for f in $OUT/logs/*.log; do echo "$(basename $f .log) $(grep -h 'iteration  *40/' $f | grep -o 'memory (GiB): [0-9.]*')"; done >> $OUT/summary.txt
tar czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
sort $OUT/summary.txt
