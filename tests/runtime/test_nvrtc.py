"""The compile-and-load path without a GPU: NVRTC 12.x and 13.x side by side, which one compiles
what, the cubin disk cache under ``CUPY_CACHE_DIR``, ``get_module`` loading cubins (a stand-in
CuPy records what it is asked to load), and the dispatcher's rule for ``sm_90a`` tiers."""

from __future__ import annotations

import dataclasses
import os
import sys
import types
from typing import ClassVar

import numpy as np
import pytest
from support.options import check_attention

from cuflash.kernels import dispatch
from cuflash.kernels.softmax import SoftmaxVariant
from cuflash.runtime import cubin, cuda_runner, nvrtc, validation, variants


def _compiler(major: int) -> nvrtc.Nvrtc:
    if nvrtc.find(major) is None:
        pytest.skip(f"NVRTC {major}.x is not installed: pip install '{nvrtc.WHEELS[major]}' (the test extra installs it)")
    return nvrtc.load(major)


PROBE_SRC = r"""
extern "C" __global__ void __launch_bounds__(128, 1) cuflash_probe_sm90a_x(float* out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
    out[threadIdx.x] = 1.0f;
}
"""


@dataclasses.dataclass(frozen=True)
class HopperProbe(variants.Variant):
    """A stand-in Hopper-tier variant (its source is handed in by the tests)."""

    family: ClassVar[str] = "probe_sm90a"
    source: ClassVar[str] = "probe_sm90a.cu"
    target_arch: ClassVar[str | None] = "90a"
    tag: str = "x"


@dataclasses.dataclass(frozen=True)
class Cuda13Probe(HopperProbe):
    min_nvrtc_major: ClassVar[int] = 13


# ------------------------------------------------------------------------------------ the NVRTCs


@pytest.mark.parametrize("major", nvrtc.MAJORS)
def test_each_nvrtc_loads_and_reports_its_version(major):
    lib = _compiler(major)
    assert lib.major == major and lib.version[1] >= 0 and 90 in lib.supported_archs
    assert lib in cuda_runner.available_nvrtcs()
    cubin_, log = cuda_runner.nvrtc_compile(PROBE_SRC, 90, nvrtc=major)
    assert cubin.cubin_arch(cubin_) == "sm_90"


def test_both_nvrtcs_are_found_apart():
    """The test extra installs both; their libraries are different files, loaded side by side."""
    a, b = _compiler(12), _compiler(13)
    assert a.path != b.path and a.version < b.version
    assert cuda_runner.nvrtc_majors() == (12, 13)


def test_a_missing_nvrtc_names_its_wheel(monkeypatch):
    monkeypatch.setattr(nvrtc, "_loaded", {})
    monkeypatch.setattr(nvrtc, "find", lambda major: None)
    with pytest.raises(RuntimeError, match=r"NVRTC 13\.x .*not found; install 'nvidia-cuda-nvrtc==13\.\*'"):
        nvrtc.load(13)


@pytest.mark.parametrize("bad,exc", [(11, ValueError), ("13", TypeError), (True, TypeError)])
def test_nvrtc_argument_is_checked(bad, exc):
    with pytest.raises(exc, match="nvrtc"):
        cuda_runner.nvrtc_compile(PROBE_SRC, 90, nvrtc=bad)


def test_compile_errors_carry_the_log_and_the_version():
    lib = cuda_runner.default_nvrtc()
    with pytest.raises(RuntimeError, match=rf"NVRTC {lib.version_string} failed for sm_80:\n.*undefined"):
        cuda_runner.nvrtc_compile('extern "C" __global__ void k() { undefined_thing(); }', 80)


def test_runtime_options_are_cupys(monkeypatch):
    """-ftz=true and the rest of what RawModule(code=...) added, then the explicit -arch."""
    seen = []
    lib = cuda_runner.default_nvrtc()
    real = lib.compile
    monkeypatch.setattr(lib, "compile", lambda src, opts, name: seen.append(tuple(opts)) or real(src, opts, name=name))
    cuda_runner.nvrtc_compile(PROBE_SRC, "90a", nvrtc=lib)
    assert seen[0] == cuda_runner.nvrtc_options(lib) + ("-ftz=true", "--device-as-default-execution-space",
                                                        "-std=c++17", "-arch=sm_90a")


def test_each_nvrtc_gets_headers_of_its_major_when_there_are_some():
    for lib in cuda_runner.available_nvrtcs():
        inc = cuda_runner.cuda_include_dir(lib.major)
        assert os.path.isfile(os.path.join(inc, "cuda_fp16.h"))
        majors = {cuda_runner.headers_major(c) for c in cuda_runner._include_candidates()
                  if os.path.isfile(os.path.join(c, "cuda_fp16.h"))}
        if lib.major in majors:
            assert cuda_runner.headers_major(inc) == lib.major


def test_default_nvrtc_follows_cupy_then_the_environment(monkeypatch):
    _compiler(12), _compiler(13)
    monkeypatch.delenv("CUFLASH_NVRTC", raising=False)
    monkeypatch.setattr(cuda_runner, "_cupy_cuda_major", lambda: 12)
    assert cuda_runner.default_nvrtc().major == 12
    monkeypatch.setattr(cuda_runner, "_cupy_cuda_major", lambda: 13)
    assert cuda_runner.default_nvrtc().major == 13
    monkeypatch.setattr(cuda_runner, "_cupy_cuda_major", lambda: None)
    assert cuda_runner.default_nvrtc().major == 13   # the newest
    monkeypatch.setenv("CUFLASH_NVRTC", "12")
    assert cuda_runner.default_nvrtc().major == 12
    monkeypatch.setenv("CUFLASH_NVRTC", "11")
    with pytest.raises(ValueError, match="CUFLASH_NVRTC='11' must be one of 12, 13"):
        cuda_runner.default_nvrtc()


def test_a_cuda13_only_variant_gets_nvrtc13_or_says_what_to_install(monkeypatch):
    _compiler(12), _compiler(13)
    monkeypatch.setenv("CUFLASH_NVRTC", "12")
    assert cuda_runner.nvrtc_for(HopperProbe()).major == 12
    assert cuda_runner.nvrtc_for(Cuda13Probe()).major == 13
    monkeypatch.setattr(nvrtc, "installed_majors", lambda: (12,))
    with pytest.raises(RuntimeError, match=r"CUDA-13-only .*install 'nvidia-cuda-nvrtc==13\.\*'"):
        cuda_runner.nvrtc_for(Cuda13Probe())


def test_device_arch_falls_back_within_the_major():
    lib = _compiler(12)
    assert cuda_runner.device_arch(90, lib) == 90
    assert cuda_runner.device_arch(88, lib) == 87   # 12.9 knows 80, 86, 87 of major 8, not 88
    with pytest.raises(RuntimeError, match="cannot compile for compute capability 14.0"):
        cuda_runner.device_arch(140, lib)


# ------------------------------------------------------------------------------ the disk cache


def test_cubins_are_cached_under_cupys_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    real = cuda_runner.nvrtc_compile
    monkeypatch.setattr(cuda_runner, "nvrtc_compile", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    path = cuda_runner.cached_cubin(PROBE_SRC, "90a", stem="probe")
    assert os.path.dirname(path) == str(tmp_path / "cache") and os.path.basename(path).startswith("probe_")
    assert cubin.cubin_arch(open(path, "rb").read()) == "sm_90a"
    assert cuda_runner.cached_cubin(PROBE_SRC, "90a", stem="probe") == path and calls == ["sm_90a"]
    other = cuda_runner.cached_cubin(PROBE_SRC, 90, stem="probe")   # another arch: another key
    assert other != path and calls == ["sm_90a", "sm_90"]
    with open(path, "wb") as f:   # a torn file is compiled again
        f.write(b"\x7fELF\x02")
    assert cuda_runner.cached_cubin(PROBE_SRC, "90a", stem="probe") == path and len(calls) == 3
    assert [p for p in os.listdir(tmp_path / "cache") if not p.endswith(".cubin")] == []   # no temp files left


def test_the_cache_key_holds_source_options_version_and_arch():
    base = ("src", "90a", ("-ftz=true",), (12, 9))
    key = cuda_runner.cubin_cache_key(*base)
    for i, other in enumerate(("src2", 90, ("-ftz=false",), (13, 5))):
        changed = list(base)
        changed[i] = other
        assert cuda_runner.cubin_cache_key(*changed) != key


def test_the_default_cache_dir_is_cupys(monkeypatch):
    monkeypatch.delenv("CUPY_CACHE_DIR", raising=False)
    assert cuda_runner.cache_dir() == os.path.expanduser("~/.cupy/kernel_cache")


# ------------------------------------------------------------------------- get_module, no GPU


@pytest.fixture
def fake_cupy(monkeypatch, tmp_path):
    """A stand-in CuPy whose device 0 has the compute capability ``fake_cupy.cc`` and whose
    ``RawModule`` records the cubin path it loads."""
    loaded = []

    class Device:
        def __init__(self, i=0):
            self.id = i
            self.compute_capability = str(ns.cc)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class RawModule:
        def __init__(self, code=None, *, path=None, options=()):
            assert code is None and path is not None
            self.path = path

        def compile(self):
            loaded.append(self.path)

    ns = types.SimpleNamespace(cuda=types.SimpleNamespace(Device=Device), RawModule=RawModule, cc=80, loaded=loaded)
    monkeypatch.setitem(sys.modules, "cupy", ns)
    monkeypatch.setattr(cuda_runner, "_modules", {})
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "cache"))
    return ns


def test_get_module_loads_a_cubin_for_the_devices_arch(fake_cupy):
    v = SoftmaxVariant("f32", "warp")
    mod = cuda_runner.get_module(v, 0)
    assert fake_cupy.loaded == [mod.path] and mod.path.startswith(os.environ["CUPY_CACHE_DIR"])
    image = open(mod.path, "rb").read()
    assert cubin.cubin_arch(image) == "sm_80" and v.entry.encode() in image
    assert cuda_runner.get_module(v, 0) is mod and len(fake_cupy.loaded) == 1   # memoized


def test_get_module_compiles_a_hopper_variant_for_sm90a(fake_cupy, monkeypatch):
    monkeypatch.setattr(cuda_runner, "build_source", lambda v: PROBE_SRC)
    fake_cupy.cc = 90
    mod = cuda_runner.get_module(HopperProbe(), 0)
    assert cubin.cubin_arch(open(mod.path, "rb").read()) == "sm_90a"


@pytest.mark.parametrize("cc", [100, 120, 80])
def test_get_module_refuses_a_hopper_variant_off_cc90(fake_cupy, monkeypatch, cc):
    monkeypatch.setattr(cuda_runner, "build_source", lambda v: PROBE_SRC)
    fake_cupy.cc = cc
    with pytest.raises(ValueError, match=r"cuflash_probe_sm90a_x cannot load on this device: sm_90a .* 9\.0 only"):
        cuda_runner.get_module(HopperProbe(), 0)
    assert fake_cupy.loaded == []


def test_an_sm90a_cubin_is_refused_off_cc90():
    image, _ = cuda_runner.nvrtc_compile(PROBE_SRC, "90a")
    cuda_runner.check_loadable(image, 90)
    with pytest.raises(ValueError, match=r"10\.0 \(Blackwell\)"):
        cuda_runner.check_loadable(image, 100)
    plain, _ = cuda_runner.nvrtc_compile(PROBE_SRC, 80)
    cuda_runner.check_loadable(plain, 86)
    with pytest.raises(ValueError, match="sm_80 code runs on compute capability 8.x"):
        cuda_runner.check_loadable(plain, 90)


def test_variants_say_where_they_run():
    assert SoftmaxVariant("f32", "warp").unsupported_device_reason(120) is None
    assert HopperProbe().unsupported_device_reason(90) is None
    assert "Blackwell" in HopperProbe().unsupported_device_reason(100)


# ------------------------------------------------------------------------- the dispatcher's rule


def _problem():
    q = np.zeros((1, 2, 128, 64), np.float16)
    return check_attention(q, q, q, func="test"), (q, q, q)


def _fake_hopper_tier(**attrs):
    """A stand-in tier module (a module object, as the dispatcher's tiers are)."""
    v = types.SimpleNamespace(describe=lambda: "cuflash_probe_sm90a_x (fake)")
    mod = types.ModuleType("fake_hopper_tier")
    mod.TARGET_ARCH = "90a"
    mod.unsupported_reason = lambda p, arch, arrays=None: None
    mod.variant_for = lambda *a, **k: v
    for k, val in attrs.items():
        setattr(mod, k, val)
    return mod


@pytest.mark.parametrize("arch,family", [(100, "10.0 (Blackwell)"), (103, "10.3 (Blackwell)"),
                                         (120, "12.0 (Blackwell)"), (80, "8.0")])
def test_the_dispatcher_passes_over_sm90a_tiers_off_cc90_and_says_why(monkeypatch, arch, family):
    """No Hopper tier exists yet: a stand-in one declaring TARGET_ARCH = "90a" is put in front."""
    hopper = _fake_hopper_tier()
    monkeypatch.setattr(dispatch, "TIERS", (("Hopper wgmma", hopper),) + dispatch.TIERS)
    p, arrays = _problem()
    assert dispatch.forward_tier(p, arch, arrays) is not hopper
    line = dispatch.describe_choice(p, arch, arrays)
    assert "tensor-core mma.sync tier" in line
    assert f"Hopper wgmma tier not used: sm_90a code (wgmma, setmaxnreg) runs on compute capability 9.0 only, not on {family}" in line


def test_the_dispatcher_takes_an_sm90a_tier_on_cc90(monkeypatch):
    hopper = _fake_hopper_tier()
    monkeypatch.setattr(dispatch, "TIERS", (("Hopper wgmma", hopper),) + dispatch.TIERS)
    p, arrays = _problem()
    assert dispatch.forward_tier(p, 90, arrays) is hopper
    assert dispatch.describe_choice(p, 90, arrays) == "sm_90: Hopper wgmma tier, cuflash_probe_sm90a_x (fake)"


def test_a_cuda13_only_tier_falls_back_under_nvrtc12(monkeypatch):
    hopper = _fake_hopper_tier(MIN_NVRTC_MAJOR=13)
    assert dispatch.target_reason(hopper, 90, (12, 13)) is None
    assert dispatch.target_reason(hopper, 90, ()) is None   # no NVRTC at all: a simulator-only install
    why = dispatch.target_reason(hopper, 90, (12,))
    assert "CUDA-13-only" in why and "nvidia-cuda-nvrtc==13.*" in why
    monkeypatch.setattr(dispatch, "TIERS", (("Hopper wgmma", hopper),) + dispatch.TIERS)
    monkeypatch.setattr(cuda_runner, "nvrtc_majors", lambda: (12,))
    p, arrays = _problem()
    line = dispatch.describe_choice(p, 90, arrays)
    assert line.startswith("sm_90: Hopper wgmma tier, cuflash_attn_fwd_sm90") and \
        "Hopper wgmma tier not used: its kernels are CUDA-13-only" in line   # (the stand-in, then the real one)


def test_the_public_catalog_has_two_sm90a_tiers_the_hopper_forward_and_backward():
    from cuflash.kernels import attention_bwd_sm90, attention_fwd_sm90

    sm90a = [mod for _, mod in dispatch.TIERS + dispatch.BACKWARD_TIERS if getattr(mod, "TARGET_ARCH", None)]
    assert sm90a == [attention_fwd_sm90, attention_bwd_sm90] and attention_bwd_sm90.TARGET_ARCH == "90a"
    assert dispatch.target_reason(attention_fwd_sm90, 100) and dispatch.target_reason(attention_fwd_sm90, 90) is None
