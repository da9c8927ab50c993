"""Score modifiers in the kernels (kernels_cu/score_mods.cuh; the tensor-core tier's ``mods``
forms of attention_fwd_mma.cu and attention_bwd_mma.cu) on the CUDA simulator.

The forward is held to the project's tolerance rule against the float64 oracle with the same
modifiers (:func:`cuflash.reference.tolerance.compare`). Gradients (dq, dk, dv, and d attn_bias
and d sinks when asked for) are held to the gradient rule's form: the error against the float64
gradients is at most twice the error of the NumPy path run in the same input dtype, plus the
rule's floor. Grids are pairwise (``allpairspy``) over the modifier sets (each alone and every
pair), lengths (odd; fully masked tiles at 150 keys), head dims (40 to 256), GQA, causal and
windows, dtypes and the forms of the bias (full, broadcast over batch and rows, 2-D, a strided
view of a NaN-filled buffer) and of the mask (random, fully masked rows, fully masked key tiles).
Also: checked mode (races and bounds) on a forward and a backward; the packed (varlen) and
KV-cache entry points with softcap, ALiBi and sinks, split-KV included; bit-identical dbias under
``deterministic=True``; NaN in a bias reaching only its own row; the dispatcher's choice (the
Hopper tier passes the modifiers to the tensor-core tier, and says so).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from allpairspy import AllPairs
from support.grids import default_share
from support.grads import grad_floor

import cuflash
from cuflash import sim
from cuflash.kernels import attention_fwd_mma
from cuflash.reference import tolerance
from cuflash.runtime import dtypes

NAMES = ("softcap", "alibi_slopes", "attn_bias", "attn_mask", "sinks")
COMBOS = [(n,) for n in NAMES] + list(itertools.combinations(NAMES, 2))
LENGTHS = [(1, 77), (70, 150), (129, 64)]
HEAD_DIMS = [40, 64, 256]
HEADS = [(2, 2), (4, 2)]
MASKS = {"none": (False, (-1, -1)), "causal": (True, (-1, -1)), "window": (False, (30, 5))}
DTYPES = {"f16": dtypes.float16, "bf16": dtypes.bfloat16}
FORMS = ["full", "broadcast", "2d", "strided"]
GRID = [tuple(c) for c in AllPairs([COMBOS, LENGTHS, HEAD_DIMS, HEADS, list(MASKS), list(DTYPES), FORMS])]
ARCH = 80   # the tensor-core tier (sm_90's Hopper tier: HOPPER_GRID)
#: float32 runs on the portable tier (attention_fwd_simt.cu / attention_bwd_simt.cu, their ``mods``
#: forms): the same design, on an emulated sm_90 and sm_75
F32_GRID = [tuple(c) for c in AllPairs([COMBOS, LENGTHS, HEAD_DIMS, HEADS, list(MASKS), FORMS, [90, 75]])]
#: the default run's share of it: one head-dim bucket and arch (one forward and one backward
#: variant, shared), every modifier, every mask and every form of the bias once
F32_DEFAULT = [(("attn_bias", "attn_mask"), (70, 150), 64, (4, 2), "causal", "full", 90),
               (("softcap", "sinks"), (129, 64), 64, (2, 2), "window", "strided", 90),
               (("alibi_slopes", "attn_bias"), (1, 77), 64, (4, 2), "none", "broadcast", 90)]


def make_modifiers(rng, names, b, hq, sq, sk, dtype, form):
    """The modifier arguments of ``names``: the bias and the mask in ``form``."""
    mods = {}
    if "softcap" in names:
        mods["softcap"] = 3.0
    if "alibi_slopes" in names:
        shape = (b, hq) if form == "full" else (hq,)
        mods["alibi_slopes"] = rng.uniform(0.02, 0.4, shape).astype(np.float32)
    if "attn_bias" in names:
        bdt = np.float32 if form in ("broadcast", "2d") else dtype
        if form == "full":
            bias = rng.standard_normal((b, hq, sq, sk)).astype(bdt)
        elif form == "broadcast":
            bias = rng.standard_normal((1, hq, 1, sk)).astype(bdt)
        elif form == "2d":
            bias = rng.standard_normal((sq, sk)).astype(bdt)
        else:   # every other column of a NaN-filled buffer
            buf = np.full((b, hq, sq, 2 * sk), np.nan, bdt)
            buf[..., ::2] = rng.standard_normal((b, hq, sq, sk))
            bias = buf[..., ::2]
        mods["attn_bias"] = bias
    if "attn_mask" in names:
        mask = rng.random((b, 1, sq, sk)) > 0.4
        mask[:, :, sq // 2, :] = False          # a fully masked row
        mask[:, :, :, 64:128] = False           # a fully masked key tile (Bc = 64)
        mods["attn_mask"] = mask
    if "sinks" in names:
        mods["sinks"] = rng.standard_normal(hq).astype(np.float32)
    return mods


def _f64(mods: dict) -> dict:
    return {n: (a.astype(np.float64) if n == "attn_bias" else a) for n, a in mods.items()}


def check_grads(actual, expected, baseline, names, dtype):
    """The gradient rule: |actual - exact| <= 2 |same-dtype NumPy path - exact| + floor, per element."""
    for name, a, x, base in zip(names, actual, expected, baseline):
        a = np.asarray(a, np.float64)
        assert a.shape == x.shape, (name, a.shape, x.shape)
        assert not np.isnan(a).any(), f"NaN in {name} of finite input"
        base_err = float(np.max(np.abs(np.asarray(base, np.float64) - x), initial=0.0))
        excess = np.abs(a - x) - (2 * base_err + grad_floor(x, dtype) + 1e-6)
        assert (excess <= 0).all(), f"{name}: error exceeds 2 x the NumPy path's {base_err:.3g} + floor by {excess.max():.3g}"


def run_case(rng, names, lengths, d, heads, mask, dtype_key, form, *, checked=False, backward=True, seed=0,
             deterministic=False, arch=ARCH, tier="attention_fwd_mma"):
    (sq, sk), (hq, hk) = lengths, heads
    dtype = DTYPES[dtype_key] if dtype_key != "f32" else np.dtype(np.float32)
    b = 2
    q = rng.standard_normal((b, hq, sq, d)).astype(dtype)
    k = rng.standard_normal((b, hk, sk, d)).astype(dtype)
    v = rng.standard_normal((b, hk, sk, d)).astype(dtype)
    causal, window = MASKS[mask]
    opts = dict(causal=causal, window_size=window)
    mods = make_modifiers(rng, names, b, hq, sq, sk, dtype, form)
    assert cuflash.explain(q, k, v, backend="sim", arch=arch, **opts, **mods)["tier"] == tier
    with sim.options(arch=arch, checked=checked, seed=seed):
        out, lse = cuflash.attention(q, k, v, return_lse=True, backend="sim", **opts, **mods)
    ok, msg, _ = tolerance.compare(out, q, k, v, lse=lse, **opts, **mods)
    assert ok, f"forward {names}: {msg}"
    if not backward:
        return out, lse, None
    asks = {"return_dbias": "attn_bias" in names, "return_dsinks": "sinks" in names}
    dout = rng.standard_normal(out.shape).astype(dtype)
    with sim.options(arch=arch, checked=checked, seed=seed):
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, backend="sim", deterministic=deterministic,
                                           **opts, **mods, **asks)
    f64 = [x.astype(np.float64) for x in (q, k, v, dout)]
    o64, l64 = cuflash.attention(*f64[:3], return_lse=True, backend="numpy", **opts, **_f64(mods))
    exact = cuflash.attention_backward(f64[3], *f64[:3], o64, l64, backend="numpy", **opts, **_f64(mods), **asks)
    o16, l16 = cuflash.attention(q, k, v, return_lse=True, backend="numpy", **opts, **mods)
    same = cuflash.attention_backward(dout, q, k, v, o16, l16, backend="numpy", **opts, **mods, **asks)
    labels = ["dq", "dk", "dv"] + [n[7:] for n, on in asks.items() if on]
    assert len(grads) == len(labels)
    if asks["return_dbias"]:
        assert grads[3].shape == mods["attn_bias"].shape and grads[3].dtype == mods["attn_bias"].dtype
    if asks["return_dsinks"]:   # the formula (DESIGN.md §3.2) on this backward's own inputs, in float64
        check_dsinks(grads[-1], dout, out, lse, mods["sinks"])
        labels, grads, exact, same = labels[:-1], grads[:-1], exact[:-1], same[:-1]
    check_grads(grads, exact, same, labels, dtype)
    return out, lse, grads


def check_dsinks(dsinks, dout, out, lse, sinks):
    """d sink_h = -sum over batch and rows of exp(sink_h - lse) rowsum(dout * out), evaluated in
    float64 on the arrays the backward got; the float32 kernel path may differ by the rounding of
    its float32 row sums (a few units in 1e-7 of the sum of the terms' magnitudes)."""
    dd = (dout.astype(np.float64) * out.astype(np.float64)).sum(-1)
    terms = np.exp(sinks.astype(np.float64)[:, None] - lse.astype(np.float64)) * dd
    expected = -terms.sum(axis=(0, 2))
    mag = (np.exp(sinks.astype(np.float64)[:, None] - lse) *
           np.abs(dout.astype(np.float64) * out.astype(np.float64)).sum(-1)).sum(axis=(0, 2))
    assert dsinks.shape == sinks.shape and dsinks.dtype == np.float32
    assert (np.abs(dsinks - expected) <= 1e-5 * mag + 1e-6).all(), (dsinks, expected)


@pytest.mark.parametrize("names,lengths,d,heads,mask,dtype,form", default_share(GRID, args=lambda c: c))
def test_pairwise_grid(names, lengths, d, heads, mask, dtype, form, rng):
    run_case(rng, names, lengths, d, heads, mask, dtype, form)


@pytest.mark.parametrize("names,lengths,d,heads,mask,form,arch",
                         [pytest.param(*c, marks=() if c in F32_DEFAULT else (pytest.mark.slow,))
                          for c in F32_DEFAULT + [c for c in F32_GRID if c not in F32_DEFAULT]])
def test_float32_portable_grid(names, lengths, d, heads, mask, form, arch, rng):
    run_case(rng, names, lengths, d, heads, mask, "f32", form, arch=arch, tier="attention_fwd_simt")


#: the Hopper tier's forward (sm_90a) on every third case of the grid
HOPPER_GRID = GRID[::3]


@pytest.mark.parametrize("names,lengths,d,heads,mask,dtype,form", HOPPER_GRID)
def test_hopper_forward_grid(names, lengths, d, heads, mask, dtype, form, rng):
    run_case(rng, names, lengths, d, heads, mask, dtype, form, backward=False, arch=90, tier="attention_fwd_sm90")


def test_hopper_forward_d192_window_has_its_own_tile(rng):
    # (192, 192) with a window: the modifier form's 96-key tile (112 spills), masked edges in it
    from cuflash.kernels import attention_fwd_sm90

    assert attention_fwd_sm90.Sm90ForwardVariant("bf16", 192, 192, True, True).block_n == 96
    run_case(rng, ("softcap", "attn_mask"), (129, 300), 192, (4, 2), "window", "bf16", "broadcast", backward=False,
             arch=90, tier="attention_fwd_sm90")


@pytest.mark.checked
def test_hopper_forward_checked(rng):
    run_case(rng, ("attn_bias", "sinks"), (70, 150), 64, (4, 2), "causal", "bf16", "strided", checked=True,
             backward=False, arch=90, tier="attention_fwd_sm90")


@pytest.mark.parametrize("names,backward", [(("attn_bias", "attn_mask"), True), (("softcap", "sinks"), True),
                                            (("alibi_slopes", "attn_mask"), False)])
@pytest.mark.checked
def test_checked_mode(names, backward, rng):
    run_case(rng, names, (70, 150), 64, (4, 2), "causal", "f16", "strided", checked=True, backward=backward)


def test_dbias_is_bit_identical_under_deterministic(rng):
    state = rng.bit_generator.state
    runs = []
    for seed in (1, 31337):
        rng.bit_generator.state = state
        runs.append(run_case(rng, ("attn_bias",), (70, 150), 64, (4, 2), "none", "bf16", "broadcast", seed=seed,
                             deterministic=True)[2])
    for a, b in zip(*runs):
        assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_nan_in_the_bias_reaches_only_its_row(rng):
    q, k, v = (rng.standard_normal((1, 2, 40, 64)).astype(np.float16) for _ in range(3))
    bias = rng.standard_normal((1, 2, 40, 40)).astype(np.float32)
    bias[0, 1, 7, 3] = np.nan
    with sim.options(arch=ARCH):
        out = cuflash.attention(q, k, v, attn_bias=bias, backend="sim")
    bad = np.isnan(out).any(axis=-1)
    expected = np.zeros_like(bad)
    expected[0, 1, 7] = True
    assert np.array_equal(bad, expected)


def test_varlen_softcap_and_alibi(rng):
    lens_q, lens_k = [5, 0, 70], [9, 3, 130]
    cq, ck = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lens_q, lens_k))
    hq, hk, d = 4, 2, 64
    q = rng.standard_normal((cq[-1], hq, d)).astype(np.float16)
    k = rng.standard_normal((ck[-1], hk, d)).astype(np.float16)
    v = rng.standard_normal((ck[-1], hk, d)).astype(np.float16)
    mods = dict(softcap=4.0, alibi_slopes=rng.uniform(0.02, 0.4, (3, hq)).astype(np.float32))
    args = (cq, ck, max(lens_q), max(lens_k))
    with sim.options(arch=ARCH):
        out, lse = cuflash.attention_varlen(q, k, v, *args, causal=True, return_lse=True, backend="sim", **mods)
        dout = rng.standard_normal(out.shape).astype(np.float16)
        grads = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, *args, causal=True, backend="sim", **mods)
    f64 = [x.astype(np.float64) for x in (q, k, v, dout)]
    o64, l64 = cuflash.attention_varlen(*f64[:3], *args, causal=True, return_lse=True, backend="numpy", **mods)
    exact = cuflash.attention_varlen_backward(f64[3], *f64[:3], o64, l64, *args, causal=True, backend="numpy", **mods)
    o16, l16 = cuflash.attention_varlen(q, k, v, *args, causal=True, return_lse=True, backend="numpy", **mods)
    same = cuflash.attention_varlen_backward(dout, q, k, v, o16, l16, *args, causal=True, backend="numpy", **mods)
    check_grads([out], [o64], [o16], ["out"], np.float16)
    fin = np.isfinite(l64)
    assert np.array_equal(np.isfinite(lse), fin) and np.abs(lse[fin] - l64[fin]).max() < 1e-3
    check_grads(grads, exact, same, ["dq", "dk", "dv"], np.float16)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_kvcache_softcap_alibi_sinks(num_splits, rng):
    b, hq, hk, d, cap = 2, 4, 2, 64, 300
    q = rng.standard_normal((b, 3, hq, d)).astype(np.float16)
    k_cache = rng.standard_normal((b, cap, hk, d)).astype(np.float16)
    v_cache = rng.standard_normal((b, cap, hk, d)).astype(np.float16)
    seqlens = np.array([250, 17], np.int32)
    mods = dict(softcap=5.0, alibi_slopes=rng.uniform(0.02, 0.4, (hq,)).astype(np.float32),
                sinks=rng.standard_normal(hq).astype(np.float32))
    with sim.options(arch=ARCH):
        out, lse = cuflash.attention_with_kvcache(q, k_cache, v_cache, seqlens, causal=True, num_splits=num_splits,
                                                  return_lse=True, backend="sim", **mods)
    f64 = [x.astype(np.float64) for x in (q, k_cache, v_cache)]
    o64, l64 = cuflash.attention_with_kvcache(*f64, seqlens, causal=True, return_lse=True, backend="numpy", **mods)
    o16 = cuflash.attention_with_kvcache(q, k_cache, v_cache, seqlens, causal=True, backend="numpy", **mods)
    check_grads([out], [o64], [o16], ["out"], np.float16)
    assert np.abs(lse - l64).max() < 1e-3


def test_dispatch_picks_the_modifier_forms():
    q = np.zeros((1, 2, 64, 128), dtypes.bfloat16)
    plain = cuflash.explain(q, q, q, backend="sim", arch=90)
    assert plain["tier"] == "attention_fwd_sm90" and not plain["variant"].endswith("_mods")
    info = cuflash.explain(q, q, q, softcap=30.0, backend="sim", arch=90)
    assert info["tier"] == "attention_fwd_sm90" and info["variant"].endswith("_mods")
    info = cuflash.explain(q, q, q, softcap=30.0, backend="sim", arch=80)
    assert info["tier"] == "attention_fwd_mma" and info["variant"].endswith("_mods")
    # dropout with a modifier: no tensor-core form yet; the portable tier runs it, and says why
    from cuflash.kernels import attention_fwd_simt, dispatch
    from support.options import check_attention

    both = check_attention(q, q, q, softcap=30.0, dropout_p=0.1, dropout_seed=1)
    assert dispatch.forward_tier(both, ARCH, (q, q, q)) is attention_fwd_simt
    line = dispatch.describe_choice(both, ARCH, (q, q, q))
    assert "_dropout_mods" in line and "dropout with softcap is not in the tensor-core kernel yet" in line, line
    # float32 runs on the portable tier, in its modifier form, naming why the faster tiers do not
    q32 = np.zeros((1, 2, 8, 16), np.float32)
    for arch in (90, 80, 75):
        info = cuflash.explain(q32, q32, q32, attn_mask=np.ones((8, 8), bool), backend="sim", arch=arch)
        assert info["tier"] == "attention_fwd_simt" and info["variant"].endswith("_mods"), info
        assert arch < 80 or "dtype float32 (tensor cores here take float16/bfloat16)" in info["choice"]
    assert attention_fwd_mma.choose_variant(dtypes.float16, 64, 64, 90, mods=True).name.endswith("_mods")


#: the tensor-core tier's sm_75 (Turing) form with the modifiers, float16 (not at head dim 256,
#: whose sm_75 tile spills: the portable tier runs it there)
SM75_GRID = [c[:5] + ("f16",) + c[6:] for c in GRID[::4] if c[2] != 256]


@pytest.mark.slow
@pytest.mark.parametrize("names,lengths,d,heads,mask,dtype,form", SM75_GRID)
def test_sm75_modifiers(names, lengths, d, heads, mask, dtype, form, rng):
    run_case(rng, names, lengths, d, heads, mask, dtype, form, arch=75)


def test_sm75_modifiers_at_256_take_the_portable_tier():
    q = np.zeros((1, 2, 8, 256), np.float16)
    info = cuflash.explain(q, q, q, softcap=5.0, backend="sim", arch=75)
    assert info["tier"] == "attention_fwd_simt" and "its only sm_75 tile (64 x 16) spills" in info["choice"]
