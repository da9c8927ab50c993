"""The forward kernels on the CUDA simulator: one breaking grid, run over every tier.

Each tier gets a pairwise covering design (allpairspy: every value of every axis appears and
every pair of axes' values is covered) over the axes it branches on, at simulator-friendly sizes:

* ``simt`` (``kernels_cu/attention_fwd_simt.cu``) as an sm_75 device runs it (its only tier
  there): every dtype, head dims 40..256 including ones no tensor-core tier takes (59, 111);
* ``mma`` (``attention_fwd_mma.cu``) on sm_90 with the Hopper tier taken out of the
  dispatcher's list: what serves sm_90 calls the Hopper tier refuses, and Blackwell; fp16/bf16,
  every head-dim bucket, views that must fall back to SIMT (odd offset, strides not multiples
  of 8);
* ``sm90`` (``attention_fwd_sm90.cu``) on sm_90: the cases of the same axes that the Hopper tier
  takes, a few it refuses, and hand-picked cases around its 128-row and Bc-key tiles.

Every case asserts the tier the dispatcher chose (a fallback cannot pass as a tier's result),
checks the output against the float64 oracle with the tolerance rule of DESIGN.md §5 and the LSE
(``-inf`` exactly on rows without keys, whose output is 0). Fresh outputs are NaN-poisoned and
strided views sit inside NaN-filled buffers, so a read outside a view shows. The full
cross-products run under ``slow``.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging

import ml_dtypes
import numpy as np
import pytest
from allpairspy import AllPairs
from support.grids import default_share
from support.grads import check_grads_close
from support.inputs import MASKS, MISALIGNED_FORMS, aligned, make_inputs
from support.options import check_attention
from support.tiers import without_tensor_cores
from support.tolerance import check_close, check_lse

import cuflash
from cuflash import sim
from cuflash.kernels import attention_fwd_mma, attention_fwd_simt, attention_fwd_sm90, catalog, dispatch
from cuflash.reference import tolerance
from cuflash.runtime import dtypes, plan

BF16 = ml_dtypes.bfloat16
DTYPES = {"f16": dtypes.float16, "bf16": dtypes.bfloat16, "f32": dtypes.float32}
DV = ["same", "other"]
LOGITS = ["normal", "large"]


def _expects_mma(d: int, dv: int, form: str, arrays) -> bool:
    """The tensor-core tier's rule: D, Dv multiples of 8 and 16-byte-aligned rows (the misaligned
    forms fall back unless only axes of length 1, whose stride is never used, are affected)."""
    return d % 8 == 0 and dv % 8 == 0 and (form not in MISALIGNED_FORMS or (arrays is not None and aligned(arrays)))


def _expects_sm90(d: int, dv: int, form: str, arrays) -> bool:
    """The Hopper tier's rule: D and Dv multiples of 8 in buckets it has ((D, D) or (192, 128)),
    views a TMA tensor map can describe (16-byte strides and base; not a stride-0 broadcast)."""
    if d % 8 or dv % 8 or form == "broadcast":
        return False
    b, bv = attention_fwd_sm90.bucket(d), attention_fwd_sm90.bucket(dv)
    return (b == bv or (b, bv) == (192, 128)) and (form not in MISALIGNED_FORMS or (arrays is not None and aligned(arrays)))


@dataclasses.dataclass(frozen=True)
class Tier:
    """One tier's grid: where it runs, what it must be, and its axes."""

    arch: int
    module: object
    hopper: bool                      # whether the Hopper tier stays in the dispatcher's list
    lengths: tuple
    head_dims: tuple
    other_dv: dict                    # the value head dim of the "other" case
    heads: tuple                      # (Hq, Hk)
    forms: tuple
    dtypes: tuple
    expects: object = None            # (d, dv, form, arrays) -> whether the tier serves the case

    def axes(self):
        return [list(self.lengths), list(self.lengths), list(self.head_dims), DV, list(self.heads), list(MASKS),
                list(self.forms), list(self.dtypes), LOGITS]


_SIMT_DIMS = (40, 59, 64, 72, 96, 111, 128, 160, 256)
_MMA_DV = {40: 96, 59: 64, 64: 32, 80: 128, 96: 40, 128: 64, 160: 256, 192: 120, 256: 200}
TIERS = {
    "simt": Tier(75, attention_fwd_simt, True, (1, 17, 97, 128, 129, 255), _SIMT_DIMS,
                 {d: _SIMT_DIMS[(i + 3) % len(_SIMT_DIMS)] for i, d in enumerate(_SIMT_DIMS)},
                 ((1, 1), (7, 7), (7, 1), (8, 2)), ("bhsd", "bshd", "strided", "transposed", "broadcast"),
                 ("f16", "bf16", "f32")),
    "mma": Tier(90, attention_fwd_mma, False, (1, 17, 97, 128, 129), (40, 59, 64, 80, 96, 128, 160, 192, 256), _MMA_DV,
                ((1, 1), (2, 2), (4, 1), (4, 2)),
                ("bhsd", "bshd", "strided8", "transposed", "broadcast", "strided3", "offset"), ("f16", "bf16"),
                _expects_mma),
}
TIERS["sm90"] = dataclasses.replace(TIERS["mma"], module=attention_fwd_sm90, hopper=True, expects=_expects_sm90)
#: the tensor-core tier's sm_75 (Turing) form: float16 only, the tensor-core grid's other axes
TIERS["sm75"] = dataclasses.replace(TIERS["mma"], arch=75, hopper=True, dtypes=("f16",))

_PAIRWISE = {name: [tuple(c) for c in AllPairs(t.axes())] for name, t in TIERS.items() if name not in ("sm90", "sm75")}
#: the Hopper tier's part of the tensor-core axes: the cases it takes, and a few it refuses
_PAIRWISE["sm90"] = ([c for c in _PAIRWISE["mma"] if _expects_sm90(c[2], _MMA_DV[c[2]] if c[3] == "other" else c[2],
                                                                     c[6], None)]
                     + [c for c in _PAIRWISE["mma"] if not _expects_sm90(
                         c[2], _MMA_DV[c[2]] if c[3] == "other" else c[2], c[6], None)][:6])
GRID = [(name, c) for name, cases in _PAIRWISE.items() for c in cases]
#: the sm_75 grid (slow: a simulator build per variant): the tensor-core design's cases, in float16
SM75_GRID = sorted({c[:7] + ("f16",) + c[8:] for c in _PAIRWISE["mma"]})


@pytest.fixture
def tier_list(monkeypatch):
    """``tier_list(tier)``: the dispatcher's tiers as ``tier`` needs them (the tensor-core grid on
    sm_90 runs without the Hopper tier, which would take its aligned cases first)."""
    def use(t: Tier):
        if not t.hopper:
            monkeypatch.setattr(dispatch, "TIERS", tuple(x for x in dispatch.TIERS if x[1] is not attention_fwd_sm90))
        if t.module is attention_fwd_simt:   # (its float16 calls: the tensor-core tier's sm_75 form, TIERS["sm75"])
            without_tensor_cores(monkeypatch)
    return use


def _dv(t: Tier, d: int, kind: str) -> int:
    return d if kind == "same" else t.other_dv[d]


def run_case(rng, t: Tier, case, *, arch=None, batch=None):
    """Run one grid case on the simulator: assert the tier, the output (the rule) and the LSE."""
    sq, sk, d, dv_kind, heads, mask, form, dtype_key, logits = case
    arch = arch or t.arch
    hq, hk = heads
    dv = _dv(t, d, dv_kind)
    dtype = DTYPES[dtype_key]
    b = batch or (2 if form == "broadcast" else 1)
    scale = 100.0 / d**0.25 if logits == "large" else 1.0   # "large": scores |s| ~ 1e4
    q, k, v, layout = make_inputs(rng, form, dtype, (b, hq, hk, sq, sk, d, dv), scale)
    causal, window = MASKS[mask]
    kw = dict(causal=causal, window_size=window, layout=layout)
    if t.expects is not None:
        problem = check_attention(q, k, v, **kw)
        tier = dispatch.forward_tier(problem, arch, (q, k, v, None))
        assert (tier is t.module) == t.expects(d, dv, form, (q, k, v)), dispatch.describe_choice(problem, arch,
                                                                                                 (q, k, v))
    else:
        assert cuflash.explain(q, k, v, arch=arch, **kw)["tier"] == t.module.__name__.rsplit(".", 1)[-1]
    with sim.options(arch=f"sm_{arch}"):
        out, lse = cuflash.attention(q, k, v, return_lse=True, backend="sim", **kw)
    assert out.dtype == dtype and lse.dtype == np.float32
    err = check_close(out, q, k, v, large_logits=logits == "large", **kw)
    empty = check_lse(lse, q, k, v, **kw)
    if empty.any():
        rows = out.swapaxes(1, 2) if layout == "bshd" else out
        assert (rows[empty] == 0).all(), "rows without a visible key must be 0"
    return err


@pytest.mark.parametrize("tier,case", default_share(GRID, [f"{n}-" + "-".join(map(str, c)).replace(" ", "") for n, c in GRID],
                                                   args=lambda g: g, key=lambda g: (g[0], *g[1])))
def test_grid(tier, case, rng, tier_list):
    tier_list(TIERS[tier])
    run_case(rng, TIERS[tier], case)


@pytest.mark.slow
@pytest.mark.parametrize("case", SM75_GRID, ids=["-".join(map(str, c)).replace(" ", "") for c in SM75_GRID])
def test_sm75_grid(case, rng):
    run_case(rng, TIERS["sm75"], case)


#: a checked-mode subset of the sm_75 grid: one case per head-dim bucket, masked and unmasked
SM75_CHECKED = [next(c for c in SM75_GRID if c[2] == d and c[5] == m)
                for d, m in ((64, "causal"), (96, "none"), (128, "win_lr"), (192, "none"), (256, "causal"))]


@pytest.mark.checked
@pytest.mark.slow
@pytest.mark.parametrize("case", SM75_CHECKED, ids=["-".join(map(str, c)).replace(" ", "") for c in SM75_CHECKED])
def test_sm75_checked(case, rng):
    with sim.options(checked=True):
        run_case(rng, TIERS["sm75"], case)


@pytest.mark.slow
@pytest.mark.parametrize("d", [64, 256])
def test_sm75_form_forced_on_sm90(d, rng, caplog):
    # what `python -m cuflash check` runs on a newer GPU: the Turing form's instructions built for
    # sm_90 (attention_fwd_mma.sm75_form), forward and (head dim 64) backward against the oracle
    q = rng.standard_normal((1, 2, 70, d)).astype(np.float16)
    k = rng.standard_normal((1, 1, 45, d)).astype(np.float16)
    v = rng.standard_normal((1, 1, 45, d)).astype(np.float16)
    with attention_fwd_mma.sm75_form(), sim.options(arch="sm_90"), \
            caplog.at_level(logging.DEBUG, logger="cuflash.dispatch"):
        out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True, backend="sim")
        dout = rng.standard_normal(out.shape).astype(np.float16)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, backend="sim")
    assert f"cuflash_attn_fwd_mma_f16_d{d}_m" in caplog.text and "_s1_sm75form" in caplog.text
    check_close(out, q, k, v, causal=True)
    check_grads_close(grads, dout, q, k, v, out, lse, causal=True)


def test_sm75_grid_covers_every_sm75_variant():
    t = TIERS["sm75"]
    seen = {attention_fwd_mma.choose_variant(DTYPES["f16"], c[2], _dv(t, c[2], c[3]), 75)
            for c in SM75_GRID if _expects_mma(c[2], _dv(t, c[2], c[3]), c[6], None)}
    assert seen == set(attention_fwd_mma.all_variants(75))


def test_covering_designs_cover_every_value_and_pair():
    for name in ("simt", "mma"):
        axes, cases = TIERS[name].axes(), _PAIRWISE[name]
        for i, axis in enumerate(axes):
            assert {c[i] for c in cases} == set(axis)
        for i, j in itertools.combinations(range(len(axes)), 2):
            assert len({(c[i], c[j]) for c in cases}) == len(axes[i]) * len(axes[j]), (name, i, j)
    # the tensor-core grid exercises every tensor-core variant of sm_90 (both dtypes, every bucket)
    t = TIERS["mma"]
    seen = {attention_fwd_mma.choose_variant(DTYPES[c[7]], c[2], _dv(t, c[2], c[3]), 90)
            for c in _PAIRWISE["mma"] if _expects_mma(c[2], _dv(t, c[2], c[3]), c[6], None)}
    assert seen == set(attention_fwd_mma.all_variants(90))
    # and the Hopper part covers its buckets and forms
    hopper = [c for c in _PAIRWISE["sm90"] if _expects_sm90(c[2], _dv(t, c[2], c[3]), c[6], None)]
    seen = {attention_fwd_sm90.choose_variant(DTYPES[c[7]], c[2], _dv(t, c[2], c[3]), local=c[5] != "none")
            for c in hopper}
    assert {(64, 64), (96, 96), (128, 128), (192, 192), (256, 256)} <= {(v.head_dim, v.head_dim_v) for v in seen}
    assert {c[6] for c in hopper} >= {"bhsd", "bshd", "strided8", "transposed"} and len(hopper) >= 20


_SLOW = [(name, c) for name in ("simt", "mma") for c in itertools.product(
    TIERS[name].lengths, TIERS[name].lengths, TIERS[name].head_dims, list(MASKS), TIERS[name].dtypes)]


@pytest.mark.slow
@pytest.mark.parametrize("tier,case", _SLOW)
def test_full_grid(tier, case, rng, tier_list):
    # the cross-product of lengths, head dims, masks and dtypes; the other axes rotate
    t = TIERS[tier]
    tier_list(t)
    i = _SLOW.index((tier, case))
    sq, sk, d, mask, dt = case
    run_case(rng, t, (sq, sk, d, DV[i % 2], t.heads[i % 4], mask, t.forms[i % 5], dt, LOGITS[i % 2]))


# --------------------------------------------------------------------------------------------
# every tier: rows without keys, scales, shapes


@pytest.mark.parametrize("arch", [75, 90])
def test_rows_without_keys_and_no_keys_at_all(arch, rng):
    # causal with Sq > Sk: the first Sq - Sk rows see nothing; Sk = 0: no row sees anything
    q = rng.standard_normal((1, 3, 40, 64)).astype(np.float16)
    k = rng.standard_normal((1, 3, 9, 64)).astype(np.float16)
    v = rng.standard_normal((1, 3, 9, 64)).astype(np.float16)
    with sim.options(arch=f"sm_{arch}"):
        out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True, backend="sim")
        assert (out[:, :, :31] == 0).all() and np.isneginf(lse[:, :, :31]).all()
        check_close(out, q, k, v, causal=True)
        out, lse = cuflash.attention(q, k[:, :, :0], v[:, :, :0], return_lse=True, backend="sim")
    assert (out == 0).all() and np.isneginf(lse).all()


def test_zero_scale_averages_values(rng):
    q = rng.standard_normal((2, 5, 33, 72)).astype(np.float32)
    k = rng.standard_normal((2, 5, 70, 72)).astype(np.float32)
    v = rng.standard_normal((2, 5, 70, 40)).astype(np.float32)
    out, lse = cuflash.attention(q, k, v, softmax_scale=0.0, return_lse=True, backend="sim")
    np.testing.assert_allclose(out, np.broadcast_to(v.mean(axis=2, keepdims=True), out.shape), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, np.log(70), rtol=1e-6)


def test_zero_scale_and_window_rows_empty_mid_tile_on_tensor_cores(rng, tier_list):
    tier_list(TIERS["mma"])
    q = rng.standard_normal((1, 2, 33, 96)).astype(dtypes.bfloat16)
    k = rng.standard_normal((1, 2, 70, 96)).astype(dtypes.bfloat16)
    v = rng.standard_normal((1, 2, 70, 96)).astype(dtypes.bfloat16)
    out, lse = cuflash.attention(q, k, v, softmax_scale=0.0, return_lse=True, backend="sim")
    mean = v.astype(np.float64).mean(axis=2, keepdims=True)
    np.testing.assert_allclose(out.astype(np.float64), np.broadcast_to(mean, out.shape), atol=2.0**-7)
    np.testing.assert_allclose(lse, np.log(70), rtol=1e-6)
    # a window that misses Sk entirely for some rows (left of the first key)
    out = cuflash.attention(q, k[:, :, :20], v[:, :, :20], backend="sim", window_size=(2, 0))
    check_close(out, q, k[:, :, :20], v[:, :, :20], window_size=(2, 0))


def test_two_dim_extra_batch_dims_and_out_argument(rng):
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((19, 32), (23, 32), (23, 16)))
    out = cuflash.attention(q, k, v, causal=True, backend="sim")
    check_close(out, q, k, v, causal=True)
    # leading batch dims that do not merge into one stride: launched per outer index
    base = rng.standard_normal((3, 4, 2, 9, 8)).astype(np.float16)
    q5 = base[:, ::2]
    k5, v5 = (rng.standard_normal((3, 2, 2, 11, 8)).astype(np.float16) for _ in range(2))
    buf = np.full((3, 2, 2, 9, 8), np.nan, np.float16)
    res = cuflash.attention(q5, k5, v5, out=buf, backend="sim")
    assert res is buf
    check_close(buf, q5, k5, v5)


def test_head_dims_one_to_256(rng):
    # every head dim works, not only the grid's: a sweep of odd ones, D != Dv both ways
    for d, dv in ((1, 1), (3, 200), (33, 8), (200, 3), (256, 255)):
        q = rng.standard_normal((1, 2, 21, d)).astype(np.float32)
        k = rng.standard_normal((1, 1, 30, d)).astype(np.float32)
        v = rng.standard_normal((1, 1, 30, dv)).astype(np.float32)
        out = cuflash.attention(q, k, v, causal=True, backend="sim")
        check_close(out, q, k, v, causal=True)


def test_float64_has_no_kernel():
    x = np.zeros((1, 1, 4, 8))
    with pytest.raises(NotImplementedError, match=r"float64 runs on the NumPy path only .*backend='sim'"):
        cuflash.attention(x, x, x, backend="sim")


@pytest.mark.parametrize("case", [
    (129, 129, 256, "same", (2, 1), "none", "bhsd", "bf16", "normal"),
    (97, 129, 256, "same", (1, 1), "causal", "strided8", "f16", "large"),
    (129, 97, 128, "other", (2, 2), "win_lr", "bshd", "f16", "normal"),
    (17, 129, 192, "same", (1, 1), "causal_win", "transposed", "bf16", "normal"),
], ids=["d256", "d256-causal", "d128", "d192"])
def test_tensor_cores_on_sm80(case, rng):
    # sm_80 has less shared memory than sm_90: other tiles (Bc = 32 for 256)
    run_case(rng, TIERS["mma"], case, arch=80)


# --------------------------------------------------------------------------------------------
# the dispatcher's choice and the variants


def test_odd_offset_falls_back_visibly(rng, caplog, tier_list):
    tier_list(TIERS["mma"])
    buf = rng.standard_normal(1 + 2 * 33 * 64).astype(np.float16)
    q = buf[1:].reshape(1, 2, 33, 64)
    k = rng.standard_normal((1, 2, 33, 64)).astype(np.float16)
    line = dispatch.describe_choice(check_attention(q, k, k), 90, (q, k, k))
    assert "portable SIMT tier" in line and "q starts at an address that is not 16-byte aligned" in line
    with caplog.at_level(logging.DEBUG, logger="cuflash.dispatch"):
        out = cuflash.attention(q, k, k, backend="sim")
    assert "cuflash_attn_fwd_simt_f16" in caplog.text
    check_close(out, q, k, k)
    with caplog.at_level(logging.DEBUG, logger="cuflash.dispatch"):
        cuflash.attention(q.copy(), k, k, backend="sim")
    assert "cuflash_attn_fwd_mma_f16_d64" in caplog.text


def test_describe_choice_names_tier_variant_and_reason(tier_list):
    tier_list(TIERS["mma"])

    def prob(dtype, d, dv=None, s=16):
        dv = dv or d
        return check_attention(np.zeros((1, 1, s, d), dtype), np.zeros((1, 1, s, d), dtype),
                               np.zeros((1, 1, s, dv), dtype))

    line = dispatch.describe_choice(prob(dtypes.bfloat16, 128), 90)
    assert line.startswith("sm_90: tensor-core mma.sync tier, cuflash_attn_fwd_mma_bf16_d128_m128_n64: 4 warps of 32 "
                           "query rows, Br=128 x Bc=64")
    assert "portable SIMT" in dispatch.describe_choice(prob(dtypes.float32, 64), 90)
    assert "float32" in dispatch.describe_choice(prob(dtypes.float32, 64), 90)
    line = dispatch.describe_choice(prob(dtypes.float16, 64), 75)   # the sm_75 (Turing) form
    assert line.startswith("sm_75: tensor-core mma.sync tier, cuflash_attn_fwd_mma_f16_d64_m128_n32_s1") and "Turing" in line
    assert "has no bfloat16 tensor-core mma" in dispatch.describe_choice(prob(dtypes.bfloat16, 64), 75)
    assert "tensor cores on sm_75 take float16" in dispatch.describe_choice(prob(dtypes.float32, 64), 75)
    assert "needs sm_75+" in dispatch.describe_choice(prob(dtypes.float16, 64), 70)
    assert "D=72" not in dispatch.describe_choice(prob(dtypes.float16, 72), 90)  # 72 runs in bucket 96
    assert "D=59 is not a multiple of 8" in dispatch.describe_choice(prob(dtypes.float16, 59), 90)
    assert "Dv=20 is not a multiple of 8" in dispatch.describe_choice(prob(dtypes.float16, 64, 20), 90)
    assert dispatch.forward_tier(prob(dtypes.float16, 256), 90) is attention_fwd_mma
    assert dispatch.forward_tier(prob(dtypes.float16, 64), 75) is attention_fwd_mma
    assert dispatch.forward_tier(prob(dtypes.bfloat16, 64), 75) is attention_fwd_simt
    # a stride that is not a multiple of 8 elements (a slice of a packed buffer)
    big = np.zeros((1, 1, 16, 68), np.float16)
    p = check_attention(big[..., :64], big[..., :64], big[..., :64])
    assert dispatch.forward_tier(p, 90, (big[..., :64],) * 3) is attention_fwd_simt
    assert "stride of 68 elements" in dispatch.describe_choice(p, 90, (big[..., :64],) * 3)


def test_variants_fit_and_are_named():
    for arch in attention_fwd_simt.ARCHES:
        for v in attention_fwd_simt.all_variants(arch):
            assert v.smem_bytes <= plan.max_dynamic_smem(arch)
    v = attention_fwd_simt.choose_variant(np.float16, 40, 72, 90)
    assert (v.head_dim_max, v.dtype) == (128, "f16")
    assert v.entry == f"cuflash_attn_fwd_simt_f16_d128_m{v.block_m}_n{v.block_n}"
    with pytest.raises(NotImplementedError, match="head dim 300 exceeds the largest bucket 256"):
        attention_fwd_simt.AttentionFwdSimt.bucket(300, 8)
    for arch in attention_fwd_mma.ARCHES:
        vs = attention_fwd_mma.all_variants(arch)
        assert {v.head_dim_max for v in vs} == set(attention_fwd_mma.HEAD_DIM_BUCKETS)
        for v in vs:
            assert v.smem_bytes <= plan.max_dynamic_smem(arch)
    for arch in (86, 89):  # 99 KB parts still get a tile for every bucket
        assert {v.head_dim_max for v in attention_fwd_mma.all_variants(arch)} == set(attention_fwd_mma.HEAD_DIM_BUCKETS)
    vs = attention_fwd_mma.all_variants(75)   # the sm_75 form: float16, one stage, in Turing's 64 KB
    assert {v.head_dim_max for v in vs} == set(attention_fwd_mma.HEAD_DIM_BUCKETS)
    assert all(v.dtype == "f16" and v.stages == 1 and v.smem_bytes <= plan.max_dynamic_smem(75) for v in vs)
    assert 2 * attention_fwd_mma.choose_variant(dtypes.float16, 64, 64, 75).smem_bytes <= 64 * 1024   # 2 CTAs per SM
    assert attention_fwd_mma.all_variants(70) == ()
    for form in ("kvcache", "dropout", "mods"):   # 16 rows per warp, one stage; no mods tile at 256 (it spills)
        fvs = attention_fwd_mma.all_variants(75, **{form: True})
        assert all(v.dtype == "f16" and v.stages == 1 and v.rows_per_warp == 16 for v in fvs)
        assert {v.head_dim_max for v in fvs} == set(attention_fwd_mma.HEAD_DIM_BUCKETS) - ({256} if form == "mods" else set())
    v = attention_fwd_mma.choose_variant(dtypes.float16, 80, 40, 90)
    assert v.head_dim_max == 96 and v.entry.startswith("cuflash_attn_fwd_mma_f16_d96_")
    with pytest.raises(NotImplementedError, match="float32"):
        attention_fwd_mma.choose_variant(np.float32, 64, 64, 90)
    with pytest.raises(ValueError):
        attention_fwd_mma.AttentionFwdMma("f16", 72, 64, 64)


def test_catalog_lists_the_tensor_core_variants_on_sm75_and_newer():
    targets = catalog.compile_targets()
    for arch in attention_fwd_mma.ARCHES + (attention_fwd_mma.SM75_ARCH,):
        assert set(attention_fwd_mma.all_variants(arch)) <= {v for a, v in targets if a == arch}
    assert not any(v.family == "attn_fwd_mma" for a, v in targets if a < attention_fwd_mma.SM75_ARCH)
    # sm_75: float16 only, every form (fixed, packed, KV cache over 16-bit and fp8 caches, dropout, modifiers)
    sm75 = {v for a, v in targets if a == 75 and v.family == "attn_fwd_mma"}
    assert {v.dtype for v in sm75} == {"f16"} and all(v.single_stage for v in sm75)
    assert {(v.varlen, v.kvcache, v.cache_fp8, v.dropout, v.mods) for v in sm75} >= {
        (False, False, False, False, False), (True, False, False, False, False), (False, True, False, False, False),
        (True, True, False, False, False), (False, True, True, False, False), (False, False, False, True, False),
        (False, False, False, False, True), (False, True, False, False, True)}


# --------------------------------------------------------------------------------------------
# the Hopper tier's own cases: around its 128-row and Bc-key tiles, TMA-aligned strided views

#: (dtype, B, Hq, Hk, Sq, Sk, D, Dv, mask, layout, view, logits)
HOPPER_CASES = [
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


def _hopper_inputs(case, seed=0):
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


def _hopper_run(case, **opts):
    q, k, v = _hopper_inputs(case, opts.pop("input_seed", 0))
    layout, mask = case[9], case[8]
    kw = dict(layout=layout, **({"none": dict(), "causal": dict(causal=True)}.get(mask) if isinstance(mask, str)
                                 else dict(window_size=mask)))
    with sim.options(arch="sm_90", **opts):
        info = cuflash.explain(q, k, v, backend="sim", **kw)
        out, lse = cuflash.attention(q, k, v, backend="sim", return_lse=True, **kw)
    assert info["tier"] == "attention_fwd_sm90", info["choice"]
    ok, msg, _ = tolerance.compare(out, q, k, v, lse=lse, large_logits=case[11] > 1, **kw)
    assert ok, msg


@pytest.mark.parametrize("case", HOPPER_CASES, ids=lambda c: "-".join(map(str, c)).replace(" ", ""))
def test_hopper_cases(case):
    _hopper_run(case)


@pytest.mark.checked
@pytest.mark.parametrize("case", [HOPPER_CASES[i] for i in (1, 2, 4, 6, 11)], ids=lambda c: f"{c[0]}-d{c[6]}-{c[8]}")
def test_hopper_cases_checked(case):
    _hopper_run(case, checked=True)


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scale", [-0.3, 0.0])
def test_hopper_steady_loop_under_negative_and_zero_scale(scale, causal):
    # the plain Hopper forms keep the raw scores in every loop: a zero scale runs there (passed as
    # FLT_MIN), a negative one (which would turn their row maximum into the minimum) on the
    # tensor-core forward. Sk = 400: three whole key tiles of 128 before the edge, most of them
    # steady for every row. The keys after the first tile are 4x larger: a maximum taken the wrong
    # way round keeps the first tile's, and P overflows fp16
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((1, 2, s, 64)) for s in (130, 400, 400))
    k[:, :, 128:] *= 4
    q, k, v = (x.astype(np.float16) for x in (q, k, v))
    with sim.options(arch="sm_90"):
        tier = cuflash.explain(q, k, v, backend="sim", causal=causal, softmax_scale=scale)["tier"]
        out, lse = cuflash.attention(q, k, v, backend="sim", return_lse=True, causal=causal, softmax_scale=scale)
    assert tier == ("attention_fwd_sm90" if scale >= 0 else "attention_fwd_mma"), tier
    ok, msg, _ = tolerance.compare(out, q, k, v, lse=lse, causal=causal, softmax_scale=scale)
    assert ok, msg


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_hopper_under_seeds(seed):
    _hopper_run(HOPPER_CASES[7], seed=seed)
    _hopper_run(HOPPER_CASES[12], seed=seed)


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
    aligned_view = buf[..., 8:136]                # 16 bytes in: the Hopper tier takes it
    assert cuflash.explain(aligned_view, aligned_view, aligned_view, arch=90)["tier"] == "attention_fwd_sm90"


def test_backward_takes_the_hopper_forward_lse():
    """The backward (tensor-core tier) of a forward the Hopper kernel ran: its LSE (natural log)
    is what the backward expects."""
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
