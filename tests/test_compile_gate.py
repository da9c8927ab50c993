"""The NVRTC compile gate: every variant the dispatcher can choose compiles for every arch it
targets, with exactly the options the library passes at run time (plus ``-Xptxas=-v`` to read the
resource use), with no spill, no stack frame and shared memory within the per-block limit.

No GPU is needed: CuPy's low-level ``cupy.cuda.nvrtc`` binding compiles with an explicit arch.
The table of registers, shared memory and cold compile time is printed at the end of the run.
"""

from __future__ import annotations

import time

import pytest

from cuflash.kernels import catalog
from cuflash.runtime import cuda_runner, plan, source

TARGETS = catalog.compile_targets()
RESOURCE_TABLE: list[tuple] = []

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


@pytest.mark.parametrize("arch,variant", TARGETS, ids=[f"sm_{a}-{v.entry}" for a, v in TARGETS])
def test_variant_compiles_without_spills(arch, variant):
    text = source.build_source(variant)
    t0 = time.perf_counter()
    _, log = cuda_runner.nvrtc_compile(text, arch, name=variant.source, extra_options=("-Xptxas=-v",))
    seconds = time.perf_counter() - t0
    r = parse_ptxas(log, variant.entry)
    dynamic = getattr(variant, "smem_bytes", 0)
    limit = plan.SMEM_OPT_IN_LIMIT[arch] if dynamic + r["static_smem"] > plan.SMEM_DEFAULT_LIMIT else plan.SMEM_DEFAULT_LIMIT
    RESOURCE_TABLE.append((f"sm_{arch}", variant.entry, r["registers"], r["static_smem"] + dynamic, seconds))
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0, f"{variant.entry} spills on sm_{arch}: {r}"
    assert r["stack_frame"] == 0, f"{variant.entry} has a stack frame on sm_{arch}: {r}"
    assert r["static_smem"] + dynamic <= limit, f"{variant.entry} needs {r['static_smem'] + dynamic} B of shared memory; sm_{arch} allows {limit}"
    assert r["registers"] <= 255
