"""cuflash.jax.softmax and cuflash.jax.merge_attention on CPU JAX: values and gradients against
float64 NumPy formulas written here, eagerly and under ``jax.jit``, ``jax.grad`` and ``jax.vmap``;
the rule for ``-inf`` entries and empty parts; the refusals and their messages.

Tolerances: float32 results against float64 within a few units of float32's epsilon scaled by
the largest magnitude (sums over at most a few dozen terms); bfloat16 within one rounding."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

import cuflash.jax as cj  # noqa: E402

F64 = np.float64


def close(actual, expected, tol=2e-6):
    actual, expected = np.asarray(actual, F64), np.asarray(expected, F64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert np.array_equal(np.isnan(actual), np.isnan(expected)), "NaN where the formula has none, or none where it has"
    assert np.array_equal(np.isneginf(actual), np.isneginf(expected))
    finite = np.isfinite(expected)
    scale = max(1.0, float(np.abs(expected[finite]).max(initial=0.0)))
    err = float(np.abs(actual[finite] - expected[finite]).max(initial=0.0))
    assert err <= tol * scale, f"max error {err:.3g} > {tol * scale:.3g}"


# --------------------------------------------------------------------------------------------
# float64 formulas


def softmax64(x, axis):
    x = np.asarray(x, F64)
    with np.errstate(invalid="ignore"):
        e = np.exp(x - x.max(axis=axis, keepdims=True))
        return e / e.sum(axis=axis, keepdims=True)


def softmax_grad64(x, g, axis):
    y, g = softmax64(x, axis), np.asarray(g, F64)
    return y * (g - (g * y).sum(axis=axis, keepdims=True))


def merge64(outs, lses):
    """The merge over the parts whose lse is not -inf, row by row (a row with none: 0 and -inf)."""
    outs = np.stack([np.asarray(o, F64) for o in outs])
    lses = np.stack([np.asarray(s, F64) for s in lses])
    out, lse = np.zeros(outs.shape[1:]), np.full(lses.shape[1:], -np.inf)
    for idx in np.ndindex(lses.shape[1:]):
        live = ~np.isneginf(lses[(slice(None),) + idx])
        if live.any():
            s = lses[(slice(None),) + idx][live]
            lse[idx] = s.max() + np.log(np.exp(s - s.max()).sum())
            out[idx] = (np.exp(s - lse[idx])[:, None] * outs[(slice(None),) + idx][live]).sum(axis=0)
    return out, lse


def merge_grads64(outs, lses, w_out, w_lse):
    """d/d out_i and d/d lse_i of ``sum(w_out * out) + sum(w_lse * lse)``: with ``a_i = exp(lse_i -
    lse)``, ``a_i w_out`` and ``a_i (sum_d w_out (out_i - out) + w_lse)``; 0 for an empty part."""
    out, lse = merge64(outs, lses)
    d_outs, d_lses = [], []
    for o, s in zip(outs, lses):
        s = np.asarray(s, F64)
        with np.errstate(invalid="ignore"):
            a = np.where(np.isneginf(s), 0.0, np.exp(s - lse))
        o = np.where(np.isneginf(s)[..., None], 0.0, np.asarray(o, F64))
        d_outs.append(a[..., None] * w_out)
        d_lses.append(a * ((w_out * (o - out)).sum(-1) + w_lse))
    return d_outs, d_lses


# --------------------------------------------------------------------------------------------
# softmax


def softmax_and_grad(axis, backend):
    """One jitted computation: the softmax of ``a`` and the gradient of ``sum(softmax(a) * g)``."""
    def f(a, g):
        return cj.softmax(a, axis, backend=backend), jax.grad(lambda b: jnp.sum(cj.softmax(b, axis=axis,
                                                                                       backend=backend) * g))(a)
    return jax.jit(f)


@pytest.mark.parametrize("shape,axis", [((3, 5, 37), -1), ((4, 9, 6), 1)])
def test_softmax_values_and_gradient(shape, axis, rng):
    x = (3 * rng.standard_normal(shape)).astype(np.float32)
    x[0, 1, 2] = -np.inf   # an entry with probability 0 (a gradient of 0)
    g = rng.standard_normal(shape).astype(np.float32)
    y, dx = softmax_and_grad(axis, "numpy")(jnp.asarray(x), jnp.asarray(g))
    close(y, softmax64(x, axis))
    close(dx, softmax_grad64(x, g, axis))
    assert np.asarray(y)[0, 1, 2] == 0 and np.asarray(dx)[0, 1, 2] == 0


@pytest.mark.slow
@pytest.mark.parametrize("shape,axis,dtype", [((7, 3), 0, np.float32), ((2, 3, 33), -1, np.float32),
                                              ((5, 40), 1, jnp.bfloat16), ((3, 6, 8), 1, np.float16)])
def test_softmax_on_the_simulated_kernel(shape, axis, dtype, rng):
    x = jnp.asarray(3 * rng.standard_normal(shape), dtype)
    g = jnp.asarray(rng.standard_normal(shape), dtype)
    x64, g64 = np.asarray(x, F64), np.asarray(g, F64)
    tol = 2e-6 if dtype == np.float32 else 2.0**-7
    close(cj.softmax(x, axis, backend="sim"), softmax64(x64, axis), tol=tol)
    y, dx = softmax_and_grad(axis, "sim")(x, g)
    assert y.dtype == dx.dtype == dtype
    close(y, softmax64(x64, axis), tol=tol)
    close(dx, softmax_grad64(x64, g64, axis), tol=4 * tol)


def test_softmax_under_vmap_keeps_the_axis_of_the_unmapped_array(rng):
    x = rng.standard_normal((3, 4, 6)).astype(np.float32)
    g = rng.standard_normal((3, 4, 6)).astype(np.float32)

    @jax.jit
    def f(a, b):   # axis=0 of each (4, 6) element is axis 1 of the stack; mapped over the last axis, axis=1 too
        return (jax.vmap(lambda e: cj.softmax(e, axis=0))(a),
                jax.vmap(lambda e: cj.softmax(e, 1), in_axes=2, out_axes=2)(a),
                jax.vmap(jax.grad(lambda e, h: jnp.sum(cj.softmax(e, axis=0) * h)))(a, b))

    y0, y2, dx = f(jnp.asarray(x), jnp.asarray(g))
    close(y0, softmax64(x, 1))
    close(y2, softmax64(x, 1))
    close(dx, softmax_grad64(x, g, 1))


def test_softmax_eager_rows_of_minus_inf_and_nan(rng):
    x = rng.standard_normal((4, 8)).astype(np.float32)
    x[1] = -np.inf
    x[2, 3] = np.nan
    y = np.asarray(cj.softmax(jnp.asarray(x)))
    assert np.isnan(y[1]).all() and np.isnan(y[2]).all()
    close(y[[0, 3]], softmax64(x[[0, 3]], -1))
    assert cj.softmax(jnp.zeros((2, 0), jnp.float32)).shape == (2, 0)


@pytest.mark.parametrize("args,kwargs,error,match", [
    (([1.0, 2.0],), {}, TypeError, "x must be a jax.Array"),
    ((jnp.arange(4),), {}, TypeError, "x.dtype must be float16, bfloat16, float32 or float64, got int32"),
    ((jnp.ones(()),), {}, ValueError, "x must have at least 1 dimension"),
    ((jnp.ones((2, 3)), 2), {}, ValueError, r"axis=2 must be in \[-2, 1\] for x.ndim=2"),
    ((jnp.ones((2, 3)), True), {}, TypeError, "axis must be an int, got bool"),
    ((jnp.ones((2, 3)), jnp.asarray(0)), {}, TypeError, "axis must be an int"),
    ((jnp.ones((2, 3)),), dict(backend="gpu"), ValueError, "backend must be one of"),
    ((jnp.ones((2, 3)),), dict(backend="cuda"), ValueError, "backend='cuda' needs GPU arrays"),
    ((np.ones((2, 3)),), dict(backend="sim"), NotImplementedError,
     "the kernels compute float16, bfloat16 and float32; float64 runs on the NumPy path only"),
])
def test_softmax_refusals(args, kwargs, error, match):
    with pytest.raises(error, match="^cuflash.jax.softmax: " + match):
        cj.softmax(*args, **kwargs)


# --------------------------------------------------------------------------------------------
# merge_attention


def parts(rng, n=3, shape=(2, 5), dv=4):
    outs = [rng.standard_normal(shape + (dv,)).astype(np.float32) for _ in range(n)]
    lses = [(2 * rng.standard_normal(shape)).astype(np.float32) for _ in range(n)]
    lses[1][0, 1] = -np.inf          # one empty part in this row; its out is garbage
    outs[1][0, 1] = np.nan
    for i in range(n):               # a row empty in every part
        lses[i][1, 2] = -np.inf
    outs[0][1, 2] = np.inf
    return outs, lses


@jax.jit
def merge_and_grads(outs, lses, w_out, w_lse):
    """The merge, and the gradients of ``sum(w_out * out) + sum(w_lse * lse)`` in every out and lse,
    as one jitted computation (one forward)."""
    def loss(os, ss):
        o, s = cj.merge_attention(os, ss)
        return jnp.sum(o * w_out) + jnp.sum(s * w_lse), (o, s)

    (_, merged), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(outs, lses)
    return merged, grads


def test_merge_values_and_gradients_with_empty_parts(rng):
    outs, lses = parts(rng)
    w_out = rng.standard_normal(outs[0].shape).astype(np.float32)
    w_lse = rng.standard_normal(lses[0].shape).astype(np.float32)
    (out, lse), (d_outs, d_lses) = merge_and_grads([jnp.asarray(o) for o in outs], [jnp.asarray(s) for s in lses],
                                                   w_out, w_lse)
    assert out.dtype == jnp.float32 and lse.dtype == jnp.float32
    ref_out, ref_lse = merge64(outs, lses)
    close(out, ref_out)
    close(lse, ref_lse)
    assert np.asarray(lse)[1, 2] == -np.inf and (np.asarray(out)[1, 2] == 0).all()
    exp_outs, exp_lses = merge_grads64(outs, lses, w_out, w_lse)
    for got, want in zip(list(d_outs) + list(d_lses), exp_outs + exp_lses):
        close(got, want, tol=5e-6)
    assert (np.asarray(d_outs[1])[0, 1] == 0).all() and np.asarray(d_lses[1])[0, 1] == 0
    for i in range(3):   # the row empty in every part: zero gradients, no NaN
        assert (np.asarray(d_outs[i])[1, 2] == 0).all() and np.asarray(d_lses[i])[1, 2] == 0


def test_merge_nan_reaches_its_row_only(rng):
    outs, lses = parts(rng)
    outs[0][0, 0, 2] = np.nan        # a part that counts
    lses[2][0, 3] = np.nan
    w = np.ones(outs[0].shape, np.float32), np.ones(lses[0].shape, np.float32)
    merged, _ = merge_and_grads([jnp.asarray(o) for o in outs], [jnp.asarray(s) for s in lses], *w)
    out, lse = (np.asarray(a) for a in merged)
    assert np.isnan(out[0, 0, 2]) and np.isfinite(out[0, 0, [0, 1, 3]]).all() and np.isfinite(lse[0, 0])
    assert np.isnan(out[0, 3]).all() and np.isnan(lse[0, 3])
    assert np.isfinite(out[0, 1]).all() and np.isfinite(lse[0, 1])   # its empty part's out holds NaN
    ref_out, ref_lse = merge64(outs, lses)
    close(out, ref_out)
    close(lse, ref_lse)


def test_merge_eager_under_vmap(rng):
    outs, lses = parts(rng, n=2, shape=(3, 5))
    merged = jax.vmap(cj.merge_attention, in_axes=([1, 1], [1, 1]), out_axes=(1, 1))(
        [jnp.asarray(o) for o in outs], [jnp.asarray(s) for s in lses])
    ref_out, ref_lse = merge64(outs, lses)
    close(merged[0], ref_out)
    close(merged[1], ref_lse)


@pytest.mark.slow
def test_merge_of_bfloat16_parts(rng):
    outs, lses = parts(rng, n=2, shape=(3, 5))
    ob = [jnp.asarray(o, jnp.bfloat16) for o in outs]
    out, lse = cj.merge_attention(ob, [jnp.asarray(s) for s in lses])
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    ref_out, ref_lse = merge64([np.asarray(o, F64) for o in ob], lses)
    close(out, ref_out, tol=2.0**-8)
    close(lse, ref_lse)


@pytest.mark.parametrize("outs,lses,error,match", [
    (jnp.ones((2, 3, 4)), [jnp.ones(3)], TypeError, "outs must be a list or tuple of arrays"),
    ([], [], ValueError, "outs must hold at least one part, got none"),
    ([jnp.ones((3, 4))], [jnp.ones(3), jnp.ones(3)], ValueError, "1 outs but 2 lses; one lse per part"),
    ([jnp.ones((3, 4)), "a"], [jnp.ones(3), jnp.ones(3)], TypeError, r"outs\[1\] must be a jax.Array"),
    ([jnp.ones((3, 4)), jnp.ones((3, 4), jnp.float16)], [jnp.ones(3)] * 2, TypeError,
     r"outs\[1\].dtype=float16 must equal outs\[0\].dtype=float32"),
    ([jnp.ones((3, 4), jnp.int32)], [jnp.ones(3)], TypeError, r"outs\[0\].dtype=int32 is not supported"),
    ([jnp.ones(4)], [jnp.ones(())], ValueError, r"outs\[0\].shape=\(4,\) must be \(..., Sq, Dv\)"),
    ([jnp.ones((3, 4))], [jnp.ones(3, jnp.float16)], TypeError, r"lses\[0\].dtype=float16 must be float32"),
    ([jnp.ones((3, 4))], [jnp.ones(4)], ValueError, r"lses\[0\].shape=\(4,\) must be \(3,\)"),
    ([jnp.ones((3, 4)), jnp.ones((3, 5))], [jnp.ones(3)] * 2, ValueError,
     r"outs\[1\].shape=\(3, 5\) must equal outs\[0\].shape=\(3, 4\)"),
])
def test_merge_refusals(outs, lses, error, match):
    with pytest.raises(error, match="^cuflash.jax.merge_attention: " + match):
        cj.merge_attention(outs, lses)
