"""Device-call diagnostic, loaded at interpreter start by a .pth line: with
MEGAFP8_TRACE_COPY_ENGINES=1, every copy-engine barrier and workspace growth a rank issues is
printed to stderr (rank, barrier number, channel, buffer generation, capturing or not), so two
ranks' sequences can be compared after a barrier timeout: the same sequence means a lost signal,
different ones mean the ranks issued different transfers."""
import os
import sys
import time

if os.environ.get("MEGAFP8_TRACE_COPY_ENGINES") == "1":
    import torch
    from megafp8 import symmetric_memory as _sm

    _W = _sm._Workspace
    _reserve, _barrier = _W._reserve, _W._barrier

    def _say(self, what):
        print(
            f"[trace] rank {self.rank} t={time.time():.4f} gen {len(self._kept)} "
            f"barrier#{getattr(self, '_barriers', 0)} capturing={torch.cuda.is_current_stream_capturing()} "
            f"{what}",
            file=sys.stderr,
            flush=True,
        )

    def traced_reserve(self, gather_bytes=0, scatter_bytes=0):
        grows = gather_bytes > self.gather_bytes or scatter_bytes > self.scatter_bytes
        if grows and not getattr(self, "_said_setup", False):
            self._said_setup = True
            from torch.distributed import _symmetric_memory as symm
            pool = getattr(symm, "_should_use_implicit_mempool", lambda: "n/a")()
            _say(self, f"torch {torch.__version__} implicit pool {pool} "
                 f"backend {getattr(symm, 'get_backend', lambda d: 'n/a')(torch.device('cuda'))}")
        if grows:
            _say(self, f"grow from {self.gather_bytes}+{self.scatter_bytes} for {gather_bytes}+{scatter_bytes}")
        result = _reserve(self, gather_bytes, scatter_bytes)
        if grows:
            pads = getattr(self.handle, "signal_pad_ptrs", None)
            _say(self, f"grown to {self.gather_bytes}+{self.scatter_bytes} buffer {self.mine.data_ptr():#x} "
                 f"pads {[hex(p) for p in pads] if pads else pads}")
        return result

    def traced_barrier(self, channel):
        self._barriers = getattr(self, "_barriers", 0) + 1
        _say(self, f"ch{channel}")
        return _barrier(self, channel)

    _W._reserve, _W._barrier = traced_reserve, traced_barrier
