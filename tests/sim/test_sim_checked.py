"""Checked mode of the simulator (``cuflash.sim.options(checked=True)``): planted faults in the
probe kernels of ``kernels/check_probes.cu`` are each reported precisely, as a
:class:`SimCheckError` naming the kernel, block, thread, array and element; the clean variants
of the same kernels pass and give the right results."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from conftest import probe_source
from support.simtools import P, i32, plan

from cuflash import sim
from cuflash.runtime.plan import PointerArg, ScalarArg
from cuflash.sim import launcher
from cuflash.sim.launcher import SimCheckError, SimError

pytestmark = pytest.mark.checked


@pytest.fixture(scope="module")
def chk(_sim_cache):
    with sim.options(checked=True) as o:
        return launcher.load_source(probe_source("check_probes.cu"), origin="check_probes.cu", options=o)


def run(mod, p, **opts):
    with sim.options(checked=True, **opts) as o:
        return mod.launch(p, o)


def fault(mod, p, **opts) -> SimCheckError:
    with pytest.raises(SimCheckError) as info:
        run(mod, p, **opts)
    e = info.value
    assert isinstance(e, SimError) and e.kernel == p.entry and e.kernel in str(e)
    assert f"block {e.block} thread {e.thread}" in str(e)
    return e


def i64(v):
    return ScalarArg("row_stride", np.int64(v))


def test_checked_module_is_separate_and_instrumented(chk, modules):
    assert chk.checked and chk.path != modules["sim"].path
    assert "-fsanitize=thread" in launcher.compile_flags(90, True, checked=True)
    assert "-fsanitize=thread" not in launcher.compile_flags(90, True)
    undefined = subprocess.run(["nm", "-u", str(chk.path)], capture_output=True, text=True).stdout
    assert "__tsan" not in undefined and "__ubsan" not in undefined   # the hooks are the module's own
    with sim.options() as o, pytest.raises(ValueError, match="compiled with checked=True"):
        chk.launch(plan("chk_write", 1, 32, P(np.zeros(16, np.float32)), i32(16), i32(0)), o)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_missing_syncthreads(chk, seed):
    x = np.arange(128, dtype=np.float32)
    y = np.full(128, np.nan, np.float32)
    run(chk, plan("chk_reverse", 1, 128, P(x, "x"), P(y, "y"), i32(1)), seed=seed)
    np.testing.assert_array_equal(y, x[::-1])
    e = fault(chk, plan("chk_reverse", 1, 128, P(x, "x"), P(y, "y"), i32(0)), seed=seed)
    # a reader ran before its writer (uninitialized) or after it (race): both name the slot
    assert e.kind in ("shared race", "uninitialized shared read") and e.array == "s"
    assert e.block == (0, 0, 0) and e.access == "read" and e.index == (127 - e.thread[0],)
    if e.kind == "shared race":
        assert e.other_thread == (127 - e.thread[0], 0, 0) and e.other_access == "write"


def test_read_one_past_a_view_inside_a_larger_buffer(chk):
    big = np.arange(100, dtype=np.float32)
    y = np.full(10, np.nan, np.float32)
    x = PointerArg("x", big, 10, (10,), (1,))  # big[10:20]: big[20] is memory, not the view
    run(chk, plan("chk_copy", 1, 32, x, P(y, "y"), i32(10), i32(0)))
    np.testing.assert_array_equal(y, big[10:20])
    e = fault(chk, plan("chk_copy", 1, 32, x, P(y, "y"), i32(10), i32(1)))
    assert (e.kind, e.array, e.index, e.thread, e.access, e.nbytes) == ("out-of-bounds read", "x", (10,), (10, 0, 0), "read", 4)
    assert "x[10] (view shape (10,)" in str(e) and "outside the view" in str(e)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_read_in_the_gap_of_a_strided_view(chk, dtype):
    """q = qkv[:, 0, :] of a packed (rows, 3, 8) buffer; one read past a row's end reads k."""
    qkv = np.arange(5 * 3 * 8, dtype=np.float32).reshape(5, 3, 8)
    q = PointerArg.of("q", qkv[:, 0, :])
    assert q.strides == (24, 1)
    y = np.full((5, 8), np.nan, np.float32)
    run(chk, plan("chk_rows", 5, 32, q, P(y, "y"), i32(5), i32(8), i64(24), i32(0)))
    np.testing.assert_array_equal(y, qkv[:, 0, :])
    e = fault(chk, plan("chk_rows", 5, 32, q, P(y, "y"), i32(5), i32(8), i64(24), i32(1)), workers=1)
    assert (e.kind, e.array, e.block, e.thread) == ("out-of-bounds read", "q", (0, 0, 0), (7, 0, 0))
    assert e.index == (0, 8)  # column 8 of row 0: k's first element


def test_out_of_bounds_write_and_write_to_input(chk):
    y = np.zeros(20, np.float32)
    view = PointerArg("y", y, 2, (16,), (1,), writable=True)
    e = fault(chk, plan("chk_write", 1, 32, view, i32(16), i32(1)))
    assert (e.kind, e.array, e.index, e.thread, e.access) == ("out-of-bounds write", "y", (16,), (16, 0, 0), "write")
    assert (y == 0).all()  # the faulty launch wrote nothing back
    run(chk, plan("chk_write", 1, 32, view, i32(16), i32(0)))
    assert (y[2:18] == 1).all() and (y[:2] == 0).all() and (y[18:] == 0).all()
    e = fault(chk, plan("chk_write_input", 1, 4, PointerArg.of("x", np.zeros(4, np.float32))))
    assert e.kind == "write to read-only argument" and e.array == "x" and e.index == e.thread[:1]


def test_uninitialized_shared_read(chk):
    y = np.full(64, np.nan, np.float32)
    run(chk, plan("chk_uninit_shared", 1, 64, P(y, "y"), i32(0)))
    np.testing.assert_array_equal(y, np.arange(64) % 32)
    e = fault(chk, plan("chk_uninit_shared", 1, 64, P(y, "y"), i32(1)))
    assert (e.kind, e.array) == ("uninitialized shared read", "t")
    t = e.thread[0]
    assert t >= 32 and e.index == (t // 16, t % 16)
    assert "__shared__ t[" in str(e) and "extents (4, 16)" in str(e)


def test_uninitialized_local_shows_the_pattern(chk):
    x = np.ones(6, np.float32)
    y = np.full(32, np.nan, np.float32)
    run(chk, plan("chk_uninit_local", 1, 32, P(x, "x"), P(y, "y"), i32(6), i32(0)))
    assert (y == 6).all()
    run(chk, plan("chk_uninit_local", 1, 32, P(x, "x"), P(y, "y"), i32(6), i32(1)))
    # 0xFE bytes: -1.7e38 per float; the sum of four overflows
    assert (~np.isfinite(y) | (np.abs(y) > 1e37)).all()


def test_race_between_two_threads(chk):
    y = np.zeros(32, np.float32)
    run(chk, plan("chk_race", 1, 32, P(y, "y"), i32(0)))
    assert y[0] == 3 and y[1] == 9
    e = fault(chk, plan("chk_race", 1, 32, P(y, "y"), i32(1)))
    assert (e.kind, e.array, e.index, e.access, e.other_access) == ("shared race", "w", (0,), "write", "write")
    assert {e.thread, e.other_thread} == {(3, 0, 0), (9, 0, 0)}


def test_syncwarp_orders_lanes_of_a_warp(chk):
    y = np.zeros(32, np.float32)
    run(chk, plan("chk_warp_sync", 1, 32, P(y, "y"), i32(1)))
    assert (y == 5).all()
    e = fault(chk, plan("chk_warp_sync", 1, 32, P(y, "y"), i32(0)))
    assert (e.kind, e.array, e.index) == ("shared race", "v", (0,))
    assert (0, 0, 0) in (e.thread, e.other_thread)


def test_atomics_are_not_races_but_need_initialized_memory(chk):
    total = np.zeros(1, np.int32)
    run(chk, plan("chk_atomics", 3, 64, P(total, "total"), i32(0)))
    assert total[0] == 3 * 64
    e = fault(chk, plan("chk_atomics", 3, 64, P(total, "total"), i32(1)))
    assert (e.kind, e.array, e.access) == ("uninitialized shared read", "count", "atomic")


def test_clean_probe_kernels_pass_checked(_sim_cache):
    """The built-in probes (shuffles, votes, atomics, static/dynamic/template shared memory)."""
    with sim.options(checked=True) as o:
        mod = launcher.load_source(probe_source("sim_probes.cu"), origin="sim_probes.cu", options=o)
        nb, nt = 4, 128
        n = nb * nt - 5
        x = np.random.default_rng(1).standard_normal(nb * nt).astype(np.float32)
        sums = np.full(nb, np.nan, np.float32)
        wmax = np.full(nb * nt, np.nan, np.float32)
        mod.launch(plan("block_reduce", nb, nt, P(x, "x"), P(sums, "s"), P(wmax, "m"), i32(n)), o)
        ref = np.where(np.arange(x.size) < n, x, 0).reshape(nb, nt).sum(1)
        np.testing.assert_allclose(sums, ref, rtol=1e-5, atol=1e-5)
        out = np.zeros((2, 32, 10), np.int32)
        mod.launch(plan("warp_ops", 2, 32, P(out), i32(32)), o)
        xs = np.arange(64, dtype=np.float32)
        res = np.full(12 + 20, np.nan, np.float32)
        mod.launch(plan("shared_kinds", 1, 64, P(xs, "x"), P(res, "out"), i32(20), smem=20 * 4), o)
        np.testing.assert_array_equal(res[12:], xs[:20][::-1] * 2)
        # the probe that reads unwritten shared memory on purpose is reported
        with pytest.raises(SimCheckError, match="uninitialized shared read") as info:
            mod.launch(plan("read_unwritten", 1, 64, P(np.zeros(128, np.uint32), "out"), smem=256), o)
        assert info.value.array == "s"


def test_far_accesses_are_reported_as_wild(chk):
    """Accesses within the slack around a copy are reported with their (negative) index; one beyond
    (the guard page, or any memory that is no argument, no shared memory and not the thread's
    stack) is a wild access naming the block and thread, made before the access happens."""
    y = np.zeros(4, np.float32)
    arg = PointerArg.of("y", y, writable=True)
    e = fault(chk, plan("chk_poke", 1, 1, arg, ScalarArg("at", np.int64(-3))))
    assert (e.kind, e.array, e.index) == ("out-of-bounds write", "y", (-3,))
    at = -(launcher.CHECK_SLACK + launcher._PAGE) // 4
    e = fault(chk, plan("chk_poke", 1, 1, arg, ScalarArg("at", np.int64(at))))
    assert (e.kind, e.kernel, e.block, e.thread, e.access) == ("wild access", "chk_poke", (0, 0, 0), (0, 0, 0), "write")
    assert isinstance(e.address, int) and "wild write of 4 bytes" in str(e)
    assert (y == 0).all()
