"""Packed batches in fp8 on the Hopper forward (``kernels_cu/attention_fwd_sm90.cu``, its
``_varlen_e4m3`` forms) on the simulator as an sm_90 device runs them.

Each sequence is held to the fp8 rule of a fixed-shape call on its own slices with its own row of
the descales (tests/support/tolerance.py, ``check_packed_forward``: the float64 attention of the
descaled fp8 values; the lse against float64), and every case asserts the dispatcher chose the
packed fp8 form. The packed arrays are views inside buffers of fp8 NaN; the keys and values past
each sequence's ``seqused_k``, and those of the sequences without query rows, are NaN (rows no
sequence may read); ``out=`` is a view inside a buffer of a sentinel that must stay untouched.
Descales differ per (sequence, kv head), values reach e4m3's largest, 448.

The default run compiles one variant (bf16 output, head-dim bucket 64, causal or windowed:
``cuflash_attn_fwd_sm90_bf16_d64_local_varlen_e4m3``); the grid over head dims 64, 128, 256,
masks, GQA, both output types and lengths, and checked mode, run under ``slow``.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from support.tolerance import check_packed_forward

import cuflash
from cuflash.kernels import attention_fwd_sm90 as sm90

E4M3 = ml_dtypes.float8_e4m3fn
SENTINEL = 3.5
NAN8 = np.uint8(0x7F)


def _packed(rng, shape, scale, pad=3):
    """Random fp8 ``(rows, H, D)`` as a TMA-aligned view inside a buffer of fp8 NaN (``pad`` rows
    before and after, 16 columns either side)."""
    rows, h, d = shape
    big = np.full((rows + 2 * pad, h, d + 32), NAN8, np.uint8).view(E4M3)
    view = big[pad:pad + rows, :, 16:16 + d]
    view[...] = np.clip(rng.standard_normal(shape) * scale, -448, 448).astype(E4M3)
    return view


def make_case(rng, lengths, hq, hk, d, used, near_max=True):
    """q, k, v (views in NaN), cu_seqlens_q/k, max lengths, seqused_k (None for ``used="all"``;
    ``"some"``: every other sequence uses about half its keys) and descales ``(B, Hk)`` differing
    per sequence and kv head; keys and values past ``seqused_k``, and those of sequences without
    queries, are NaN. ``near_max``: each sequence's first query row at +-448 and every tenth key
    scaled toward 448, with descales small enough to keep the scores in a softmax's range."""
    lq = np.array([a for a, _ in lengths], np.int64)
    lk = np.array([b for _, b in lengths], np.int64)
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    q, k, v = _packed(rng, (int(cq[-1]), hq, d), 3), _packed(rng, (int(ck[-1]), hk, d), 3), \
        _packed(rng, (int(ck[-1]), hk, d), 60)
    b = len(lengths)
    kw = dict(q_descale=rng.uniform(0.02, 0.08, (b, hk)).astype(np.float32),
              k_descale=rng.uniform(0.02, 0.08, (b, hk)).astype(np.float32),
              v_descale=rng.uniform(0.25, 4.0, (b, hk)).astype(np.float32))
    if near_max:
        q[cq[:-1][lq > 0]] = np.where(np.arange(d) % 2, 448, -448).astype(E4M3)
        k[::10] = np.clip(k[::10].astype(np.float32) * 100, -448, 448).astype(E4M3)
    used_k = None if used == "all" else np.array([n // 2 if i % 2 == 0 else n for i, n in enumerate(lk)], np.int32)
    for i in range(b):
        first = ck[i] + (lk[i] if used_k is None else used_k[i]) if lq[i] else ck[i]
        k.view(np.uint8)[first:ck[i + 1]] = NAN8
        v.view(np.uint8)[first:ck[i + 1]] = NAN8
    return q, k, v, cq, ck, int(lq.max(initial=0)), int(lk.max(initial=0)), used_k, kw


MASKS = {"none": {}, "causal": dict(causal=True), "window": dict(window_size=(9, 4)),
         "causal_win": dict(causal=True, window_size=(20, -1)), "one_key": dict(window_size=(0, 0))}


def run_case(rng, lengths, heads, d, mask, used, out_dtype=None, **opts):
    hq, hk = heads
    q, k, v, cq, ck, mq, mk, used_k, kw = make_case(rng, lengths, hq, hk, d, used)
    kw |= MASKS[mask] | ({} if out_dtype is None else dict(out_dtype=out_dtype))
    odt = np.dtype(out_dtype or ml_dtypes.bfloat16)
    big = np.full((q.shape[0] + 4, hq, d + 16), SENTINEL, odt)
    out = big[2:2 + q.shape[0], :, 8:8 + d]
    before = big.copy()
    with cuflash.sim.options(arch="sm_90", **opts):
        ex = cuflash.explain_varlen(q, k, v, cq, ck, mq, mk, seqused_k=used_k, backend="sim", **kw)
        assert ex["tier"] == "attention_fwd_sm90" and ex["entry"].endswith("_varlen_e4m3"), ex["choice"]
        got, lse = cuflash.attention_varlen(q, k, v, cq, ck, mq, mk, seqused_k=used_k, return_lse=True, out=out,
                                            backend="sim", **kw)
    assert got is out
    check_packed_forward(out, lse, q, k, v, cq, ck, used_k, **kw)
    outside = np.ones(big.shape, bool)
    outside[2:2 + q.shape[0], :, 8:8 + d] = False
    np.testing.assert_array_equal(big[outside].view(np.uint16), before[outside].view(np.uint16))
    for i in range(len(lengths)):   # a sequence without keys: output 0 (lse -inf is check_packed_forward's)
        if ck[i + 1] == ck[i] or (used_k is not None and used_k[i] == 0):
            assert (out[cq[i]:cq[i + 1]].astype(np.float32) == 0).all()
    return ex


#: (query length, key length): lengths 0 and 1, under a tile, several tiles, starts off 32
EDGES = [(5, 7), (0, 9), (1, 1), (130, 300), (0, 20), (40, 0), (17, 200)]


def test_packed_fp8_forward_d64():
    """One variant: causal GQA 4:2 over EDGES with seqused_k (keys past it NaN), descales per
    (sequence, kv head), values at 448; then a window whose rows see keys of three tiles."""
    ex = run_case(np.random.default_rng(7), EDGES, (4, 2), 64, "causal", "some")
    assert ex["entry"] == "cuflash_attn_fwd_sm90_bf16_d64_local_varlen_e4m3"
    run_case(np.random.default_rng(8), [(300, 280), (0, 13), (64, 64), (1, 0)], (2, 1), 48, "causal_win", "all")


def test_value_copy_places_each_sequence_from_its_start():
    """The packed V^T copy, per key from the formulas: sequence b's key j (j < its used length)
    at column p[b] + (j's position in its 32-key block), p[b] = 32 (cu_seqlens_k[b] // 32) + Bc b;
    every other column 0, including the NaN rows past seqused_k and those of other sequences
    (which the kernel's last tile of a sequence must not reach: p[b + 1] - p[b] covers its tiles)."""
    rng = np.random.default_rng(3)
    lens = np.array([45, 0, 1, 70, 33])
    ck = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    used = np.array([45, 0, 1, 40, 33], np.int32)
    v = rng.integers(1, 127, (int(ck[-1]), 2, 5)).astype(np.uint8)
    for bn in (64, 128, 192):
        vt = sm90.fp8_value_copy_packed(v, ck, used, bn, np)
        starts = sm90.fp8_value_starts(ck, int(ck[-1]), bn, np)
        assert vt.shape == (2, 5, sm90.fp8_value_keys(int(ck[-1]), 5, bn))
        want = np.zeros_like(vt)
        for b in range(5):
            assert starts[b] == 32 * (ck[b] // 32) + bn * b
            assert starts[b + 1] - starts[b] >= -(-lens[b] // bn) * bn   # the sequence's whole tiles
            for j in range(used[b]):
                blk, r = divmod(j, 32)
                pos = 32 * blk + 16 * (r // 16) + 4 * ((r % 8) // 2) + 2 * ((r // 8) % 2) + r % 2
                want[:, :, starts[b] + pos] = v[ck[b] + j]
        np.testing.assert_array_equal(vt, want, err_msg=f"Bc={bn}")


def test_packed_fp8_refusals_and_explain():
    """Off arch 9.0, and with score modifiers, the packed fp8 call is a NotImplementedError naming
    the tiers and the arch; explain names the packed fp8 form on 9.0; the NumPy path takes it."""
    rng = np.random.default_rng(1)
    q, k, v, cq, ck, mq, mk, _, kw = make_case(rng, [(5, 7), (9, 40)], 2, 1, 64, "all")
    ex = cuflash.explain_varlen(q, k, v, cq, ck, mq, mk, arch=90, backend="sim", **kw)
    assert ex["variant"] == "bf16_d64_varlen_e4m3" and "key-contiguous copy" in ex["choice"]
    with pytest.raises(NotImplementedError, match="sm_80.*fp8"):
        cuflash.explain_varlen(q, k, v, cq, ck, mq, mk, arch=80, backend="sim", **kw)
    with cuflash.sim.options(arch="sm_80"), pytest.raises(NotImplementedError, match="sm_80"):
        cuflash.attention_varlen(q, k, v, cq, ck, mq, mk, backend="sim", **kw)
    with pytest.raises(NotImplementedError, match="score modifiers"):
        cuflash.explain_varlen(q, k, v, cq, ck, mq, mk, arch=90, backend="sim", softcap=5.0, **kw)
    out, lse = cuflash.attention_varlen(q, k, v, cq, ck, mq, mk, backend="numpy", return_lse=True, **kw)
    assert out.dtype == np.dtype(ml_dtypes.bfloat16)
    check_packed_forward(out, lse, q, k, v, cq, ck, None, **kw)
    with pytest.raises(ValueError, match=r"q_descale.shape=\(1, 1\) must be \(2, 1\)"):
        cuflash.attention_varlen(q, k, v, cq, ck, mq, mk, q_descale=np.ones((1, 1), np.float32))
    pages = np.zeros((2, 32, 1, 64), np.uint8).view(E4M3)
    with pytest.raises(NotImplementedError, match="block_table"):
        cuflash.attention_varlen(q, pages, pages, cq, ck, mq, mk, block_table=np.zeros((2, 2), np.int32), **kw)


# ------------------------------------------------------------------------------------- slow

BATCHES = {"edges": EDGES, "long": [(300, 280), (1, 0), (129, 457)], "short": [(1, 1), (0, 0), (3, 100), (64, 64)]}
GRID = [
    ("edges", (4, 4), 64, "none", "all", "float16"),
    ("long", (8, 2), 64, "window", "some", "bfloat16"),
    ("edges", (2, 1), 128, "causal", "some", "bfloat16"),
    ("long", (4, 2), 128, "none", "all", "float16"),
    ("short", (6, 3), 128, "causal_win", "some", "bfloat16"),
    ("long", (2, 2), 128, "one_key", "all", "bfloat16"),
    ("edges", (2, 1), 256, "causal_win", "all", "float16"),
    ("long", (4, 2), 256, "causal", "some", "bfloat16"),
    ("short", (2, 1), 256, "window", "all", "float16"),
]


@pytest.mark.slow
@pytest.mark.parametrize("batch, heads, d, mask, used, out_dtype", GRID)
def test_packed_fp8_grid(batch, heads, d, mask, used, out_dtype):
    dh = d - 16 if d > 64 else d   # (128 and 256: a head dim below the bucket)
    run_case(np.random.default_rng(d + len(batch) + len(mask)), BATCHES[batch], heads, dh, mask, used, out_dtype)


@pytest.mark.slow
def test_packed_fp8_dv_below_d():
    """D = 48, Dv = 32 in the bucket 64 (V^T's rows past Dv and q's, k's columns past D are the
    maps' zero fill), causal GQA with seqused_k, against each sequence's oracle."""
    rng = np.random.default_rng(12)
    q, k, _, cq, ck, mq, mk, used, kw = make_case(rng, [(5, 7), (0, 9), (130, 300), (17, 200)], 4, 2, 48, "some")
    v = _packed(rng, (k.shape[0], 2, 32), 60)
    with cuflash.sim.options(arch="sm_90"):
        out, lse = cuflash.attention_varlen(q, k, v, cq, ck, mq, mk, seqused_k=used, causal=True, return_lse=True,
                                            backend="sim", **kw)
    check_packed_forward(out, lse, q, k, v, cq, ck, used, causal=True, **kw)


@pytest.mark.slow
@pytest.mark.checked
def test_packed_fp8_checked():
    """Checked mode (races, bounds, uninitialised reads, the async proxies): head dim 128 (192-key
    tiles over three V^T panels), causal GQA, several tiles of one sequence beside short ones."""
    run_case(np.random.default_rng(5), [(5, 7), (0, 9), (130, 500), (40, 0), (3, 33)], (4, 2), 128, "causal", "some",
             checked=True)


def test_torch_fp8_packed_batch_is_forwarded_and_refuses_gradients():
    """cuflash.torch.attention_varlen with torch.float8_e4m3fn tensors: forwarded to
    cuflash.attention_varlen (the NumPy path here, its result the same bits), and refused with a
    TypeError when an input requires grad (fp8 has no backward)."""
    torch = pytest.importorskip("torch")
    import cuflash.torch as ct

    rng = np.random.default_rng(2)
    q, k, v, cq, ck, mq, mk, _, kw = make_case(rng, [(5, 7), (9, 40)], 2, 1, 32, "all", near_max=False)
    qt, kt, vt = (torch.from_numpy(np.ascontiguousarray(a).view(np.uint8)).view(torch.float8_e4m3fn) for a in (q, k, v))
    kwt = {n: torch.from_numpy(a) for n, a in kw.items()}
    got = ct.attention_varlen(qt, kt, vt, torch.from_numpy(cq), torch.from_numpy(ck), mq, mk, causal=True,
                              backend="numpy", **kwt)
    want = cuflash.attention_varlen(np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v), cq, ck,
                                    mq, mk, causal=True, backend="numpy", **kw)
    assert got.dtype == torch.bfloat16
    np.testing.assert_array_equal(got.view(torch.int16).numpy(), want.view(np.int16))
    with pytest.raises(TypeError, match="fp8 attention .* has no backward"):
        ct.attention_varlen(qt.clone().requires_grad_(True), kt, vt, torch.from_numpy(cq), torch.from_numpy(ck), mq, mk,
                            backend="numpy", **kwt)


def test_packed_fp8_plan_and_reasons_refuse_what_the_kernel_cannot_take():
    """plan_fp8_varlen refuses a V^T copy of the wrong key count and an lse of the wrong shape,
    naming the arrays; a packed fp8 batch without any key has no tensor map (explain says so)."""
    rng = np.random.default_rng(4)
    q, k, v, cq, ck, mq, mk, _, kw = make_case(rng, [(5, 7), (9, 40)], 2, 1, 64, "all", near_max=False)
    qb, kb = q.view(np.uint8), k.view(np.uint8)
    out = np.zeros(q.shape[:2] + (64,), np.uint16)
    good = sm90.fp8_value_copy_packed(v, ck, None, 128, np)
    with pytest.raises(ValueError, match=r"vt \(1, 64, 544\).*must be \(total_q, Hq, D\), \(total_k, Hk, D\), "
                                         r"\(Hk, Dv, 320\)"):
        sm90.plan_fp8_varlen(qb, kb, np.zeros((1, 64, 544), np.uint8), out, np.zeros((2, 14), np.float32), (), (),
                             batch=2, max_seqlen_q=9, softmax_scale=0.1)
    with pytest.raises(ValueError, match=r"lse must be a C-contiguous float32 \(2, 14\)"):
        sm90.plan_fp8_varlen(qb, kb, good, out, np.zeros((14, 2), np.float32), (), (), batch=2, max_seqlen_q=9,
                             softmax_scale=0.1)
    z = np.zeros((0, 1, 64), np.uint8).view(E4M3)
    zero = np.zeros(3, np.int32)
    with pytest.raises(NotImplementedError, match="no key in the whole packed batch"):
        cuflash.explain_varlen(q, z, z, cq, zero, mq, 0, arch=90, backend="sim", **kw)


@pytest.mark.slow
@pytest.mark.checked
def test_packed_fp8_hostile_indices_stay_inside_the_arrays():
    """Garbage in a device-resident index (decreasing, negative, past the end): the V^T copy and
    the kernel clamp every index as the 16-bit packed form does (checked mode reports any access
    outside the arrays); the one non-empty query sequence then has no key: output 0, lse -inf."""
    import dataclasses

    from support.device import on_device, sim_call
    from support.options import check_varlen

    from cuflash.kernels import dispatch

    q, k, v, cq, ck, mq, mk, _, kw = make_case(np.random.default_rng(8), [(5, 7), (0, 3), (33, 40)], 2, 1, 64, "all")
    problem = check_varlen(q, k, v, cq, ck, mq, mk, causal=True, **kw)
    bad_q = np.array([5, -7, 10**6, 2], np.int32)          # -> [5, 5), [0, 38), [38, 38)
    bad_k = np.array([0, 80, 90, 2**31 - 1], np.int32)     # -> [0, 50), [50, 50), [50, 50)
    used = np.array([10**6, -3, 1], np.int32)
    vl = dataclasses.replace(problem.varlen, cu_seqlens_q=bad_q, cu_seqlens_k=bad_k, seqused_k=used, checked=False)
    with cuflash.sim.options(arch="sm_90", checked=True), sim_call(q) as call:
        p, qd, kd, vd = on_device(call, dataclasses.replace(problem, varlen=vl), q, k, v)
        assert sm90.variant_for(p).entry.endswith("_varlen_e4m3")
        out, lse = dispatch.run_forward(p, qd, kd, vd, None, call)
    assert (np.asarray(out).astype(np.float32) == 0).all() and np.isneginf(np.asarray(lse)).all()
