"""The Hopper forward (kernels_cu/attention_fwd_sm90.cu) on the simulator's sm_90 against the float64
oracle (DESIGN.md §5's rule, with LSE), through ``cuflash.attention(backend="sim")``; every case
also asserts that the Hopper tier ran (a fallback cannot pass as its result).

The grid pairs the axes the kernel branches on: dtype, head dims 40..256 (every bucket, (192, 128)
and sizes below their bucket), lengths around the 128-row and Bc-key tiles (1, odd, exact, one
past), GQA groups 1/2/4, masks (none, causal with Sq > Sk so rows have no key, windows on one or
both sides), both layouts, strided views inside NaN-filled buffers, large logits; a subset runs in
checked mode and under several seeds (TMA loads and wgmma results landing early or late).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from test_attention_mma_sim import FALLBACK_FORMS, OTHER_DV, PAIRWISE, run_case

import cuflash
from cuflash import sim
from cuflash.kernels import attention_fwd_sm90
from cuflash.reference import tolerance

BF16 = ml_dtypes.bfloat16

#: (dtype, B, Hq, Hk, Sq, Sk, D, Dv, mask, layout, view, logits)
CASES = [
    ("bf16", 1, 2, 1, 100, 130, 64, 64, "none", "bhsd", "contiguous", 1.0),
    ("f16", 2, 4, 2, 128, 256, 128, 128, "causal", "bshd", "contiguous", 1.0),
    ("bf16", 1, 4, 1, 300, 65, 40, 40, "causal", "bhsd", "strided", 1.0),        # Sq > Sk: rows without keys
    ("f16", 1, 1, 1, 1, 1, 128, 128, "none", "bshd", "contiguous", 1.0),
    ("bf16", 1, 2, 2, 129, 257, 96, 96, (16, 8), "bshd", "strided", 1.0),
    ("f16", 1, 2, 1, 70, 90, 256, 256, "none", "bhsd", "contiguous", 1.0),
    ("bf16", 1, 2, 1, 130, 170, 192, 128, "causal", "bshd", "contiguous", 1.0),
    ("f16", 2, 2, 1, 150, 140, 192, 192, (30, -1), "bhsd", "strided", 1.0),
    ("bf16", 1, 1, 1, 129, 300, 72, 72, (5, 0), "bhsd", "contiguous", 1.0),
    ("f16", 1, 2, 2, 60, 300, 160, 160, "causal", "bshd", "strided", 1.0),
    ("bf16", 1, 4, 4, 63, 63, 128, 128, (-1, 2), "bhsd", "contiguous", 30.0),    # large logits
    ("f16", 1, 2, 1, 256, 100, 64, 64, (0, 0), "bshd", "contiguous", 1.0),       # a one-key window
    ("bf16", 2, 2, 2, 33, 400, 256, 256, "causal", "bhsd", "strided", 1.0),
    ("f16", 1, 1, 1, 200, 81, 120, 120, "none", "bhsd", "contiguous", 30.0),
    ("bf16", 1, 2, 1, 17, 113, 184, 184, (40, 40), "bshd", "contiguous", 1.0),
    ("f16", 1, 4, 2, 257, 129, 48, 48, "causal", "bhsd", "contiguous", 1.0),
]


def _window(mask):
    return {"none": dict(), "causal": dict(causal=True)}.get(mask) if isinstance(mask, str) else dict(window_size=mask)


def _inputs(case, seed=0):
    dt, b, hq, hk, sq, sk, d, dv, mask, layout, view, logits = case
    rng = np.random.default_rng(seed + sq * 3 + d)
    npdt = BF16 if dt == "bf16" else np.float16

    def make(h, s, dd, scale=1.0):
        shape = (b, h, s, dd) if layout == "bhsd" else (b, s, h, dd)
        x = (rng.standard_normal(shape) * scale).astype(npdt)
        if view == "contiguous":
            return x
        big = np.full(shape[:-1] + (dd + 24,), np.nan, npdt)   # a view into a NaN-filled buffer: rows of dd + 24
        out = big[..., 8 : 8 + dd]                               # (16 bytes in: TMA-aligned)
        out[...] = x
        return out

    return make(hq, sq, d, logits ** 0.5), make(hk, sk, d, logits ** 0.5), make(hk, sk, dv)


def _run(case, **opts):
    q, k, v = _inputs(case, opts.pop("input_seed", 0))
    layout, mask = case[9], case[8]
    kw = dict(layout=layout, **_window(mask))
    with sim.options(arch="sm_90", **opts):
        info = cuflash.explain(q, k, v, backend="sim", **kw)
        out, lse = cuflash.attention(q, k, v, backend="sim", return_lse=True, **kw)
    assert info["tier"] == "attention_fwd_sm90", info["choice"]
    ok, msg, _ = tolerance.compare(out, q, k, v, lse=lse, large_logits=case[11] > 1, **kw)
    assert ok, msg


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)).replace(" ", ""))
def test_hopper_forward_matches_the_oracle(case):
    _run(case)


@pytest.mark.parametrize("case", [CASES[i] for i in (1, 2, 4, 6, 11)], ids=lambda c: f"{c[0]}-d{c[6]}-{c[8]}")
def test_hopper_forward_checked(case):
    _run(case, checked=True)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_hopper_forward_under_seeds(seed):
    _run(CASES[7], seed=seed)
    _run(CASES[12], seed=seed)


def test_explain_names_the_hopper_tier_for_bf16_d128():
    q = np.zeros((1, 2, 64, 128), BF16)
    info = cuflash.explain(q, q, q, arch=90)
    assert info["tier"] == "attention_fwd_sm90" and info["entry"] == "cuflash_attn_fwd_sm90_bf16_d128"
    assert info["threads"] == 384 and info["block_m"] == 128 and info["block_n"] == 128


@pytest.mark.parametrize("arch,why", [(80, "runs on compute capability 9.0 only"), (86, "9.0 only")])
def test_other_arches_fall_back_to_mma_and_say_why(arch, why):
    q = np.zeros((1, 2, 64, 128), BF16)
    info = cuflash.explain(q, q, q, arch=arch)
    assert info["tier"] == "attention_fwd_mma" and why in info["choice"]


def test_views_tma_cannot_describe_fall_back_visibly():
    buf = np.zeros((1, 2, 64, 136), np.float16)   # rows of 272 bytes: strides TMA takes
    q = buf[..., 4:132]                           # ... but a base 8 bytes in, which it does not
    info = cuflash.explain(q, q, q, arch=90)
    assert info["tier"] != "attention_fwd_sm90"
    assert "Hopper wgmma tier not used" in info["choice"] and "16-byte aligned" in info["choice"]
    q32 = np.zeros((1, 2, 64, 64), np.float32)
    assert "dtype float32" in cuflash.explain(q32, q32, q32, arch=90)["choice"]
    aligned = buf[..., 8:136]                     # 16 bytes in: the Hopper tier takes it
    assert cuflash.explain(aligned, aligned, aligned, arch=90)["tier"] == "attention_fwd_sm90"


def test_backward_takes_the_hopper_forward_lse():
    """The backward (tensor-core tier) of a forward the Hopper kernel ran: its LSE (natural log)
    is what the backward expects."""
    from test_backward_reference import check_grads_close

    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 2, 90, 64)).astype(np.float16)
    k = rng.standard_normal((1, 1, 110, 64)).astype(np.float16)
    v = rng.standard_normal((1, 1, 110, 64)).astype(np.float16)
    with sim.options(arch="sm_90"):
        assert cuflash.explain(q, k, v, causal=True, backend="sim")["tier"] == "attention_fwd_sm90"
        out, lse = cuflash.attention(q, k, v, causal=True, backend="sim", return_lse=True)
        dout = rng.standard_normal(out.shape).astype(np.float16)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, backend="sim")
    check_grads_close(grads, dout, q, k, v, out, lse, causal=True)


def _dv(d, kind):
    return d if kind == "same" else OTHER_DV[d]


def expects_sm90(d: int, dv: int, form: str, arrays=None) -> bool:
    """Whether the Hopper tier serves a case of the tensor-core grid: D and Dv multiples of 8 in
    buckets it has ((D, D) or (192, 128)), and views a TMA tensor map can describe (16-byte
    strides and base; not the broadcast form's stride 0)."""
    if d % 8 or dv % 8:
        return False
    b, bv = attention_fwd_sm90.bucket(d), attention_fwd_sm90.bucket(dv)
    if not (b == bv or (b, bv) == (192, 128)):
        return False
    if form == "broadcast":
        return False
    if form not in FALLBACK_FORMS or arrays is None:
        return form not in FALLBACK_FORMS
    return all(x.ctypes.data % 16 == 0 and all(st % 16 == 0 for st, n in zip(x.strides[:-1], x.shape[:-1]) if n > 1)
               for x in arrays)


#: the tensor-core grid's cases the Hopper tier takes (by shape and form), and a few it refuses
HOPPER_PAIRWISE = [c for c in PAIRWISE if expects_sm90(c[2], _dv(c[2], c[3]), c[6])]
REFUSED = [c for c in PAIRWISE if not expects_sm90(c[2], _dv(c[2], c[3]), c[6])][:6]


@pytest.mark.parametrize("sq,sk,d,dv,heads,mask,form,dtype,logits", HOPPER_PAIRWISE + REFUSED)
def test_hopper_on_the_tensor_core_grid(sq, sk, d, dv, heads, mask, form, dtype, logits, rng):
    """The breaking grid of tests/test_attention_mma_sim.py on sm_90 with the Hopper tier first:
    the cases it takes run on it (asserted), the others fall back (asserted too)."""
    run_case(rng, sq, sk, d, dv, heads, mask, form, dtype, logits, tier_module=attention_fwd_sm90,
             expects=expects_sm90)


def test_the_hopper_grid_covers_its_variants_and_forms():
    seen = {attention_fwd_sm90.choose_variant(np.float16 if c[7] == "f16" else BF16, c[2], _dv(c[2], c[3]),
                                              local=c[5] != "none") for c in HOPPER_PAIRWISE}
    buckets = {(v.head_dim, v.head_dim_v) for v in seen}
    assert {(64, 64), (96, 96), (128, 128), (192, 192), (256, 256)} <= buckets, sorted(buckets)
    assert {c[6] for c in HOPPER_PAIRWISE} >= {"bhsd", "bshd", "strided8", "transposed"}
    assert len(HOPPER_PAIRWISE) >= 20
