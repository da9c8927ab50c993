"""Packed variable-length batches: ``cuflash.attention_varlen`` and its backward (issue 21).

Every sequence of a packed batch is held to the float64 oracle of a fixed-shape call on its own
slices (the tolerance rules of tests/support/tolerance.py and
tests/reference/test_backward_reference.py), on the NumPy path and on the simulator's tiers
(tensor-core on sm_90 and sm_80, SIMT on sm_75; the Hopper tier's packed forms have their own
grid in tests/kernels/test_hopper_varlen.py), over a pairwise covering design of batches with
mixed lengths (0, 1, up to 300), GQA, head dims 40 to 256 with Dv != D, causal and windows,
``seqused_k``, both dtypes and both backward modes; in checked mode; deterministic bits across
thread orders; hostile device-style indices that the kernels must clamp; the validation messages;
the roofline of the packed kernels against the fixed-shape ones.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from allpairspy import AllPairs
from support.grids import default_share
from support.tiers import without_tensor_cores
from support.device import on_device, sim_call
from support.inputs import make_batch
from support.options import check_varlen
from support.tolerance import check_packed_backward as check_backward
from support.tolerance import check_packed_forward as check_forward

import cuflash
from cuflash.kernels import attention_bwd_sm90, attention_fwd_sm90, backward_run, dispatch
from cuflash.runtime import dtypes

#: (query length, key length) of each sequence of a batch
BATCHES = {
    "one_empty": [(0, 0)],
    "single_token": [(1, 1)],
    "mixed3": [(5, 7), (0, 3), (33, 40)],
    "long": [(300, 280)],
    "mixed5": [(17, 1), (1, 17), (64, 64), (0, 0), (129, 200)],
}
HEADS = [(1, 1), (4, 1), (8, 2)]
HEAD_DIMS = [40, 64, 128, 176, 256]
DV = ["same", "other"]
MASKS = {"none": (False, (-1, -1)), "causal": (True, (-1, -1)), "window": (False, (9, 4)),
         "causal_win": (True, (20, -1))}
USED = ["all", "some"]
DTYPES = {"f16": dtypes.float16, "bf16": dtypes.bfloat16}
TIERS = ["mma_sm90", "mma_sm80", "simt_sm75"]
MODES = ["atomic", "deterministic"]
ARCH = {"mma_sm90": "sm_90", "mma_sm80": "sm_80", "simt_sm75": "sm_75", "mma_sm75": "sm_75"}

AXES = [list(BATCHES), HEADS, HEAD_DIMS, DV, list(MASKS), USED, list(DTYPES), TIERS, MODES]
PAIRWISE = [tuple(c) for c in AllPairs(AXES)]


def run_case(rng, batch, heads, d, dv_kind, mask, used, dtype_key, tier, mode, *, checked=False, seed=0):
    if tier == "mma_sm90":   # the tensor-core tier on sm_90: without the Hopper tiers, which take aligned packed calls
        with pytest.MonkeyPatch.context() as mp:   # (tests/kernels/test_hopper_backward.py runs the Hopper backward's)
            mp.setattr(dispatch, "TIERS", tuple(t for t in dispatch.TIERS if t[1] is not attention_fwd_sm90))
            mp.setattr(dispatch, "BACKWARD_TIERS", tuple(t for t in dispatch.BACKWARD_TIERS if t[1] is not attention_bwd_sm90))
            return _run_case(rng, batch, heads, d, dv_kind, mask, used, dtype_key, tier, mode, checked=checked,
                             seed=seed)
    if tier == "simt_sm75":   # the portable tier on sm_75: without the tensor-core tier's sm_75 form (float16)
        with pytest.MonkeyPatch.context() as mp:
            without_tensor_cores(mp)
            return _run_case(rng, batch, heads, d, dv_kind, mask, used, dtype_key, tier, mode, checked=checked,
                             seed=seed)
    return _run_case(rng, batch, heads, d, dv_kind, mask, used, dtype_key, tier, mode, checked=checked, seed=seed)


def _run_case(rng, batch, heads, d, dv_kind, mask, used, dtype_key, tier, mode, *, checked=False, seed=0):
    hq, hk = heads
    dv = d if dv_kind == "same" else HEAD_DIMS[(HEAD_DIMS.index(d) + 2) % len(HEAD_DIMS)]
    dt = DTYPES[dtype_key]
    q, k, v, cq, ck, mq, mk, used_k = make_batch(rng, BATCHES[batch], hq, hk, d, dv, dt, used)
    causal, window = MASKS[mask]
    kw = dict(causal=causal, window_size=window)
    out, lse = cuflash.attention_varlen(q, k, v, cq, ck, mq, mk, seqused_k=used_k, return_lse=True, **kw)  # NumPy
    check_forward(out, lse, q, k, v, cq, ck, used_k, **kw)
    problem = check_varlen(q, k, v, cq, ck, mq, mk, seqused_k=used_k, **kw)
    arch = int(ARCH[tier][3:])
    want = "attention_fwd_simt" if tier.startswith("simt") else "attention_fwd_mma"
    assert dispatch.forward_tier(problem, arch, (q, k, v)).__name__.endswith(want)
    with cuflash.sim.options(arch=ARCH[tier], checked=checked, seed=seed):
        o_sim, l_sim = cuflash.attention_varlen(q, k, v, cq, ck, mq, mk, seqused_k=used_k, return_lse=True,
                                                backend="sim", **kw)
        check_forward(o_sim, l_sim, q, k, v, cq, ck, used_k, **kw)
        dout = rng.standard_normal(out.shape).astype(dt)
        grads = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, mq, mk, seqused_k=used_k,
                                                  deterministic=mode == "deterministic", backend="sim", **kw)
    check_backward(grads, dout, q, k, v, out, lse, cq, ck, used_k, **kw)
    numpy_grads = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, mq, mk, seqused_k=used_k, **kw)
    check_backward(numpy_grads, dout, q, k, v, out, lse, cq, ck, used_k, **kw)
    return o_sim, grads


@pytest.mark.parametrize("case", default_share(range(len(PAIRWISE)), ["-".join(map(str, c)) for c in PAIRWISE],
                                              key=lambda i: PAIRWISE[i]))
def test_pairwise_grid(case, rng):
    # the simulator's thread-order seed varies over the grid (0..3): copies land early or late
    run_case(rng, *PAIRWISE[case], seed=case % 4)


#: the tensor-core tier's sm_75 (Turing) form: the design's cases in float16 (slow: a build per variant)
SM75_CASES = sorted({c[:6] + ("f16", "mma_sm75") + c[8:] for c in PAIRWISE})


@pytest.mark.slow
@pytest.mark.parametrize("case", SM75_CASES, ids=["-".join(map(str, c)) for c in SM75_CASES])
def test_sm75_tensor_core_form(case, rng):
    run_case(rng, *case)


@pytest.mark.checked
@pytest.mark.slow
def test_sm75_checked(rng):
    for mode in MODES:
        run_case(rng, "mixed5", (4, 2), 64, "same", "causal", "some", "f16", "mma_sm75", mode, checked=True)
    # bucket 128: the 128 x 16 tile, whose next K/V tile waits in registers across the math
    run_case(rng, "mixed5", (4, 2), 128, "same", "causal", "some", "f16", "mma_sm75", MODES[0], checked=True)


@pytest.mark.checked
@pytest.mark.parametrize("tier", [t if t == "mma_sm90" else pytest.param(t, marks=pytest.mark.slow) for t in TIERS])
def test_checked_mode(tier, rng, monkeypatch):   # (the default run: the tier an H200 runs packed batches on)
    monkeypatch.setattr(backward_run, "MAX_DETERMINISTIC_SPLITS", 2)
    # each case in one backward mode (the modes' shared code runs in both cases; each mode's own
    # dQ path in one); the pairwise grid runs both modes unchecked
    atomic, deterministic = MODES
    run_case(rng, "mixed5", (4, 2), 64, "other", "causal", "some", "bf16", tier, atomic, checked=True)
    run_case(rng, "long", (2, 1), 128, "same", "window", "all", "f16", tier, deterministic, checked=True)


@pytest.mark.parametrize("tier", ["mma_sm90", "simt_sm75"])
def test_deterministic_bits_across_thread_orders(tier, monkeypatch):
    monkeypatch.setattr(backward_run, "MAX_DETERMINISTIC_SPLITS", 2)
    a = run_case(np.random.default_rng(3), "mixed5", (4, 2), 128, "same", "causal", "all", "bf16", tier,
                 "deterministic", seed=1)[1]
    b = run_case(np.random.default_rng(3), "mixed5", (4, 2), 128, "same", "causal", "all", "bf16", tier,
                 "deterministic", seed=777)[1]
    for x, y in zip(a, b):
        assert np.array_equal(x.view(np.uint16), y.view(np.uint16))


@pytest.mark.usefixtures("without_hopper_tier")   # (the packed form runs on the tensor-core tier)
def test_matches_fixed_shape_calls_bit_for_bit_per_sequence(rng):
    # one sequence of a packed batch is the same computation as a fixed-shape call on its slices
    q, k, v, cq, ck, mq, mk, _ = make_batch(rng, BATCHES["mixed3"], 4, 2, 64, 64, dtypes.bfloat16)
    with cuflash.sim.options(arch="sm_90"):
        packed = cuflash.attention_varlen(q, k, v, cq, ck, mq, mk, causal=True, backend="sim")
        for b in (0, 2):
            rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
            alone = cuflash.attention(q[None, rq], k[None, rk], v[None, rk], causal=True, layout="bshd", backend="sim")
            assert np.array_equal(packed[rq].view(np.uint16), alone[0].view(np.uint16))


@pytest.mark.parametrize("tier", ["mma_sm90", pytest.param("simt_sm75", marks=pytest.mark.slow)])
def test_hostile_indices_stay_inside_the_arrays(tier, rng, monkeypatch):
    """Device-resident indices are not read by the host: whatever they hold, the kernels clamp
    every index into the arrays (checked mode would report any access outside q, k, v, out or
    lse), and rows no tile covers come out NaN (the fresh output is NaN-filled), never stale
    data. The problem is built from valid indices, then handed garbage as if unchecked."""
    monkeypatch.setattr(dispatch, "TIERS", tuple(t for t in dispatch.TIERS if t[1] is not attention_fwd_sm90))
    monkeypatch.setattr(dispatch, "BACKWARD_TIERS",
                        tuple(t for t in dispatch.BACKWARD_TIERS if t[1] is not attention_bwd_sm90))
    q, k, v, cq, ck, mq, mk, _ = make_batch(rng, BATCHES["mixed3"], 2, 1, 64, 64, dtypes.float16)
    problem = check_varlen(q, k, v, cq, ck, mq, mk)
    # decreasing, negative, past the end; clamped, the sequences do not overlap (overlapping
    # ones would race on dk/dv between blocks, inside the arrays, which checked mode reports too)
    bad_q = np.array([5, -7, 10**6, 2], np.int32)   # -> [5, 5), [0, 38), [38, 38)
    bad_k = np.array([0, 80, 90, 2**31 - 1], np.int32)   # -> [0, 50), [50, 50), [50, 50)
    used = np.array([10**6, -3, 1], np.int32)
    vl = dataclasses.replace(problem.varlen, cu_seqlens_q=bad_q, cu_seqlens_k=bad_k, seqused_k=used, checked=False)
    hostile = dataclasses.replace(problem, varlen=vl)
    with cuflash.sim.options(arch=ARCH[tier], checked=True), sim_call(q) as call:
        p, qd, kd, vd = on_device(call, hostile, q, k, v)
        out, lse = dispatch.run_forward(p, qd, kd, vd, None, call)
        dout = call.import_array(np.ones(out.shape, out.dtype))
        grads = dispatch.run_backward(p, dout, qd, kd, vd, out, call.import_array(np.nan_to_num(lse, nan=0.0)), call)
    # the one non-empty query sequence has no key: output 0, lse -inf; no query sees any key:
    # every gradient 0 (and nothing NaN: every row of this batch is covered by a tile)
    assert (out == 0).all() and np.isneginf(lse).all()
    assert all((g == 0).all() for g in grads)


BAD = [
    (lambda a: dict(a, cu_seqlens_q=a["cu_seqlens_q"].astype(np.int64)), TypeError, "cu_seqlens_q must be int32"),
    (lambda a: dict(a, cu_seqlens_k=a["cu_seqlens_k"][None]), ValueError, "cu_seqlens_k must be 1-D"),
    (lambda a: dict(a, cu_seqlens_k=a["cu_seqlens_k"][:-1]), ValueError, r"cu_seqlens_k.shape=\(3,\) must be \(4,\)"),
    (lambda a: dict(a, cu_seqlens_q=a["cu_seqlens_q"] + 1), ValueError, r"cu_seqlens_q\[0\]=1 must be 0"),
    (lambda a: dict(a, cu_seqlens_q=np.array([0, 5, 3, 78], np.int32)), ValueError, "must be non-decreasing"),
    (lambda a: dict(a, cu_seqlens_k=np.array([0, 7, 10, 49], np.int32)), ValueError,
     r"cu_seqlens_k\[-1\]=49 must equal k.shape\[0\]=50"),
    (lambda a: dict(a, max_seqlen_q=20), ValueError, "max_seqlen_q=20 is smaller than sequence 2's length 33"),
    (lambda a: dict(a, max_seqlen_k=39), ValueError, "max_seqlen_k=39 is smaller than sequence 2's length 40"),
    (lambda a: dict(a, max_seqlen_k=-1), ValueError, r"max_seqlen_k=-1 must be in \[0"),
    (lambda a: dict(a, max_seqlen_k=1.5), TypeError, "max_seqlen_k must be an int"),
    (lambda a: dict(a, seqused_k=np.array([1, 2], np.int32)), ValueError, r"seqused_k.shape=\(2,\) must be \(3,\)"),
    (lambda a: dict(a, seqused_k=np.array([8, 0, 0], np.int32)), ValueError, r"seqused_k\[0\]=8 must be in \[0, 7\]"),
    (lambda a: dict(a, q=a["q"][None]), ValueError, "q.ndim must be 3"),
    (lambda a: dict(a, v=a["v"][:-1]), ValueError, r"v.shape\[0\]=49 must equal k.shape\[0\]=50"),
    (lambda a: dict(a, k=a["k"][:, :, :32], v=a["v"][:, :, :32]), ValueError, r"k.shape\[-1\]=32 must equal q.shape\[-1\]=64"),
    (lambda a: dict(a, q=a["q"][:, :3]), ValueError, "3 query heads must be a multiple of"),
    (lambda a: dict(a, k=a["k"].astype(np.float32)), TypeError, "k.dtype=float32 must equal q.dtype=float16"),
    (lambda a: dict(a, cu_seqlens_q=[0, 5, 5, 38]), TypeError, "cu_seqlens_q must be an array"),
]


@pytest.mark.parametrize("edit,exc,match", BAD, ids=[b[2][:40] for b in BAD])
def test_bad_input_is_refused_before_any_work(edit, exc, match, rng):
    q, k, v, cq, ck, mq, mk, _ = make_batch(rng, BATCHES["mixed3"], 4, 2, 64, 64, dtypes.float16)
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=mq, max_seqlen_k=mk)
    for backend in ("numpy", "sim"):
        with pytest.raises(exc, match=match):
            cuflash.attention_varlen(**edit(args), backend=backend)
    with pytest.raises(exc, match=match):   # explain validates as the call does
        cuflash.explain_varlen(**edit(args), arch=90)


def test_backward_bad_input(rng):
    q, k, v, cq, ck, mq, mk, _ = make_batch(rng, BATCHES["mixed3"], 4, 2, 64, 64, dtypes.float16)
    out, lse = cuflash.attention_varlen(q, k, v, cq, ck, mq, mk, return_lse=True)
    with pytest.raises(ValueError, match=r"lse.shape=\(38, 4\) must be \(4, 38\)"):
        cuflash.attention_varlen_backward(out, q, k, v, out, lse.T, cq, ck, mq, mk)
    with pytest.raises(ValueError, match=r"dout.shape=\(38, 4, 32\) must be \(38, 4, 64\)"):
        cuflash.attention_varlen_backward(out[..., :32], q, k, v, out, lse, cq, ck, mq, mk)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        cuflash.attention_varlen_backward(out, q, k, v, out, lse, cq, ck, mq, mk, deterministic=1)


@pytest.mark.usefixtures("without_hopper_tier")   # (the tensor-core tier's packed form; the Hopper one's out=:
def test_empty_batch_and_out(rng):                # tests/kernels/test_hopper_varlen.py)
    q, k, v, cq, ck, mq, mk, _ = make_batch(rng, BATCHES["mixed3"], 2, 1, 64, 64, dtypes.float16)
    empty = np.zeros(1, np.int32)
    z = cuflash.attention_varlen(q[:0], k[:0], v[:0], empty, empty, 0, 0, backend="sim")
    assert z.shape == (0, 2, 64)
    buf = np.full(q.shape[:2] + (64,), np.nan, np.float16)
    got, lse = cuflash.attention_varlen(q, k, v, cq, ck, mq, mk, out=buf, return_lse=True, backend="sim")
    assert got is buf
    check_forward(buf, lse, q, k, v, cq, ck, None)


def test_torch_cpu_tensors_come_back_as_tensors(rng):
    torch = pytest.importorskip("torch")
    q, k, v, cq, ck, mq, mk, _ = make_batch(rng, BATCHES["mixed3"], 2, 1, 32, 32, np.float32)
    out, lse = cuflash.attention_varlen(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v),
                                        torch.from_numpy(cq), torch.from_numpy(ck), mq, mk, causal=True,
                                        return_lse=True)
    assert isinstance(out, torch.Tensor) and isinstance(lse, torch.Tensor)
    check_forward(out.numpy(), lse.numpy(), q, k, v, cq, ck, None, causal=True)


#: (query, key) lengths with Sq < Sk, Sq > Sk, Sq = Sk, an empty sequence and one without keys
WINDOW_BATCH = [(5, 9), (9, 5), (12, 12), (0, 4), (3, 0), (1, 1)]


def test_windows_apply_per_sequence_numpy(rng):
    """A window is each sequence's own (bottom-right aligned per sequence), whatever max_seqlen
    says: bounds at and around every sequence's lengths, with and without causal, with
    max_seqlen the longest lengths and above them, each sequence against the float64 oracle."""
    q, k, v, cq, ck, mq, mk, _ = make_batch(rng, WINDOW_BATCH, 2, 1, 16, 16, np.float32)
    bounds = sorted({n + d for pair in WINDOW_BATCH for n in pair for d in (-2, -1, 0, 1)} | {2**31 - 1, 2**40})
    bounds = [b for b in bounds if b >= 0]
    for mx in ((mq, mk), (40, 100), (mq, 2**31 - 257)):
        for left in bounds:
            for right, causal in ((-1, False), (-1, True), (4, False), (11, False), (12, True)):
                kw = dict(causal=causal, window_size=(left, right))
                out, lse = cuflash.attention_varlen(q, k, v, cq, ck, *mx, return_lse=True, **kw)
                check_forward(out, lse, q, k, v, cq, ck, None, **kw)


@pytest.mark.parametrize("window", [(2**31 - 194, -1), (2**31 + 5, 3)])
def test_max_seqlen_above_the_longest_keeps_the_window_exact(window, rng):
    """flash-attn's ``max_seqlen`` may exceed the longest sequence. Bounds are normalised with
    what any sequence can hold (``max_seqlen`` or the total rows, whichever is smaller), so a
    window that reaches past every sequence is unbounded, not a number near 2**31 that the
    kernels' 32-bit bound arithmetic wraps (sequence 0's rows saw no key) or that does not fit
    their int32 argument (OverflowError)."""
    q, k, v, cq, ck, _, _, _ = make_batch(rng, [(300, 10), (5, 40), (0, 3)], 2, 1, 64, 64, np.float16)
    mx = (300, 2**31 - 257)
    problem = check_varlen(q, k, v, cq, ck, *mx, window_size=window)
    assert (problem.window_left, problem.window_right) == (-1, window[1])
    out, lse = cuflash.attention_varlen(q, k, v, cq, ck, *mx, window_size=window, return_lse=True, backend="sim")
    check_forward(out, lse, q, k, v, cq, ck, None, window_size=window)
