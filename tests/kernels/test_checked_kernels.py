"""The real kernels under the simulator's checked mode (``cuflash.sim.options(checked=True)``).

Every launch of ``cuflash.attention(..., backend="sim")`` and ``cuflash.softmax(..., backend="sim")``
runs instrumented: a global access outside an argument's view, a read of unwritten shared memory or
a shared-memory race raises :class:`cuflash.sim.SimCheckError`. A small set of shapes that stress
the bounds (packed qkv views and views inside NaN-filled buffers, GQA, causal, odd lengths, head
dims 40 and 256, every dtype) must pass with no report and the right results.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from support.tolerance import check_close

import cuflash
from cuflash import reference as ref
from cuflash import sim
from cuflash import softmax
from cuflash.runtime import dtypes
from cuflash.sim import launcher

pytestmark = pytest.mark.checked

DTYPES = {"f16": dtypes.float16, "bf16": dtypes.bfloat16, "f32": dtypes.float32}


@pytest.fixture(autouse=True)
def _checked():
    with sim.options(checked=True):
        yield


def _packed_qkv(rng, dtype, b, s, h, d):
    """q, k, v as bshd views of one packed (B, S, 3, H, D) buffer inside a NaN-filled larger one."""
    buf = np.full((b, s + 2, 3, h, d + 3), np.nan, dtype)
    qkv = buf[:, 1 : s + 1, :, :, :d]
    qkv[...] = rng.standard_normal(qkv.shape).astype(dtype)
    return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]


def _nan_padded(rng, shape, dtype):
    buf = np.full(tuple(n + 3 for n in shape), np.nan, dtype)
    view = buf[tuple(slice(1, n + 1) for n in shape)]
    view[...] = rng.standard_normal(shape).astype(dtype)
    return view


CASES = [
    # (name, dtype, B, Hq, Hk, Sq, Sk, D, causal, form)
    ("packed_f16_d40", "f16", 1, 2, 2, 17, 17, 40, False, "packed"),
    ("gqa_causal_bf16_d40", "bf16", 2, 4, 2, 33, 97, 40, True, "padded"),
    ("causal_f32_d256_odd", "f32", 1, 2, 1, 19, 9, 256, True, "padded"),
    ("packed_bf16_d256_causal", "bf16", 1, 2, 2, 13, 13, 256, True, "packed"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_attention_checked_no_report(case, rng):
    _, key, b, hq, hk, sq, sk, d, causal, form = case
    dtype = DTYPES[key]
    if form == "packed":
        q, k, v = _packed_qkv(rng, dtype, b, sq, hq, d)
        layout = "bshd"
    else:
        q = _nan_padded(rng, (b, hq, sq, d), dtype)
        k = _nan_padded(rng, (b, hk, sk, d), dtype)
        v = _nan_padded(rng, (b, hk, sk, d), dtype)
        layout = "bhsd"
    out, lse = cuflash.attention(q, k, v, causal=causal, layout=layout, return_lse=True, backend="sim")
    check_close(out, q, k, v, causal=causal, layout=layout)
    _, lse_ref = ref.naive_attention(q, k, v, causal=causal, layout=layout, return_lse=True)
    empty = np.isneginf(lse_ref)
    assert np.array_equal(np.isneginf(lse), empty)
    np.testing.assert_allclose(lse[~empty], lse_ref[~empty], rtol=2e-5, atol=2e-4)


def test_attention_checked_catches_a_plan_that_understates_a_view(rng, monkeypatch):
    """The checks are live on cuflash.attention's path: with a plan whose q region is one row
    short, the first read of the missing row is reported."""
    q, k, v = (_nan_padded(rng, (1, 1, 9, 40), np.float32) for _ in range(3))
    run = launcher.run

    def shrunk(plan, options=None):
        qa = plan.args[0]
        short = dataclasses.replace(qa, shape=qa.shape[:-2] + (qa.shape[-2] - 1, qa.shape[-1]))
        return run(dataclasses.replace(plan, args=(short,) + plan.args[1:]), options)

    monkeypatch.setattr(launcher, "run", shrunk)
    with pytest.raises(sim.SimCheckError) as info:
        cuflash.attention(q, k, v, backend="sim")
    e = info.value
    assert (e.kind, e.array, e.access) == ("out-of-bounds read", "q", "read")
    assert e.index[-2] == 8 and 0 <= e.index[-1] < 40 and e.kernel.startswith("cuflash_attn")


@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
def test_softmax_checked_no_report(dtype, rng):
    big = (rng.standard_normal((5, 1200)) * 3).astype(DTYPES[dtype])
    big[:, 1150:] = np.nan
    # strided views inside a NaN-padded buffer; one warp per row (<= 1024 columns) and one block per row
    for x in (big[1:4, 3:290], big[::2, :33], big[1:4, 5:1105]):
        y = softmax(x, backend="sim")
        x64 = x.astype(np.float64)
        e = np.exp(x64 - x64.max(-1, keepdims=True))
        np.testing.assert_allclose(y.astype(np.float64), e / e.sum(-1, keepdims=True), rtol=1e-2, atol=1e-6)


CP_ASYNC_PROBE = r"""
#include "common.cuh"
#include "ptx.cuh"
// Each thread copies one 16-byte chunk into shared memory with cp.async, waits, and after a
// barrier reads its neighbour's chunk (plainly, then through ldmatrix).
extern "C" __global__ void cp_async_then_read(const __half* __restrict__ g, float* __restrict__ out, int zfill) {
    __shared__ __align__(16) __half s[32 * 8];
    const int t = threadIdx.x;
    ptx_cp_async_16_zfill(s + t * 8, g + t * 8, zfill && t % 2 ? 0 : 16);
    ptx_cp_async_commit();
    ptx_cp_async_wait<0>();
    __syncthreads();
    unsigned r[4];
    ptx_ldmatrix_x4(r, s + ((t + 1) % 32) * 8);
    out[t] = __half2float(s[((t + 1) % 32) * 8]) + (r[0] == 0xffffffffu ? 1e30f : 0.0f);
}
"""


@pytest.mark.parametrize("zfill", [0, 1])
def test_cp_async_landing_counts_as_written(zfill):
    # Bytes that cp.async lands (copied or zero-filled) are initialized shared memory: reading them
    # after the wait and a barrier is no report (a regression: the landing once went unseen).
    from cuflash.runtime import plan, source

    text = source.build_text(CP_ASYNC_PROBE, origin="cp_async_probe.cu")
    g = np.arange(256).astype(np.float16)
    out = np.full(32, np.nan, np.float32)
    opts = sim.current_options()
    assert opts.checked
    mod = launcher.load_source(text, origin="cp_async_probe.cu", options=opts)
    plan = plan.LaunchPlan(None, "cp_async_then_read", (1, 1, 1), (32, 1, 1), 0, (
        plan.PointerArg.of("g", g), plan.PointerArg.of("out", out, writable=True),
        plan.ScalarArg("zfill", np.int32(zfill))))
    mod.launch(plan, opts)
    nxt = (np.arange(32) + 1) % 32
    expected = np.where(zfill & (nxt % 2 == 1), 0.0, g[nxt * 8].astype(np.float32))
    np.testing.assert_array_equal(out, expected)


def test_cp_async_read_past_a_view_is_reported():
    # cp.async's global read is checked like any load: one chunk past the view is an error.
    from cuflash.runtime import plan, source

    text = source.build_text(CP_ASYNC_PROBE, origin="cp_async_probe.cu")
    big = np.arange(512).astype(np.float16)
    view = big[:248]  # the last thread's 16-byte chunk runs 8 elements past the view
    out = np.zeros(32, np.float32)
    opts = sim.current_options()
    mod = launcher.load_source(text, origin="cp_async_probe.cu", options=opts)
    plan = plan.LaunchPlan(None, "cp_async_then_read", (1, 1, 1), (32, 1, 1), 0, (
        plan.PointerArg.of("g", view), plan.PointerArg.of("out", out, writable=True),
        plan.ScalarArg("zfill", np.int32(0))))
    with pytest.raises(sim.SimCheckError, match=r"out-of-bounds read .* at g\[248\]"):
        mod.launch(plan, opts)


@pytest.mark.parametrize("dtype,sq,sk,d,causal", [("f16", 40, 71, 40, True), ("bf16", 33, 50, 128, False),
                                                  ("f16", 17, 129, 96, True)])
@pytest.mark.usefixtures("without_hopper_tier")
def test_tensor_core_kernel_is_clean(dtype, sq, sk, d, causal):
    # aligned fp16/bf16 views: the dispatcher picks the mma.sync kernel (cp.async, ldmatrix)
    rng = np.random.default_rng(sq * 1000 + d)
    dt = DTYPES[dtype]
    q = rng.standard_normal((1, 2, sq, d)).astype(dt)
    k = rng.standard_normal((1, 1, sk, d)).astype(dt)
    v = rng.standard_normal((1, 1, sk, d)).astype(dt)
    assert "tensor-core" in cuflash.explain(q, k, v, causal=causal, backend="sim")["choice"]
    out = cuflash.attention(q, k, v, causal=causal, backend="sim")
    check_close(out, q, k, v, causal=causal)


CP_ASYNC_HAZARDS = r"""
#include "common.cuh"
#include "ptx.cuh"
// Two warps; thread 0 fills s[0..7] with one cp.async. mode 0: the correct order (issue, commit,
// wait, barrier, thread 32 reads). 1: thread 0 reads before any wait. 2: thread 32 reads after
// thread 0's wait but with no barrier between. 3: write-after-read: thread 32 reads s, then (no
// barrier) thread 0 refills it. 4: thread 32 reads s while thread 0's copy is in flight, a
// barrier having passed (the copy crossed it without its wait).
extern "C" __global__ void cp_async_hazards(const __half* __restrict__ g, float* __restrict__ out, int mode) {
    __shared__ __align__(16) __half s[8];
    const int t = threadIdx.x;
    if (t == 0) s[0] = __float2half(0.0f);
    if (t == 0) for (int i = 1; i < 8; ++i) s[i] = __float2half(0.0f);
    __syncthreads();
    float x = 0.0f;
    if (mode == 3 && t == 32) x = __half2float(s[0]);
    if (t == 0) {
        ptx_cp_async_16(s, g);
        ptx_cp_async_commit();
        if (mode == 1) x = __half2float(s[1]);
        if (mode != 4) ptx_cp_async_wait<0>();
    }
    if (mode == 0 || mode == 4) __syncthreads();
    if ((mode == 0 || mode == 2 || mode == 4) && t == 32) x = __half2float(s[2]);
    if (mode == 4) {
        __syncthreads();
        if (t == 0) ptx_cp_async_wait<0>();
    }
    out[t] = x;
}
"""


@pytest.mark.parametrize("mode,kind", [(0, None), (1, "cp.async in flight"), (2, "shared race"), (3, "shared race"),
                                       (4, "cp.async in flight")],
                         ids=["correct", "read-before-wait", "no-barrier-after-wait", "refill-while-read",
                              "read-across-barrier-in-flight"])
def test_cp_async_hazards_are_reported(mode, kind):
    """An access to bytes a cp.async is still filling, by any thread, is an error; the copy counts
    as the issuer's write at issue (so a refill of bytes another thread read in the same barrier
    phase is a race) and again at its wait (so a reader needs a barrier after the wait)."""
    from cuflash.runtime import plan, source

    text = source.build_text(CP_ASYNC_HAZARDS, origin="cp_async_hazards.cu")
    g = np.arange(1, 9).astype(np.float16)
    out = np.full(64, np.nan, np.float32)
    opts = dataclasses.replace(sim.current_options(), arch=80)
    mod = launcher.load_source(text, origin="cp_async_hazards.cu", options=opts)
    p = plan.LaunchPlan(None, "cp_async_hazards", (1, 1, 1), (64, 1, 1), 0, (
        plan.PointerArg.of("g", g), plan.PointerArg.of("out", out, writable=True), plan.ScalarArg("mode", np.int32(mode))))
    if kind is None:
        mod.launch(p, opts)
        assert out[32] == 3.0  # thread 32 saw the landed copy
        return
    with pytest.raises(sim.SimCheckError) as info:
        mod.launch(p, opts)
    assert info.value.kind == kind, str(info.value)
    if kind == "cp.async in flight":
        assert info.value.other_thread == (0, 0, 0) and "still filling it" in str(info.value)
