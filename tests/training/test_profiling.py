"""The profile's reading of a Chrome trace (megafp8.training.profiling), on traces made by hand:
the kernel time split into compute and exposed communication, the GPU's time line, the kernel
categories, and where the GPU sat idle between its activities."""

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


def test_kernel_time_separates_exposed_communication():
    from megafp8.training.profiling import kernel_time

    def kernel(name, ts, dur):
        return {"cat": "kernel", "name": name, "ts": ts, "dur": dur}

    trace = {
        "traceEvents": [
            kernel("sm90_gemm", 0, 100),
            kernel("quantize", 50, 100),  # compute 0..150
            kernel(
                "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 120, 60
            ),  # 30 beside, 30 alone
            kernel("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", 300, 50),  # alone
            kernel("sm90_gemm", 400, 10),
            kernel(
                "c10d::symmetric_memory::barrier_kernel(unsigned int**, int, int, int, unsigned long)",
                405,
                20,
            ),
            {
                "cat": "gpu_memcpy",
                "name": "Memcpy PtoP (Device -> Device)",
                "ts": 440,
                "dur": 30,
            },  # alone
            {
                "cat": "gpu_memcpy",
                "name": "Memcpy DtoD (Device -> Device)",
                "ts": 500,
                "dur": 5,
            },  # local: neither
            {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 999},
        ]
    }
    times = kernel_time(trace)
    assert times["kernels"] == 6
    assert times["busy_ms"] * 1000 == 150 + 30 + 50 + 25 + 30
    assert times["compute_ms"] * 1000 == 160
    assert times["communication_ms"] * 1000 == 60 + 50 + 20 + 30
    assert times["communication_exposed_ms"] * 1000 == 30 + 50 + 15 + 30
    assert {
        kind: (t["count"], round(t["ms"] * 1000), round(t["exposed_ms"] * 1000))
        for kind, t in times["by_kind"].items()
    } == {
        "AllGather": (1, 60, 30),
        "ReduceScatter": (1, 50, 50),
        "symmetric-memory barriers": (1, 20, 15),
        "peer copies": (1, 30, 30),
    }
    assert list(times["by_kind"])[0] == "AllGather"  # largest first


def test_the_gpu_timeline_shows_where_a_rank_waits():
    from megafp8.training.profiling import gpu_timeline

    def kernel(name, ts, dur):
        return {"cat": "kernel", "name": name, "ts": ts, "dur": dur}

    send = "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"
    trace = {
        "traceEvents": [
            # (times from the first kernel, in ms)
            kernel("sm90_gemm", 1000, 2000),  # compute 0..2
            kernel("quantize", 3020, 980),  # 20 us later: the same compute run, to 3
            kernel(send, 3500, 1000),  # beside compute to 3, then alone 3..3.5
            kernel(send, 4540, 460),  # alone again 40 us later: one run, 3..4
            kernel("sm90_gemm", 6000, 1000),  # nothing ran 4..5: idle
            {"cat": "cpu_op", "name": "aten::mm", "ts": 4500, "dur": 100},  # not the GPU's
        ]
    }
    timeline = [
        (round(start, 3), round(length, 3), what) for start, length, what in gpu_timeline(trace)
    ]
    assert timeline == [
        (0.0, 3.0, "compute"),
        (3.0, 1.0, "SendRecv"),
        (4.0, 1.0, "idle"),
        (5.0, 1.0, "compute"),
    ]
    assert gpu_timeline({"traceEvents": []}) == []


def test_kernel_categories_name_what_the_step_spent_its_gpu_time_on():
    from megafp8.training.profiling import kernel_categories

    names = {
        "nvjet_sm90_qqtst_192x192_128x4_2x1_v_bz_coopB_bias_TNN": "FP8 GEMMs",
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "other GEMMs",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16": "attention",
        "_quantize_kernel": "FP8 casts",
        "_statistics_kernel": "loss",
        "_adamw_kernel": "optimizer",
        "void at::native::vectorized_layer_norm_kernel<c10::BFloat16>": "norms/activations",
        "ncclDevKernel_AllGather_RING_LL": "communication",
        "_activation_backward_quantize_kernel": "norms/activations",
        "void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add>": "other elementwise",
    }
    events = [
        {"cat": "kernel", "name": name, "ts": i, "dur": 1000 * (i + 1)}
        for i, name in enumerate(names)
    ]
    categories = kernel_categories(
        {"traceEvents": events + [{"cat": "cpu_op", "name": "aten::mm", "dur": 5}]}
    )
    expected = {}
    for i, category in enumerate(names.values()):
        expected[category] = expected.get(category, 0.0) + i + 1.0
    assert categories == expected and list(categories.values()) == sorted(
        expected.values(), reverse=True
    )
