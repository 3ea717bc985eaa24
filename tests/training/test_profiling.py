"""The profile's reading of a trace: where the GPU sat idle between its activities, and next to
what (megafp8.training.profiling.idle_gaps), on a trace made by hand."""

import pytest

from megafp8.training.profiling import idle_gaps


def event(cat, name, ts, dur):
    return {"cat": cat, "name": name, "ts": ts, "dur": dur}


def test_idle_gaps_are_summed_by_size_and_by_what_surrounds_them():
    trace = {
        "traceEvents": [
            event(
                "kernel",
                "void at::native::vectorized_elementwise_kernel<8, at::native::Add<float>>(int)",
                0,
                10,
            ),
            event("gpu_memset", "Memset (Device)", 13, 1),  # 3 us after the add
            event("kernel", "nvjet_sm90_gemm", 16, 14),  # 2 us after the memset
            event("gpu_memcpy", "Memcpy PtoP (Device -> Device)", 20, 20),  # beside the GEMM
            event("kernel", "nvjet_sm90_gemm", 300, 10),  # 260 us after the copy ended
            event("kernel", "barrier_kernel(unsigned int**)", 312, 8),  # 2 us
            event("cpu_op", "aten::mm", 500, 50),  # host work: not the GPU's
        ]
    }
    gaps = idle_gaps(trace, top=2)
    assert gaps["gaps"] == 4
    assert gaps["idle_ms"] == pytest.approx(0.267)
    assert gaps["by_size"] == pytest.approx(
        {"< 5 us": 0.007, "< 20 us": 0.0, "< 200 us": 0.0, ">= 200 us": 0.26}
    )
    assert gaps["around"][0] == (pytest.approx(0.26), 1, "Memcpy PtoP -> nvjet_sm90_gemm")
    assert gaps["around"][1] == (
        pytest.approx(0.003),
        1,
        "vectorized_elementwise_kernel<8, Add<float>> -> Memset",
    )
    assert idle_gaps({"traceEvents": []})["gaps"] == 0
