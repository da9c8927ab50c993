"""The kernel machinery: variants, the source builder, the lowering of __shared__, launch plans,
the simulator's options and its disk cache."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from support.simtools import P, plan

from cuflash import sim
from cuflash.kernels.softmax import SoftmaxVariant
from cuflash.runtime import paths, source
from cuflash.runtime.plan import PointerArg
from cuflash.sim import launcher, lower


def test_variant_is_hashable_and_names_its_entry():
    v = SoftmaxVariant("bf16", "block")
    assert v == SoftmaxVariant("bf16", "block") and hash(v) == hash(SoftmaxVariant("bf16", "block"))
    assert v.name == "bf16_block" and v.entry == "cuflash_softmax_bf16_block"
    d = dict(v.defines())
    assert d["CUFLASH_ENTRY"] == v.entry and d["CUFLASH_T"] == "__nv_bfloat16" and d["CUFLASH_SOFTMAX_WARP"] == "0"
    assert len({x.name for x in SoftmaxVariant.all()}) == 6
    with pytest.raises(ValueError, match="dtype='f64'"):
        SoftmaxVariant("f64", "warp")
    with pytest.raises(AttributeError):
        v.dtype = "f32"


def test_source_pastes_our_headers_once_and_keeps_toolkit_includes():
    text = source.build_source(SoftmaxVariant("f16", "warp"))
    assert text.index("#define CUFLASH_ENTRY cuflash_softmax_f16_warp") < text.index('#line 1 "softmax.cu"')
    assert paths.kernel_source("common.cuh").split("#pragma once")[1].strip()[:40] in text
    assert text.count("__device__ __forceinline__ float to_float(float x)") == 1
    assert '#include "' not in text and "#include <cuda_fp16.h>" in text and "#pragma once" not in text
    assert '#line 1 "common.cuh"' in text
    # the text changes when a header changes: caches keyed on it cannot go stale
    assert source.build_source(SoftmaxVariant("f16", "block")) != text


def test_source_missing_header(tmp_path):
    with pytest.raises(FileNotFoundError, match='#include "nope.cuh" in k.cu'):
        source.build_text('#include "nope.cuh"\n', origin="k.cu")


def test_lowering_of_shared_declarations():
    src = (
        "__global__ void k() {\n"
        "  __shared__ __align__(16) float t[4][5];  // comment __shared__\n"
        "  extern __shared__ __align__(8) unsigned char dyn[];\n"
        "  __shared__\n int x;\n"
        '  const char* s = "__shared__";\n'
        "}\n"
    )
    out = lower.lower_shared(src, "k.cu")
    assert out.count("\n") == src.count("\n")  # line numbers kept
    assert "::cusim::shared_static(&__cusim_sh_k0, sizeof(__cusim_sh_t0), ((16) > alignof(__cusim_sh_t0)" in out
    assert "using __cusim_sh_t0 = float[4][5];" in out and "__cusim_sh_t0& t =" in out
    assert "using __cusim_sh_t1 = unsigned char; __cusim_sh_t1* const dyn" in out
    assert "__cusim_sh_t2& x" in out
    assert '"__shared__"' in out and "// comment __shared__" in out
    for bad, msg in [
        ("__shared__ float a[2];\n", "file-scope"),
        ("void f() { __shared__ float a[2], b[2]; }", "one __shared__ variable"),
        ("void f() { __shared__ float a = 1; }", "one __shared__ variable"),
        ("void f() { extern __shared__ float a[4]; }", "unknown size"),
        ("void f() {\n#define S __shared__ float z[2]\n}", "preprocessor"),
    ]:
        with pytest.raises(ValueError, match=msg):
            lower.lower_shared(bad, "bad.cu")
    assert lower.find_entries('extern "C" __global__ void __launch_bounds__(128) foo(int) {}\n'
                              'extern "C" __global__ void bar() {}') == ["foo", "bar"]


def test_pointer_arg_regions():
    a = np.zeros((6, 80), np.float16)
    v = a[::2, 5:70]
    p = PointerArg.of("v", v)
    assert p.shape == (3, 65) and p.strides == (160, 1) and p.extent == 385
    assert p.address == a.ctypes.data + 5 * 2
    with pytest.raises(ValueError, match="beyond the 385 elements"):
        PointerArg("v", v, 1, (3, 65), (160, 1))
    with pytest.raises(ValueError, match="negative"):
        PointerArg.of("r", a[::-1])


def test_plan_opt_in_flag():
    x = np.zeros(4, np.float32)
    assert not plan("k", 1, 32, P(x), smem=48 * 1024).needs_smem_opt_in
    p = plan("k", 1, 32, P(x), smem=48 * 1024 + 1)
    assert p.needs_smem_opt_in and p.smem_limit(80) == 163 * 1024 and p.smem_limit(75) == 64 * 1024


@pytest.mark.sim_default_options
def test_sim_options_context_and_environment(monkeypatch):
    for env in ("CUFLASH_SIM_ARCH", "CUFLASH_SIM_SEED", "CUFLASH_SIM_CHECKED", "CUFLASH_SIM_WORKERS",
                "CUFLASH_SIM_FIBERS"):
        monkeypatch.delenv(env, raising=False)
    assert sim.current_options() == sim.SimOptions()
    with sim.options(arch="sm_80", seed=5) as o:
        assert (o.arch, o.seed) == (80, 5)
        with sim.options(seed=6) as inner:
            assert (inner.arch, inner.seed) == (80, 6)
        assert sim.current_options().seed == 5
    assert sim.current_options().arch == 90
    monkeypatch.setenv("CUFLASH_SIM_ARCH", "sm_86")
    monkeypatch.setenv("CUFLASH_SIM_SEED", "9")
    assert (sim.current_options().arch, sim.current_options().seed) == (86, 9)
    with sim.options(arch=75):
        assert sim.current_options().arch == 75
    with sim.options(checked=True) as o:
        assert o.checked
    with sim.options(checked=False):
        pass
    with pytest.raises(ValueError, match="arch='sm_100'"):
        with sim.options(arch="sm_100"):
            pass
    with pytest.raises(ValueError, match="fibers='green'"):
        with sim.options(fibers="green"):
            pass
    monkeypatch.setenv("CUFLASH_SIM_SEED", "x")
    with pytest.raises(ValueError, match="CUFLASH_SIM_SEED"):
        sim.current_options()
    monkeypatch.setenv("CUFLASH_SIM_SEED", "1")
    monkeypatch.setenv("CUFLASH_SIM_CHECKED", "1")
    assert sim.current_options().checked
    with sim.options(checked=False):
        assert not sim.current_options().checked
    monkeypatch.setenv("CUFLASH_SIM_CHECKED", "maybe")
    with pytest.raises(ValueError, match="CUFLASH_SIM_CHECKED"):
        sim.current_options()


def test_fibers_env_forces_ucontext(monkeypatch):
    monkeypatch.setenv("CUFLASH_SIM_FIBERS", "ucontext")
    assert sim.current_options().fibers == "ucontext"
    assert not launcher.use_asm_fibers("ucontext")


def test_disk_cache_key_and_reuse(modules, tmp_path):
    """The cache folder follows CUFLASH_SIM_CACHE_DIR; a fresh process loads, not compiles."""
    folder = launcher.cache_dir()
    assert str(folder) == os.environ["CUFLASH_SIM_CACHE_DIR"]
    path = modules["sim"].path
    assert path.parent == folder and path.suffix == ".so"
    code = (
        "import sys; from cuflash.kernels.softmax import SoftmaxVariant; from cuflash.sim import launcher;"
        "m = launcher.load_variant(SoftmaxVariant('f32', 'warp'));"
        "print(m.compile_seconds, m.path)"
    )
    env = dict(os.environ, PYTHONPATH=str(paths.kernels_dir().parent))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    secs, p = out.split()
    assert float(secs) == 0.0 and p == str(modules["f32_warp"].path)


def test_compile_error_is_reported(tmp_path):
    with pytest.raises(RuntimeError, match="g\\+\\+ failed on broken.cu"):
        launcher.load_source('extern "C" __global__ void broken(int* p) { p[0] = undefined_name; }', origin="broken.cu")
