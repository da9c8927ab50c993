"""The NVRTC compile gate: every variant the dispatcher can choose compiles for every arch it
targets, with each NVRTC cuflash supports (12.x and 13.x, DESIGN.md §4), with exactly the options
the library passes at run time (plus ``-Xptxas=-v`` to read the resource use), with no spill, no
stack frame and shared memory within the per-block limit. The default run gates one variant of
every family on every arch with each compiler (:func:`_sample`); ``-m compile_gate`` runs the
whole gate (every variant, about 2160 compiles: .ci/run does, after the test command). Under
pytest-xdist the gate's tests share one worker (``xdist_group``, ``--dist loadgroup``), whose
pool compiles them.

No GPU is needed: :mod:`cuflash.runtime.nvrtc` loads ``libnvrtc.so.12`` (``nvidia-cuda-nvrtc-cu12``)
and ``libnvrtc.so.13`` (``nvidia-cuda-nvrtc`` 13.x) side by side through ctypes; the ``test`` extra
installs both. A missing one skips its half of the gate with a reason naming the wheel (and
``.ci/run`` fails on that skip). Each compiler compiles the session's targets once, on a thread
pool as wide as the machine (NVRTC is thread-safe and ctypes releases the GIL), so two compilers
cost about what one did serially. The table of registers, shared memory and compile time per
compiler is printed at the end of the run.

A variant NVRTC 12.x cannot compile is CUDA-13-only: it says so with ``min_nvrtc_major = 13``
(:class:`cuflash.runtime.variants.Variant`), the gate compiles it with 13.x only and checks
that 12.x still fails on it (in a subprocess: NVRTC 12.9 has been seen to crash, not fail, on
TMA plus ``setmaxnreg`` code), so the mark cannot go stale.
"""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import threading
import time

import pytest

from cuflash.kernels import catalog
from cuflash.runtime import cuda_runner, nvrtc, plan, source

#: what the dispatcher picks, then the forms it passes over because they spill (KNOWN_SPILLS
#: keeps them honest: one that stops spilling fails its strict xfail)
TARGETS = catalog.compile_targets() + catalog.passed_over_targets()
#: (compiler, arch, entry, registers, shared memory bytes, seconds): printed by conftest
RESOURCE_TABLE: list[tuple] = []
#: compiler -> total NVRTC seconds (summed over the pool's threads) and wall seconds of its pool
COMPILE_TIMES: dict[str, list[float]] = {}
#: the compile pool's threads: the CPUs this process may use
WORKERS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def compiler(major: int) -> nvrtc.Nvrtc:
    """NVRTC ``major``, or a skip naming the wheel that installs it."""
    if nvrtc.find(major) is None:
        pytest.skip(f"NVRTC {major}.x is not installed: pip install '{nvrtc.WHEELS[major]}' (the test extra "
                    "installs it)")
    return nvrtc.load(major)


def parse_ptxas(log: str, entry: str) -> dict:
    """Registers, stack frame, spills and static shared memory of ``entry`` from a ptxas -v log."""
    try:
        return cuda_runner.ptxas_resources(log, entry)
    except ValueError as e:
        pytest.fail(str(e))


def test_parse_ptxas_reads_the_figures():
    log = (
        "ptxas info    : Compiling entry function 'k1' for 'sm_80'\n"
        "ptxas info    : Function properties for k1\n"
        "ptxas         .     16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
        "ptxas info    : Used 40 registers, 2048 bytes smem, 380 bytes cmem[0]\n"
    )
    assert parse_ptxas(log, "k1") == {"registers": 40, "stack_frame": 16, "spill_stores": 8, "spill_loads": 4, "static_smem": 2048}


def test_gate_covers_every_family_and_arch():
    families = {(arch, v.family) for arch, v in TARGETS}
    for arch in catalog.SIMT_ARCHS:
        assert {(arch, "softmax"), (arch, "attn_fwd_simt"), (arch, "attn_bwd_simt")} <= families


def _compile(lib: nvrtc.Nvrtc, arch, variant) -> tuple[str, float]:
    t0 = time.perf_counter()
    arch = variant.target_arch or arch   # (an sm_90a variant is compiled for sm_90a on the 9.0 row)
    _, log = cuda_runner.nvrtc_compile(source.build_source(variant), arch, name=variant.source,
                                       extra_options=("-Xptxas=-v",), nvrtc=lib)
    return log, time.perf_counter() - t0


class GatePool:
    """The session's compiles, once per compiler: on the first request for a compiler, every
    gate test of that compiler collected in this session is submitted to a thread pool."""

    def __init__(self, session):
        self.session = session
        self.futures: dict = {}
        self.lock = threading.Lock()
        self.pools: list = []

    def result(self, major: int, arch, variant) -> tuple[str, float]:
        lib = compiler(major)
        with self.lock:
            if (major, arch, variant) not in self.futures:
                self._submit_all(lib)
            fut = self.futures.get((major, arch, variant))
            if fut is None:  # not a collected item (called directly): compile it alone
                fut = self.futures[(major, arch, variant)] = concurrent.futures.Future()
                fut.set_result(_compile(lib, arch, variant))
        return fut.result()

    def _submit_all(self, lib):
        todo = []
        for item in self.session.items:
            params = getattr(getattr(item, "callspec", None), "params", {})
            if item.originalname == "test_variant_compiles_without_spills" and params.get("major") == lib.major:
                key = (lib.major, params["arch"], params["variant"])
                if key not in self.futures:
                    todo.append(key)
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=WORKERS,
                                                     thread_name_prefix=f"nvrtc{lib.major}")
        self.pools.append(pool)
        start = time.perf_counter()
        times = COMPILE_TIMES.setdefault(lib.version_string, [0.0, 0.0])
        left = [len(todo)]
        tally = threading.Lock()

        def done(fut):
            with tally:
                if not fut.cancelled() and fut.exception() is None:
                    times[0] += fut.result()[1]
                left[0] -= 1
                if left[0] == 0:
                    times[1] = time.perf_counter() - start

        for key in todo:
            fut = self.futures[key] = pool.submit(_compile, lib, key[1], key[2])
            fut.add_done_callback(done)

    def close(self):
        for pool in self.pools:
            pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="session")
def gate_pool(request):
    pool = GatePool(request.session)
    yield pool
    pool.close()


#: (major, arch, entry) that spill with that NVRTC: measured with NVRTC 12.9 and 13.5.37 (ptxas:
#: 4-60 bytes of spill stores, registers at the launch-bounds cap).
#: Expected failures, strict: a compiler or kernel change that cures one fails the gate until
#: its line goes. The dispatcher never runs one under the major named
#: (test_the_dispatcher_picks_no_known_spill): the portable forwards are forms it passes over
#: (catalog.passed_over_targets); the tensor-core backward rows are compiled by the other major
#: where it is installed, else the call runs the portable backward (attention_bwd_mma.SPILLING_FORMS).
KNOWN_SPILLS = {
    # the plain packed portable forward under NVRTC 13 (no register floor in those forms): sm_75
    # float16 d64 runs 32 x 32 instead, d256 runs the modifier form with every modifier off
    # (attention_fwd_simt.packed_form)
    (13, 75, "cuflash_attn_fwd_simt_f16_d64_m32_n64_varlen"),
    (13, 75, "cuflash_attn_fwd_simt_f16_d256_m8_n32_varlen"),
    (13, 75, "cuflash_attn_fwd_simt_f32_d256_m8_n32_varlen"),
    (13, 90, "cuflash_attn_fwd_simt_f16_d256_m8_n32_varlen"),
    (13, 90, "cuflash_attn_fwd_simt_f32_d256_m8_n32_varlen"),
    (13, 90, "cuflash_attn_fwd_simt_bf16_d256_m8_n32_varlen"),
    # the dropout backward at head dims 192 (sm_90, 8 bytes with 13.5) and 256 (sm_80, 4 bytes with
    # 12.9): the keep bits, drawn before S and dP, beside the 64 x 192 / 64 x 256 dK/dV
    # accumulators; no smaller tile of the bucket exists (one stage spills too); the other major
    # compiles each without spills (nvrtc_for picks it; with only this major, the portable backward)
    (12, 80, "cuflash_attn_bwd_mma_main_f16_d256_m64_n64_s1_dropout"),
    (12, 80, "cuflash_attn_bwd_mma_main_bf16_d256_m64_n64_s1_dropout"),
    (13, 90, "cuflash_attn_bwd_mma_main_f16_d192_m64_n64_s2_dropout"),
    (13, 90, "cuflash_attn_bwd_mma_main_bf16_d192_m64_n64_s2_dropout"),
    # the score-modifier backward at head dims 192 and 256 (the per-pair modifier code beside S,
    # dP and the 64 x 192 / 64 x 256 dK/dV accumulators): 8-60 bytes, with 12.9 on the fixed forms,
    # with 12.9 at 256 and 13.5 at 192 on the packed ones; no smaller tile of the bucket exists (Br
    # 64 and Bc 64 are the warp layouts' least; one stage spills 8-56 bytes on sm_90); the other
    # major compiles each without spills (as above)
    (12, 90, "cuflash_attn_bwd_mma_main_f16_d192_m64_n64_s2_mods"),
    (12, 90, "cuflash_attn_bwd_mma_main_bf16_d192_m64_n64_s2_mods"),
    (12, 80, "cuflash_attn_bwd_mma_main_f16_d256_m64_n64_s1_mods"),
    (12, 80, "cuflash_attn_bwd_mma_main_bf16_d256_m64_n64_s1_mods"),
    (12, 90, "cuflash_attn_bwd_mma_main_f16_d256_m64_n64_s2_mods"),
    (12, 90, "cuflash_attn_bwd_mma_main_bf16_d256_m64_n64_s2_mods"),
    (12, 90, "cuflash_attn_bwd_mma_main_f16_d256_m64_n64_s2_varlen_mods"),
    (12, 90, "cuflash_attn_bwd_mma_main_bf16_d256_m64_n64_s2_varlen_mods"),
    (13, 90, "cuflash_attn_bwd_mma_main_f16_d192_m64_n64_s2_varlen_mods"),
    (13, 90, "cuflash_attn_bwd_mma_main_bf16_d192_m64_n64_s2_varlen_mods"),
}


def _sample() -> set:
    """The default run's share of the gate: for each compiler and arch, the first variant of every
    kernel family (the one that compiles fastest of its family is not sought: the first listed).
    Every family and every arch is compiled by both compilers; the whole gate is ``-m
    compile_gate`` (.ci/run runs it after the test command)."""
    seen, keep = set(), set()
    for major in nvrtc.MAJORS:
        for arch, v in TARGETS:
            # (the portable tier's dropout and modifier forms: under -m compile_gate only)
            key = (major, arch, v.family, getattr(v, "mods", False) and not v.family.endswith("_simt"))
            if major in catalog.compilers(arch, v) and key not in seen:
                seen.add(key)
                keep.add((major, arch, v.entry))
    return keep


SAMPLE = _sample()


def _gate_params():
    out = []
    for major in nvrtc.MAJORS:
        for arch, v in TARGETS:
            if major in catalog.compilers(arch, v):
                marks = [pytest.mark.compile_gate, pytest.mark.xdist_group("compile_gate")]
                if (major, arch, v.entry) in KNOWN_SPILLS:
                    marks.append(pytest.mark.xfail(strict=True, raises=AssertionError,
                                                   reason=f"NVRTC {major}.x spills on this variant (KNOWN_SPILLS)"))
                if (major, arch, v.entry) not in SAMPLE:
                    marks.append(pytest.mark.slow)
                out.append(pytest.param(major, arch, v, id=f"nvrtc{major}-sm_{arch}-{v.entry}", marks=marks))
    return out


def test_known_spills_name_gate_targets():
    """Every KNOWN_SPILLS line names a target the gate compiles (no line outlives its variant)."""
    targets = {(major, arch, v.entry) for major in nvrtc.MAJORS for arch, v in TARGETS}
    assert KNOWN_SPILLS <= targets, sorted(KNOWN_SPILLS - targets)


def test_the_dispatcher_picks_no_known_spill():
    """No KNOWN_SPILLS row (any dtype, arch, NVRTC major) is a variant the dispatcher runs under that
    major on its arch: the portable forwards' rows are forms it passes over, and the tensor-core
    backward's are exactly the majors its variants declare spilling, which nvrtc_for avoids."""
    picked = {(arch, v.entry) for arch, v in catalog.compile_targets()}
    simt_rows = {(a, e) for _, a, e in KNOWN_SPILLS if "_bwd_mma_" not in e}
    assert not picked & simt_rows, sorted(picked & simt_rows)
    assert simt_rows <= {(arch, v.entry) for arch, v in catalog.passed_over_targets()}
    declared = {(m, arch, v.entry) for arch, v in catalog.compile_targets() if v.family == "attn_bwd_mma"
                for m in v.spilling_nvrtc_majors(arch) if m in catalog.compilers(arch, v)}
    assert declared == {row for row in KNOWN_SPILLS if "_bwd_mma_" in row[2]}


def test_the_sample_covers_every_family_arch_and_compiler():
    cells = {(major, arch, v.family) for major in nvrtc.MAJORS for arch, v in TARGETS if major in catalog.compilers(arch, v)}
    entries = {(a, v.entry): v.family for a, v in TARGETS}
    assert {(major, arch, entries[(arch, e)]) for major, arch, e in SAMPLE} == cells
    assert len(SAMPLE) < len(_gate_params()) / 5


@pytest.mark.parametrize("major,arch,variant", _gate_params())
def test_variant_compiles_without_spills(major, arch, variant, gate_pool):
    log, seconds = gate_pool.result(major, arch, variant)
    r = parse_ptxas(log, variant.entry)
    dynamic = getattr(variant, "smem_bytes", 0)
    cc = cuda_runner.parse_arch(arch)[0]
    limit = plan.SMEM_OPT_IN_LIMIT[cc] if dynamic + r["static_smem"] > plan.SMEM_DEFAULT_LIMIT else plan.SMEM_DEFAULT_LIMIT
    RESOURCE_TABLE.append((nvrtc.load(major).version_string, cuda_runner.arch_name(arch), variant.entry,
                           r["registers"], r["static_smem"] + dynamic, seconds))
    where = f"{variant.entry} on sm_{arch} with NVRTC {major}.x"
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0, f"{where} spills: {r}"
    assert r["stack_frame"] == 0, f"{where} has a stack frame: {r}"
    assert r["static_smem"] + dynamic <= limit, f"{where} needs {r['static_smem'] + dynamic} B of shared memory; the limit is {limit}"
    assert r["registers"] <= 255


def test_sm70_rows_are_nvrtc12_only():
    """CUDA 13 dropped sm_70 (Volta): the gate's sm_70 rows are NVRTC 12.x's, and that stays
    true (13.x must still refuse sm_70, 12.x must still take it, or the rule is stale)."""
    assert {m for a, v in TARGETS if a == 70 for m in catalog.compilers(a, v)} == {12}
    assert {"softmax", "attn_fwd_simt", "attn_bwd_simt"} <= {v.family for a, v in TARGETS if a == 70}
    assert not any(v.family.endswith(("_mma", "_sm90")) for a, v in TARGETS if a == 70)
    for major in nvrtc.MAJORS:
        lib = compiler(major)
        assert min(lib.supported_archs) == nvrtc.OLDEST_ARCH[major], (major, lib.supported_archs)


_FAILS_UNDER = r"""
import sys
from cuflash.kernels import catalog
from cuflash.runtime import cuda_runner, source
arch, entry = int(sys.argv[1]), sys.argv[2]
v = next(v for a, v in catalog.compile_targets() if a == arch and v.entry == entry)
try:
    cuda_runner.nvrtc_compile(source.build_source(v), arch, name=v.source, nvrtc=12)
except RuntimeError:
    sys.exit(3)
"""


def test_cuda13_only_variants_still_fail_under_nvrtc12():
    """A variant marked CUDA-13-only (``min_nvrtc_major = 13``) must not compile with 12.x
    (a failure or a crash of the compiler both count), or the mark is stale."""
    only13 = [(arch, v) for arch, v in TARGETS if v.min_nvrtc_major > 12]
    if only13:
        compiler(12)
    stale = []
    for arch, v in only13:
        r = subprocess.run([sys.executable, "-c", _FAILS_UNDER, str(arch), v.entry], capture_output=True, text=True,
                           timeout=600)
        if r.returncode == 0:
            stale.append(f"sm_{arch} {v.entry}")
    assert not stale, "marked CUDA-13-only but NVRTC 12.x compiles them: " + ", ".join(stale)
