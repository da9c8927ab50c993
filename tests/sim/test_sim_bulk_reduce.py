"""The bulk reduce-add (cp.reduce.async.bulk .add.f32 in kernels_cu/ptx.cuh) on the simulator.

Blocks add integer-valued float32 slices into one workspace, so every order of the adds gives the
float64 sum exactly; checked mode must report a plain write racing the reduce-adds and a staged
buffer rewritten before cp.async.bulk.wait_group.read.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from support.simtools import P, i32, plan

from cuflash import sim
from cuflash.runtime import source
from cuflash.sim import launcher

KERNELS = Path(__file__).parent / "kernels"
BLOCKS, N = 6, 256


@pytest.fixture(scope="module")
def module():
    text = source.build_text((KERNELS / "bulk_reduce.cu").read_text(), origin="bulk_reduce.cu", search_dirs=[KERNELS])
    with sim.options(arch=90, checked=True) as o:
        return launcher.load_source(text, origin="bulk_reduce.cu", options=o)


def _launch(mod, mode, blocks=BLOCKS):
    rng = np.random.default_rng(5)
    src = rng.integers(-1000, 1000, size=(blocks, N)).astype(np.float32)
    ws = rng.integers(-50, 50, size=N).astype(np.float32)
    want = ws.astype(np.float64) + src.astype(np.float64).sum(axis=0)
    with sim.options(arch=90, checked=True) as o:
        mod.launch(plan("bulk_reduce", blocks, 128, P(src), P(ws, "ws"), i32(N), i32(mode)), o)
    return ws, want


def test_bulk_reduce_add_of_several_blocks_matches_the_float64_sum(module):
    ws, want = _launch(module, 0)
    np.testing.assert_array_equal(ws.astype(np.float64), want)


@pytest.mark.parametrize("mode,kind,match", [
    (1, "global race", r"race on ws\[0\].*block \(1, 0, 0\)"),
    (2, "async overlap", "unfinished wgmma or TMA store"),
])
def test_bulk_reduce_faults_are_reported(module, mode, kind, match):
    with pytest.raises(launcher.SimCheckError, match=match) as e:
        _launch(module, mode)
    assert e.value.kind == kind


@pytest.mark.parametrize("mode,match", [
    (3, r"race on ws\[0\].*: read here, reduce-add by a cp.reduce.async.bulk of this block issued by thread "
        r"\(0, 0, 0\), still in flight"),
    (4, r"race on ws\[1\].*: write here, reduce-add by a cp.reduce.async.bulk of this block issued by thread "
        r"\(0, 0, 0\), still in flight"),
], ids=["issuer-reads-before-its-wait", "other-thread-writes-before-the-wait"])
def test_plain_access_racing_the_blocks_own_reduce_is_reported(module, mode, match):
    """One block: a plain access of the workspace while the block's own reduce-add is in flight (the
    issuer itself before its wait_group, or another thread between barriers around the issue and
    the wait) is a global race."""
    with pytest.raises(launcher.SimCheckError, match=match) as e:
        _launch(module, mode, blocks=1)
    assert e.value.kind == "global race" and e.value.other_access == "reduce-add"
    assert e.value.thread == (0 if mode == 3 else 33, 0, 0) and e.value.other_thread == (0, 0, 0)


def test_reading_the_sum_after_the_issuers_wait_and_a_barrier_is_clean(module):
    ws, want = _launch(module, 5, blocks=1)
    np.testing.assert_array_equal(ws.astype(np.float64), want)


def test_bulk_reduce_compiles_for_sm_90a_to_ublkred(cuobjdump):
    """ptx.cuh's real instruction: NVRTC accepts it for sm_90a and ptxas emits SASS UBLKRED."""
    from cuflash.analysis import roofline
    from cuflash.runtime import cuda_runner

    text = source.build_text((KERNELS / "bulk_reduce.cu").read_text(), origin="bulk_reduce.cu", search_dirs=[KERNELS])
    cubin, _ = cuda_runner.nvrtc_compile(text, "90a", name="bulk_reduce.cu")
    assert cubin[:4] == b"\x7fELF"
    assert "UBLKRED" in roofline.disassemble(cubin)
