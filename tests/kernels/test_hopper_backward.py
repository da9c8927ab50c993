"""The Hopper backward's main stage (``kernels_cu/attention_bwd_sm90.cu``) on the CUDA simulator.

dq, dk, dv against the float64 gradients under the gradient rule of every tier
(:func:`support.grads.check_grads_close`), the tier run directly between the shared dot and
convert stages (:func:`support.device.sim_backward`). The default run takes two small cases of
one variant in checked mode (f16, head dim 128: Sq != Sk, neither a multiple of the tiles, GQA,
non-causal and causal, several query tiles per key tile so the 2-stage ring wraps) and one packed
batch on the same build; ``slow`` runs a pairwise grid over dtype, head dim (64, 96, 128), mask and
lengths, packed batches (``attention_varlen_backward``, ``seqused_k``, hostile device indices),
deterministic mode, and checked mode (races, bounds, proxies, in-flight TMA and bulk reduce-adds)
on the masked and steady loops.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from allpairspy import AllPairs
from support.device import sim_backward
from support.grads import check_grads_close, make_qkv

import cuflash
from cuflash.kernels import attention_bwd_sm90
from cuflash.reference import backward as ref_backward
from cuflash.runtime import dtypes
from cuflash.runtime.options import Options

MASKS = {"none": (False, (-1, -1)), "causal": (True, (-1, -1)), "window": (False, (40, 7)),
         "causal_win": (True, (70, -1)), "narrow": (False, (0, 0))}
DTYPES = {"f16": dtypes.float16, "bf16": dtypes.bfloat16}


def run_case(sq, sk, d, heads, mask, dtype_key="f16", *, seed=0, checked=False, deterministic=False):
    """One case on the simulator, held to the gradient rule; returns the gradients."""
    rng = np.random.default_rng(sq * 31 + sk + d)
    hq, hk = heads
    dtype = DTYPES[dtype_key]
    q, k, v = make_qkv(rng, 1, hq, hk, sq, sk, d, d, dtype=dtype)
    causal, window = MASKS[mask]
    kw = dict(causal=causal, window_size=window)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **kw)  # the NumPy forward
    dout = rng.standard_normal(out.shape).astype(dtype)
    with cuflash.sim.options(arch="sm_90", seed=seed, checked=checked):
        grads = sim_backward(attention_bwd_sm90, dout, q, k, v, out, lse, deterministic=deterministic, **kw)
    for g, x in zip(grads, (q, k, v)):
        assert g.dtype == dtype and g.shape == x.shape
    check_grads_close(grads, dout, q, k, v, out, lse, **kw)
    return grads


@pytest.mark.checked
@pytest.mark.parametrize("sq,sk,heads,mask", [(70, 150, (2, 1), "none"), (200, 77, (1, 1), "causal"),
                                           (150, 150, (1, 1), "causal_win")])   # both masked loops and the steady one
def test_default_cases(sq, sk, heads, mask):
    # in checked mode (races, bounds, proxies, TMA and bulk reduce-adds in flight): the build the
    # mutation probe bwd_sm90_checked and the Hopper row of test_edge_cases_checked also use
    grads = run_case(sq, sk, 128, heads, mask, checked=True)
    if mask == "causal":   # Sq > Sk: the first Sq - Sk rows see no key
        assert (grads[0][:, :, : sq - sk] == 0).all()


GRID = [tuple(c) for c in AllPairs([[1, 70, 130, 300], [1, 97, 150, 260], [64, 96, 128], [(1, 1), (4, 2)], list(MASKS),
                                     list(DTYPES)])]


@pytest.mark.slow
@pytest.mark.parametrize("case", GRID, ids=["-".join(map(str, c)).replace(" ", "") for c in GRID])
def test_grid(case):
    sq, sk, d, heads, mask, dt = case
    run_case(sq, sk, d, heads, mask, dt)


@pytest.mark.slow
@pytest.mark.checked
@pytest.mark.parametrize("sq,sk,d,heads,mask,dt", [(70, 150, 128, (2, 1), "causal", "f16"),
                                                   (200, 77, 64, (4, 2), "none", "bf16"),
                                                   (260, 129, 128, (1, 1), "causal_win", "f16"),
                                                   (70, 150, 96, (2, 1), "none", "f16"),
                                                   (200, 77, 96, (1, 1), "causal", "bf16")])
def test_checked(sq, sk, d, heads, mask, dt):
    run_case(sq, sk, d, heads, mask, dt, checked=True)


@pytest.mark.slow
def test_seeds_agree_bitwise_in_dk_dv():
    """dK and dV have one writer per element (no adds across blocks): every thread order gives
    the same bits."""
    a = run_case(130, 150, 64, (2, 1), "causal", seed=0)
    b = run_case(130, 150, 64, (2, 1), "causal", seed=3)
    for x, y in zip(a[1:], b[1:]):
        np.testing.assert_array_equal(x, y)


def _with_workspace(monkeypatch, *case, workers, runner=None, **kw):
    """``(the float32 dQ workspace's bits after the main stage, the gradients)`` of one case run on
    ``workers`` simulator threads (the workspace read through a spy on the launcher) by ``runner``
    (:func:`run_case`, or :func:`run_packed`)."""
    from cuflash.sim import launcher

    got, real = [], launcher.run

    def spy(plan, options=None):
        stats = real(plan, options)
        if isinstance(plan.variant, attention_bwd_sm90.Sm90BackwardVariant):
            arg = next(a for a in plan.args if getattr(a, "name", "") == "dq_accum")
            got.append(np.array(arg.base, copy=True).view(np.uint32))
        return stats

    monkeypatch.setattr(launcher, "run", spy)
    try:
        with cuflash.sim.options(workers=workers):
            grads = (runner or run_case)(*case, **kw)
    finally:
        monkeypatch.setattr(launcher, "run", real)
    assert len(got) == 1
    return got[0], grads


# 3 and 4 key tiles add to a query tile (two contributions would commute: no order to see); the
# causal case staggers the blocks' walks (key tile n starts at query tile 2n), so without the
# counters key tile 2 adds to query tile 4 before key tiles 0 and 1 on three workers
DET_CASES = [(300, 300, 64, (2, 1), "causal", "f16"), (130, 400, 128, (4, 2), "none", "bf16")]


@pytest.mark.slow
@pytest.mark.checked
@pytest.mark.parametrize("case", DET_CASES, ids=[f"{c[4]}-{c[5]}-d{c[2]}" for c in DET_CASES])
def test_deterministic_adds_in_key_tile_order(monkeypatch, case):
    """Deterministic mode: on three worker threads (blocks in parallel) and three thread orders
    (seeds; checked mode on one), the float32 dQ workspace has the bits of one worker running the
    blocks one after another (the adds in key-tile order), and dq, dk, dv the same bits on every
    run, each within the gradient rule of the float64 oracle (run_case)."""
    ref, _ = _with_workspace(monkeypatch, *case, workers=1)
    runs = [_with_workspace(monkeypatch, *case, workers=3, seed=s, checked=(s == 0), deterministic=True)
            for s in (0, 1, 7)]
    for ws, grads in runs:
        assert (ws == ref).all(), f"{int((ws != ref).sum())} of {ws.size} workspace words differ"
        for x, y in zip(runs[0][1], grads):
            np.testing.assert_array_equal(x.view(np.uint16), y.view(np.uint16))


#: (query length, key length) of each sequence of a packed batch: lengths 0 and 1, shorter than a
#: tile, several tiles, keys past the longest query run
EDGES = [(5, 7), (0, 9), (1, 1), (130, 140), (0, 20), (40, 0), (17, 200)]


def run_packed(lengths, heads, d, mask, used, dtype_key="f16", *, checked=False, seed=0, deterministic=False):
    """A packed batch through ``cuflash.attention_varlen_backward`` on the simulator (the Hopper
    backward, as explain says), each sequence held to the gradient rule against its own float64
    oracle; keys past ``seqused_k`` (``used="some"``: every other sequence uses half its keys) are
    NaN in k and v (never to be read) and get dk = dv = 0. Returns the gradients."""
    from support.inputs import make_batch
    from support.tolerance import check_packed_backward

    rng = np.random.default_rng(len(lengths) * 7 + d + heads[0])
    hq, hk = heads
    dt = DTYPES[dtype_key]
    q, k, v, cq, ck, mq, mk, used_k = make_batch(rng, lengths, hq, hk, d, d, dt, used)
    if used_k is not None:
        for b in range(len(lengths)):
            k[ck[b] + used_k[b]:ck[b + 1]] = np.nan
            v[ck[b] + used_k[b]:ck[b + 1]] = np.nan
    causal, window = MASKS[mask]
    kw = dict(causal=causal, window_size=window)
    out, lse = cuflash.attention_varlen(q, k, v, cq, ck, mq, mk, seqused_k=used_k, return_lse=True, **kw)  # NumPy
    dout = rng.standard_normal(out.shape).astype(dt)
    info = cuflash.explain_varlen(q, k, v, cq, ck, mq, mk, seqused_k=used_k, arch=90, **kw)
    assert info["backward"] == f"sm_90: backward on the Hopper wgmma tier, cuflash_attn_bwd_sm90_main_{dtype_key}_d{d}", info
    with cuflash.sim.options(arch="sm_90", seed=seed, checked=checked):
        grads = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, mq, mk, seqused_k=used_k,
                                                  deterministic=deterministic, backend="sim", **kw)
    check_packed_backward(grads, dout, q, k, v, out, lse, cq, ck, used_k, **kw)
    return grads


PACKED = [(EDGES, (4, 2), 64, "causal", "some", "f16"), ([(300, 280)], (2, 1), 128, "window", "all", "bf16"),
          ([(17, 1), (1, 17), (64, 64), (0, 0), (129, 200)], (8, 2), 96, "causal_win", "some", "bf16"),
          ([(200, 77), (3, 130)], (1, 1), 128, "none", "some", "f16"), (EDGES, (2, 2), 96, "narrow", "all", "f16")]


@pytest.mark.slow
@pytest.mark.parametrize("case", PACKED, ids=[f"{len(c[0])}seq-{c[2]}-{c[3]}-{c[4]}-{c[5]}" for c in PACKED])
def test_packed_batches(case):
    run_packed(*case)


@pytest.mark.checked
def test_packed_default_case():
    # in checked mode, on the build test_default_cases compiles (f16, head dim 128): sequences
    # without keys, without queries, shorter than a tile, and one of 150 keys using 75 (seqused_k:
    # its second key tile only writes zero rows, its first and its query tile straddle the ends;
    # the unused keys are NaN), causal, GQA
    run_packed([(5, 7), (0, 9), (40, 150), (30, 0)], (2, 1), 128, "causal", "some", checked=True)


@pytest.mark.slow
@pytest.mark.checked
def test_packed_checked():
    run_packed([(17, 1), (1, 17), (64, 64), (0, 0), (129, 200)], (2, 1), 64, "causal", "some", "bf16", checked=True)


@pytest.mark.slow
@pytest.mark.checked
def test_packed_deterministic_adds_in_key_tile_order(monkeypatch):
    """Deterministic mode on a packed batch: on three worker threads and three thread orders (one
    checked), the float32 dQ workspace has the bits of one worker running the blocks in order, and
    the gradients the same bits on every run (the 300-row causal sequence has three key tiles
    adding to its last query tiles; the counters are per sequence)."""
    case = ([(40, 30), (300, 300), (0, 5), (70, 200)], (2, 1), 64, "causal", "all", "f16")
    ref, _ = _with_workspace(monkeypatch, *case, workers=1, runner=run_packed)
    runs = [_with_workspace(monkeypatch, *case, workers=3, runner=run_packed, seed=s, checked=(s == 0),
                            deterministic=True) for s in (0, 1, 7)]
    for ws, grads in runs:
        assert (ws == ref).all(), f"{int((ws != ref).sum())} of {ws.size} workspace words differ"
        for x, y in zip(runs[0][1], grads):
            np.testing.assert_array_equal(x.view(np.uint16), y.view(np.uint16))


@pytest.mark.slow
@pytest.mark.checked
@pytest.mark.parametrize("deterministic", [False, True])
def test_packed_hostile_indices_stay_inside_the_arrays(deterministic):
    """Device-resident indices are not read by the host: whatever they hold, the Hopper backward
    clamps every index into the arrays (checked mode reports any access outside q, k, v, dout,
    lse, the workspace, dk, dv or the deterministic counters), as the other tiers do
    (tests/api/test_varlen.py). The problem is built from valid indices, then handed garbage as if
    unchecked: sequence 1 claims 38 query rows, more than max_seqlen_q = 33 allows for."""
    from support.device import on_device, sim_call
    from support.inputs import make_batch
    from support.options import check_varlen

    from cuflash.kernels import dispatch

    rng = np.random.default_rng(2)
    q, k, v, cq, ck, mq, mk, _ = make_batch(rng, [(5, 7), (0, 3), (33, 40)], 2, 1, 64, 64, dtypes.float16)
    problem = check_varlen(q, k, v, cq, ck, mq, mk, deterministic=deterministic)
    bad_q = np.array([5, -7, 10**6, 2], np.int32)   # -> [5, 5), [0, 38), [38, 38)
    bad_k = np.array([0, 80, 90, 2**31 - 1], np.int32)   # -> [0, 50), [50, 50), [50, 50)
    used = np.array([10**6, -3, 1], np.int32)
    vl = dataclasses.replace(problem.varlen, cu_seqlens_q=bad_q, cu_seqlens_k=bad_k, seqused_k=used, checked=False)
    hostile = dataclasses.replace(problem, varlen=vl)
    with cuflash.sim.options(arch="sm_90", checked=True), sim_call(q) as call:
        p, qd, kd, vd = on_device(call, hostile, q, k, v)
        out = call.import_array(np.ones(q.shape, q.dtype))
        lse = call.import_array(np.zeros((2, q.shape[0]), np.float32))
        assert dispatch.backward_tier(p, 90, (qd, kd, vd, out, out)) is attention_bwd_sm90
        grads = dispatch.run_backward(p, out, qd, kd, vd, out, lse, call)
    # sequence 0 owns keys [0, 50) and no query: dk = dv = 0 there; rows no tile covers stay NaN
    assert (grads[1][:50] == 0).all() and (grads[2][:50] == 0).all()
    assert (grads[0] == 0).all()


def _problem(d=128, dv=128, dtype=dtypes.float16, **opts):
    rng = np.random.default_rng(0)
    q, k, v = make_qkv(rng, 1, 2, 1, 9, 5, d, dv, dtype=dtype)
    out = np.zeros(q.shape[:-1] + (dv,), dtype)
    lse = np.zeros(q.shape[:-1], np.float32)
    return ref_backward.check_backward(out, q, k, v, out, lse, Options(**opts), func="test", max_head_dim=256)


@pytest.mark.parametrize("kw,words", [
    (dict(d=80, dv=80), "(D, Dv) = (80, 80): the Hopper backward takes D = Dv in (64, 96, 128) exactly so far"),
    (dict(d=192, dv=128), "a consumer thread would hold 272 float32 accumulator registers"),
    (dict(d=256, dv=256), "setmaxnreg gives 240) and the tiles would take 362496 B of shared memory"),
    (dict(d=128, dv=64), "(D, Dv) = (128, 64)"),
    (dict(dtype=np.float32), "float16/bfloat16"),
])
def test_refusals_name_the_reason(kw, words):
    p = _problem(kw.get("d", 128), kw.get("dv", 128), kw.get("dtype", dtypes.float16), **kw.get("opts", {}))
    assert words in attention_bwd_sm90.unsupported_reason(p, 90)


def test_plan_refuses_mismatched_shapes():
    q = np.zeros((1, 2, 9, 64), np.float16)
    k = np.zeros((1, 1, 5, 64), np.float16)
    lse = np.zeros((1, 2, 9), np.float32)
    acc = np.zeros((1, 1, 2, 9, 64), np.float32)
    with pytest.raises(ValueError, match="dout"):
        attention_bwd_sm90.plan_main((q, k, k, q[:, :1], k, k), lse, lse, acc, None, softmax_scale=1.0, dtype="f16")


def test_dispatcher_picks_the_hopper_backward_on_cc90_and_says_why_not_elsewhere():
    from cuflash.kernels import attention_bwd_mma, dispatch

    p = _problem(64, 64)
    assert dispatch.backward_tier(p, 90) is attention_bwd_sm90
    assert dispatch.describe_backward_choice(p, 90).startswith("sm_90: Hopper wgmma tier, cuflash_attn_bwd_sm90_main_f16_d64")
    assert dispatch.backward_tier(p, 80) is attention_bwd_mma
    assert "Hopper wgmma tier not used" in dispatch.describe_backward_choice(p, 100)
    assert dispatch.backward_tier(_problem(128, 128, deterministic=True), 90) is attention_bwd_sm90
    assert dispatch.describe_backward_choice(_problem(96, 96), 90).startswith(
        "sm_90: Hopper wgmma tier, cuflash_attn_bwd_sm90_main_f16_d96")
    line = dispatch.describe_backward_choice(_problem(192, 128), 90)
    assert line.startswith("sm_90: tensor-core mma.sync tier") and "Hopper wgmma tier not used: (D, Dv) = (192, 128)" in line


@pytest.mark.slow
@pytest.mark.parametrize("layout,form,dt,d", [("bshd", "plain", "bf16", 128), ("bhsd", "dout_transposed", "f16", 64)])
def test_public_backward_in_both_layouts(layout, form, dt, d):
    """Through ``cuflash.attention_backward`` (the dispatcher's choice asserted): batch 2, GQA,
    causal, a bshd layout or a non-contiguous dout (a bhsd view of bshd storage)."""
    from cuflash.kernels import dispatch

    rng = np.random.default_rng(5)
    dtype = DTYPES[dt]
    q, k, v = make_qkv(rng, 2, 4, 2, 90, 140, d, d, layout=layout, dtype=dtype)
    kw = dict(causal=True, layout=layout)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **kw)
    dout = rng.standard_normal(out.shape).astype(dtype)
    if form == "dout_transposed":
        dout = np.ascontiguousarray(dout.swapaxes(1, 2)).swapaxes(1, 2)
    p = ref_backward.check_backward(dout, q, k, v, out, lse, Options(**kw), func="test", max_head_dim=256)
    assert dispatch.backward_tier(p, 90, (q, k, v, out, dout)) is attention_bwd_sm90
    with cuflash.sim.options(arch="sm_90"):
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, backend="sim", **kw)
    check_grads_close(grads, dout, q, k, v, out, lse, **kw)


@pytest.mark.slow
@pytest.mark.checked
def test_d96_reads_only_the_views_in_nan_filled_buffers():
    """Head dim 96 through the public backward: q, k, v, dout are views into NaN-filled buffers (a
    head sliced off, 24 extra columns past the 96, a 16-byte offset). The tiles' columns 96..127
    must be the tensor maps' zero fill: a NaN anywhere in the gradients, or a checked-mode report,
    means the kernel read outside the views."""
    from cuflash.kernels import dispatch

    rng = np.random.default_rng(11)
    dt = dtypes.bfloat16

    def view(b, h, s, c):
        buf = np.full((b, h + 1, s, c + 24), np.nan, dt)
        x = buf[:, 1:, :, 8:8 + c]
        x[...] = rng.standard_normal(x.shape).astype(dt)
        return x

    q, k, v, dout = view(2, 4, 150, 96), view(2, 2, 130, 96), view(2, 2, 130, 96), view(2, 4, 150, 96)
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    p = ref_backward.check_backward(dout, q, k, v, out, lse, Options(), func="test", max_head_dim=256)
    assert dispatch.backward_tier(p, 90, (q, k, v, out, dout)) is attention_bwd_sm90
    with cuflash.sim.options(arch="sm_90", checked=True):
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, backend="sim")
    assert not any(np.isnan(g.astype(np.float32)).any() for g in grads)
    check_grads_close(grads, dout, q, k, v, out, lse)
