"""The GPU path, tested as far as a machine without a GPU allows (DESIGN.md §5, issue 7).

Validation and refusals, the dispatcher's choice for simulated devices, precompile's variant
list, the check command's structure and oracle, the demo's GPU plumbing, and the DLPack/stream
plumbing against torch CPU tensors, NumPy and fakes. Nothing here pretends a kernel ran: where
the GPU path would start device work, the tests assert the clear "no GPU" error (NO_GPU).
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from support.options import check_attention

import cuflash
from cuflash.api import attention as api
from cuflash.kernels import catalog, precompile
from cuflash.reference import tolerance
from cuflash.runtime import device_call, interop
from cuflash.runtime.dtypes import bfloat16
from cuflash.tools import check, demo

REPO_ROOT = Path(__file__).resolve().parents[2]


def _gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


no_gpu = pytest.mark.skipif(_gpu(), reason="asserts the behaviour without a GPU")

#: interop.require_cuda's reasons on a machine without a usable GPU (CI has no driver at all)
NO_GPU = (r"(no NVIDIA driver or GPU found|no NVIDIA GPU found|no usable CUDA device|"
          r"the NVIDIA driver supports CUDA|needs CuPy|CuPy failed to import)")


class FakeCudaTensor:
    """Metadata of a CUDA tensor (DLPack device (2, id)); its data can never be reached."""

    def __init__(self, shape, dtype="float16", device=(2, 0), strides=None):
        self.shape = tuple(shape)
        self.dtype = dtype
        self._device = device
        self._strides = strides

    def __dlpack__(self, stream=None):
        raise AssertionError("the data of a fake tensor must not be requested")

    def __dlpack_device__(self):
        return self._device

    def stride(self):
        if self._strides is not None:
            return self._strides
        out, acc = [], 1
        for n in reversed(self.shape):
            out.append(acc)
            acc *= max(n, 1)
        return tuple(reversed(out))


def from_dlpack(x):  # the fake framework's importer (found by the exporter lookup, never called)
    raise AssertionError("no result can come back without a GPU")


# ------------------------------------------------------------------------------------ refusals


@no_gpu
def test_cuda_dlpack_input_is_validated_then_reaches_the_gpu_path():
    q, k, v = FakeCudaTensor((2, 4, 5, 64)), FakeCudaTensor((2, 2, 7, 64)), FakeCudaTensor((2, 2, 7, 64))
    with pytest.raises(ValueError, match=r"k.shape\[-1\]=32 must equal q.shape\[-1\]=64"):
        cuflash.attention(q, FakeCudaTensor((2, 2, 7, 32)), v)
    with pytest.raises(RuntimeError, match=rf"cuflash.attention: {NO_GPU}"):
        cuflash.attention(q, k, v, causal=True)
    with pytest.raises(RuntimeError, match=NO_GPU):
        cuflash.attention(q, k, v, backend="cuda", return_lse=True)


def test_float64_cuda_input_is_not_implemented():
    q = FakeCudaTensor((1, 2, 3, 8), dtype="float64")
    with pytest.raises(NotImplementedError, match="float64 runs on the NumPy path only"):
        cuflash.attention(q, q, q)


def test_torch_cpu_tensors_run_the_numpy_path_and_come_back_as_tensors(rng):
    torch = pytest.importorskip("torch")
    q, k, v = (rng.standard_normal((1, 2, 9, 8)).astype(np.float32) for _ in range(3))
    tq, tk, tv = (torch.from_numpy(x.copy()) for x in (q, k, v))
    out, lse = cuflash.attention(tq, tk, tv, causal=True, return_lse=True)
    assert isinstance(out, torch.Tensor) and isinstance(lse, torch.Tensor)
    o64, l64 = cuflash.reference.naive_attention(q, k, v, causal=True, return_lse=True)
    np.testing.assert_allclose(out.numpy(), o64, atol=2e-6)
    np.testing.assert_allclose(lse.numpy(), l64, atol=2e-6)
    y = cuflash.softmax(tq)
    assert isinstance(y, torch.Tensor)
    np.testing.assert_allclose(y.numpy(), cuflash.reference.softmax(q), atol=1e-6)


def test_arrays_on_different_devices_are_refused():
    with pytest.raises(ValueError, match=r"k is on device \(2, 1\) but q is on device \(2, 0\)"):
        cuflash.attention(FakeCudaTensor((1, 2, 3, 8)), FakeCudaTensor((1, 2, 3, 8), device=(2, 1)),
                          FakeCudaTensor((1, 2, 3, 8)))


@no_gpu
def test_softmax_on_a_cuda_tensor_without_gpu_is_a_clear_error():
    with pytest.raises(RuntimeError, match=rf"cuflash.softmax: {NO_GPU}"):
        cuflash.softmax(FakeCudaTensor((4, 9), dtype="float32"))
    with pytest.raises(TypeError, match=r"x.dtype must be .* got int8"):
        cuflash.softmax(FakeCudaTensor((4, 9), dtype="int8"))
    with pytest.raises(ValueError, match=r"backend='numpy' computes on the host and takes NumPy arrays; got device arrays"):
        cuflash.softmax(FakeCudaTensor((4, 9), dtype="float32"), backend="numpy")


def test_jax_out_is_refused_before_device_work():
    class FakeJax(FakeCudaTensor):
        pass

    FakeJax.__module__ = "jax._src.array"
    q = FakeCudaTensor((1, 2, 3, 8))
    with pytest.raises(ValueError, match="JAX arrays are immutable"):
        device_call.DeviceCall("cuflash.attention", None, q, out=FakeJax((1, 2, 3, 8)))


def test_unknown_dlpack_producer_without_from_dlpack_is_refused():
    class Unknown(FakeCudaTensor):
        pass

    Unknown.__module__ = "json.decoder"  # a package without from_dlpack
    with pytest.raises(TypeError, match="cannot hand a result back"):
        device_call.DeviceCall("cuflash.attention", None, Unknown((1, 2, 3, 8)))


# ------------------------------------------------------------------------------ plumbing


def test_framework_of_and_exporters():
    torch = pytest.importorskip("torch")
    assert interop.framework_of(np.zeros(2)) == "numpy"
    assert interop.framework_of(torch.zeros(2)) == "torch"
    assert interop.framework_of(FakeCudaTensor((2,))) == "dlpack"
    back = interop.exporter(torch.zeros(2), "f")
    for dt, tdt in ((bfloat16, torch.bfloat16), (np.float16, torch.float16), (np.float32, torch.float32)):
        a = np.arange(6).astype(dt)
        t = back(a)
        assert t.dtype == tdt and t.data_ptr() == a.ctypes.data   # zero-copy
    assert interop.exporter(np.zeros(2), "f")(a) is a


def test_dlpack_carries_the_strides_of_a_cache_view():
    """The zero-copy import the GPU path relies on: a K/V view of a longer cache crosses DLPack
    with its strides and offset (NumPy is the consumer here; CuPy does the same on a GPU)."""
    torch = pytest.importorskip("torch")
    cache = torch.randn(2, 3, 50, 16)
    k = cache[:, :, 5:37]
    info = interop.describe(k, "k")
    assert info.strides == (3 * 50 * 16, 50 * 16, 16, 1) and info.shape == (2, 3, 32, 16)
    a = np.from_dlpack(k)
    assert a.__array_interface__["data"][0] == k.data_ptr()
    assert tuple(s // 4 for s in a.strides) == info.strides
    assert device_call.span_bytes(a) == 4 * (1 + 1 * 2400 + 2 * 800 + 31 * 16 + 15)


def test_overlap_check_on_device_pointers():
    def arr(ptr, shape, strides, item=2):
        return types.SimpleNamespace(data=types.SimpleNamespace(ptr=ptr), shape=shape,
                                     strides=tuple(s * item for s in strides), size=int(np.prod(shape)),
                                     dtype=np.dtype(np.float16))

    q = arr(1000, (2, 8), (8, 1))
    device_call.check_no_overlap("f", arr(1032, (2, 8), (8, 1)), {"q": q})  # adjacent: fine
    with pytest.raises(ValueError, match="out overlaps q in device memory"):
        device_call.check_no_overlap("f", arr(1030, (2, 8), (8, 1)), {"q": q})


# ------------------------------------------------------------------ dispatcher's choice


@pytest.mark.parametrize("arch, dtype, d, prefix", [
    (90, np.float16, 64, "f16_d64"),
    (80, bfloat16, 40, "bf16_d"),
    (75, np.float32, 256, "f32_d256_"),
    (90, np.float32, 192, "f32_d256_"),
])
def test_explain_names_the_variant_for_a_simulated_device(arch, dtype, d, prefix):
    from cuflash.kernels import dispatch
    from cuflash.runtime import plan

    q = np.zeros((2, 4, 100, d), dtype)
    info = api.explain(q, q, q, backend="sim", arch=f"sm_{arch}")
    problem = check_attention(q, q, q)
    tier = dispatch.forward_tier(problem, arch, (q, q, q))
    expected = tier.choose_variant(problem.dtype, d, d, arch)
    assert info["backend"] == "sim" and info["arch"] == arch and info["tier"] == tier.__name__.rsplit(".", 1)[-1]
    assert info["variant"] == expected.name and info["variant"].startswith(prefix)
    assert info["entry"] == expected.entry
    assert info["smem_bytes"] <= plan.SMEM_OPT_IN_LIMIT[arch]
    assert info["blocks"] == -(-100 // info["block_m"]) * 4 * 2
    assert expected.entry in (info["choice"] or expected.entry)
    # a CUDA tensor on such a device gets the same choice
    fake = FakeCudaTensor((2, 4, 100, d), dtype=np.dtype(dtype).name)
    assert api.explain(fake, fake, fake, arch=arch)["variant"] == expected.name


def test_explain_numpy_and_errors():
    q = np.zeros((1, 2, 3, 8), np.float32)
    assert api.explain(q, q, q)["backend"] == "numpy"
    assert "NumPy path" in api.explain(q, q, q)["choice"]
    # an explicit arch asks what a device would run: planned as the simulator plans it
    h = np.zeros((1, 2, 3, 64), np.float16)
    as_device = api.explain(h, h, h, arch=90)
    assert as_device["backend"] == "sim" and as_device["arch"] == 90
    assert as_device["choice"] == api.explain(h, h, h, backend="sim", arch=90)["choice"]
    with pytest.raises(ValueError, match="cuflash.explain: backend='cuda' needs GPU arrays"):
        api.explain(q, q, q, backend="cuda")


# ----------------------------------------------------------------------------- precompile


def test_precompile_variant_lists():
    everything = precompile.variants_to_compile(90)
    assert everything == list(catalog.variants_for_arch(90))
    f16_64 = precompile.variants_to_compile(90, dtypes="float16", head_dims=[40, 64])
    names = {v.name for v in f16_64}
    # (the dropout mask kernel has no dtype axis: kept, as softmax's head-dim-free variants are)
    assert any(n.startswith("f16_d64_") for n in names) and all(getattr(v, "dtype", "f16") == "f16" for v in f16_64)
    assert not any(getattr(v, "head_dim_max", 64) != 64 for v in f16_64)
    assert {"f16_warp", "f16_block"} <= names  # softmax has no head dim: kept
    assert any(v.name.startswith("bf16_d256_")
               for v in precompile.variants_to_compile(80, dtypes=[bfloat16], head_dims=200))
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        precompile.variants_to_compile(90, dtypes="float64")
    with pytest.raises(ValueError, match=r"head_dims must be ints in \[1, 256\]"):
        precompile.variants_to_compile(90, head_dims=[300])


@no_gpu
def test_precompile_without_gpu_is_a_clear_error():
    with pytest.raises(RuntimeError, match=rf"cuflash.precompile: {NO_GPU}"):
        precompile.precompile()


def test_precompile_compiles_each_variant_once_with_progress(monkeypatch, capsys):
    """With a simulated device: the variants of its arch go to the (memoized) module cache."""
    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(
        Device=lambda i=0: types.SimpleNamespace(id=i, compute_capability="80")))
    monkeypatch.setattr(interop, "require_cuda", lambda func: fake_cupy)
    compiled = []
    from cuflash.runtime import cuda_runner

    monkeypatch.setattr(cuda_runner, "get_module", lambda v, dev: compiled.append((v, dev)))
    monkeypatch.setitem(sys.modules, "tqdm", None)  # the plain fallback
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    names = precompile.precompile(dtypes=["f32"], progress=True)
    assert names == [v.entry for v in precompile.variants_to_compile(80, dtypes=["f32"])]
    assert [dev for _, dev in compiled] == [0] * len(names)
    err = capsys.readouterr().err
    assert f"[{len(names)}/{len(names)}]" in err


# ------------------------------------------------------------------------------- the check


@no_gpu
def test_check_without_gpu_exits_2_and_reports_nothing():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "cuflash", "check"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "python -m cuflash check: error: nothing was checked: " in done.stderr
    assert done.stderr.count("cuflash check") == 1, done.stderr  # the prefix is said once
    assert "PASS" not in done.stdout + done.stderr and "passed" not in done.stdout


def test_check_rejects_unknown_sections(capsys):
    assert check.main(["--sections", "grid,warp"]) == 2
    assert "unknown section" in capsys.readouterr().err


def test_check_lists_check_command():
    from cuflash import __main__

    assert "check" in __main__.COMMANDS and "check" in __main__._usage()


def test_check_oracle_matches_the_reference(rng):
    assert check.tolerance is tolerance  # the GPU check applies the package's rule, as the tests do
    from cuflash.reference import naive_attention

    q = rng.standard_normal((2, 6, 37, 40))
    k = rng.standard_normal((2, 3, 29, 40))
    v = rng.standard_normal((2, 3, 29, 24))
    for causal, window in ((False, (-1, -1)), (True, (-1, -1)), (False, (4, 2)), (True, (7, -1))):
        ref, ref_lse = naive_attention(q, k, v, causal=causal, window_size=window, return_lse=True)
        out, lse = tolerance.attention_rows(q, k, v, causal=causal, window_size=window)
        np.testing.assert_allclose(out, ref, atol=1e-12)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
        rows = np.array([0, 5, 36])
        sub, _ = tolerance.attention_rows(q, k, v, causal=causal, window_size=window, rows=rows)
        np.testing.assert_allclose(sub, ref[:, :, rows], atol=1e-12)


def test_check_tolerance_rule_accepts_the_numpy_path_and_catches_a_wrong_mask(rng):
    q, k, v = (rng.standard_normal((1, 2, 50, 64)).astype(np.float16) for _ in range(3))
    good = cuflash.attention(q, k, v, causal=True)
    ok, msg, _ = tolerance.compare(good, q, k, v, causal=True)
    assert ok, msg
    wrong = cuflash.attention(q, k, v, causal=False)
    ok, msg, _ = tolerance.compare(wrong, q, k, v, causal=True)
    assert not ok and "max error" in msg
    nan = good.copy()
    nan[0, 0, 3, 1] = np.nan
    assert not tolerance.compare(nan, q, k, v, causal=True)[0]
    assert tolerance.bound(np.float32, 0.0) == 2.0**-18


def test_check_grid_covers_the_issue(rng):
    cases = check.grid_cases()
    dims = {c["D"] for c in cases}
    assert {32, 40, 64, 72, 96, 128, 160, 192, 256} <= dims
    assert {c["dtype"] for c in cases} == {"f16", "bf16", "f32"}
    assert {c["layout"] for c in cases} == {"bhsd", "bshd"}
    assert {c["view"] for c in cases} == {"contiguous", "cache", "padded", "broadcast"}
    assert any(c["Hq"] != c["Hk"] for c in cases) and any(c["Hk"] == 1 and c["Hq"] > 1 for c in cases)
    assert any(c["causal"] and c["Sq"] > c["Sk"] for c in cases)  # empty rows
    assert any(c["Sk"] == 0 for c in cases) and any(c["logits"] > 4 for c in cases)
    assert any(c["Sq"] % 2 and c["Sk"] % 2 for c in cases)
    for c in cases:  # every case's host side is well formed and the reference is NaN-free
        q, k, v = check._host_inputs(dict(c, Sq=min(c["Sq"], 8), Sk=min(c["Sk"], 8)), rng)
        out, _ = tolerance.attention_rows(q, k, v, causal=c["causal"], window_size=c["window"])
        assert not np.isnan(out).any()


def test_check_sections_are_isolated_and_the_table_comes_last(monkeypatch, capsys):
    def boom(clock, log):
        raise RuntimeError("kernel exploded")

    def fine(clock, log):
        return "all good"

    def skip(clock, log):
        raise check.Skip("JAX is not installed")

    monkeypatch.setattr(check, "_FUNCS", {"device": fine, "grid": boom, "jax": skip})
    monkeypatch.setattr(check, "gpu_status", lambda: (True, "device 0, sm_90 (simulated)"))
    rc = check.main(["--sections", "device,grid,jax", "--budget", "30"])
    out = capsys.readouterr().out.rstrip().splitlines()
    assert rc == 1
    assert out[-1].startswith("1 passed, 1 failed, 1 skipped")
    table = "\n".join(out[-5:])
    assert "grid" in table and "FAIL" in table and "kernel exploded" in table and "SKIP" in table


# ----------------------------------------------------------------------------------- demo


def test_demo_resolves_the_gpu_path(monkeypatch):
    monkeypatch.delenv("CUFLASH_BACKEND", raising=False)
    assert demo.resolve_backend("auto", gpu=True) == "cuda"
    assert demo.resolve_backend("cuda", gpu=True) == "cuda"
    assert demo.resolve_backend("numpy", gpu=True) == "numpy"
    assert demo.resolve_backend("auto", gpu=False) == "numpy"
    monkeypatch.setenv("CUFLASH_BACKEND", "numpy")
    assert demo.resolve_backend("auto", gpu=True) == "numpy"


def test_demo_gpu_path_plumbing(monkeypatch):
    """With a (simulated) GPU the demo hands every layer to the CUDA path and says so."""
    monkeypatch.delenv("CUFLASH_BACKEND", raising=False)
    monkeypatch.setattr(demo, "gpu_available", lambda: True)
    seen = []

    def fake_gpu_attention(q, k, v, *, backend, causal=True):
        seen.append(backend)
        return cuflash.attention(q, k, v, causal=causal, backend="numpy")

    monkeypatch.setattr(demo, "run_attention", fake_gpu_attention)
    lines = []
    result = demo.run_demo(use_embedded=True, out=lines.append)
    assert result["backend"] == "cuda" and set(seen) == {"cuda"}
    assert any("GPU path" in line and "cupy.asarray" in line for line in lines)


@no_gpu
def test_demo_without_gpu(monkeypatch, rng):
    monkeypatch.delenv("CUFLASH_BACKEND", raising=False)
    assert demo.gpu_available() is False
    q = rng.standard_normal((1, 2, 4, 8)).astype(np.float32)
    with pytest.raises(RuntimeError, match=rf"cuflash demo: {NO_GPU}"):
        demo.run_attention(q, q, q, backend="cuda")
    with pytest.raises(ValueError, match="cuda"):
        demo.run_demo(backend="cuda", use_embedded=True, out=lambda line: None)


def _fake_cupy(monkeypatch, *, count_error=None, driver=0, runtime=12090, count=1):
    """A stand-in ``cupy`` module whose runtime answers as a given machine would."""
    def get_device_count():
        if count_error is not None:
            raise count_error
        return count

    rt = types.SimpleNamespace(getDeviceCount=get_device_count, driverGetVersion=lambda: driver,
                               runtimeGetVersion=lambda: runtime)
    fake = types.ModuleType("cupy")
    fake.cuda = types.SimpleNamespace(runtime=rt)
    monkeypatch.setitem(sys.modules, "cupy", fake)


class _CUDARuntimeError(RuntimeError):
    pass


def test_no_driver_is_said_in_words(monkeypatch):
    _fake_cupy(monkeypatch, count_error=_CUDARuntimeError("cudaErrorInsufficientDriver: CUDA driver version is "
                                                          "insufficient for CUDA runtime version"), driver=0)
    with pytest.raises(RuntimeError, match=r"^cuflash.attention: no NVIDIA driver or GPU found; the CUDA kernels "
                                           r"cannot run here") as info:
        interop.require_cuda("cuflash.attention")
    assert "cudaError" not in str(info.value)


def test_old_driver_is_told_apart_from_no_driver(monkeypatch):
    _fake_cupy(monkeypatch, count_error=_CUDARuntimeError("cudaErrorInsufficientDriver"), driver=11080, runtime=12090)
    with pytest.raises(RuntimeError, match=r"the NVIDIA driver supports CUDA 11.8 but CuPy was built for CUDA 12.9"):
        interop.require_cuda("cuflash check")


def test_zero_devices_and_other_errors(monkeypatch):
    _fake_cupy(monkeypatch, count=0)
    with pytest.raises(RuntimeError, match=r"cuflash bench: no NVIDIA GPU found \(the driver reports 0 CUDA devices\)"):
        interop.require_cuda("cuflash bench")
    _fake_cupy(monkeypatch, count_error=_CUDARuntimeError("cudaErrorUnknown"), driver=12090)
    with pytest.raises(RuntimeError, match=r"no usable CUDA device \(_CUDARuntimeError: cudaErrorUnknown\)"):
        interop.require_cuda("cuflash bench")


def test_bench_and_check_say_their_name_once(monkeypatch, capsys):
    from cuflash.tools import bench

    _fake_cupy(monkeypatch, count_error=_CUDARuntimeError("cudaErrorInsufficientDriver"), driver=0)
    assert bench.main(["--quick"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m cuflash bench: error: no NVIDIA driver or GPU found") and err.count("cuflash bench") == 1
    assert check.main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m cuflash check: error: nothing was checked: no NVIDIA driver or GPU found")
    assert err.count("cuflash check") == 1


def test_check_edge_and_nonfinite_cases_through_a_numpy_stand_in(monkeypatch):
    """The check's grid logic (placement in views, poisoned out=, the oracle comparison, the
    non-finite row rule) run end to end with NumPy standing in for CuPy, so the cases and their
    verdicts are right before they ever meet a GPU. (The kernels themselves are not run here.)"""
    fake = types.ModuleType("cupy")
    fake.ndarray, fake.full, fake.broadcast_to = np.ndarray, np.full, np.broadcast_to
    fake.asarray = np.asarray
    fake.asnumpy = np.asarray
    monkeypatch.setitem(sys.modules, "cupy", fake)
    cases = [c for c in check.grid_cases() if c.get("nonfinite") or c["window"][1] == 2**40 or c["Sq"] == 146]
    assert {c.get("nonfinite") for c in cases} >= {"q", "k", "v"} and len(cases) >= 5
    for c in cases:
        ok, msg = check.run_case(c, np.random.default_rng(7))
        assert ok, (check._case_name(c), msg)
        if c.get("nonfinite"):
            assert "non-finite rows, as the oracle" in msg and not msg.startswith("0 ")
    c = dict(cases[-1])
    real = cuflash.attention

    def hides_nan(*args, **kwargs):  # a backend that zeroes NaN rows must fail the check
        o, lse = real(*args, **kwargs)
        o[np.isnan(o.astype(np.float32))] = 0
        return o, lse

    monkeypatch.setattr(cuflash, "attention", hides_nan)
    ok, msg = check.run_case(c, np.random.default_rng(7))
    assert not ok and "non-finite rows differ" in msg


def test_check_backward_section_through_a_numpy_stand_in(monkeypatch):
    """The check's backward section (its cases, the float64 bound, the deterministic rerun)
    with NumPy standing in for CuPy: the verdict logic is right before it meets a GPU. (The
    kernels themselves are not run here; with NumPy arrays the NumPy backward answers.)"""
    fake = types.ModuleType("cupy")
    fake.asarray = fake.asnumpy = np.asarray
    monkeypatch.setitem(sys.modules, "cupy", fake)
    lines = []
    note = check.section_backward(check._Clock(600), lines.append)
    assert note.startswith("6 cases (head dims to 256") and len(lines) == 7, (note, lines)
    assert "attention_varlen" in lines[-1]
    real = cuflash.attention_backward
    runs = []

    def flips_bits(*args, **kwargs):  # a deterministic mode that is not must fail the check
        grads = real(*args, **kwargs)
        if kwargs.get("deterministic"):
            runs.append(1)
            if len(runs) == 2:
                dq = grads[0].copy()
                dq.view(np.uint16).flat[0] ^= 1   # one bit of one element
                grads = (dq,) + tuple(grads[1:])
        return grads

    monkeypatch.setattr(cuflash, "attention_backward", flips_bits)
    with pytest.raises(AssertionError, match="different bits on a second run"):
        check.section_backward(check._Clock(600), lines.append)


def test_check_modifiers_section_through_a_numpy_stand_in(monkeypatch):
    """The check's modifiers section (forward, backward with dbias and dsinks, the rule) with NumPy
    standing in for CuPy, at a small shape: the verdict logic works, and a backend whose d sinks
    has the wrong sign fails it."""
    fake = types.ModuleType("cupy")
    fake.asarray = fake.asnumpy = np.asarray
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(check, "MODIFIERS_SHAPE", (1, 4, 2, 37, 300, 32))
    lines = []
    note = check.section_modifiers(check._Clock(600), lines.append)
    assert "within the rule" in note and len(lines) == 6, (note, lines)
    real = cuflash.attention_backward
    calls = []

    def flips_dsinks(*args, **kwargs):
        grads = real(*args, **kwargs)
        calls.append(1)
        return grads[:-1] + (-grads[-1],) if len(calls) == 3 else grads

    monkeypatch.setattr(cuflash, "attention_backward", flips_dsinks)
    with pytest.raises(AssertionError, match="modifiers dsinks"):
        check.section_modifiers(check._Clock(600), lines.append)


def test_check_rule_helper_bounds_the_gpu_result_by_the_numpy_paths_error():
    """check._held_to_rule, which every GPU section applies: at most twice the NumPy path's error
    against float64 plus the floor; beyond it, or non-finite, is a failure naming the result."""
    exact = np.linspace(-1.0, 1.0, 50)
    numpy_ref = exact + 1e-3
    floor = check.tolerance.floor_for(np.float16)
    assert check._held_to_rule("x", exact + 2e-3, numpy_ref, exact, np.float16) <= 1.0
    with pytest.raises(AssertionError, match="x: error"):
        check._held_to_rule("x", exact + 2e-3 + 2 * floor, numpy_ref, exact, np.float16)
    bad = exact.copy()
    bad[3] = np.nan
    with pytest.raises(AssertionError, match="x: error"):
        check._held_to_rule("x", bad, numpy_ref, exact, np.float16)


@pytest.mark.parametrize("cc", ["80", "100", "120"])
def test_check_hopper_section_skips_off_compute_capability_9_0(monkeypatch, cc):
    """The sm_90a probes run only where their cubin loads (compute capability 9.0); elsewhere the
    section is skipped with the reason, never reported as passed."""

    device = types.SimpleNamespace(compute_capability=cc)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(Device=lambda: device)))
    with pytest.raises(check.Skip, match="9.0"):
        check.section_hopper(check._Clock(60), lambda s: None)
