"""sm_90a on the CPU: both NVRTCs compile Hopper-only PTX (``wgmma``, ``setmaxnreg``) for
``sm_90a``, the cubin's ELF header says so, its SASS holds the warpgroup instructions, and the
arch rules decide which device may load which cubin. No GPU needed."""

from __future__ import annotations

import subprocess

import pytest

from cuflash.analysis import roofline
from cuflash.runtime import cubin, cuda_runner, nvrtc

#: the smallest sm_90a program: the three wgmma fences and a register hand-back, guarded as the
#: Hopper kernels guard them (the macro is defined only when compiling for sm_90a); the launch
#: bounds let ptxas know the register count at entry, without which it ignores setmaxnreg
SM90A_PROBE = r"""
extern "C" __global__ void __launch_bounds__(384, 1) cuflash_probe_sm90a(float* out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
#endif
    out[threadIdx.x] = 1.0f;
}
"""
PLAIN = r'extern "C" __global__ void cuflash_probe_plain(float* x) { x[threadIdx.x] += 1.0f; }'


def _compiler(major: int) -> nvrtc.Nvrtc:
    if nvrtc.find(major) is None:
        pytest.skip(f"NVRTC {major}.x is not installed: pip install '{nvrtc.WHEELS[major]}' (the test extra installs it)")
    return nvrtc.load(major)




def _listed_arch(cuobjdump: str, image: bytes, tmp_path) -> str:
    """The arch ``cuobjdump --list-elf`` names (``ELF file 1: kernel.sm_90a.cubin``)."""
    path = tmp_path / "kernel.cubin"
    path.write_bytes(image)
    r = subprocess.run([cuobjdump, "--list-elf", str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().rsplit(".", 2)[-2]


@pytest.mark.parametrize("major", nvrtc.MAJORS)
def test_sm90a_probe_compiles_and_says_sm90a(major, cuobjdump, tmp_path):
    lib = _compiler(major)
    image, log = cuda_runner.nvrtc_compile(SM90A_PROBE, "90a", nvrtc=major)
    assert "setmaxnreg" not in log, f"ptxas ignored setmaxnreg with NVRTC {lib.version_string}: {log}"
    assert cubin.cubin_arch(image) == "sm_90a" == _listed_arch(cuobjdump, image, tmp_path)
    sass = roofline.disassemble(image)
    # wgmma.fence -> WARPGROUP.ARRIVE, wait_group 0 -> WARPGROUP.DEPBAR.LE gsb0, 0x0,
    # setmaxnreg.dec 40 -> USETMAXREG.DEALLOC.CTAPOOL 0x28 (NVRTC 12.9 and 13.5 alike)
    assert "WARPGROUP.ARRIVE" in sass and "WARPGROUP.DEPBAR" in sass, sass
    assert "USETMAXREG.DEALLOC" in sass and "0x28" in sass, sass


@pytest.mark.parametrize("major", nvrtc.MAJORS)
def test_the_guard_drops_the_hopper_code_for_plain_sm90(major):
    _compiler(major)
    image, _ = cuda_runner.nvrtc_compile(SM90A_PROBE, 90, nvrtc=major)
    assert cubin.cubin_arch(image) == "sm_90"
    sass = roofline.disassemble(image)
    assert "WARPGROUP" not in sass and "SETMAXREG" not in sass


@pytest.mark.parametrize("major", nvrtc.MAJORS)
@pytest.mark.parametrize("arch", [75, 80, 86, 89, 90, "90a", 100, "100a", 120, "120a"])
def test_cubin_arch_agrees_with_cuobjdump(major, arch, cuobjdump, tmp_path):
    """Both ELF layouts (ABI 7: NVRTC 12.x up to sm_90; ABI 8: sm_100+ and all of 13.x, where
    13.x marks ``a`` in ``.nv.compat``) read back as cuobjdump names them."""
    _compiler(major)
    image, _ = cuda_runner.nvrtc_compile(PLAIN, arch, nvrtc=major)
    assert cubin.cubin_arch(image) == cubin.arch_name(arch) == _listed_arch(cuobjdump, image, tmp_path)


def test_cubin_arch_refuses_what_is_not_gpu_code():
    with pytest.raises(ValueError, match="64-bit little-endian ELF"):
        cubin.cubin_arch(b"not an ELF image at all, but long enough to have a header............")
    head = bytearray(64)
    head[:6] = b"\x7fELF\x02\x01"
    head[0x12] = 62   # EM_X86_64
    with pytest.raises(ValueError, match="e_machine 190"):
        cubin.cubin_arch(bytes(head))


@pytest.mark.parametrize("arch,cc,ok", [
    ("90a", 90, True), ("90a", 100, False), ("90a", 120, False), ("90a", 80, False),
    (90, 90, True), (80, 86, True), (86, 80, False), (90, 100, False), ("sm_120", 121, True),
])
def test_which_device_runs_which_arch(arch, cc, ok):
    why = cubin.arch_reason(arch, cc)
    assert (why is None) is ok, why


def test_sm90a_on_blackwell_says_why():
    why = cubin.arch_reason("90a", 100)
    assert "sm_90a" in why and "9.0 only" in why and "10.0 (Blackwell)" in why
    assert "12.0 (Blackwell)" in cubin.arch_reason("sm_90a", 120)


@pytest.mark.parametrize("bad,exc", [(True, TypeError), (9.0, TypeError), ("sm_90x", ValueError), ("9", ValueError),
                                     ("compute_90", ValueError)])
def test_arch_names_are_checked(bad, exc):
    with pytest.raises(exc, match="arch="):
        cubin.arch_name(bad)


def test_arch_names():
    assert [cubin.arch_name(a) for a in (80, "90", "90a", "sm_90a", " sm_100a ")] == \
        ["sm_80", "sm_90", "sm_90a", "sm_90a", "sm_100a"]


@pytest.mark.parametrize("major", nvrtc.MAJORS)
def test_hopper_probes_compile_for_sm90a_with_the_tma_and_wgmma_sass(major, cuobjdump, tmp_path):
    """kernels_cu/hopper_probe.cu (the simulator's sm_90a probes, and check's on a GPU) with each
    NVRTC: the cubin says sm_90a, its SASS has the tensor-core and TMA instructions the PTX asks
    for (wgmma -> HGMMA, cp.async.bulk.tensor -> UTMALDG / UTMASTG, mbarrier -> SYNCS, stmatrix ->
    STSM, setmaxnreg -> USETMAXREG), and no entry spills."""
    import re

    from cuflash.kernels import hopper_probe as hp
    from cuflash.runtime import source

    _compiler(major)
    image, log = cuda_runner.nvrtc_compile(source.build_source(hp.VARIANT), "90a", name=hp.VARIANT.source,
                                           extra_options=("-Xptxas=-v",), nvrtc=major)
    assert cubin.cubin_arch(image) == "sm_90a" == _listed_arch(cuobjdump, image, tmp_path)
    sass = roofline.disassemble(image)
    for op in ("HGMMA.64x64x16.F32.BF16", "UTMALDG.2D", "UTMASTG.2D", "SYNCS.", "STSM.", "USETMAXREG", "ELECT"):
        assert op in sass, f"{op} missing from the probes' SASS (NVRTC {major})"
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert spills and all(s == ("0", "0") for s in spills), log


def _all_widths_source() -> str:
    """One kernel per (N, dtype, A source) calling the generated wgmma wrapper once."""
    from cuflash.runtime import ptx_gen

    body = ['#include "ptx.cuh"', "#if defined(__CUDA_ARCH_FEAT_SM90_ALL)"]
    for n in ptx_gen.WGMMA_N:
        for bf16 in ("true", "false"):
            tag = f"{n}_{'bf16' if bf16 == 'true' else 'f16'}"
            body.append(f'extern "C" __global__ void __launch_bounds__(128) w_{tag}(float* out, unsigned long long da, '
                        f"unsigned long long db, unsigned a0) {{\n  float d[{n // 2}] = {{}};\n  const unsigned a[4] = "
                        "{a0, a0, a0, a0};\n  ptx_wgmma_fence();\n"
                        f"  ptx_wgmma_ss<{n}, {bf16}, 0, 1>(d, da, db, 1);\n  ptx_wgmma_rs<{n}, {bf16}, 0>(d, a, db, 1);\n"
                        f"  ptx_wgmma_commit();\n  ptx_wgmma_wait<0>();\n  for (int i = 0; i < {n // 2}; ++i) "
                        f"out[threadIdx.x * {n // 2} + i] = d[i];\n}}")
    body.append("#endif")
    return "\n".join(body)


@pytest.mark.parametrize("major", nvrtc.MAJORS)
def test_every_generated_wgmma_width_assembles(major):
    """cuflash/runtime/ptx_gen.py's wrappers, N = 16..256 in steps of 16, f16 and bf16, A from shared
    memory and from registers: each assembles, and its HGMMA has the N asked for."""
    import re

    from cuflash.runtime import ptx_gen, source

    _compiler(major)
    text = source.build_text(_all_widths_source(), origin="wgmma_widths.cu")
    image, _ = cuda_runner.nvrtc_compile(text, "90a", name="wgmma_widths.cu", nvrtc=major)
    sass = roofline.disassemble(image)
    # (the SASS names bf16 inputs `.BF16`; f16, the default, has no suffix)
    shapes = {(n, t or ".F16") for n, t in re.findall(r"HGMMA\.64x(\d+)x16\.F32(\.BF16)?\b", sass)}
    assert shapes == {(str(n), t) for n in ptx_gen.WGMMA_N for t in (".BF16", ".F16")}, sorted(shapes)


@pytest.mark.parametrize("key", [("f16", 64, 64, False), ("bf16", 128, 128, True), ("bf16", 192, 128, True),
                                 ("f16", 256, 256, False)], ids=lambda k: f"{k[0]}-d{k[1]}-dv{k[2]}{'-local' if k[3] else ''}")
def test_hopper_forward_sass_is_wgmma_and_tma(key, cuobjdump, tmp_path):
    """The Hopper tier's kernel (issue 20): sm_90a, wgmma (HGMMA) for both GEMMs with no mma.sync
    (HMMA), TMA loads and stores (UTMALDG / UTMASTG), mbarrier waits (SYNCS), the register
    hand-over (USETMAXREG), no spills. (Every variant's spills, with both NVRTCs: the compile gate.)"""
    import re

    from cuflash.kernels import attention_fwd_sm90
    from cuflash.runtime import source

    v = attention_fwd_sm90.Sm90ForwardVariant(*key)
    image, log = cuda_runner.nvrtc_compile(source.build_source(v), "90a", name=v.source, extra_options=("-Xptxas=-v",))
    assert cubin.cubin_arch(image) == "sm_90a" == _listed_arch(cuobjdump, image, tmp_path)
    sass = roofline.disassemble(image)
    shapes = set(re.findall(r"HGMMA\.64x(\d+)x16", sass))
    assert shapes == {str(v.block_n), str(v.head_dim_v)}, shapes   # S = Q K^T (N = Bc) and O += P V (N = Dv)
    for op in ("UTMALDG.4D", "UTMASTG.4D", "SYNCS.PHASECHK", "USETMAXREG"):
        assert op in sass, op
    assert "HMMA" not in sass
    res = cuda_runner.ptxas_resources(log, v.entry)
    assert res["spill_stores"] == res["spill_loads"] == 0
