# Is the 7b FP8 delayed step slower on some H200 machines because of the GPU (clocks under FP8 load)
# or the host (gaps between kernels)? Clocks/power sampled throughout; a sustained GEMM test; profiles.
source .dev/setup.sh >/dev/null 2>&1
lscpu | grep -m1 "Model name"; nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,driver_version --format=csv,noheader
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv -lms 250 > $OUT/smi.csv 2>&1 &
SMI=$!
python - <<'PY' 2>&1 | tee $OUT/gemm.txt
import torch, time
d = "cuda"
def bench(fn, secs=3.0):
    fn(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n, t0, best = 0, time.perf_counter(), float("inf")
    while time.perf_counter() - t0 < secs:
        s.record()
        for _ in range(20): fn()
        e.record(); e.synchronize(); best = min(best, s.elapsed_time(e) / 20); n += 1
    return best
for m, n, k in ((8192, 4096, 4096), (8192, 16384, 4096), (8192, 4096, 16384)):
    a = torch.randn(m, k, device=d).to(torch.float8_e4m3fn); b = torch.randn(n, k, device=d).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=d)
    t8 = bench(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16))
    ab, bb = a.bfloat16(), b.bfloat16()
    t16 = bench(lambda: ab @ bb)
    f = 2 * m * n * k
    print(f"{m}x{n}x{k}: fp8 {t8:.3f} ms {f/t8/1e9:.0f} TFLOPS | bf16 {t16:.3f} ms {f/t16/1e9:.0f} TFLOPS")
PY
for p in delayed bf16; do
  flags=""; [ $p = delayed ] && flags="--fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 1024 --fp8-amax-compute-algo max"
  timeout 150 torchrun --standalone --nproc-per-node 1 -m megafp8.train $(python benchmarks/peer_gpt.py --shape 7b --trainer-flags) \
    --bf16 --enable-cuda-graph --train-iters 20 --log-interval 5 --lr 1e-4 --mock-data $flags \
    --profile --use-pytorch-profiler --profile-step-start 16 --profile-step-end 18 --tensorboard-dir /tmp/tb_$p > $OUT/profile_7b_$p.txt 2>&1
  echo "profile $p rc=$?"; grep -E "tokens/s|tokens_per_sec" $OUT/profile_7b_$p.txt | tail -2 | cut -c1-200
  grep -E "kernel time by category|GPU busy|GPU idle" $OUT/profile_7b_$p.txt | cut -c1-400
done
kill $SMI
python - <<'PY'
import csv, os
rows = list(csv.reader(open(os.environ["OUT"] + "/smi.csv")))[1:]
clk = [int(r[1].split()[0]) for r in rows if len(r) > 3 and r[1].strip()[0].isdigit()]
pw = [float(r[2].split()[0]) for r in rows if len(r) > 3 and r[2].strip()[0].isdigit()]
busy = [(c, p) for c, p in zip(clk, pw) if p > 300]
if busy:
    cs = sorted(c for c, _ in busy); ps = sorted(p for _, p in busy)
    print(f"under load ({len(busy)} samples >300 W): SM clock min {cs[0]} median {cs[len(cs)//2]} max {cs[-1]} MHz; power median {ps[len(ps)//2]:.0f} max {ps[-1]:.0f} W")
    from collections import Counter
    print("throttle reasons:", Counter(r[4].strip() for r in rows if len(r) > 4).most_common(4))
PY
