"""Planted faults for the hazard classes the simulator catches (issue 16): read-modify-write races,
global-memory races, misaligned and wild accesses, crashes, spin-waits, and the rounding rules of
``gpu_numerics``. Each test runs the
clean variant of its kernel too (flag 0), so a check that fires on everything would fail here."""

from __future__ import annotations

import re

import numpy as np
import pytest
from conftest import probe_source
from support.simtools import P, i32, plan

from cuflash import sim
from cuflash.runtime.plan import PointerArg, ScalarArg
from cuflash.sim import launcher
from cuflash.sim.launcher import SimCheckError, SimError


@pytest.fixture(scope="module")
def source():
    return probe_source("hazard_probes.cu")


@pytest.fixture(scope="module")
def hz(_sim_cache, source):
    with sim.options() as o:
        return launcher.load_source(source, origin="hazard_probes.cu", options=o)


@pytest.fixture(scope="module")
def hzc(_sim_cache, source):
    with sim.options(checked=True) as o:
        return launcher.load_source(source, origin="hazard_probes.cu", options=o)


def run(mod, p, **opts):
    with sim.options(checked=mod.checked, **opts) as o:
        return mod.launch(p, o)


def fault(mod, p, **opts) -> SimCheckError:
    with pytest.raises(SimCheckError) as info:
        run(mod, p, **opts)
    e = info.value
    assert e.kernel == p.entry and f"block {e.block} thread {e.thread}" in str(e)
    return e


def ro(name, a):
    return PointerArg.of(name, a, writable=False)


# ---------------------------------------------------------------- class 2: read-modify-write races
@pytest.mark.parametrize("seed", [0, 3])
def test_shared_read_modify_write_race(hzc, seed):
    y = np.zeros(1, np.float32)
    run(hzc, plan("hz_shared_rmw", 1, 64, P(y, "y"), i32(0)), seed=seed)
    assert y[0] == 1.0
    e = fault(hzc, plan("hz_shared_rmw", 1, 64, P(y, "y"), i32(1)), seed=seed)
    # the second thread's read or write of `count` meets the first one's write in the same phase
    assert (e.kind, e.array, e.other_access) == ("shared race", "count", "write")
    assert e.other_thread != e.thread


def test_read_modify_write_of_a_read_only_argument(hzc):
    x = np.zeros(32, np.float32)
    e = fault(hzc, plan("hz_rmw_input", 1, 32, ro("x", x)))
    assert (e.kind, e.array, e.access) == ("write to read-only argument", "x", "write")
    assert (x == 0).all()


# ---------------------------------------------------------------- class 3: global-memory races
def test_global_race_within_a_block(hzc):
    y = np.zeros(64, np.float32)
    run(hzc, plan("hz_global_rmw", 1, 64, P(y, "y"), i32(0)))
    assert (y == 1).all()
    e = fault(hzc, plan("hz_global_rmw", 1, 64, P(np.zeros(64, np.float32), "y"), i32(1)))
    assert (e.kind, e.array, e.index, e.other_block) == ("global race", "y", (0,), (0, 0, 0))
    assert e.other_thread != e.thread and "same barrier phase" in str(e)


def test_global_race_between_blocks(hzc):
    y = np.zeros(4, np.float32)
    run(hzc, plan("hz_global_blocks", 4, 32, P(y, "y"), i32(0)))
    np.testing.assert_array_equal(y, np.arange(4))
    e = fault(hzc, plan("hz_global_blocks", 4, 32, P(np.zeros(4, np.float32), "y"), i32(1)), workers=1)
    assert (e.kind, e.array, e.index, e.access, e.other_access) == ("global race", "y", (0,), "write", "write")
    assert e.other_block != e.block and e.thread == e.other_thread == (0, 0, 0)


def test_global_read_of_another_blocks_write(hzc):
    y = np.zeros(3, np.float32)
    run(hzc, plan("hz_global_reader", 2, 32, P(y, "y"), i32(0)), workers=1)
    e = fault(hzc, plan("hz_global_reader", 2, 32, P(np.zeros(3, np.float32), "y"), i32(1)), workers=1)
    assert (e.kind, e.array, e.index) == ("global race", "y", (0,))
    assert {e.access, e.other_access} == {"read", "write"} and e.other_block != e.block


@pytest.mark.parametrize("seed", [0, 1])
def test_syncthreads_orders_global_memory_in_a_block(hzc, seed):
    y = np.zeros(2, np.float32)
    run(hzc, plan("hz_global_barrier", 1, 64, P(y, "y"), i32(1)), seed=seed)
    assert (y == 5).all()
    e = fault(hzc, plan("hz_global_barrier", 1, 64, P(np.zeros(2, np.float32), "y"), i32(0)), seed=seed)
    assert (e.kind, e.array, e.index) == ("global race", "y", (0,))


def test_global_atomics_are_not_races(hzc):
    total = np.zeros(1, np.int32)
    run(hzc, plan("hz_global_atomics", 3, 64, P(total, "total")))
    assert total[0] == 3 * 64


# ---------------------------------------------------------------- class 4: misaligned, wild, crashes
def test_misaligned_vector_load(hz, hzc):
    """Checked mode: reported before it happens, with the line. Normal mode has no alignment
    check (g++ may load the float4 with unaligned instructions or four scalar ones); where its code
    faults, the fault is an error naming the thread, and the process goes on."""
    x = np.arange(64, dtype=np.float32)
    for mod in (hz, hzc):
        y = np.zeros(32, np.float32)
        run(mod, plan("hz_misaligned", 1, 32, ro("x", x), P(y, "y"), i32(4)))
        assert (y == 4 + 5 + 6 + 7).all()
    try:
        run(hz, plan("hz_misaligned", 1, 32, ro("x", x), P(np.zeros(32, np.float32), "y"), i32(1)))
    except SimError as e:
        assert re.search(r"hz_misaligned .*block \(0,0,0\) thread \(\d+,0,0\): segmentation fault", str(e))
    e = fault(hzc, plan("hz_misaligned", 1, 32, ro("x", x), P(np.zeros(32, np.float32), "y"), i32(1)))
    assert e.kind == "misaligned access" and e.address % 16 == 4
    assert re.search(r"of type 'const (struct )?float4', which needs 16-byte alignment, at .*hazard_probes.cu:\d+", str(e))


@pytest.mark.checked
def test_far_index_is_a_wild_access_in_checked_mode(hzc):
    x = np.arange(8, dtype=np.float32)
    y = np.zeros(4, np.float32)
    run(hzc, plan("hz_far_read", 1, 4, ro("x", x), P(y, "y"), ScalarArg("at", np.int64(5))))
    assert (y == 5).all()
    at = (1 << 31) // 4 + 8   # past 2^31 bytes: far outside every argument
    e = fault(hzc, plan("hz_far_read", 1, 4, ro("x", x), P(y, "y"), ScalarArg("at", np.int64(at))))
    assert (e.kind, e.access, e.nbytes) == ("wild access", "read", 4)


def test_crash_in_normal_mode_is_an_error_naming_the_thread(hz):
    x = np.arange(8, dtype=np.float32)
    with pytest.raises(SimError, match=r"hz_far_read .*block \(0,0,0\) thread \(\d+,0,0\): segmentation fault"):
        run(hz, plan("hz_far_read", 1, 4, ro("x", x), P(np.zeros(4, np.float32), "y"),
                     ScalarArg("at", np.int64(-(1 << 46) // 4))))
    y = np.zeros(8, np.int32)
    run(hz, plan("hz_divide", 1, 8, P(y, "y"), i32(10)))
    assert (y == 100).all()
    with pytest.raises(SimError, match=r"thread \(\d+,0,0\): arithmetic fault \(an integer division by zero\)"):
        run(hz, plan("hz_divide", 1, 8, P(y, "y"), i32(0)))
    # the process goes on: the handler is uninstalled and the next launch works
    run(hz, plan("hz_divide", 1, 8, P(y, "y"), i32(-10)))
    assert (y == -100).all()


# ---------------------------------------------------------------- class 10: spin-waits
def test_volatile_data_gets_the_poll_hooks(source):
    text = launcher.module_text(source, ["hz_spin_shared"])
    assert launcher.has_volatile_data(text)
    assert not launcher.has_volatile_data('asm volatile("x;"); // volatile here\n/* volatile */ int a;')


@pytest.mark.parametrize("seed", [0, 1, 2, 5])
def test_spin_wait_on_a_flag_another_warp_sets(hz, hzc, seed):
    for mod in (hz, hzc):
        y = np.zeros(32, np.int32)
        run(mod, plan("hz_spin_shared", 1, 64, P(y, "y"), i32(0)), seed=seed)
        assert (y == 7).all()
        flag, y = np.zeros(1, np.int32), np.zeros(1, np.int32)
        run(mod, plan("hz_spin_atomic", 1, 64, P(flag, "flag"), P(y, "y"), i32(0)), seed=seed)
        assert y[0] == 3


def test_a_real_deadlock_is_reported_by_the_watchdog(hz, hzc):
    for mod in (hz, hzc):
        with pytest.raises(SimError, match=r"deadlock: \d+ polls .* without progress; warp 0: 32 lane\(s\) poll "
                                           r"__shared__ flag byte 0, .*warp 1: 0 lane\(s\) poll -, .*32 exited"):
            run(mod, plan("hz_spin_shared", 1, 64, P(np.zeros(32, np.int32), "y"), i32(1)))
        with pytest.raises(SimError, match=r"deadlock: .*warp 0: 1 lane\(s\) poll global address"):
            run(mod, plan("hz_spin_atomic", 1, 64, P(np.zeros(1, np.int32), "flag"), P(np.zeros(1, np.int32), "y"),
                          i32(1)))


# ---------------------------------------------------------------- class 9: GPU numerics
def ulps(a, b):
    """Distance in units of the last place between float32 arrays of one sign."""
    return np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64))


def f32(name, v):
    return ScalarArg(name, np.float32(v))


@pytest.mark.skipif(launcher.platform.machine().lower() not in ("x86_64", "amd64"), reason="needs x86-64")
def test_gpu_numerics_rounding_rules(_sim_cache):
    src = probe_source("hazard_probes.cu")
    x = np.linspace(-20, 20, 4001, dtype=np.float32)
    a = b = np.float32(1 + 2.0**-12)
    c = -np.float32(a * b)   # a * b rounded: separately the sum is 0; fused it is 2^-24
    tiny, tiny2 = np.float32(1e-20), np.float32(1e-20)   # 1e-40: subnormal in float32
    outs = {}
    for gpu in (False, True):
        with sim.options(gpu_numerics=gpu) as o:
            mod = launcher.load_source(src, ["hz_numerics"], origin="hazard_probes.cu", options=o)
            out = np.full(x.size + 2, np.nan, np.float32)
            mod.launch(plan("hz_numerics", -(-x.size // 128), 128, PointerArg.of("x", x, writable=False),
                            P(out, "out"), i32(x.size), f32("a", a), f32("b", b), f32("c", c),
                            f32("tiny", tiny), f32("tiny2", tiny2)), o)
            outs[gpu] = out
    exact = np.exp2(x.astype(np.float64)).astype(np.float32)
    np.testing.assert_array_equal(outs[False][: x.size], exact)         # exact mode: correctly rounded
    err = ulps(outs[True][: x.size], exact)
    assert err.max() == 2 and (err > 0).mean() > 0.5                   # gpu: within 2 ulp, and not exact
    assert outs[False][x.size] == 0 and outs[True][x.size] == np.float32(2.0**-24)   # FMA contraction
    assert outs[False][x.size + 1] > 0 and outs[True][x.size + 1] == 0             # flush to zero
