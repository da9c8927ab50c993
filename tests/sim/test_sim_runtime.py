"""The simulator's CUDA built-ins: barriers, shuffles, votes, atomics, shared memory, indices,
16-bit conversions, device math, strictness and limits."""

from __future__ import annotations

import time

import ml_dtypes
import numpy as np
import pytest
from support.simtools import P, i32, plan

from cuflash import sim
from cuflash.runtime.plan import PointerArg, ScalarArg
from cuflash.sim import launcher


def _block_reduce(mod, nblocks=64, threads=128, seed=0, workers=None):
    n = nblocks * threads - 5  # a ragged tail
    x = np.random.default_rng(seed).standard_normal(nblocks * threads).astype(np.float32)
    x[n:] = np.nan
    sums = np.full(nblocks, np.nan, np.float32)
    wmax = np.full(nblocks * threads, np.nan, np.float32)
    with sim.options(seed=seed, workers=workers) as o:
        stats = mod.launch(plan("block_reduce", nblocks, threads, P(x), P(sums), P(wmax), i32(n)), o)
    ref = np.where(np.arange(x.size) < n, x, 0).astype(np.float64).reshape(nblocks, threads).sum(1)
    np.testing.assert_allclose(sums, ref, rtol=1e-5, atol=1e-5)
    xm = np.where(np.arange(x.size) < n, x, -np.inf).reshape(-1, 32).max(1).repeat(32)
    assert np.array_equal(wmax[:n], xm[:n])
    assert np.isnan(wmax[n:]).all()  # never written
    return stats


@pytest.mark.parametrize("workers", [1, 2])
def test_block_reduction_shared_memory_and_shuffles(modules, workers):
    stats = _block_reduce(modules["sim"], workers=workers)
    assert stats.blocks == 64 and stats.threads_per_block == 128
    assert stats.static_smem_bytes == 32 * 4


def test_block_reduction_ucontext_fallback(modules):
    mod = modules["sim_ucontext"]
    assert "-DCUSIM_FIBERS_UCONTEXT=1" in launcher.compile_flags(90, asm_fibers=False)
    _block_reduce(mod, nblocks=8)
    y = np.full(4 * 128, np.nan, np.float32)
    x = np.arange(4 * 128, dtype=np.float32)
    mod.launch(plan("reverse_block", 4, 128, P(x), P(y), i32(1)))
    assert np.array_equal(y, x.reshape(4, 128)[:, ::-1].ravel())


def test_time_per_block_of_128_threads(modules, capsys):
    """Reports the time to simulate one 128-thread block (no timed assertion)."""
    mod = modules["sim"]
    _block_reduce(mod, nblocks=256)  # warm-up
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        stats = _block_reduce(mod, nblocks=256, workers=1)
        best = min(best, stats.seconds)
        assert time.perf_counter() - t0 >= stats.seconds
    per_block = best / 256
    with capsys.disabled():
        print(f"\n[cuflash sim] block_reduce: {per_block * 1e6:.1f} us per 128-thread block "
              f"(one worker, {stats.context_switches / 256:.0f} fiber switches per block)")
    assert per_block > 0


def test_missing_syncthreads_is_detected(modules):
    """Without the barrier, threads read slots others have not written (poisoned NaN)."""
    mod = modules["sim"]
    x = np.arange(4 * 128, dtype=np.float32)
    ref = x.reshape(4, 128)[:, ::-1].ravel()
    y = np.full_like(x, -1)
    mod.launch(plan("reverse_block", 4, 128, P(x), P(y), i32(1)))
    assert np.array_equal(y, ref)
    wrong = []
    for seed in (0, 1):
        y = np.full_like(x, -1)
        with sim.options(seed=seed) as o:
            mod.launch(plan("reverse_block", 4, 128, P(x), P(y), i32(0)), o)
        assert not np.array_equal(y, ref)
        assert np.isnan(y).sum() > 100  # poisoned shared memory, not stale zeros
        wrong.append(y)
    # deterministic for a seed
    y = np.full_like(x, -1)
    with sim.options(seed=1) as o:
        mod.launch(plan("reverse_block", 4, 128, P(x), P(y), i32(0)), o)
    np.testing.assert_array_equal(y, wrong[1])


@pytest.mark.parametrize("width", [32, 8])
def test_shuffles_and_votes(modules, width):
    out = np.full((2, 32, 10), -999, np.int32)
    modules["sim"].launch(plan("warp_ops", 2, 32, P(out), i32(width)))
    lane = np.arange(32)
    v = 100 + lane
    base = lane & ~(width - 1)
    exp = np.empty((32, 10), np.int64)
    exp[:, 0] = v[base + (5 % width)]
    exp[:, 1] = v[base + ((lane + 3) % width)]
    exp[:, 2] = np.where(lane - base >= 2, v[np.maximum(lane - 2, 0)], v)
    exp[:, 3] = np.where(lane - base + 3 < width, v[np.minimum(lane + 3, 31)], v)
    src = lane ^ 5
    exp[:, 4] = np.where((src & ~(width - 1)) > base, v, v[src])
    ballot = sum(1 << int(l) for l in lane if l % 3 == 0)
    exp[:, 5] = np.int32(np.uint32(ballot).view(np.int32))
    exp[:, 6] = 1
    exp[:, 7] = 0
    exp[:, 8] = 1
    exp[:, 9] = np.where(lane < 16, v[lane ^ 1], -1)
    for b in range(2):
        np.testing.assert_array_equal(out[b], exp)


def test_atomics_global_and_shared(modules):
    nb, nt = 6, 96
    fsum = np.zeros(1, np.float32)
    isum = np.zeros(1, np.int32)
    imax = np.full(1, -1, np.int32)
    usum = np.zeros(1, np.uint64)
    counts = np.zeros(nb, np.int32)
    modules["sim"].launch(plan("atomics", nb, nt, P(fsum), P(isum), P(imax), P(usum), P(counts)))
    g = np.arange(nb * nt)
    assert fsum[0] == 0.5 * nb * nt
    assert isum[0] == g.sum()
    assert imax[0] == ((g * 37) % 1001).max()
    assert usum[0] == nb * nt * (1 << 33)
    assert (counts == nt).all()


def test_builtin_indices_3d(modules):
    grid, block = (3, 2, 2), (4, 3, 2)
    nb, nt = 12, 24
    out = np.full((nb, nt, 8), -1, np.int32)
    modules["sim"].launch(plan("indices", grid, block, P(out)))
    for bz in range(2):
        for by in range(2):
            for bx in range(3):
                bid = bx + 3 * (by + 2 * bz)
                for tz in range(2):
                    for ty in range(3):
                        for tx in range(4):
                            tid = tx + 4 * (ty + 3 * tz)
                            assert list(out[bid, tid]) == [tx, ty, tz, bx, by, bz, 432, 322]


def test_shared_memory_kinds(modules):
    x = np.random.default_rng(1).standard_normal(200).astype(np.float32)
    n_dyn = 100
    out = np.full(12 + n_dyn, np.nan, np.float32)
    stats = modules["sim"].launch(plan("shared_kinds", 1, 64, P(x), P(out), i32(n_dyn), smem=n_dyn * 4))
    np.testing.assert_allclose(out[:8], x[:64].reshape(8, 8).sum(0), rtol=1e-6)
    np.testing.assert_allclose(out[8:12], x[:16].reshape(4, 4).sum(0), rtol=1e-6)
    np.testing.assert_array_equal(out[12:], (x[:n_dyn] * 2)[::-1])
    # one static slot per template instantiation: 8x9 and 4x5 floats
    assert stats.static_smem_bytes >= (72 + 20) * 4


def test_unwritten_shared_memory_is_poisoned(modules):
    out = np.zeros(128, np.uint32)
    for _ in range(2):  # also on a worker's second block
        modules["sim"].launch(plan("read_unwritten", 2, 64, P(out), smem=64 * 4))
        assert (out == 0xFFFFFFFF).all()


def test_shared_memory_limits(modules):
    mod = modules["sim"]
    out = np.zeros(64, np.float32)
    with pytest.raises(launcher.SimError, match="static __shared__ memory"):
        modules["too_much_static"].launch(plan("too_much_static", 1, 64, P(out)))
    # 40 KB dynamic: fine without opt-in
    n = 10 * 1024
    mod.launch(plan("big_dynamic", 1, 128, P(out), i32(n), smem=n * 4))
    assert out[0] == n - 1
    # 100 KB: needs the opt-in; allowed on sm_90 (227 KB), not on sm_86 (99 KB)
    n = 25 * 1024
    p = plan("big_dynamic", 1, 128, P(out), i32(n), smem=n * 4)
    assert p.needs_smem_opt_in and p.smem_limit(90) == 227 * 1024 and p.smem_limit(86) == 99 * 1024
    mod.launch(p)
    assert out[0] == n - 1
    with pytest.raises(ValueError, match="sm_86 maximum"):
        p.check_device(86)
    with pytest.raises(ValueError, match="exceed"):
        plan("big_dynamic", 1, 128, P(out), i32(n), smem=228 * 1024).check_device(90)


def test_launch_limits_and_argument_types(modules):
    mod = modules["sim"]
    out = np.zeros(2048, np.float32)
    with pytest.raises(ValueError, match="1026 threads per block"):
        plan("divergent_barrier", 1, (513, 2, 1), P(out))
    with pytest.raises(ValueError, match="block\\[2\\]=65"):
        plan("divergent_barrier", 1, (1, 1, 65), P(out))
    with pytest.raises(ValueError, match="grid\\[1\\]=65536"):
        plan("divergent_barrier", (1, 65536), 32, P(out))
    x = np.zeros(4 * 128, np.float32)
    # int64 where the kernel takes int: caught before launching
    bad = plan("reverse_block", 4, 128, P(x), P(x), ScalarArg("use_barrier", np.int64(1)))
    with pytest.raises(TypeError, match="argument 2 .*4-byte signed integer.*8-byte"):
        mod.launch(bad)
    with pytest.raises(TypeError, match="takes 3 arguments"):
        mod.launch(plan("reverse_block", 4, 128, P(x), P(x)))
    with pytest.raises(TypeError, match="NumPy scalar"):
        ScalarArg("n", 3)


def test_deadlock_and_trap_are_reported(modules):
    out = np.zeros(64, np.float32)
    with pytest.raises(launcher.SimError, match="deadlock"):
        modules["sim"].launch(plan("divergent_barrier", 1, 64, P(out)))
    with pytest.raises(launcher.SimError, match=r"thread \(7,0,0\): __trap"):
        modules["sim"].launch(plan("trap_kernel", 3, 32, P(out)))
    # the module stays usable
    _block_reduce(modules["sim"], nblocks=2)


def test_half_and_bfloat16_conversions_round_to_nearest_even(modules):
    rng = np.random.default_rng(5)
    parts = [
        rng.standard_normal(4000).astype(np.float32) * 10,
        (rng.standard_normal(2000) * 1e-5).astype(np.float32),  # half subnormals
        (rng.standard_normal(1000) * 1e-7).astype(np.float32),  # underflow region
        np.array([65504, 65519.99, 65520, 70000, -70000, np.inf, -np.inf, 0.0, -0.0, 2**-25, 2**-24,
                  1.5 * 2**-25, 1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8, 1 + 3 * 2**-8], np.float32),
        # exact ties of both formats
        (np.arange(1, 3001, dtype=np.float32) * 2**-11 + 1) ,
        rng.integers(0, 2**32, 4000, dtype=np.uint64).astype(np.uint32).view(np.float32),  # any bits
    ]
    x = np.concatenate(parts).astype(np.float32)
    n = x.size
    h = np.zeros(n, np.uint16)
    b = np.zeros(n, np.uint16)
    back = np.zeros(2 * n, np.float32)
    modules["sim"].launch(plan("convert16", -(-n // 256), 256, P(x), P(h), P(b), P(back), i32(n)))
    nan = np.isnan(x)
    with np.errstate(over="ignore", invalid="ignore"):
        eh = x.astype(np.float16)
        eb = x.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(h[~nan], eh.view(np.uint16)[~nan])
    np.testing.assert_array_equal(b[~nan], eb.view(np.uint16)[~nan])
    assert np.isnan(h.view(np.float16)[nan]).all() and np.isnan(b.view(ml_dtypes.bfloat16)[nan]).all()
    np.testing.assert_array_equal(back[0::2][~nan], eh.astype(np.float32)[~nan])
    np.testing.assert_array_equal(back[1::2][~nan], eb.astype(np.float32)[~nan])


def test_every_half_value_converts_back_exactly(modules):
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    x = bits.view(np.float16).astype(np.float32)
    n = x.size
    h = np.zeros(n, np.uint16)
    b = np.zeros(n, np.uint16)
    back = np.zeros(2 * n, np.float32)
    modules["sim"].launch(plan("convert16", n // 1024, 1024, P(x), P(h), P(b), P(back), i32(n)))
    finite = ~np.isnan(x)
    np.testing.assert_array_equal(h[finite], bits[finite])
    np.testing.assert_array_equal(back[0::2][finite], x[finite])


def test_device_math(modules):
    x = np.linspace(-20, 20, 1000, dtype=np.float32)
    out = np.zeros((1000, 8), np.float32)
    modules["sim"].launch(plan("device_math", 4, 256, P(x), P(out), i32(1000)))
    x64 = x.astype(np.float64)
    ref = np.stack([np.exp(x64), np.exp2(x64), np.exp(x64), np.maximum(x64, 0.25), 1 / np.sqrt(np.abs(x64) + 1),
                    x64 / 3, np.log(np.abs(x64) + 1), np.minimum(x64, -0.25)], axis=1)
    np.testing.assert_allclose(out, ref, rtol=2e-6, atol=0)


@pytest.mark.parametrize("mode", [0, 1], ids=["if-else", "per-warp-trip-count"])
def test_barriers_at_two_call_sites_are_reported(modules, mode):
    """CUDA allows __syncthreads in conditional code only where the condition is uniform over the
    block; threads meeting at two call sites are an error naming both (not a silent merge)."""
    out = np.zeros(64, np.float32)
    with pytest.raises(launcher.SimError, match=r"divergent __syncthreads: thread \(\d+,0,0\) waits at "
                                                 r"sim_probes.cu:\d+ while \d+ thread\(s\) of the block wait at "
                                                 r"sim_probes.cu:\d+"):
        modules["sim"].launch(plan("two_barrier_sites", 1, 64, P(out), i32(mode)))


def test_shuffle_from_an_exited_lane_is_reported(modules):
    out = np.full(32, np.nan, np.float32)
    modules["sim"].launch(plan("shfl_from_exited", 1, 32, P(out), i32(0)))
    np.testing.assert_array_equal(out[:16], np.arange(16) ^ 1)
    with pytest.raises(launcher.SimError, match=r"__shfl_sync: lane \d+ reads lane \d+, which has exited"):
        modules["sim"].launch(plan("shfl_from_exited", 1, 32, P(out), i32(1)))


def test_launch_bounds_are_enforced(modules):
    out = np.zeros(256, np.float32)
    modules["sim"].launch(plan("bounded64", 4, 64, P(out)))
    assert (out == 1).all()
    with pytest.raises(launcher.SimError, match=r"launch of 128 threads per block exceeds the kernel's "
                                                 r"__launch_bounds__\(2 \* 32\) = 64 \(PTX ISA .maxntid"):
        modules["sim"].launch(plan("bounded64", 2, 128, P(out)))


def test_restrict_pointers_must_not_alias(modules):
    x = np.arange(64, dtype=np.float32)
    out = np.zeros(64, np.float32)
    modules["sim"].launch(plan("scale_restrict", 1, 64, P(x), P(out), i32(64)))
    np.testing.assert_array_equal(out, 2 * x)
    with pytest.raises(launcher.SimError, match=r"__restrict__ argument out \(written\) overlaps argument in"):
        modules["sim"].launch(plan("scale_restrict", 1, 64, PointerArg.of("in", x), P(x[8:], name="out"), i32(32)))
    y = x.copy()
    modules["sim"].launch(plan("scale_in_place", 1, 64, P(y), P(y), i32(64)))  # no promise: in place is fine
    np.testing.assert_array_equal(y, 2 * x)


@pytest.mark.parametrize("arch,dtype", [("sm_75", np.float32), ("sm_80", np.float16)], ids=["simt", "mma"])
def test_our_kernels_declare_their_launch_bounds(monkeypatch, arch, dtype):
    """The attention kernels' __launch_bounds__(NT) holds in the simulator: a plan with twice the
    threads is refused by the kernel itself."""
    import dataclasses

    import cuflash

    run = launcher.run

    def doubled(p, options=None):
        return run(dataclasses.replace(p, block=(2 * p.block[0],) + tuple(p.block[1:])), options)

    monkeypatch.setattr(launcher, "run", doubled)
    q = np.ones((1, 1, 16, 64), dtype)
    with sim.options(arch=arch), pytest.raises(launcher.SimError, match=r"exceeds the kernel's __launch_bounds__\(NT\)"):
        cuflash.attention(q, q, q, backend="sim")
