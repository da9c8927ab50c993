"""``python -m cuflash bench --fp8`` without a GPU: its arguments, its refusal, the plan of what a
run measures and the table it prints (the measurements themselves need a GPU)."""

from __future__ import annotations

import pytest

from cuflash.tools import bench, bench_fp8


def test_fp8_needs_a_gpu_and_measures_nothing_without_one(capsys, monkeypatch):
    monkeypatch.setattr(bench, "gpu_available", lambda: (False, "no GPU here"))
    assert bench.main(["--quick", "--fp8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m cuflash bench: error: no GPU here. The benchmark needs a GPU")
    assert bench._parser().parse_args(["--quick", "--fp8"]).fp8


def test_fp8_with_cpu_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--cpu", "--fp8"])
    assert exit_info.value.code == 2
    assert "--fp8 with --cpu" in capsys.readouterr().err


def test_the_plan_names_each_measurement_and_its_flops():
    steps = bench_fp8.plan()
    assert [s["name"] for s in steps] == ["cuflash decode, fp8 cache", "cuflash decode, bf16 cache",
                                          "cuflash fp8 forward", "cuflash fp8 forward, causal",
                                          "fp8 GEMM (torch._scaled_mm)", "cuDNN fp8 attention"]
    # one query row per sequence: Q K^T and P V, 2 flops per multiply-add each, over every cached key
    assert steps[0]["flops"] == steps[1]["flops"] == 4 * 64 * 32 * 8192 * 128
    assert steps[4]["flops"] == 2 * 8192**3
    # the fp8 forward: Q K^T and P V over B=2, H=16, S=8192, D=128, 2 flops per multiply-add; half causal
    assert steps[2]["flops"] == 4 * 2 * 16 * 8192**2 * 128 == 2 * steps[3]["flops"]
    assert not steps[2]["causal"] and steps[3]["causal"] and "S=8192, D=128" in steps[2]["what"]
    assert steps[5]["flops"] is None   # reported without a rate
    assert "e4m3 caches with descales" in steps[0]["what"] and "pages of 16" in steps[0]["what"]


def test_the_table_shows_rates_and_says_why_a_row_did_not_run():
    steps = bench_fp8.plan()
    records = [dict(steps[0], ms=2.0, tflops=steps[0]["flops"] / 2e-3 / 1e12, gb_per_s=1100.0),
               dict(steps[4], ms=1.5, tflops=733.0, gb_per_s=None),
               dict(steps[2], ms=None, tflops=None, gb_per_s=None, note="not run: no kernel takes this call on sm_80")]
    table = bench_fp8.format_table(records, "NVIDIA H200")
    lines = table.splitlines()
    assert lines[0].startswith("fp8 on NVIDIA H200")
    assert "cuflash decode, fp8 cache" in lines[2] and "2.000" in lines[2] and " 4.3 " in lines[2] and "1100" in lines[2]
    assert "733.0" in lines[3]
    assert lines[4].split()[3:6] == ["-", "-", "-"] and lines[4].endswith("not run: no kernel takes this call on sm_80")


def test_the_fp8_forward_record_times_the_call_or_says_why_not(monkeypatch):
    """The fp8 forward's record on the CPU: small NumPy fp8 inputs in place of the GPU's, a timer
    that calls once; the rate is the step's flops over the time, the causal step passes
    causal=True, and a call no kernel takes is a record with the refusal, not a failure."""
    import ml_dtypes
    import numpy as np

    import cuflash

    rng = np.random.default_rng(0)
    qkv = [rng.standard_normal((1, 2, 40, 16)).astype(ml_dtypes.float8_e4m3fn) for _ in range(3)]
    d = np.full((1, 2), 0.5, np.float32)
    inputs = (qkv, dict(q_descale=d, k_descale=d, v_descale=d))
    calls = []

    class Timer:
        def median_ms(self, fn):
            calls.append(fn())
            return 4.0

    steps = bench_fp8.plan()
    rec = bench_fp8._forward(Timer(), inputs, steps[3])
    assert rec["ms"] == 4.0 and rec["tflops"] == steps[3]["flops"] / 4e-3 / 1e12
    want = cuflash.attention(*qkv, causal=True, q_descale=d, k_descale=d, v_descale=d)
    np.testing.assert_array_equal(np.asarray(calls[0], np.float32), np.asarray(want, np.float32))

    def refuse(*a, **k):
        raise NotImplementedError("cuflash.explain: no kernel takes this call on sm_80: ...")

    monkeypatch.setattr(cuflash, "explain", refuse)
    rec = bench_fp8._forward(Timer(), inputs, steps[2])
    assert rec["ms"] is None and rec["note"].startswith("not run: cuflash.explain: no kernel takes this call on sm_80")
