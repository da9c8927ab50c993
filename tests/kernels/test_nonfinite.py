"""NaN and inf in the input, on every backend and kernel tier, forward and backward (DESIGN.md §3).

The rule: a row's output and lse are non-finite exactly where the float64 oracle's are, never a
quiet zero and never a warning. Expected patterns come from math, not from an implementation: a
non-finite entry travels along the (query, key) pairs that are visible and nowhere else
(:func:`predicted_forward`, :func:`predicted_backward` propagate it through the formulas of
FlashAttention-2, Section 2.2, at row granularity). The CUDA kernels have one documented
latitude: a NaN in a V row (or, in the backward, in any row of a tile) that a row does not see
but whose tile it visits may also reach it through ``0 * NaN`` in a tile product; where a mask
makes that possible they are held to "at least the predicted rows", without a mask exactly.
Rows the prediction says are finite must also be right: they are compared, with the tolerance
rule, against attention of the same input with the non-finite entry replaced by a finite one.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from support.tiers import without_tensor_cores

import cuflash
from cuflash import reference as ref
from cuflash.reference import masks, tolerance
from cuflash.runtime import dtypes, validation

#: (name, backend, simulated arch, dtype, head dim): the NumPy path and every kernel tier
FWD_TIERS = [
    ("numpy", "numpy", None, dtypes.float32, 32),
    ("simt_f32", "sim", "sm_75", dtypes.float32, 32),
    ("simt_f16", "sim", "sm_75", dtypes.float16, 64),
    ("mma_f16", "sim", "sm_80", dtypes.float16, 64),
    ("mma_bf16_d128", "sim", "sm_80", dtypes.bfloat16, 128),
]
BWD_TIERS = [FWD_TIERS[0], FWD_TIERS[1], FWD_TIERS[3]]
#: the Hopper forward and backward (what sm_90 runs for float16 at head dim 128), under -m slow
HOPPER = ("sm90_f16_d128", "sim", "sm_90", dtypes.float16, 128)


def _with_hopper(tiers):
    return [pytest.param(t, id=t[0]) for t in tiers] + [pytest.param(HOPPER, id=HOPPER[0], marks=pytest.mark.slow)]


MASKS = {"none": dict(), "causal": dict(causal=True), "window": dict(window_size=(20, 10))}
SQ, SK = 150, 130
#: (name, tensor, row, column, value)
PLACEMENTS = [("nan_q", "q", 37, 5, np.nan), ("nan_k", "k", 60, 3, np.nan), ("nan_v", "v", 60, 7, np.nan),
              ("inf_q", "q", 37, 5, np.inf), ("ninf_k", "k", 60, 3, -np.inf)]


def _visible(sq, sk, kw):
    left, right = validation.check_window_size(kw.get("window_size", (-1, -1)), kw.get("causal", False), "test")
    vis = masks.visible_mask(np.arange(sq), np.arange(sk), sq, sk, left, right)
    return np.ones((sq, sk), bool) if vis is None else vis


def predicted_forward(bad_q, bad_k, bad_v, vis):
    """Rows of (out, lse) that are non-finite by math: a row's scores are NaN when its q row is
    or a key it sees is; its output also when a value it sees is; a row without keys has
    lse = -inf (and output 0)."""
    bad_s = bad_q | (vis & bad_k[None]).any(1)
    empty = ~vis.any(1)
    return bad_s | (vis & bad_v[None]).any(1), bad_s | empty


def predicted_backward(bad_q, bad_k, bad_v, bad_do, vis):
    """Rows of (dq, dk, dv) that are non-finite by math (``P = exp(S - lse)``, ``dP = dO V^T``,
    ``D = rowsum(dO * O)``, ``dS = P (dP - D)``, ``dQ = dS K``, ``dK = dS^T Q``, ``dV = P^T dO``,
    every product taken over visible pairs only)."""
    bad_out, _ = predicted_forward(bad_q, bad_k, bad_v, vis)
    bad_s = bad_q | (vis & bad_k[None]).any(1)
    bad_p = vis & bad_s[:, None]
    bad_dp = vis & (bad_do[:, None] | bad_v[None, :])
    bad_ds = vis & (bad_p | bad_dp | (bad_out | bad_do)[:, None])
    dq = bad_ds.any(1) | (vis & bad_k[None]).any(1)
    dk = bad_ds.any(0) | (vis & bad_q[:, None]).any(0)
    dv = (bad_p | (vis & bad_do[:, None])).any(0)
    return dq, dk, dv


def rows_nonfinite(a):
    """Per row (the sequence axis of (1, 1, S, D) or (1, 1, S)), whether any entry is non-finite."""
    a = np.asarray(a, np.float64)[0, 0]
    return ~np.isfinite(a).all(axis=-1) if a.ndim == 2 else ~np.isfinite(a)


def _inputs(rng, dtype, d, placement):
    q = rng.standard_normal((1, 1, SQ, d)).astype(dtype)
    k = rng.standard_normal((1, 1, SK, d)).astype(dtype)
    v = rng.standard_normal((1, 1, SK, d)).astype(dtype)
    arrays = dict(q=q, k=k, v=v)
    clean = {n: a.copy() for n, a in arrays.items()}
    if placement is not None:
        _, name, row, col, value = placement
        arrays[name][0, 0, row, col] = value
    return arrays, clean


def _bad_rows(arrays):
    return {n: ~np.isfinite(np.asarray(a, np.float64)[0, 0]).all(axis=-1) for n, a in arrays.items()}


def _run(backend, arch, fn, *args, **kw):
    with warnings.catch_warnings(), pytest.MonkeyPatch.context() as mp:
        warnings.simplefilter("error")  # the rule: no RuntimeWarning leaks out
        if arch == "sm_75":   # the portable tier (whose float16 calls the tensor-core tier's sm_75 form takes first)
            without_tensor_cores(mp)
        if backend == "sim":
            with cuflash.sim.options(**({"arch": arch} if arch else {})):
                return fn(*args, backend="sim", **kw)
        return fn(*args, backend=backend, **kw)


def _check_finite_rows_are_right(out, clean, kw, rows):
    """The rows that should be finite equal attention of the clean input (tolerance rule)."""
    rows = np.flatnonzero(rows)
    if rows.size:
        ok, msg, _ = tolerance.compare(np.asarray(out)[:, :, rows], clean["q"], clean["k"], clean["v"], rows=rows,
                                       **kw)
        assert ok, msg


# ----------------------------------------------------------------------------------------- oracle


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("placement", PLACEMENTS[:3], ids=[p[0] for p in PLACEMENTS[:3]])
def test_oracle_forward_follows_the_math(placement, mask, rng):
    arrays, _ = _inputs(rng, np.float64, 16, placement)
    kw = MASKS[mask]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = ref.naive_attention(**arrays, return_lse=True, **kw)
    bad = _bad_rows(arrays)
    want_out, want_lse = predicted_forward(bad["q"], bad["k"], bad["v"], _visible(SQ, SK, kw))
    assert want_out.any() and not want_out.all() or mask == "none"
    np.testing.assert_array_equal(rows_nonfinite(out), want_out)
    np.testing.assert_array_equal(rows_nonfinite(lse), want_lse)
    assert not np.isneginf(lse[0, 0][want_out & ~want_lse]).any()  # NaN rows are NaN, not "empty"


@pytest.mark.parametrize("mask", ["none", "causal"])
@pytest.mark.parametrize("name", ["q", "k", "v", "dout"])
def test_oracle_backward_follows_the_math(name, mask, rng):
    arrays, _ = _inputs(rng, np.float64, 16, None)
    dout = rng.standard_normal((1, 1, SQ, 16))
    kw = MASKS[mask]
    (arrays | {"dout": dout})[name][0, 0, 60 if name in "kv" else 37, 3] = np.nan
    out, lse = ref.naive_attention(**arrays, return_lse=True, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        grads = ref.attention_backward(dout, arrays["q"], arrays["k"], arrays["v"], out, lse, **kw)
    bad = _bad_rows(arrays)
    bad_do = ~np.isfinite(dout[0, 0]).all(-1)
    want = predicted_backward(bad["q"], bad["k"], bad["v"], bad_do, _visible(SQ, SK, kw))
    for g, w, gname in zip(grads, want, ("dq", "dk", "dv")):
        np.testing.assert_array_equal(rows_nonfinite(g), w, err_msg=gname)


def test_masked_matmul_leaves_out_invisible_products():
    a = np.array([[0.5, 0.0], [0.25, 0.75]])
    b = np.array([[1.0, 2.0], [np.nan, np.inf]])
    vis = np.array([[True, False], [True, True]])
    got = masks.masked_matmul(a, b, vis)
    np.testing.assert_array_equal(got[0], [0.5, 1.0])  # 0 * NaN left out
    assert np.isnan(got[1, 0]) and np.isposinf(got[1, 1])


# ------------------------------------------------------------------------------- every backend


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("placement", PLACEMENTS, ids=[p[0] for p in PLACEMENTS])
@pytest.mark.parametrize("tier", _with_hopper(FWD_TIERS))
def test_forward_nonfinite_rows(tier, placement, mask, rng):
    _, backend, arch, dtype, d = tier
    arrays, clean = _inputs(rng, dtype, d, placement)
    kw = MASKS[mask]
    out, lse = _run(backend, arch, cuflash.attention, *arrays.values(), return_lse=True, **kw)
    o64, l64 = ref.naive_attention(*arrays.values(), return_lse=True, **kw)
    want_out, want_lse = rows_nonfinite(o64), rows_nonfinite(l64)
    if placement[0].startswith("nan"):  # the oracle is itself held to the math above; check it here too
        bad = _bad_rows(arrays)
        np.testing.assert_array_equal((want_out, want_lse), predicted_forward(bad["q"], bad["k"], bad["v"],
                                                                              _visible(SQ, SK, kw)))
    got_out, got_lse = rows_nonfinite(out), rows_nonfinite(lse)
    np.testing.assert_array_equal(got_lse, want_lse)
    np.testing.assert_array_equal(np.isnan(np.asarray(lse, np.float64)), np.isnan(l64))
    latitude = backend == "sim" and placement[1] == "v" and mask != "none"
    if latitude:
        assert (got_out >= want_out).all(), "a row that sees the non-finite value came out finite"
    else:
        np.testing.assert_array_equal(got_out, want_out)
    bad = _bad_rows(arrays)
    touched, _ = predicted_forward(bad["q"], bad["k"], bad["v"], _visible(SQ, SK, kw))
    _check_finite_rows_are_right(out, clean, kw, ~touched & ~got_out)


@pytest.mark.parametrize("mask", ["none", "causal"])
@pytest.mark.parametrize("name", ["q", "k", "v", "dout"])
@pytest.mark.parametrize("tier", _with_hopper(BWD_TIERS))
def test_backward_nonfinite_rows(tier, name, mask, rng):
    _, backend, arch, dtype, d = tier
    arrays, _ = _inputs(rng, dtype, d, None)
    dout = rng.standard_normal((1, 1, SQ, d)).astype(dtype)
    kw = MASKS[mask]
    (arrays | {"dout": dout})[name][0, 0, 60 if name in "kv" else 37, 3] = np.nan
    q, k, v = arrays.values()
    out, lse = _run(backend, arch, cuflash.attention, q, k, v, return_lse=True, **kw)
    grads = _run(backend, arch, cuflash.attention_backward, dout, q, k, v, out, lse, **kw)
    bad = _bad_rows(arrays)
    want = predicted_backward(bad["q"], bad["k"], bad["v"], ~np.isfinite(np.asarray(dout, np.float64)[0, 0]).all(-1),
                              _visible(SQ, SK, kw))
    for g, w, gname in zip(grads, want, ("dq", "dk", "dv")):
        got = rows_nonfinite(g)
        if backend == "sim" and mask != "none":  # the kernels' latitude: 0 * NaN inside a tile
            assert (got >= w).all(), f"{gname}: a row the math makes non-finite came out finite"
        else:
            np.testing.assert_array_equal(got, w, err_msg=gname)


# ------------------------------------------------------------------------------------ softmax


@pytest.mark.parametrize("n_cols", [3, 64, 1500], ids=["warp3", "warp64", "block1500"])
@pytest.mark.parametrize("backend", ["numpy", "sim"])
def test_softmax_row_with_nan_or_inf_is_all_nan(backend, n_cols, rng):
    x = rng.standard_normal((6, n_cols)).astype(np.float32)
    x[1, 1] = np.nan                    # lane 1 of a warp: its NaN must survive the merges
    x[2, n_cols - 1] = np.inf           # +inf has no finite normaliser
    x[3, 0] = -np.inf                   # -inf is probability 0, the row stays finite
    x[4, :] = -np.inf                   # no finite entry: NaN (as torch.softmax)
    x[5, [0, n_cols - 1]] = np.nan
    y = _run(backend, None, cuflash.softmax, x)
    math_nan = np.array([False, True, True, False, True, True])
    np.testing.assert_array_equal(np.isnan(y).all(axis=1), math_nan)
    np.testing.assert_array_equal(np.isnan(y).any(axis=1), math_nan)
    np.testing.assert_array_equal(np.isnan(ref.softmax(x)).all(axis=1), math_nan)
    finite = ~math_nan
    np.testing.assert_allclose(y[finite], ref.softmax(x.astype(np.float64))[finite], rtol=1e-5, atol=1e-7)
    assert y[3, 0] == 0.0
