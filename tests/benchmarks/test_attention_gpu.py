"""Attention on the GPU with pytest-benchmark: cuflash's forward and backward against baselines.

The sweep of ``python -m cuflash bench`` (cuflash/tools/bench.py): fp16/bf16, hdim 64/128/256,
causal or not, seqlen 512 .. 16k at 16k tokens per batch and H * D = 2048. Baselines in the same
process: cuflash's portable SIMT kernel, naive CuPy attention, PyTorch SDPA (flash and cuDNN
backends) when torch has CUDA. The ``--quick`` subset of the command is selected with
``-k quick`` (its test ids carry "quick"; baselines only at the bar shape, bf16 d128 S8192)::

    PYTHONPATH=. python -m pytest tests/benchmarks/test_attention_gpu.py --benchmark-enable -k quick

pytest-benchmark's own statistics are wall-clock (each round ends with a device synchronize, the
L2 flush runs in the untimed setup); ``extra_info`` carries the CUDA-event median (``ms``), the
TFLOP/s by DESIGN.md §6 and by flash-attn's convention, and the ratio to a bf16 matmul measured
in the same session. Every cuflash result is checked against float32 attention on a slice. No
timing is asserted. Without a GPU the timed tests skip (``gpu`` marker).
"""

from __future__ import annotations

import pytest

from cuflash.tools import bench

QUICK = set(bench.sweep(quick=True))
CASES = []
for _cfg in bench.sweep(quick=False) + [c for c in bench.sweep(quick=True) if c not in bench.sweep(quick=False)]:
    _quick = _cfg in QUICK
    for _impl in bench.IMPLS:
        _base = bench.baselines_for(_cfg, quick=_quick)
        if _impl == "cuflash" or _impl in _base:
            _id = f"{'quick-' if _quick else ''}{_impl}-{_cfg.dtype}-d{_cfg.head_dim}-S{_cfg.seqlen}-{'causal' if _cfg.causal else 'full'}"
            CASES.append(pytest.param(_cfg, _impl, id=_id))


@pytest.fixture(scope="module")
def timer():
    return bench.Timer(warmup=3, iters=10)


@pytest.fixture(scope="module")
def matmul_peak(timer):
    return bench.matmul_peak_tflops(timer)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg,impl", CASES)
def test_forward(benchmark, timer, matmul_peak, cfg, impl):
    import cupy as cp

    if impl.startswith("torch") and not bench._have_torch_cuda():
        pytest.skip("torch with CUDA is not installed")
    q, k, v = bench.make_inputs(cfg)
    if impl in ("cuflash", "cuflash_simt"):
        fn, kernel = bench.cuflash_runner(q, k, v, cfg.causal, tier="simt" if impl == "cuflash_simt" else "auto")
        benchmark.extra_info["kernel"] = kernel
        err = bench.check_error(fn(), q, k, v, cfg.causal)
        benchmark.extra_info["max_error"] = err
        assert err <= bench.CHECK_TOL[cfg.dtype], f"{kernel}: max error {err:.3g} on {cfg.label}"
    elif impl == "cupy_naive":
        fn = bench.naive_runner(q, k, v, cfg.causal)
    else:
        fn = bench.torch_runner(q, k, v, cfg.causal, impl.rsplit("_", 1)[1])
    ms = timer.median_ms(fn)
    peak, peak_src = matmul_peak
    tflops = cfg.flops() / (ms * 1e-3) / 1e12
    benchmark.extra_info.update(
        config=cfg.label, impl=impl, ms=ms, tflops=tflops, tflops_flash_attn=cfg.flops_flash_attn() / (ms * 1e-3) / 1e12,
        matmul_peak_tflops=peak, matmul_peak_source=peak_src, ratio_to_matmul=tflops / peak,
    )

    def run():
        fn()
        cp.cuda.get_current_stream().synchronize()

    benchmark.pedantic(run, setup=timer.flush, rounds=5, iterations=1, warmup_rounds=1)


BACKWARD_CASES = [pytest.param(c, impl, id=f"quick-{impl}-{c.dtype}-d{c.head_dim}-S{c.seqlen}-{'causal' if c.causal else 'full'}")
                  for c in bench.sweep(quick=True) for impl in bench.IMPLS_BWD + ("cuflash_fwd_bwd",)]


@pytest.mark.gpu
@pytest.mark.parametrize("cfg,impl", BACKWARD_CASES)
def test_backward(benchmark, timer, matmul_peak, cfg, impl):
    """Backward (FLOPs 2.5x the forward's) and forward + backward (3.5x), cuflash against SDPA
    flash's backward, on the quick configurations."""
    import cupy as cp

    if impl.startswith("torch") and not bench._have_torch_cuda():
        pytest.skip("torch with CUDA is not installed")
    q, k, v = bench.make_inputs(cfg)
    if impl == "torch_sdpa_flash_bwd":
        fn = bench.torch_backward_runner(q, k, v, cfg.causal, "flash")
        factor = 2.5
    else:
        bwd = bench.cuflash_backward_runner(q, k, v, cfg.causal)
        benchmark.extra_info["kernel"] = bench._backward_kernel_name(q, k, v, cfg.causal)
        if impl == "cuflash_bwd":
            fn, factor = bwd, 2.5
        else:
            fwd, _ = bench.cuflash_runner(q, k, v, cfg.causal)

            def fn():
                fwd()
                return bwd()

            factor = 3.5
        dq = fn()
        assert bool(cp.isfinite(dq).all()), f"non-finite dq on {cfg.label}"
    ms = timer.median_ms(fn)
    peak, peak_src = matmul_peak
    tflops = factor * cfg.flops() / (ms * 1e-3) / 1e12
    benchmark.extra_info.update(config=cfg.label, impl=impl, ms=ms, tflops=tflops, flops_factor=factor,
                                matmul_peak_tflops=peak, matmul_peak_source=peak_src, ratio_to_matmul=tflops / peak)

    def run():
        fn()
        cp.cuda.get_current_stream().synchronize()

    benchmark.pedantic(run, setup=timer.flush, rounds=5, iterations=1, warmup_rounds=1)


def test_bench_command_without_gpu_exits_2(monkeypatch, capsys):
    # runs everywhere (no gpu marker): on a machine without a device the command refuses to
    # produce numbers; simulate one so the test means the same on a GPU machine
    monkeypatch.setattr(bench, "gpu_available", lambda: (False, "no NVIDIA driver or GPU found"))
    assert bench.main(["--quick"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m cuflash bench: error: no NVIDIA driver or GPU found.") and "nothing was measured" in err


def test_sweep_shapes():
    quick = bench.sweep(quick=True)
    assert len(quick) == 16 and {c.head_dim for c in quick} == {64, 128} and {c.seqlen for c in quick} == {2048, 8192}
    full = bench.sweep(quick=False)
    assert len(full) == 72
    for c in full:
        assert c.batch * c.seqlen == bench.TOKENS and c.heads * c.head_dim == bench.HIDDEN
    bar = bench.Config(*bench.BAR_SHAPE)
    assert bench.baselines_for(bar, quick=True) == bench.IMPLS[1:]
    assert bench.baselines_for(quick[0], quick=True) == () or quick[0] == bar
    # FLOPs by DESIGN.md §6: non-causal 4*B*H*S^2*D for D = Dv (the flash-attn convention agrees)
    assert bar.flops() == bar.flops_flash_attn() == 4 * 2 * 16 * 8192**2 * 128


def test_table_and_ratios_from_records():
    recs = []
    for impl, tf in (("cuflash", 300.0), ("torch_sdpa_flash", 350.0)):
        recs.append(dict(impl=impl, dtype="bfloat16", head_dim=128, seqlen=8192, causal=False, ms=1.0, tflops=tf,
                         tflops_flash_attn=tf, pct_peak=tf / 7, max_error=1e-3 if impl == "cuflash" else None, error=None))
    bench.add_ratios(recs)
    assert recs[0]["ratio_torch_sdpa_flash"] == pytest.approx(300 / 350)
    table = bench.format_table(recs, 700.0, "test", "nowhere")
    assert "1.17x slower than torch_sdpa_flash" in table and "TFLOP/s" in table   # 300 against 350 TFLOP/s
    recs[1]["tflops"] = 300.0 * 1.004   # rounds alike: "as fast as", never "as fast than"
    del recs[0]["ratio_torch_sdpa_flash"]
    bench.add_ratios(recs)
    table = bench.format_table(recs, 700.0, "test", "nowhere")
    assert "as fast as torch_sdpa_flash" in table and "than" not in table
    assert bench._against("-", "torch_sdpa_flash") == "- (torch_sdpa_flash)"   # a missing time


def test_backward_ratios_pair_backward_with_backward():
    recs = []
    for impl, tf in (("cuflash", 300.0), ("torch_sdpa_flash", 350.0), ("cuflash_bwd", 100.0),
                     ("torch_sdpa_flash_bwd", 250.0)):
        recs.append(dict(impl=impl, dtype="bfloat16", head_dim=128, seqlen=8192, causal=True, ms=1.0, tflops=tf,
                         tflops_flash_attn=tf, pct_peak=tf / 7, max_error=None, error=None))
    bench.add_ratios(recs)
    assert recs[0]["ratio_torch_sdpa_flash"] == pytest.approx(300 / 350)
    assert "ratio_torch_sdpa_flash_bwd" not in recs[0]
    assert recs[2]["ratio_torch_sdpa_flash_bwd"] == pytest.approx(100 / 250)
    assert "ratio_torch_sdpa_flash" not in recs[2]
