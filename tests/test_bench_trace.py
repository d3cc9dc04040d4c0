"""The profiler summary's GPU side, from kernel intervals (CPU runs have no GPU plane)."""

from jrl.bench.trace import kernel_summary

US = 1_000  # ns


def two_steps():
    """Two steps of three kernels each: a GEMM, a norm, attention; 1 µs idle between kernels."""
    kernels, t = [], 0
    for _ in range(2):
        for name, us in (("gemm_fusion_dot_1", 5), ("fusion_3599", 2), ("body_mosaic_gpu_kernel", 6)):
            kernels.append((t, t + us * US, name))
            t += (us + 1) * US
    return kernels


def test_step_kernels_are_the_last_step_in_launch_order_with_their_durations():
    out = kernel_summary(list(reversed(two_steps())), n_steps=2)
    assert out["step_kernels"] == [{"name": "gemm_fusion_dot_1", "us": 5.0}, {"name": "fusion_3599", "us": 2.0},
                                   {"name": "body_mosaic_gpu_kernel", "us": 6.0}]


def test_busy_time_is_the_union_of_intervals_and_the_span_counts_the_gaps():
    out = kernel_summary(two_steps(), n_steps=2)
    assert out["kernels_per_step"] == 3
    assert out["gpu_busy_us_per_step"] == 13.0
    assert out["gpu_span_us_per_step"] == 15.5  # 31 µs first start to last end, 5 idle µs between
    assert len(out["idle_gaps"]) == 5 and {g["us"] for g in out["idle_gaps"]} == {1.0}


def test_kernels_are_classed_by_name():
    out = kernel_summary(two_steps(), n_steps=2)
    assert out["by_class_us_per_step"] == {"attention": 6.0, "matmul": 5.0, "other": 2.0}


def test_no_kernels_give_no_gpu_fields():
    assert kernel_summary([], n_steps=4) == {}
