# the lazy-loading hypothesis of the tp2 hang: a direct test on 2 GPUs (each mode 60 s at most)
for mode in preloaded lazy; do
  echo "== $mode"; timeout 60 torchrun --nproc-per-node 2 .dev/lazy_load_repro.py $mode 2>&1 | grep -v Warning | tail -12; echo "rc=$?"
done
echo "== lazy, CUDA_MODULE_LOADING=EAGER"; CUDA_MODULE_LOADING=EAGER timeout 90 torchrun --nproc-per-node 2 .dev/lazy_load_repro.py lazy 2>&1 | tail -8
echo "== lazy, CUDA_MODULE_DATA_LOADING=EAGER"; CUDA_MODULE_DATA_LOADING=EAGER timeout 90 torchrun --nproc-per-node 2 .dev/lazy_load_repro.py lazy 2>&1 | tail -8
# what eager loading costs a process: start-up time and device memory of the context
for m in LAZY EAGER; do
  CUDA_MODULE_LOADING=$m python -c "
import time; t = time.time(); import torch; x = torch.zeros(1, device='cuda'); torch.cuda.synchronize()
free, total = torch.cuda.mem_get_info(); print('$m', f'start {time.time() - t:.1f} s, device memory in use {(total - free) / 2**30:.2f} GiB')"
done
# the check's tp2 runs, many at once (share 8), to see a rare hang: --repeat
python -m tests.multigpu.check_layouts --layouts tp2 --precisions delayed --kinds straight --repeat 6 --share 8 --time-limit 300 --output /tmp/chk_rep 2>&1 | grep -v "reading:\|tokenizing:" | tail -16
