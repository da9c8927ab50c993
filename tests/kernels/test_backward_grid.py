"""The backward kernels on the CUDA simulator: one grid, run over every tier.

dq, dk, dv against the float64 gradients with the gradient tolerance rule
(:func:`support.grads.check_grads_close`) over a pairwise covering design per tier:

* ``simt`` (``kernels_cu/attention_bwd_simt.cu``'s main stage) as an sm_75 device runs it (its only
  tier there): every dtype;
* ``mma`` (``attention_bwd_mma.cu``) on sm_90: fp16/bf16, lengths up to 300 (several query tiles per
  key tile, unmasked interior tiles), default and deterministic modes;

each over odd lengths, head dims 40 to 256 with Dv != D, GQA, causal and windows (rows without
keys), both layouts and a non-contiguous dout. Every case asserts the tier the dispatcher chose.
The one-stage and 64 x 64 tiles of smaller shared memories (sm_80, sm_86), checked mode, the
fallbacks to the portable backward and bit-identical deterministic results under different
thread orders follow. Fresh gradients are NaN-poisoned before the launches.
"""

from __future__ import annotations

import dataclasses
from unittest import mock

import numpy as np
import pytest
from allpairspy import AllPairs
from support.grids import default_share
from support.grads import check_grads_close, make_qkv
from support.options import check_attention

import cuflash
from cuflash.kernels import attention_bwd_mma, attention_bwd_simt, attention_bwd_sm90, backward_run, dispatch
from cuflash.reference import backward as ref_backward
from cuflash.runtime import dtypes, plan
from cuflash.runtime.options import Options

MASKS = {"none": (False, (-1, -1)), "causal": (True, (-1, -1)), "window": (False, (9, 4)),
         "causal_win": (True, (20, -1)), "win_2_31": (False, (2**31 + 3, 2**31 - 1))}
FORMS = ["bhsd", "bshd", "dout_transposed"]
DTYPES = {"f16": dtypes.float16, "bf16": dtypes.bfloat16, "f32": dtypes.float32}
DV = ["same", "other"]
HEADS = [(1, 1), (7, 1), (8, 2)]
MODES = ["atomic", "deterministic"]


@dataclasses.dataclass(frozen=True)
class Tier:
    arch: int
    module: object
    lengths: tuple
    head_dims: tuple
    dtypes: tuple
    modes: tuple

    def axes(self):
        return [list(self.lengths), list(self.lengths), list(self.head_dims), DV, HEADS, list(MASKS), FORMS,
                list(self.dtypes), list(self.modes)]


TIERS = {
    "simt": Tier(75, attention_bwd_simt, (1, 17, 97, 128), (40, 64, 96, 128, 256), ("f16", "bf16", "f32"), ("atomic",)),
    "mma": Tier(90, attention_bwd_mma, (1, 17, 97, 128, 300), (40, 64, 96, 128, 176, 256), ("f16", "bf16"), MODES),
}
_PAIRWISE = {name: [tuple(c) for c in AllPairs(t.axes())] for name, t in TIERS.items()}
GRID = [(name, c) for name, cases in _PAIRWISE.items() for c in cases]
#: the tensor-core backward's sm_75 (Turing) form: float16, head dims up to its one bucket (64; Dv
#: "other" is 40 or 56), slow (a simulator build per variant)
SM75 = Tier(75, attention_bwd_mma, (1, 17, 97, 128, 300), (40, 64, 56), ("f16",), MODES)
SM75_GRID = [tuple(c) for c in AllPairs(SM75.axes())]


def _problem(dout, q, k, v, out, lse, **kw):
    opts = Options(causal=kw.get("causal", False), window_size=kw.get("window_size", (-1, -1)),
                   layout=kw.get("layout", "bhsd"))
    return ref_backward.check_backward(dout, q, k, v, out, lse, opts, func="test", max_head_dim=256)


def run_case(rng, t: Tier, case, *, seed=0, arch=None, dv=None, scale=1.0):
    """One case on the simulator: the tier asserted, the gradients held to the rule; returns them."""
    sq, sk, d, dv_kind, heads, mask, form, dtype_key, mode = case
    arch = arch or t.arch
    hq, hk = heads
    if dv is None:
        dv = d if dv_kind == "same" else t.head_dims[(t.head_dims.index(d) + 2) % len(t.head_dims)]
    dtype = DTYPES[dtype_key]
    layout = "bshd" if form == "bshd" else "bhsd"
    q, k, v = make_qkv(rng, 1, hq, hk, sq, sk, d, dv, layout=layout, dtype=dtype, scale=scale)
    causal, window = MASKS[mask]
    kw = dict(causal=causal, window_size=window, layout=layout)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **kw)  # the NumPy forward
    dout = rng.standard_normal(out.shape).astype(dtype)
    if form == "dout_transposed":  # a non-contiguous dout: a bhsd view of bshd storage
        dout = np.ascontiguousarray(dout.swapaxes(1, 2)).swapaxes(1, 2)
    # the tensor-core tier itself, also where the Hopper backward would take the call
    # (tests/kernels/test_hopper_backward.py runs that one)
    tiers = tuple(x for x in dispatch.BACKWARD_TIERS if x[1] is not attention_bwd_sm90)
    if t.module is attention_bwd_simt:   # (its float16 calls on sm_75: the tensor-core tier's sm_75 form, SM75)
        tiers = tuple(x for x in tiers if x[1] is not attention_bwd_mma)
    with mock.patch.object(dispatch, "BACKWARD_TIERS", tiers):
        assert dispatch.backward_tier(_problem(dout, q, k, v, out, lse, **kw), arch, (q, k, v, out, dout)) is t.module
        with cuflash.sim.options(seed=seed, arch=f"sm_{arch}"):
            grads = cuflash.attention_backward(dout, q, k, v, out, lse, backend="sim",
                                               deterministic=mode == "deterministic", **kw)
    for g, x in zip(grads, (q, k, v)):
        assert g.dtype == dtype and g.shape == x.shape
    check_grads_close(grads, dout, q, k, v, out, lse, **kw)
    return grads


@pytest.mark.parametrize("tier,case", default_share(GRID, [f"{n}-" + "-".join(map(str, c)).replace(" ", "") for n, c in GRID],
                                                   args=lambda g: g, key=lambda g: (g[0], *g[1])))
def test_grid(tier, case, rng):
    run_case(rng, TIERS[tier], case)


@pytest.mark.slow
@pytest.mark.parametrize("case", SM75_GRID, ids=["-".join(map(str, c)).replace(" ", "") for c in SM75_GRID])
def test_sm75_grid(case, rng):
    run_case(rng, SM75, case)


@pytest.mark.checked
@pytest.mark.slow
@pytest.mark.parametrize("case", SM75_GRID[:4])
def test_sm75_grid_checked(case, rng):
    with cuflash.sim.options(checked=True):
        run_case(rng, SM75, case)


@pytest.mark.checked
@pytest.mark.slow
@pytest.mark.parametrize("case", _PAIRWISE["mma"])
def test_grid_checked(case, rng, monkeypatch):
    # the tensor-core grid again in checked mode (races, bounds, uninitialised shared reads,
    # cp.async in flight), deterministic mode with two splits so partials are read back
    monkeypatch.setattr(backward_run, "MAX_DETERMINISTIC_SPLITS", 2)
    with cuflash.sim.options(checked=True):
        run_case(rng, TIERS["mma"], case)


# --------------------------------------------------------------------------------------------
# every tier: rows without keys, large logits, empty shapes, GQA


@pytest.mark.parametrize("tier", list(TIERS))
def test_rows_without_keys_have_zero_dq_and_no_nan(tier, rng):
    # causal with Sq > Sk: the first Sq - Sk rows see nothing
    grads = run_case(rng, TIERS[tier], (40, 9, 64, "same", (7, 1), "causal", "bhsd", "f16", "atomic"))
    assert (grads[0][:, :, :31] == 0).all()
    assert all(not np.isnan(g).any() for g in grads)


def test_large_logits(rng):
    # |s| ~ 1e3: P recomputed from the saved LSE stays finite; gradients within the rule (whose
    # recompute term accounts for the rounding of large scores)
    run_case(rng, TIERS["simt"], (33, 70, 64, "same", (2, 1), "causal", "bhsd", "f32", "atomic"), scale=6.0)


def test_no_keys_and_no_queries(rng):
    q, k, v = make_qkv(rng, 1, 2, 1, 5, 0, 32, 16, dtype=np.float32)
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    dq, dk, dv = cuflash.attention_backward(np.ones_like(out), q, k, v, out, lse, backend="sim")
    assert (dq == 0).all() and dk.shape == (1, 1, 0, 32) and dv.shape == (1, 1, 0, 16)
    q, k, v = make_qkv(rng, 1, 2, 1, 0, 7, 32, 16, dtype=np.float32)
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    dq, dk, dv = cuflash.attention_backward(np.ones_like(out), q, k, v, out, lse, backend="sim")
    assert dq.shape == (1, 2, 0, 32) and (dk == 0).all() and (dv == 0).all()


def test_gqa_dk_dv_sum_over_the_group(rng):
    # dK of a kv head equals the sum of the per-query-head gradients with K repeated (MHA)
    q, k, v = make_qkv(rng, 1, 6, 2, 19, 23, 32, 32, dtype=np.float32)
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, backend="sim")
    kr, vr = np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1)
    dq_r, dk_r, dv_r = cuflash.attention_backward(dout, q, kr, vr, out, lse, causal=True, backend="sim")
    np.testing.assert_allclose(dq, dq_r, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dk, dk_r.reshape(1, 2, 3, 23, 32).sum(axis=2), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dv, dv_r.reshape(1, 2, 3, 23, 32).sum(axis=2), rtol=1e-5, atol=1e-5)


def test_float64_has_no_kernel():
    x = np.zeros((1, 1, 4, 8))
    with pytest.raises(NotImplementedError, match=r"float64 runs on the NumPy path only"):
        cuflash.attention_backward(x, x, x, x, x, np.zeros((1, 1, 4)), backend="sim")


# --------------------------------------------------------------------------------------------
# the tensor-core backward: deterministic bits, fallbacks, tiles of smaller shared memories


@pytest.mark.parametrize("d", [64, 128, 256])
def test_deterministic_bits_across_thread_orders(d, monkeypatch):
    # two key tiles per split (the partial read-modify-write path) and GQA
    monkeypatch.setattr(backward_run, "MAX_DETERMINISTIC_SPLITS", 2)
    case = (45, 250, d, "same", (4, 2), "causal", "bhsd", "bf16", "deterministic")
    a = run_case(np.random.default_rng(5), TIERS["mma"], case, seed=1)
    b = run_case(np.random.default_rng(5), TIERS["mma"], case, seed=31337)
    for x, y in zip(a, b):
        assert np.array_equal(np.ascontiguousarray(x).view(np.uint16), np.ascontiguousarray(y).view(np.uint16))


def test_fallbacks_to_simt(rng):
    def tier(d, dv, dtype=dtypes.float16, arch=90, offset=False):
        q, k, v = make_qkv(rng, 1, 2, 1, 9, 11, d, dv, dtype=dtype)
        if offset:  # a view one element into its buffer: not 16-byte aligned
            q = np.concatenate([np.zeros(1, q.dtype), q.ravel()])[1:].reshape(q.shape)
        out, lse = cuflash.attention(q, k, v, return_lse=True)
        return dispatch.backward_tier(_problem(out, q, k, v, out, lse), arch, (q, k, v, out, out))

    assert tier(64, 64) is attention_bwd_sm90 and tier(128, 40) is attention_bwd_mma
    assert tier(64, 64, dtype=dtypes.bfloat16) is attention_bwd_sm90 and tier(96, 96) is attention_bwd_sm90
    assert tier(192, 192) is attention_bwd_mma and tier(256, 64) is attention_bwd_mma
    assert tier(128, 128, arch=86) is attention_bwd_mma  # 64 x 64, one stage, in 99 KB
    assert tier(192, 192, arch=86) is attention_bwd_simt  # no 192 tile fits 99 KB
    assert tier(60, 64) is attention_bwd_simt  # D not a multiple of 8
    assert tier(64, 64, dtype=dtypes.float32) is attention_bwd_simt
    assert tier(64, 64, arch=75) is attention_bwd_mma   # the sm_75 form's one bucket
    assert tier(128, 128, arch=75) is attention_bwd_simt and tier(64, 64, dtype=dtypes.bfloat16, arch=75) is attention_bwd_simt
    assert tier(64, 64, offset=True) is attention_bwd_simt


def test_simt_backward_serves_fp16_where_the_mma_cannot(rng):
    # the portable kernel's fp16/bf16 main stage on sm_75 (bf16 there, and fp16 past the tensor-core
    # form's bucket 64 or misaligned; run_case takes the tensor-core tier out for the simt tier)
    for dt in ("f16", "bf16"):
        run_case(rng, TIERS["simt"], (19, 37, 64, "same", (2, 1), "causal", "bhsd", dt, "atomic"))


def test_variants():
    for arch in attention_bwd_simt.ARCHES:
        for v in attention_bwd_simt.all_variants(arch):
            assert v.smem_bytes <= 64 * 1024  # sm_75's opt-in limit, the smallest
    q = np.zeros((1, 2, 16, 64), np.float16)
    assert dispatch.backward_tier(check_attention(q, q, q), 75) is attention_bwd_mma
    assert [v.name for v in attention_bwd_mma.all_variants(75)] == ["main_f16_d64_m64_n64_s1"]   # Turing's 64 KB
    assert [v.name for v in attention_bwd_mma.all_variants(75, dropout=True)] == ["main_f16_d64_m64_n64_s1_dropout"]
    assert attention_bwd_mma.all_variants(70) == ()
    buckets = {arch: sorted({v.head_dim_max for v in attention_bwd_mma.all_variants(arch)}) for arch in (80, 86, 90)}
    assert buckets == {80: [64, 128, 192, 256], 86: [64, 128], 90: [64, 128, 192, 256]}
    for arch in (80, 86, 89, 90):
        for var in attention_bwd_mma.all_variants(arch):
            assert var.smem_bytes <= plan.max_dynamic_smem(arch) and var.threads == 256
    # the preferred tiles (FA2's: 128 x 128 at head dim 64 where it fits, 64 x 128 up to 128, 64 x 64 above; two
    # stages on sm_90); the dropout forms keep 64 x 128 at head dim 64
    tile = lambda d, arch, **kw: (lambda v: (v.block_m, v.block_n, v.stages))(  # noqa: E731
        attention_bwd_mma.choose_variant(dtypes.bfloat16, d, d, arch, **kw))
    assert [tile(d, 90) for d in (64, 128, 192, 256)] == [(128, 128, 2), (64, 128, 2), (64, 64, 2), (64, 64, 2)]
    assert tile(64, 90, dropout=True) == (64, 128, 2)
    assert [tile(d, 80) for d in (64, 128, 192, 256)] == [(64, 128, 2), (64, 64, 2), (64, 64, 1), (64, 64, 1)]
    assert tile(128, 86) == (64, 64, 1)
    with pytest.raises(NotImplementedError, match="no tensor-core backward tile fits sm_86"):
        attention_bwd_mma.choose_variant(dtypes.bfloat16, 256, 256, 86)


def test_deterministic_mode_is_a_form_of_its_own():
    # the plain forms: deterministic dQ is compiled in (entry suffix _det), the atomic form holds none of
    # it; the dropout and modifier forms take the mode as an argument
    from cuflash.runtime.options import DropoutOptions

    rng = np.random.default_rng(0)
    q, k, v = make_qkv(rng, 1, 2, 1, 70, 90, 128, 128, dtype=dtypes.bfloat16)
    out, lse = np.zeros(q.shape, q.dtype), np.zeros(q.shape[:-1], np.float32)

    def problem(**kw):
        return ref_backward.check_backward(out, q, k, v, out, lse, Options(**kw), func="test")

    for arch in (80, 90):
        det, atomic = (attention_bwd_mma.main_variant(problem(deterministic=d), arch) for d in (True, False))
        assert det.entry == atomic.entry + "_det" and ("CUFLASH_DETERMINISTIC_DQ", "1") in det.defines()
        assert dataclasses.replace(det, deterministic_dq=False) == atomic
        assert "without atomics (deterministic)" in dispatch.describe_backward_choice(problem(deterministic=True), 80)
        assert "_det" not in dispatch.describe_backward_choice(problem(), 80)
        drop = attention_bwd_mma.main_variant(problem(deterministic=True, dropout=DropoutOptions(0.1, 3)), arch)
        assert drop.dropout and not drop.deterministic_dq
    catalog_entries = {v.entry for v in attention_bwd_mma.all_variants(90, deterministic=True)}
    assert det.entry in catalog_entries and attention_bwd_mma.all_variants(90, deterministic=True, dropout=True) == ()
    with pytest.raises(ValueError, match="deterministic_dq is a form of the plain variants"):
        dataclasses.replace(drop, deterministic_dq=True)


@pytest.mark.checked
def test_padded_dq_workspace(rng, monkeypatch):
    # the fixed plain forms' dQ workspace: rows per head padded to the query tile (70 -> 128), row
    # pitch the bucket (40 -> 64), so the edge tile's unconditional adds land in this head's own
    # padding; two query heads (a short pitch or row count would add into the other head's rows) and
    # checked mode (bounds); the deterministic form keeps (splits, B, Hq, Sq, D)
    from cuflash.sim import launcher

    shapes, real = [], launcher.run

    def spy(plan, options=None):
        if isinstance(plan.variant, attention_bwd_mma.AttentionBwdMma):
            shapes.append((plan.variant.dq_padded, next(a for a in plan.args if getattr(a, "name", "") == "dq_accum").base.shape))
        return real(plan, options)

    monkeypatch.setattr(launcher, "run", spy)
    with cuflash.sim.options(checked=True):
        for mode in ("atomic", "deterministic"):
            run_case(rng, TIERS["mma"], (70, 90, 40, "same", (2, 1), "causal", "bhsd", "bf16", mode))
    assert shapes == [(True, (1, 1, 2, 128, 64)), (False, (1, 1, 2, 70, 40))], shapes


@pytest.mark.parametrize("case", [(130, 70, 40, "same", (1, 1), "window", "bshd", "bf16", "atomic"),
                                  pytest.param((97, 200, 128, "same", (1, 1), "causal_win", "bhsd", "bf16", "atomic"),
                                               marks=pytest.mark.slow),
                                  pytest.param((70, 150, 64, "same", (2, 1), "win_2_31", "bhsd", "bf16", "atomic"),
                                               marks=pytest.mark.slow)])
def test_edge_band_mask(case, rng):
    # the padded forms' edge tiles (rows past Sq, keys past Sk) take the band mask with both bounds
    # folded in: windows with a left and a right edge, Sq != Sk, held to the float64 oracle
    d = case[2]
    assert attention_bwd_mma.choose_variant(DTYPES[case[7]], d, d, 90).dq_padded
    run_case(rng, TIERS["mma"], case)


@pytest.mark.parametrize("arch,d,dv,sq,sk", [(80, 192, 176, 150, 130), (80, 256, 256, 70, 200), (80, 128, 96, 200, 75),
                                            (86, 128, 128, 150, 130)])
def test_smaller_shared_memories(arch, d, dv, sq, sk, rng):
    # the one-stage pipeline (its refill barrier) and the 64 x 64 tile at head dim 128
    for mode, mask in (("atomic", "causal"), ("deterministic", "window")):
        run_case(rng, TIERS["mma"], (sq, sk, d, "other", (4, 2), mask, "bhsd", "bf16", mode), arch=arch, dv=dv)


@pytest.mark.checked
@pytest.mark.parametrize("mode", [m if m == "atomic" else pytest.param(m, marks=pytest.mark.slow) for m in MODES])
def test_checked_mode(mode, rng, monkeypatch):
    # the simulator's checked mode: out-of-view global accesses, reads of unwritten shared memory
    # and shared-memory races (e.g. dS between its writers and the dQ pass) raise SimCheckError
    monkeypatch.setattr(backward_run, "MAX_DETERMINISTIC_SPLITS", 2)
    t = TIERS["mma"]
    with cuflash.sim.options(checked=True):
        run_case(rng, t, (37, 150, 64, "other", (4, 2), "causal_win", "bshd", "f16", mode))
        run_case(rng, t, (20, 70, 128, "same", (2, 1), "window", "dout_transposed", "bf16", mode))
        # four query tiles per key tile and query head: both stages refilled while others read
        run_case(rng, t, (250, 140, 128, "same", (2, 1), "causal", "bhsd", "bf16", mode))
        # ... and of head dim 64's 128-row tile (sm_90): three query tiles, the last past Sq
        run_case(rng, t, (300, 140, 64, "same", (1, 1), "causal", "bhsd", "bf16", mode))
        run_case(rng, t, (130, 70, 256, "same", (2, 1), "none", "bhsd", "bf16", mode), arch=80)   # one stage


@pytest.mark.checked
@pytest.mark.parametrize("d,dv,causal", [(96, 96, False), (176, 128, True)])
@pytest.mark.usefixtures("without_hopper_tier")   # (the Hopper backward's own: test_hopper_backward.py)
def test_strided_views_in_nan_filled_buffers(d, dv, causal, rng):
    # q, k, v, dout are views into NaN-filled buffers (a head sliced off, 24 extra columns, a
    # 16-byte offset): the kernel may read only the views' elements, zero-filling the columns up
    # to its bucket; NaN anywhere in the result, or a checked-mode report, means it read outside
    def view(b, h, s, c, dtype):
        buf = np.full((b, h + 1, s, c + 24), np.nan, dtype)
        x = buf[:, 1:, :, 8:8 + c]
        x[...] = rng.standard_normal(x.shape).astype(dtype)
        return x

    dt = dtypes.bfloat16
    q, k, v = view(2, 4, 150, d, dt), view(2, 2, 130, d, dt), view(2, 2, 130, dv, dt)
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    dout = view(2, 4, 150, dv, dt)
    assert dispatch.backward_tier(_problem(dout, q, k, v, out, lse, causal=causal), 90,
                                  (q, k, v, out, dout)) is attention_bwd_mma
    with cuflash.sim.options(checked=True):
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, backend="sim")
    assert not any(np.isnan(g.astype(np.float32)).any() for g in grads)
    check_grads_close(grads, dout, q, k, v, out, lse, causal=causal)
