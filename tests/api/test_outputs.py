"""``out=`` and the arrays a device call must import, on every target.

The simulator target runs the device call a GPU call runs (:class:`cuflash.runtime.device_call.DeviceCall`
on a :class:`cuflash.sim.device.SimDevice`), so what it imports, allocates and hands back is the
GPU path's, and the simulator's launcher refuses any pointer to memory the call did not import.
Two defects of the earlier per-entry-point device code are pinned here: a KV-cache call with
``out=`` wrote into a fresh buffer and returned the caller's unwritten one, and the packed and
KV-cache calls never imported their ALiBi slopes and sinks.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.device import to_device
from support.inputs import make_batch

import cuflash
from cuflash.kernels import launch_args
from cuflash.runtime import dtypes
from cuflash.runtime.plan import LaunchPlan, PointerArg
from cuflash.sim import launcher
from cuflash.sim.memory import is_sim_array

TARGETS = ["numpy", "sim"]


def _kvcache_call(rng, **extra):
    q = rng.standard_normal((2, 3, 4, 64)).astype(dtypes.float16)
    kc = np.full((2, 40, 2, 64), np.nan, dtypes.float16)
    vc = np.full_like(kc, np.nan)
    lengths = np.array([5, 17], np.int32)
    for b, n in enumerate(lengths):
        kc[b, :n] = rng.standard_normal((n, 2, 64)).astype(dtypes.float16)
        vc[b, :n] = rng.standard_normal((n, 2, 64)).astype(dtypes.float16)
    k = rng.standard_normal((2, 3, 2, 64)).astype(dtypes.float16)
    v = rng.standard_normal((2, 3, 2, 64)).astype(dtypes.float16)
    return q, kc, vc, lengths, dict(k=k, v=v, causal=True, **extra)


@pytest.mark.parametrize("backend", TARGETS)
def test_kvcache_out_is_written_and_returned(backend, rng):
    """A CUDA-graph decode loop passes out=: the result must land in it (the earlier CUDA path
    let the kernel write a fresh buffer and returned the caller's, unwritten)."""
    q, kc, vc, lengths, kw = _kvcache_call(rng)
    want = cuflash.attention_with_kvcache(q, kc.copy(), vc.copy(), lengths, backend="numpy", **kw)
    out = np.full(want.shape, np.nan, dtypes.float16)
    got, lse = cuflash.attention_with_kvcache(q, kc, vc, lengths, out=out, return_lse=True, backend=backend, **kw)
    assert got is out
    assert not np.isnan(out.astype(np.float32)).any(), "out= was not written"
    np.testing.assert_allclose(out.astype(np.float32), want.astype(np.float32), atol=2e-3)
    assert lse.shape == (2, 4, 3) and np.isfinite(lse).all()


@pytest.mark.parametrize("backend", TARGETS)
def test_every_entry_point_with_out_writes_into_it_and_returns_it(backend, rng):
    # attention (both layouts), attention_varlen, attention_with_kvcache; NumPy and torch CPU callers
    torch = pytest.importorskip("torch")
    q = rng.standard_normal((1, 2, 33, 64)).astype(dtypes.float16)
    k = rng.standard_normal((1, 2, 40, 64)).astype(dtypes.float16)
    for layout, (qq, kk) in (("bhsd", (q, k)), ("bshd", (q.swapaxes(1, 2).copy(), k.swapaxes(1, 2).copy()))):
        want = cuflash.attention(qq, kk, kk, causal=True, layout=layout)
        out = np.full(want.shape, np.nan, want.dtype)
        assert cuflash.attention(qq, kk, kk, causal=True, layout=layout, out=out, backend=backend) is out
        np.testing.assert_allclose(out.astype(np.float32), want.astype(np.float32), atol=2e-3)
    t = torch.from_numpy
    tout = torch.full(want.shape, float("nan"), dtype=torch.float16)
    assert cuflash.attention(t(qq), t(kk), t(kk), causal=True, layout="bshd", out=tout, backend=backend) is tout
    np.testing.assert_allclose(tout.float().numpy(), want.astype(np.float32), atol=2e-3)

    qv, kv, vv, cq, ck, mq, mk, _ = make_batch(rng, [(5, 7), (0, 3), (33, 40)], 4, 2, 64, 64, dtypes.float16)
    want = cuflash.attention_varlen(qv, kv, vv, cq, ck, mq, mk, causal=True)
    out = np.full(want.shape, np.nan, want.dtype)
    assert cuflash.attention_varlen(qv, kv, vv, cq, ck, mq, mk, causal=True, out=out, backend=backend) is out
    np.testing.assert_allclose(out.astype(np.float32), want.astype(np.float32), atol=2e-3)

    q, kc, vc, lengths, kw = _kvcache_call(rng)
    want = cuflash.attention_with_kvcache(q, kc.copy(), vc.copy(), lengths, **kw)
    tout = torch.full(want.shape, float("nan"), dtype=torch.float16)
    got = cuflash.attention_with_kvcache(t(q), t(kc), t(vc), t(lengths), out=tout, backend=backend,
                                         **{n: t(x) if isinstance(x, np.ndarray) else x for n, x in kw.items()})
    assert got is tout
    np.testing.assert_allclose(tout.float().numpy(), want.astype(np.float32), atol=2e-3)


def test_varlen_imports_its_alibi_slopes(rng):
    """The packed forward and backward on the simulator with ALiBi: the slopes reach the kernels
    as device memory (the earlier CUDA path passed the caller's host array to the launch)."""
    q, k, v, cq, ck, mq, mk, _ = make_batch(rng, [(5, 7), (0, 3), (33, 40)], 4, 2, 64, 64, dtypes.bfloat16)
    slopes = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)
    want, lse = cuflash.attention_varlen(q, k, v, cq, ck, mq, mk, causal=True, alibi_slopes=slopes, return_lse=True)
    got = cuflash.attention_varlen(q, k, v, cq, ck, mq, mk, causal=True, alibi_slopes=slopes, backend="sim")
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), atol=2e-2)
    dout = rng.standard_normal(want.shape).astype(q.dtype)
    grads = cuflash.attention_varlen_backward(dout, q, k, v, want, lse, cq, ck, mq, mk, causal=True,
                                              alibi_slopes=slopes, backend="sim")
    numpy_grads = cuflash.attention_varlen_backward(dout, q, k, v, want, lse, cq, ck, mq, mk, causal=True,
                                                    alibi_slopes=slopes)
    for g, w in zip(grads, numpy_grads):
        w = w.astype(np.float64)
        assert np.abs(g.astype(np.float64) - w).max() <= 2e-2 * max(1.0, np.abs(w).max())


def test_kvcache_imports_its_alibi_slopes_and_sinks(rng):
    q, kc, vc, lengths, kw = _kvcache_call(rng, alibi_slopes=np.array([0.3, 0.2, 0.1, 0.05], np.float32),
                                           sinks=np.array([0.5, -1.0, 2.0, 0.0], np.float32), softcap=20.0)
    want = cuflash.attention_with_kvcache(q, kc.copy(), vc.copy(), lengths, **kw)
    for splits in (1, 3):
        got = cuflash.attention_with_kvcache(q, kc.copy(), vc.copy(), lengths, num_splits=splits, backend="sim", **kw)
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), atol=2e-3)


def test_the_simulators_launcher_refuses_memory_the_call_never_imported():
    from cuflash.kernels.dropout_mask import plan_raw

    counters, words = np.zeros((1, 4), np.uint32), np.zeros((1, 4), np.uint32)
    with pytest.raises(TypeError, match="argument counters is a ndarray, not simulated device memory: the call never "
                                        "imported it"):
        launcher.run(plan_raw(counters, to_device(words), (0, 0)))
    launcher.run(plan_raw(to_device(counters), to_device(words), (0, 0)))   # imported: it runs
    assert words.any()


def test_the_empty_index_and_modifier_views_are_device_memory():
    """What the argument builders hand a launch for an absent array is the device's own."""
    from support.device import sim_call

    q = np.zeros((1, 2, 8, 64), np.float16)
    with sim_call(q) as call:
        assert is_sim_array(call.empty_index) and call.empty_index.shape == (0,)
        one = call.unit_scale   # an absent scale: device memory holding 1.0
        assert is_sim_array(one) and one.shape == (1,) and one.dtype == np.float32 and float(np.asarray(one)[0]) == 1.0
        assert launch_args.modifier_views(type("P", (), {"modifiers": None})(), call) == {}
        arg = PointerArg.of("x", call.empty_index)
        assert is_sim_array(arg.base)
        with pytest.raises(TypeError, match="not simulated device memory"):
            launcher.run(LaunchPlan(None, "k", (1, 1, 1), (1, 1, 1), 0, (PointerArg.of("x", np.zeros(1)),)))
