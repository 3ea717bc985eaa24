set -u
source .dev/setup.sh
mkdir -p /tmp/old && tar -xf .dev/head.tar -C /tmp/old && cp -r .whl /tmp/old/ && cd /tmp/old
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export LOG_INTERVAL=1
for g in 1 0; do
  GPUS=2 TP=2 ITERS=6 CUDA_GRAPH=$g bash examples/pretrain_gpt_1b_fp8.sh > /tmp/old_$g.log 2>&1
  echo "HEAD graphs=$g rc=$? losses: $(grep -o 'lm loss: [0-9.E+-]*' /tmp/old_$g.log | head -6 | sed 's/lm loss: //' | tr '\n' ' ')"
done
