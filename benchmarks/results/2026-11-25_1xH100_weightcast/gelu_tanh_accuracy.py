import torch
from tests.fp8.test_activation_quantize import make_inputs, scales, fp8_step, E5M2
from megafp8.fp8.activation_kernels import activation_backward_quantize, activation_backward_torch
from megafp8.fp8.quantize import quantize_torch
for dtype in (torch.float32, torch.bfloat16):
    h, dout = make_inputs("gelu_tanh", dtype, 4096, 2048, seed=3, device="cuda")
    _, gs = scales(h, dout, "gelu_tanh")
    exact = activation_backward_torch(dout.double(), h.double(), "gelu_tanh")
    truth = quantize_torch(exact.to(dtype), E5M2, gs, 0, True, False).data.float()
    ours = activation_backward_quantize(dout, h, "gelu_tanh", E5M2, gs, columnwise=False).data.float()
    aten = quantize_torch(activation_backward_torch(dout, h, "gelu_tanh"), E5M2, gs, 0, True, False).data.float()
    off = (ours - truth).abs()
    bad = off > fp8_step(torch.maximum(ours.abs(), truth.abs()), E5M2)
    print(dtype, "scale", gs.item(), "ours off", (ours != truth).sum().item(), "aten off", (aten != truth).sum().item(), "bad", bad.sum().item())
    for i, j in bad.nonzero()[:8].tolist():
        print(f"  x={h[i,j].item()!r} dy={dout[i,j].item()!r} exact*s={(exact[i,j]*gs.double()).item()!r} ours={ours[i,j].item()} truth={truth[i,j].item()} aten={aten[i,j].item()}")
