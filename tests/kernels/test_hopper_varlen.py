"""Packed batches on the Hopper forward (``kernels_cu/attention_fwd_sm90.cu``, its varlen forms) on
the simulator as an sm_90 device runs them.

Each sequence is held to the float64 oracle of a fixed-shape call on its own slices (the
tolerance rule, tests/support/tolerance.py), and every case asserts the dispatcher chose the
Hopper tier. The packed arrays are views inside NaN-filled buffers, the keys and values past each
sequence's ``seqused_k`` are NaN, and so are those of the sequences without query rows (keys
other sequences must never read); ``out=`` is a view inside a buffer of a sentinel value that
must stay untouched. A device-resident index that lays a later sequence's rows before an earlier
one's shows a store that would spill past a sequence's end (blocks run in order on one worker).

The default run uses one variant (f16, head-dim bucket 64, causal or windowed:
``cuflash_attn_fwd_sm90_f16_d64_local_varlen``, which tests/api/test_outputs.py runs too); the
covering grid over dtypes, every head-dim bucket, GQA up to 8, masks and lengths, checked mode and
thread orders run under ``slow``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from allpairspy import AllPairs
from support.device import on_device, sim_call
from support.options import check_varlen
from support.tolerance import check_packed_forward

import cuflash
from cuflash.kernels import attention_fwd_sm90, dispatch
from cuflash.runtime import dtypes

DTYPES = {"f16": dtypes.float16, "bf16": dtypes.bfloat16}
SENTINEL = 3.5


def _packed(rng, shape, dtype, pad=3):
    """A random ``(rows, H, D)`` array as a TMA-aligned view inside a NaN-filled buffer (``pad``
    NaN rows before and after, 8 NaN columns either side)."""
    rows, h, d = shape
    big = np.full((rows + 2 * pad, h, d + 16), np.nan, dtype)
    view = big[pad:pad + rows, :, 8:8 + d]
    view[...] = rng.standard_normal(shape).astype(dtype)
    return view


def make_case(rng, lengths, hq, hk, d, dv, dtype, used):
    """q, k, v (views in NaN), cu_seqlens_q/k, max lengths, seqused_k (None for ``used="all"``;
    ``"some"``: every other sequence uses about half of its keys); keys and values past
    ``seqused_k``, and those of sequences without queries, are NaN."""
    lq = np.array([a for a, _ in lengths], np.int64)
    lk = np.array([b for _, b in lengths], np.int64)
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    q = _packed(rng, (int(cq[-1]), hq, d), dtype)
    k = _packed(rng, (int(ck[-1]), hk, d), dtype)
    v = _packed(rng, (int(ck[-1]), hk, dv), dtype)
    used_k = None if used == "all" else np.array([n // 2 if b % 2 == 0 else n for b, n in enumerate(lk)], np.int32)
    for b in range(len(lengths)):
        first = ck[b] + (lk[b] if used_k is None else used_k[b]) if lq[b] else ck[b]
        k[first:ck[b + 1]] = np.nan
        v[first:ck[b + 1]] = np.nan
    return q, k, v, cq, ck, int(lq.max(initial=0)), int(lk.max(initial=0)), used_k


def _out_view(q, dv):
    """``out=``: a view inside a buffer of SENTINEL (rows before and after, columns either side)."""
    rows, h, _ = q.shape
    big = np.full((rows + 4, h, dv + 16), SENTINEL, q.dtype)
    return big, big[2:2 + rows, :, 8:8 + dv]


MASKS = {"none": (False, (-1, -1)), "causal": (True, (-1, -1)), "window": (False, (9, 4)),
         "causal_win": (True, (20, -1)), "one_key": (False, (0, 0))}


def run_case(rng, lengths, heads, d, dv, mask, used, dtype_key, mods=None, **opts):
    """(``mods``: the score modifiers, softcap and ALiBi slopes of shape (Hq,), passed to the call and
    the oracle alike.)"""
    hq, hk = heads
    dt = DTYPES[dtype_key]
    q, k, v, cq, ck, mq, mk, used_k = make_case(rng, lengths, hq, hk, d, dv, dt, used)
    causal, window = MASKS[mask]
    kw = dict(causal=causal, window_size=window, **(mods or {}))
    problem = check_varlen(q, k, v, cq, ck, mq, mk, seqused_k=used_k, **kw)
    line = dispatch.describe_choice(problem, 90, (q, k, v))
    assert dispatch.forward_tier(problem, 90, (q, k, v)) is attention_fwd_sm90, line
    big, out = _out_view(q, dv)
    before = big.copy()
    with cuflash.sim.options(arch="sm_90", **opts):
        got, lse = cuflash.attention_varlen(q, k, v, cq, ck, mq, mk, seqused_k=used_k, return_lse=True, out=out,
                                            backend="sim", **kw)
    assert got is out
    check_packed_forward(out, lse, q, k, v, cq, ck, used_k, **kw)
    outside = np.ones(big.shape, bool)
    outside[2:2 + q.shape[0], :, 8:8 + dv] = False
    np.testing.assert_array_equal(big[outside].view(np.uint16), before[outside].view(np.uint16))
    for b in range(len(lengths)):   # a sequence without keys: output 0 (lse -inf is check_packed_forward's)
        if ck[b + 1] == ck[b] or (used_k is not None and used_k[b] == 0):
            assert (out[cq[b]:cq[b + 1]] == 0).all()
    return line


#: (query length, key length) of each sequence: lengths 0 and 1, shorter than a tile, several tiles
EDGES = [(5, 7), (0, 9), (1, 1), (130, 140), (0, 20), (40, 0), (17, 200)]


@pytest.mark.parametrize("mask,heads,d,dv,used", [
    ("causal", (4, 2), 64, 64, "some"),
    ("causal_win", (8, 1), 40, 56, "all"),
    ("window", (2, 1), 48, 48, "some"),
])
def test_packed_batch_on_the_hopper_tier(mask, heads, d, dv, used):
    # (every case here is f16 in the head-dim bucket 64 with a mask: one variant)
    lengths = EDGES if mask != "window" else [(300, 280), (0, 13), (64, 64), (129, 257), (1, 0)]
    line = run_case(np.random.default_rng(len(mask) + d), lengths, heads, d, dv, mask, used, "f16")
    assert "cuflash_attn_fwd_sm90_f16_d64_local_varlen" in line and "ragged tensor maps" in line


def _mods(rng, hq, names, batch=1):
    m = {}
    if "softcap" in names:
        m["softcap"] = 4.0
    if "alibi" in names:   # (Hq,), or one row per sequence (B, Hq) with "alibi_b"
        m["alibi_slopes"] = rng.uniform(0.02, 0.4, (batch, hq) if "alibi_b" in names else hq).astype(np.float32)
    return m


def test_packed_batch_with_softcap_and_alibi_on_the_hopper_tier():
    """softcap and ALiBi (bottom-right per sequence: its own Sk - Sq) on the packed form, with
    lengths 0 and 1, sequences shorter than a tile and over several, half-used keys."""
    rng = np.random.default_rng(41)
    line = run_case(rng, EDGES, (4, 2), 64, 64, "causal", "some", "f16", _mods(rng, 4, ("softcap", "alibi")))
    assert "cuflash_attn_fwd_sm90_f16_d64_local_mods_varlen" in line and "ragged tensor maps" in line


MODS_GRID = [
    (EDGES, (8, 1), 128, 128, "none", "all", "bf16", ("softcap", "alibi")),
    ([(300, 280), (0, 13), (64, 64), (129, 257), (1, 0)], (2, 1), 64, 64, "window", "some", "f16", ("alibi", "alibi_b")),
    (EDGES, (6, 3), 192, 128, "causal_win", "all", "bf16", ("softcap",)),
    ([(1, 1), (130, 140), (40, 0)], (4, 1), 256, 256, "causal", "some", "f16", ("softcap", "alibi")),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", MODS_GRID, ids=[f"{c[2]}-{c[4]}-{c[6]}-{'_'.join(c[7])}" for c in MODS_GRID])
def test_packed_mods_grid(case):
    rng = np.random.default_rng(len(case[4]) + case[2])
    *args, names = case
    run_case(rng, *args, _mods(rng, args[1][0], names, len(args[0])))


@pytest.mark.slow
@pytest.mark.checked
def test_packed_mods_checked_mode():
    rng = np.random.default_rng(43)
    run_case(rng, EDGES, (4, 2), 64, 64, "causal", "some", "f16", _mods(rng, 4, ("softcap", "alibi")), checked=True)


def _reversed_index_case(**opts):
    """Sequence 0 owns query rows [5, 38), sequence 2 rows [0, 5) (sequence 1 is empty): indices
    as a device could hold them, which the host never reads. On one worker blocks run in order,
    so sequence 2's blocks store after sequence 0's: a store past sequence 2's end would
    overwrite sequence 0's rows."""
    rng = np.random.default_rng(21)
    q, k, v, cq, ck, mq, mk, _ = make_case(rng, [(33, 40), (0, 0), (5, 10)], 2, 1, 64, 64, dtypes.float16, "all")
    problem = check_varlen(q, k, v, cq, ck, mq, mk, causal=True)
    q = np.concatenate([q[33:], q[:33]])   # rows 0..4: sequence 2's, rows 5..37: sequence 0's
    bad_q = np.array([5, 38, 0, 5], np.int32)
    vl = dataclasses.replace(problem.varlen, cu_seqlens_q=bad_q, checked=False)
    with cuflash.sim.options(arch="sm_90", workers=1, **opts), sim_call(q) as call:
        p, qd, kd, vd = on_device(call, dataclasses.replace(problem, varlen=vl), q, k, v)
        assert dispatch.forward_tier(p, 90, (qd, kd, vd)) is attention_fwd_sm90
        out, lse = dispatch.run_forward(p, qd, kd, vd, None, call)
        out, lse = np.asarray(out), np.asarray(lse)
    # each sequence as if packed in order
    order = np.r_[5:38, 0:5]
    check_packed_forward(out[order], lse[:, order], q[order], k, v, cq, ck, None, causal=True)


def test_a_store_never_spills_into_the_next_rows():
    _reversed_index_case()


def test_explain_names_the_packed_form_and_why_other_forms_go_to_the_tensor_cores():
    rng = np.random.default_rng(2)
    q, k, v, cq, ck, mq, mk, _ = make_case(rng, [(5, 7), (130, 140)], 4, 2, 128, 128, dtypes.bfloat16, "all")
    plain = check_varlen(q, k, v, cq, ck, mq, mk)
    line = dispatch.describe_choice(plain, 90, (q, k, v))
    assert line.startswith("sm_90: Hopper wgmma tier, cuflash_attn_fwd_sm90_bf16_d128_varlen: packed sequences"), line
    line = dispatch.describe_choice(check_varlen(q, k, v, cq, ck, mq, mk, softcap=5.0), 90, (q, k, v))
    assert line.startswith("sm_90: Hopper wgmma tier, cuflash_attn_fwd_sm90_bf16_d128_mods_varlen: packed"), line
    for kw, why in ((dict(dropout_p=0.1, dropout_seed=3), "dropout is not in the Hopper kernel"),):
        line = dispatch.describe_choice(check_varlen(q, k, v, cq, ck, mq, mk, **kw), 90, (q, k, v))
        assert line.startswith("sm_90: tensor-core mma.sync tier") and why in line, line
        assert "_varlen" in line
    for arch in (80, 100):
        assert dispatch.forward_tier(plain, arch, (q, k, v)) is not attention_fwd_sm90


def test_ragged_map_geometry():
    """TensorMap.ragged of a packed (total, H, D) view: dims (total + 1, rows, H, D) outermost
    first, both row dims with the row stride, the origin `rows` rows before the view; element
    (c, h, r, e) is row r + e - rows. Refused for a non-3-d array, and where the origin would lie
    below address 0."""
    from cuflash.runtime.tensor_map import TensorMap

    a = _packed(np.random.default_rng(0), (37, 4, 64), np.float16)   # rows of 4 x 80 elements
    t = TensorMap.ragged(a, 128, 64, swizzle=128)
    row = 4 * 80 * 2
    assert t.shape == (38, 128, 4, 64) and t.strides == (row, row, 160, 2) and t.box == (1, 128, 1, 64)
    assert t.base_offset == -128 * row
    blob = t.encode_sim(1 << 20)
    assert int.from_bytes(blob[8:16], "little") == (1 << 20) - 128 * row
    with pytest.raises(ValueError, match="below address 0"):
        t.encode_sim(16 * row)
    with pytest.raises(ValueError, match=r"must be \(total, H, D\)"):
        TensorMap.ragged(a[0], 128, 64)
    one_head = TensorMap.ragged(a[:, :1], 64, 64, swizzle=128)   # the head stride of one head is never used
    assert one_head.strides[2] % 16 == 0 and one_head.strides[:2] == (row, row)


# ------------------------------------------------------------------------------------- slow

BATCHES = {
    "edges": EDGES,
    "long": [(300, 280), (1, 0), (129, 257)],
    "short": [(1, 1), (0, 0), (3, 100), (64, 64)],
}
HEADS = [(1, 1), (4, 1), (8, 1), (8, 2), (6, 3)]
DIMS = [(64, 64), (40, 40), (96, 72), (128, 128), (112, 112), (192, 192), (176, 128), (256, 256), (256, 200)]
AXES = [list(BATCHES), HEADS, DIMS, list(MASKS), ["all", "some"], list(DTYPES)]
GRID = [tuple(c) for c in AllPairs(AXES)]


@pytest.mark.slow
@pytest.mark.parametrize("case", GRID, ids=["-".join(map(str, c)).replace(" ", "") for c in GRID])
def test_grid(case):
    batch, heads, (d, dv), mask, used, dtype_key = case
    run_case(np.random.default_rng(d * 7 + dv), BATCHES[batch], heads, d, dv, mask, used, dtype_key)


@pytest.mark.slow
@pytest.mark.checked
def test_checked_mode():
    # a store past a sequence's end, a read past the arrays, a race between blocks: each an error
    run_case(np.random.default_rng(4), [(5, 7), (0, 9), (130, 140), (40, 0)], (4, 2), 64, 64, "causal", "some", "f16",
             checked=True)
    _reversed_index_case(checked=True)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_thread_orders(seed):
    run_case(np.random.default_rng(seed), EDGES, (4, 2), 64, 64, "causal", "some", "f16", seed=seed)
    run_case(np.random.default_rng(seed), BATCHES["long"], (2, 1), 128, 128, "none", "all", "bf16", seed=seed)


@pytest.mark.slow
@pytest.mark.checked
def test_hostile_indices_stay_inside_the_arrays():
    """Garbage in a device-resident index (decreasing, negative, past the end): the kernel clamps
    every index into the arrays (checked mode reports any access outside q, k, v, out or lse);
    the one non-empty query sequence then has no key: output 0, lse -inf."""
    rng = np.random.default_rng(8)
    q, k, v, cq, ck, mq, mk, _ = make_case(rng, [(5, 7), (0, 3), (33, 40)], 2, 1, 64, 64, dtypes.float16, "all")
    problem = check_varlen(q, k, v, cq, ck, mq, mk, causal=True)
    bad_q = np.array([5, -7, 10**6, 2], np.int32)          # -> [5, 5), [0, 38), [38, 38)
    bad_k = np.array([0, 80, 90, 2**31 - 1], np.int32)     # -> [0, 50), [50, 50), [50, 50)
    used = np.array([10**6, -3, 1], np.int32)
    vl = dataclasses.replace(problem.varlen, cu_seqlens_q=bad_q, cu_seqlens_k=bad_k, seqused_k=used, checked=False)
    with cuflash.sim.options(arch="sm_90", checked=True), sim_call(q) as call:
        p, qd, kd, vd = on_device(call, dataclasses.replace(problem, varlen=vl), q, k, v)
        assert dispatch.forward_tier(p, 90, (qd, kd, vd)) is attention_fwd_sm90
        out, lse = dispatch.run_forward(p, qd, kd, vd, None, call)
    assert (np.asarray(out) == 0).all() and np.isneginf(np.asarray(lse)).all()
