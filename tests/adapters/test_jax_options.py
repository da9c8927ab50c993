"""cuflash.jax with every option of cuflash.attention and cuflash.attention_varlen: the score
modifiers (softcap, ALiBi, bias, mask, sinks), dropout, windows and ``return_lse``, values and
gradients (q, k, v, attn_bias, sinks, and through lse's cotangent) against the float64 oracle
(:func:`cuflash.reference.naive_attention` and its backward, or central differences of it),
eagerly and under ``jax.jit``, ``jax.grad`` and ``jax.vmap``; one bfloat16 run on the simulator;
the refusals.

Gradient tolerance (float32 input on the NumPy path against float64): within ``1e-5`` of the
largest magnitude of the expected gradient (float32 accumulation over at most a few dozen terms
errs by a few units of 1e-7)."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import inspect  # noqa: E402
from unittest import mock  # noqa: E402

import jax.numpy as jnp  # noqa: E402
from support.inputs import sequences  # noqa: E402
from support.kvcache import check_prefill, make_prefill  # noqa: E402
from support.tolerance import check_close  # noqa: E402

import cuflash  # noqa: E402
import cuflash.jax as cj  # noqa: E402
from cuflash import mods  # noqa: E402
from cuflash import reference as ref  # noqa: E402
from cuflash.api import attention as api_attention  # noqa: E402
from cuflash.api import kvcache as api_kvcache  # noqa: E402
from cuflash.api import pipeline  # noqa: E402
from cuflash.api import softmax as api_softmax  # noqa: E402
from cuflash.api import varlen as api_varlen  # noqa: E402
from cuflash.kernels import attention_combine  # noqa: E402
from cuflash.runtime import dtypes  # noqa: E402
from cuflash.reference.backward import attention_backward as ref_backward  # noqa: E402

F64 = np.float64


def f64(x):
    """Float arrays (bfloat16 too) as float64; bool and int arrays as they are."""
    if x is None:
        return None
    x = np.asarray(x)
    return x if x.dtype.kind in "biu" else x.astype(F64)


def close(actual, expected, rel=1e-5, name=""):
    actual, expected = np.asarray(actual, F64), np.asarray(expected, F64)
    assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
    empty = np.isneginf(expected)   # an lse's rows without keys
    assert np.array_equal(np.isneginf(actual), empty), f"{name}: -inf where the oracle has none, or not where it has"
    actual, expected = actual[~empty], expected[~empty]
    scale = max(1.0, float(np.abs(expected).max(initial=0.0)))
    err = float(np.abs(actual - expected).max(initial=0.0))
    assert err <= rel * scale, f"{name}: max error {err:.3g} > {rel:g} * {scale:.3g}"


def qkv(rng, shapes, dtype=np.float32):
    return tuple(rng.standard_normal(s).astype(dtype) for s in shapes)


def reference_grads(dout, q, k, v, *, dbias=False, dsinks=False, **kw):
    """The float64 oracle's gradients (q, k, v, and d attn_bias / d sinks on request)."""
    kw64 = {n: f64(x) if n in ("attn_bias",) else x for n, x in kw.items()}
    out, lse = ref.naive_attention(f64(q), f64(k), f64(v), return_lse=True, **kw64)
    return ref_backward(f64(dout), f64(q), f64(k), f64(v), out, lse, return_dbias=dbias, return_dsinks=dsinks,
                        **kw64)


# (B, Hq, Hk, Sq, Sk, D, Dv), layout, options with modifier arrays made by `modifiers`
CASES = {
    "softcap-alibi-causal-bshd": ((2, 4, 2, 7, 9, 16, 8), "bshd", dict(softcap=2.5, causal=True, alibi="heads")),
    "bias2d-mask-sinks-gqa": ((1, 4, 1, 6, 11, 8, 8), "bhsd", dict(bias=(6, 11), mask=(1, 1, 6, 11), sinks=True)),
    "dropout-window-alibi-batched-full-bias": ((2, 2, 2, 5, 8, 8, 16), "bhsd",
                                               dict(dropout_p=0.3, dropout_seed=7, dropout_offset=3,
                                                    window_size=(2, 1), alibi="batch", bias=(2, 2, 5, 8))),
}


def modifiers(rng, b, hq, sq, sk, spec):
    kw = {n: spec[n] for n in ("softcap", "causal", "window_size", "dropout_p", "dropout_seed", "dropout_offset")
          if n in spec}
    if "alibi" in spec:
        kw["alibi_slopes"] = rng.uniform(0.1, 0.6, (hq,) if spec["alibi"] == "heads" else (b, hq)).astype(np.float32)
    if "bias" in spec:
        kw["attn_bias"] = rng.standard_normal(spec["bias"]).astype(np.float32)
    if "mask" in spec:
        mask = rng.random(spec["mask"]) > 0.35
        mask[..., 2, :] = False   # a row with no key
        kw["attn_mask"] = mask
    if spec.get("sinks"):
        kw["sinks"] = rng.standard_normal(hq).astype(np.float32)
    return kw


def shapes(b, hq, hk, sq, sk, d, dv, layout):
    if layout == "bshd":
        return (b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, dv)
    return (b, hq, sq, d), (b, hk, sk, d), (b, hk, sk, dv)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", ["jit", pytest.param("eager", marks=pytest.mark.slow)])
def test_options_forward_and_gradients_match_the_float64_oracle(case, mode, rng):
    (b, hq, hk, sq, sk, d, dv), layout, spec = CASES[case]
    q, k, v = qkv(rng, shapes(b, hq, hk, sq, sk, d, dv, layout))
    kw = modifiers(rng, b, hq, sq, sk, spec)
    arrays = {n: kw.pop(n) for n in ("attn_bias", "sinks") if n in kw}
    w = rng.standard_normal(q.shape[:-1] + (dv,)).astype(np.float32)

    def loss(q, k, v, arrays):
        return jnp.sum(cj.attention(q, k, v, layout=layout, **arrays, **kw) * w)

    fwd = lambda q, k, v, arrays: cj.attention(q, k, v, layout=layout, **arrays, **kw)  # noqa: E731
    grad = jax.grad(loss, argnums=(0, 1, 2, 3))
    if mode == "jit":
        fwd, grad = jax.jit(fwd), jax.jit(grad)
    out = np.asarray(fwd(q, k, v, arrays))
    check_close(out, q, k, v, layout=layout, **arrays, **kw)
    gq, gk, gv, garrays = grad(q, k, v, arrays)
    expected = reference_grads(w, q, k, v, layout=layout, dbias="attn_bias" in arrays, dsinks="sinks" in arrays,
                               **arrays, **kw)
    got = [gq, gk, gv] + [garrays[n] for n in ("attn_bias", "sinks") if n in arrays]
    names = ["dq", "dk", "dv"] + [n for n in ("attn_bias", "sinks") if n in arrays]
    for name, a, x in zip(names, got, expected):
        close(a, x, name=name)
    for n, x in arrays.items():
        assert garrays[n].dtype == x.dtype and garrays[n].shape == x.shape


def test_alibi_slopes_are_constants_and_the_mask_has_no_gradient(rng):
    # eagerly (the other tests jit), bias and sinks beside them
    q, k, v = qkv(rng, shapes(1, 2, 2, 4, 5, 8, 8, "bhsd"))
    slopes = np.array([0.3, 0.5], np.float32)
    mask = rng.random((4, 5)) > 0.3
    bias, sinks = rng.standard_normal((2, 1, 5)).astype(np.float32), rng.standard_normal(2).astype(np.float32)
    kw = dict(attn_mask=mask, attn_bias=bias, sinks=sinks)
    w = rng.standard_normal((1, 2, 4, 8)).astype(np.float32)
    g = jax.grad(lambda s, q, b: jnp.sum(cj.attention(q, k, v, **dict(kw, attn_bias=b), alibi_slopes=s) * w),
                 argnums=(0, 1, 2))(slopes, q, bias)
    assert np.array_equal(np.asarray(g[0]), np.zeros(2, np.float32))
    e = reference_grads(w, q, k, v, alibi_slopes=slopes, dbias=True, **kw)
    close(g[1], e[0], name="dq")
    close(g[2], e[3], name="attn_bias")
    # the slopes still act: the output moves with them, as the oracle's does
    out = cj.attention(q, k, v, alibi_slopes=slopes, **kw)
    check_close(np.asarray(out), q, k, v, alibi_slopes=slopes, **kw)


def central_differences(f, args, h=1e-6):
    """d f / d args for a float64 scalar function of float64 arrays."""
    grads = []
    for i, x in enumerate(args):
        g = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            plus = [a.copy() for a in args]
            minus = [a.copy() for a in args]
            plus[i][idx] += h
            minus[i][idx] -= h
            g[idx] = (f(*plus) - f(*minus)) / (2 * h)
        grads.append(g)
    return grads


def test_the_cotangent_of_lse_is_honoured(rng):
    """loss = sum(out * w) + sum(lse * u): d lse / d s = P reaches q, k, attn_bias and sinks."""
    q, k, v = qkv(rng, shapes(1, 2, 1, 3, 4, 4, 4, "bhsd"))
    bias = rng.standard_normal((1, 2, 3, 4)).astype(np.float32)
    sinks = rng.standard_normal(2).astype(np.float32)
    w = rng.standard_normal((1, 2, 3, 4)).astype(np.float32)
    u = rng.standard_normal((1, 2, 3)).astype(np.float32)
    kw = dict(softcap=3.0, causal=True)

    def loss(q, k, v, bias, sinks):
        out, lse = cj.attention(q, k, v, attn_bias=bias, sinks=sinks, return_lse=True, **kw)
        return jnp.sum(out * w) + jnp.sum(lse * u)

    def loss64(q, k, v, bias, sinks):
        out, lse = ref.naive_attention(q, k, v, attn_bias=bias, sinks=sinks, return_lse=True, **kw)
        return np.sum(out * w) + np.sum(lse * u)

    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(q, k, v, bias, sinks)
    expected = central_differences(loss64, [f64(x) for x in (q, k, v, bias, sinks)])
    for name, a, x in zip(("dq", "dk", "dv", "attn_bias", "sinks"), got, expected):
        close(a, x, rel=2e-5, name=name)
    # only lse in the loss: dv is 0, the rest is lse's share alone
    g = jax.grad(lambda q, v: jnp.sum(cj.attention(q, k, v, return_lse=True)[1] * u), argnums=(0, 1))(q, v)
    lse_only = central_differences(lambda q: np.sum(ref.naive_attention(q, f64(k), f64(v), return_lse=True)[1] * u),
                                   [f64(q)])[0]
    close(g[0], lse_only, rel=2e-5, name="dq (lse only)")
    assert np.array_equal(np.asarray(g[1]), np.zeros_like(v))
    # the identity the simulator's test takes its expected gradients from, held to the differences
    for a, x in zip(oracle_grads_with_lse(w, u, q, k, v, attn_bias=bias, sinks=sinks, **kw), expected):
        close(a, x, rel=1e-7)


def test_vmap_batches_the_modifiers_and_runs_sinks_and_dropout_per_element(rng):
    q = rng.standard_normal((3, 1, 2, 5, 8)).astype(np.float32)          # mapped axis first
    k, v = qkv(rng, [(1, 2, 6, 8), (1, 2, 6, 8)])
    bias = rng.standard_normal((3, 5, 6)).astype(np.float32)             # mapped with q
    slopes, sinks = np.array([0.2, 0.4], np.float32), rng.standard_normal(2).astype(np.float32)
    kw = dict(alibi_slopes=slopes, softcap=4.0)

    def f(q, b, s, **extra):
        return cj.attention(q, k, v, attn_bias=b, sinks=s, **kw, **extra)

    for extra in (dict(), dict(dropout_p=0.25, dropout_seed=11)):
        out = np.asarray(jax.jit(jax.vmap(lambda q, b: f(q, b, sinks, **extra)))(q, bias))
        for i in range(3):
            check_close(out[i], q[i], k, v, attn_bias=bias[i], sinks=sinks, **kw, **extra)
    w = rng.standard_normal((3, 1, 2, 5, 8)).astype(np.float32)
    g = jax.jit(jax.grad(lambda q, b, s: jnp.sum(jax.vmap(f, in_axes=(0, 0, None))(q, b, s) * w),
                         argnums=(0, 1, 2)))(q, bias, sinks)
    for i in range(3):
        e = reference_grads(w[i], q[i], k, v, attn_bias=bias[i], sinks=sinks, dbias=True, dsinks=True, **kw)
        close(g[0][i], e[0], name="dq")
        close(g[1][i], e[3], name="attn_bias")
    e_sinks = sum(reference_grads(w[i], q[i], k, v, attn_bias=bias[i], sinks=sinks, dsinks=True, **kw)[3]
                  for i in range(3))
    close(g[2], e_sinks, name="sinks (unmapped: summed over the mapped axis)")


@pytest.mark.slow   # the simulator compiles a forward and a backward form: about 30 s with cold caches
def test_bfloat16_on_the_simulator_with_modifiers_and_lse(rng):
    import ml_dtypes

    bf = ml_dtypes.bfloat16
    q, k, v = qkv(rng, shapes(1, 2, 1, 16, 16, 64, 64, "bhsd"), bf)
    bias = rng.standard_normal((16, 16)).astype(np.float32)
    sinks = rng.standard_normal(2).astype(np.float32)
    w = rng.standard_normal((1, 2, 16, 64)).astype(np.float32)
    u = rng.standard_normal((1, 2, 16)).astype(np.float32)
    kw = dict(softcap=5.0, causal=True, attn_bias=bias, sinks=sinks)

    def loss(q, k, v, bias, sinks):
        out, lse = cj.attention(q, k, v, **dict(kw, attn_bias=bias, sinks=sinks), return_lse=True, backend="sim")
        return jnp.sum(out.astype(jnp.float32) * w) + jnp.sum(lse * u)

    out = cj.attention(q, k, v, backend="sim", **kw)
    assert out.dtype == jnp.bfloat16
    check_close(np.asarray(out), q, k, v, **kw)
    got = jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, bias, sinks)
    expected = oracle_grads_with_lse(w, u, q, k, v, **kw)
    for name, a, x in zip(("dq", "dk", "dv", "attn_bias", "sinks"), got, expected):
        close(np.asarray(a, F64), x, rel=3e-2, name=name)   # bfloat16 inputs: a few units of 2**-8


def oracle_grads_with_lse(w, u, q, k, v, **kw):
    """The float64 gradients of ``sum(out * w) + sum(lse * u)``, from the oracle's backward: lse's
    share is the backward with ``D`` lowered by ``u`` (``dS = P (dP - D + u)``), which the
    oracle computes when given the out of values augmented by one zero column and ``dout``
    augmented by ``u`` against an ``out`` column of -1 (math; the oracle is float64 throughout)."""
    kw64 = dict(kw, attn_bias=f64(kw.get("attn_bias")))
    q, k, v = f64(q), f64(k), f64(v)
    out, lse = ref.naive_attention(q, k, v, return_lse=True, **kw64)
    v1 = np.concatenate([v, np.zeros(v.shape[:-1] + (1,))], -1)
    out1 = np.concatenate([out, -np.ones(out.shape[:-1] + (1,))], -1)
    rows = f64(u).swapaxes(-1, -2) if kw.get("layout") == "bshd" else f64(u)   # lse (B, Hq, Sq) -> out's rows
    dout1 = np.concatenate([f64(w), rows[..., None]], -1)
    grads = ref_backward(dout1, q, k, v1, out1, lse, return_dbias=kw64["attn_bias"] is not None,
                         return_dsinks=kw.get("sinks") is not None, **kw64)
    return (grads[0], grads[1], grads[2][..., :-1]) + tuple(grads[3:])


# --------------------------------------------------------------------------------------------
# the contract: the public functions' parameters

@pytest.mark.parametrize("jax_fn,public,extra", [
    (cj.attention, api_attention.attention, {"deterministic"}),
    (cj.attention_varlen, api_varlen.attention_varlen, {"deterministic"}),
    (cj.merge_attention, api_kvcache.merge_attention, set()),
    (cj.softmax, api_softmax.softmax, set()),
], ids=["attention", "attention_varlen", "merge_attention", "softmax"])
def test_signature_is_the_public_functions(jax_fn, public, extra):
    # every parameter of the public function under its name, default and kind, plus the
    # backward's ``deterministic``; nothing else. Two are taken only to be refused unless None
    # (test_refusals_name_the_argument): ``out`` (JAX arrays are immutable) and the fp8 options
    # (fp8 input has no JAX form); cuflash.attention called with a tracer passes every argument on
    mine, theirs = inspect.signature(jax_fn).parameters, inspect.signature(public).parameters
    assert set(mine) == set(theirs) | extra, set(mine) ^ (set(theirs) | extra)
    for name, p in theirs.items():
        assert mine[name].default == p.default, name
        assert mine[name].kind == p.kind, name
    # attention_with_kvcache has no JAX form (it appends to the caches in place); the routed
    # cuflash functions that have one are these
    assert set(cj.__all__) == {"attention", "attention_varlen", "merge_attention", "softmax"}


def test_backend_sim_runs_the_kernels_dispatcher(monkeypatch):
    # float32 with a softcap: "sim" runs the kernels the dispatcher picks (the portable tier's
    # modifier form), "numpy" the NumPy path, which launches nothing; both hold to the oracle
    from cuflash.sim import launcher

    seen: list = []
    real = launcher.run
    monkeypatch.setattr(launcher, "run", lambda plan, options=None: (seen.append(plan.entry), real(plan, options))[1])
    q = np.linspace(-1, 1, 32, dtype=np.float32).reshape(1, 1, 4, 8)
    check_close(np.asarray(jax.block_until_ready(cj.attention(q, q, q, softcap=2.0, backend="sim"))), q, q, q,
                softcap=2.0)
    assert any("fwd_simt" in e and "mods" in e for e in seen), seen
    seen.clear()
    check_close(np.asarray(cj.attention(q, q, q, softcap=2.0, backend="numpy")), q, q, q, softcap=2.0)
    assert seen == []


# --------------------------------------------------------------------------------------------
# attention_varlen


def per_sequence_oracle(q, k, v, cq, ck, w, u, *, alibi_slopes=None, **kw):
    """Each sequence through the float64 oracle as a batch whose last entry is it (its batch
    index is its position, as the packed dropout mask counts it): out, lse, and the gradients of
    ``sum(out * w) + sum(lse * u)`` (:func:`oracle_grads_with_lse`)."""
    out, lse = np.zeros(q.shape[:2] + v.shape[-1:]), np.zeros((q.shape[1], q.shape[0]))
    grads = [np.zeros(x.shape) for x in (q, k, v)]
    for b, (rq, rk, _) in enumerate(sequences(cq, ck, None)):
        def batch(x, rows):   # (b + 1, S, H, D), the sequence last, zeros before it
            x = f64(x[rows])
            return np.concatenate([np.zeros((b,) + x.shape), x[None]])
        qs, ks, vs, ws = batch(q, rq), batch(k, rk), batch(v, rk), batch(w, rq)
        us = np.concatenate([np.zeros((b,) + u[:, rq].shape), u[None, :, rq]]).astype(F64)
        sl = None if alibi_slopes is None else np.broadcast_to(alibi_slopes, (len(cq) - 1, q.shape[1]))[:b + 1]
        o, l = ref.naive_attention(qs, ks, vs, layout="bshd", return_lse=True, alibi_slopes=sl, **kw)
        out[rq], lse[:, rq] = o[b], l[b]
        g = oracle_grads_with_lse(ws, us, qs, ks, vs, layout="bshd", alibi_slopes=sl, **kw)
        grads[0][rq], grads[1][rk], grads[2][rk] = g[0][b], g[1][b], g[2][b]
    return out, lse, grads


def test_attention_varlen_options_and_the_lse_cotangent_under_jit(rng):
    from support.inputs import make_batch

    q, k, v, cq, ck, mq, mk, _ = make_batch(rng, [(5, 7), (0, 3), (6, 4)], 4, 2, 8, 8, np.float32)
    slopes = rng.uniform(0.1, 0.5, (3, 4)).astype(np.float32)
    w = rng.standard_normal((q.shape[0], 4, 8)).astype(np.float32)
    u = rng.standard_normal((4, q.shape[0])).astype(np.float32)
    for kw in (dict(softcap=2.0, causal=True), dict(dropout_p=0.3, dropout_seed=5, window_size=(3, 0))):
        def f(q, k, v):
            return cj.attention_varlen(q, k, v, jnp.asarray(cq), jnp.asarray(ck), mq, mk, alibi_slopes=slopes,
                                       return_lse=True, **kw)

        def loss(q, k, v):
            out, lse = f(q, k, v)
            return jnp.sum(out * w) + jnp.sum(lse * u)

        out, lse = jax.jit(f)(q, k, v)
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
        e_out, e_lse, e_grads = per_sequence_oracle(q, k, v, cq, ck, w, u, alibi_slopes=slopes, **kw)
        close(out, e_out, name="out")
        close(lse, e_lse, name="lse")
        for name, a, x in zip(("dq", "dk", "dv"), grads, e_grads):
            close(a, x, name=name)
    # jax.vmap: one pipeline run per mapped element, each the unmapped call
    qs = np.stack([q, q[::-1].copy()])
    got = jax.vmap(lambda q: cj.attention_varlen(q, k, v, jnp.asarray(cq), jnp.asarray(ck), mq, mk, softcap=2.0))(qs)
    for i in range(2):
        np.testing.assert_array_equal(np.asarray(got[i]), np.asarray(
            cj.attention_varlen(qs[i], k, v, jnp.asarray(cq), jnp.asarray(ck), mq, mk, softcap=2.0)))


def test_attention_varlen_block_table_runs_forward_and_refuses_its_gradient(rng):
    from support.inputs import make_batch

    q, k, v, cq, ck, mq, mk, _ = make_batch(rng, [(3, 5), (4, 6)], 2, 1, 8, 8, np.float32)
    kc = rng.standard_normal((5, 4, 1, 8)).astype(np.float32)   # 5 pages of 4 rows
    vc = rng.standard_normal((5, 4, 1, 8)).astype(np.float32)
    table = np.array([[3, 1], [0, 4]], np.int32)
    rows = lambda c, b, n: c[table[b]].reshape(-1, 1, 8)[:n]  # noqa: E731
    f = lambda q: cj.attention_varlen(q, kc, vc, jnp.asarray(cq), jnp.asarray(ck), mq, mk,  # noqa: E731
                                      block_table=jnp.asarray(table), causal=True)
    out = np.asarray(jax.jit(f)(q))
    for b, (rq, rk, _) in enumerate(sequences(cq, ck, None)):
        n = rk.stop - rk.start
        check_close(out[None, rq], q[None, rq], rows(kc, b, n)[None], rows(vc, b, n)[None], layout="bshd",
                    causal=True)
    with pytest.raises(TypeError, match="cuflash.jax.attention_varlen: block_table has no gradient"):
        jax.grad(lambda q: jnp.sum(f(q)))(q)
    assert np.isfinite(np.asarray(jax.grad(lambda q: jnp.sum(f(jax.lax.stop_gradient(q))) + jnp.sum(q))(q))).all()


def test_attention_varlen_num_splits_splits_the_chunked_prefill_on_the_simulator(rng):
    # chunked prefill over a paged cache (float16, 64 query rows: the Hopper form of the
    # simulated sm_90), through cuflash.attention_varlen with a JAX tracer (routed to cuflash.jax)
    # under jax.jit: num_splits=2 runs two key splits merged by the combine kernel, the default
    # runs unsplit; both against the float64 oracle. NaN in every cache row no sequence reads.
    q, kc, vc, cq, ck, mq, mk, used, bt = make_prefill(rng, [(64, 150), (1, 5)], 16, (2, 1), 64, dtypes.float16,
                                                       "some")
    info = cuflash.explain_varlen(q, kc, vc, cq, ck, mq, mk, causal=True, seqused_k=used, block_table=bt,
                                  num_splits=2, backend="sim", arch=90)
    assert "_varlen_kvcache" in info["variant"] and info["splits"] == 2, info["choice"]
    for num_splits, combines in ((2, 1), (None, 0)):
        split = {} if num_splits is None else dict(num_splits=num_splits)
        f = jax.jit(lambda q: cuflash.attention_varlen(  # noqa: B023
            q, kc, vc, jnp.asarray(cq), jnp.asarray(ck), mq, mk, causal=True, seqused_k=jnp.asarray(used),
            block_table=jnp.asarray(bt), return_lse=True, backend="sim", **split))
        with mock.patch.object(attention_combine, "plan_combine", wraps=attention_combine.plan_combine) as combine:
            out, lse = jax.block_until_ready(f(q))
        assert combine.call_count == combines, num_splits   # (the split path ran, or did not)
        assert out.dtype == jnp.float16 and out.shape == q.shape
        check_prefill(np.asarray(out), np.asarray(lse), q, kc, vc, cq, ck, used, bt, 16, True, (-1, -1))


@pytest.mark.parametrize("num_splits", [0, 1, 7])
def test_attention_varlen_num_splits_reaches_the_pipeline(num_splits, rng, monkeypatch):
    # the static option arrives unchanged in the public functions' pipeline (a hint the NumPy
    # path ignores: its result is the float64 oracle's whatever the count)
    seen = []
    real = pipeline.run
    monkeypatch.setattr(pipeline, "run", lambda entry, arrays, options: (
        seen.append(options.packed.num_splits), real(entry, arrays, options))[1])
    q, k, v = (rng.standard_normal((7, 2, 8)).astype(np.float32) for _ in range(3))
    cq = jnp.asarray([0, 3, 7], jnp.int32)
    out = cj.attention_varlen(q, k, v, cq, cq, 4, 4, causal=True, num_splits=num_splits, backend="numpy")
    assert seen == [num_splits]
    for rows in (slice(0, 3), slice(3, 7)):
        check_close(np.asarray(out)[None, rows], q[None, rows], k[None, rows], v[None, rows], layout="bshd",
                    causal=True)


@pytest.mark.parametrize("value,error,match", [
    (-1, ValueError, r"num_splits must be in \[0, 256\].*got -1"),
    (257, ValueError, r"num_splits must be in \[0, 256\].*got 257"),
    (2.0, TypeError, "num_splits must be an int, got 2.0"),
    (True, TypeError, "num_splits must be an int, got True"),
    ("2", TypeError, "num_splits must be an int, got '2'"),
])
def test_attention_varlen_num_splits_is_validated(value, error, match):
    q = jnp.zeros((4, 2, 8), jnp.float32)
    cq = jnp.asarray([0, 4], jnp.int32)
    with pytest.raises(error, match="cuflash.jax.attention_varlen: " + match):
        cj.attention_varlen(q, q, q, cq, cq, 4, 4, num_splits=value)
    with pytest.raises(error, match="cuflash.jax.attention_varlen: " + match):   # routed: the adapter's message
        jax.jit(lambda q: cuflash.attention_varlen(q, q, q, cq, cq, 4, 4, num_splits=value))(q)
    with pytest.raises(TypeError, match="cuflash.jax.attention_varlen: num_splits must be a Python number"):
        jax.jit(lambda n: cj.attention_varlen(q, q, q, cq, cq, 4, 4, num_splits=n))(2)


# --------------------------------------------------------------------------------------------
# refusals (at trace time unless said otherwise)


def test_refusals_name_the_argument(rng):
    q, k, v = qkv(rng, shapes(1, 2, 2, 4, 5, 8, 8, "bhsd"))
    with pytest.raises(TypeError, match="cuflash.jax.attention: out must be None: JAX arrays are immutable"):
        cj.attention(q, k, v, out=jnp.zeros((1, 2, 4, 8)))
    with pytest.raises(ValueError, match="cuflash.jax.attention: dropout_p=0.1 needs dropout_seed"):
        cj.attention(q, k, v, dropout_p=0.1)
    with pytest.raises(TypeError, match="cuflash.jax.attention: dropout_seed must be a Python number"):
        cj.attention(q, k, v, dropout_p=0.1, dropout_seed=jnp.int32(3))
    with pytest.raises(TypeError, match="cuflash.jax.attention: softcap must be a Python number .*static"):
        jax.jit(lambda q, c: cj.attention(q, k, v, softcap=c))(q, 2.0)
    with pytest.raises(ValueError, match=r"cuflash.jax.attention: backend must be one of .* got 'gpu'"):
        cj.attention(q, k, v, backend="gpu")
    with pytest.raises(ValueError, match="cuflash.jax.attention: backend='cuda' needs GPU arrays"):
        cj.attention(jnp.asarray(q), k, v, backend="cuda")
    with pytest.raises(TypeError, match="cuflash.jax.attention: attn_mask must be a bool array"):
        cj.attention(q, k, v, attn_mask=jnp.ones((4, 5)))
    with pytest.raises(ValueError, match=r"cuflash.jax.attention: alibi_slopes"):
        cj.attention(q, k, v, alibi_slopes=jnp.ones(3))
    with pytest.raises(TypeError, match=r"cuflash.jax.attention: sinks"):
        cj.attention(q, k, v, sinks=np.ones(2, np.float64))
    with pytest.raises(ValueError, match=r"cuflash.jax.attention: attn_bias"):
        cj.attention(q, k, v, attn_bias=jnp.ones((3, 5)))
    with pytest.raises(TypeError, match="cuflash.jax.attention: attn_bias must be a jax.Array or None"):
        cj.attention(q, k, v, attn_bias=[[0.0]])
    qp, kp, vp = (x.reshape(-1, 2, 8) for x in (q, k, v))   # total_q = 4, total_k = 5
    cq, ck = jnp.asarray([0, 1, 4], jnp.int32), jnp.asarray([0, 2, 5], jnp.int32)
    with pytest.raises(TypeError, match="cuflash.jax.attention_varlen: out must be None"):
        cj.attention_varlen(qp, kp, vp, cq, ck, 4, 5, out=jnp.zeros(qp.shape))
    with pytest.raises(TypeError, match="cuflash.jax.attention_varlen: block_table must be int32"):
        cj.attention_varlen(qp, kp.reshape(5, 1, 2, 8), vp.reshape(5, 1, 2, 8), cq, ck, 4, 5,
                            block_table=np.zeros((2, 2), np.int64))
    with pytest.raises(ValueError, match=r"cuflash.jax.attention_varlen: alibi_slopes"):
        cj.attention_varlen(qp, kp, vp, cq, ck, 4, 5, alibi_slopes=jnp.ones((3, 2)))
    with pytest.raises(TypeError, match="cuflash.jax.attention_varlen: max_seqlen_q must be a Python number"):
        jax.jit(lambda m: cj.attention_varlen(qp, kp, vp, cq, ck, m, 5))(4)


@pytest.mark.parametrize("name,value,got", [
    ("q_descale", np.ones((1, 2), np.float32), r"an array of shape \(1, 2\)"),
    ("k_descale", np.ones((1, 2), np.float32), r"an array of shape \(1, 2\)"),
    ("v_descale", np.ones((1, 2), np.float32), r"an array of shape \(1, 2\)"),
    ("out_dtype", "bfloat16", r"'bfloat16' \(str\)"),
])
def test_the_fp8_options_are_refused_by_name(name, value, got):
    # taken as the public functions take them: with float8 input refused by name (fp8 has no JAX
    # form), with other input the public function's ValueError (an option of fp8 input only);
    # cuflash.attention called with a tracer reaches the same answers (not an unexpected-keyword
    # error); None is fine
    q = jnp.zeros((1, 2, 4, 8), jnp.float32)
    qp, cq = q.reshape(4, 2, 8), jnp.asarray([0, 4], jnp.int32)
    public_calls = {"cuflash.attention": lambda q, **kw: cuflash.attention(q, q, q, **kw),
                    "cuflash.attention_varlen": lambda q, **kw: cuflash.attention_varlen(
                        q, q, q, np.asarray(cq), np.asarray(cq), 4, 4, **kw)}
    calls = {"cuflash.jax.attention": ("cuflash.attention", lambda q, **kw: cj.attention(q, q, q, **kw),
                                       lambda q, **kw: cuflash.attention(q, q, q, **kw), q),
             "cuflash.jax.attention_varlen": ("cuflash.attention_varlen",
                                              lambda q, **kw: cj.attention_varlen(q, q, q, cq, cq, 4, 4, **kw),
                                              lambda q, **kw: cuflash.attention_varlen(q, q, q, cq, cq, 4, 4, **kw),
                                              qp)}
    for func, (public, adapter, routed, x) in calls.items():
        want = f"{func}: {name} must be None: fp8 input has no form in cuflash.jax .*call {public} on concrete .*{got}"
        x8 = x.astype(jnp.float8_e4m3fn)
        with pytest.raises(NotImplementedError, match=want):
            adapter(x8, **{name: value})
        with pytest.raises(NotImplementedError, match=want):
            jax.jit(lambda x: routed(x, **{name: value}))(x8)  # noqa: B023
        with pytest.raises(ValueError) as expected:   # float32 input: the public function's refusal
            public_calls[public](np.asarray(x), **{name: value})
        assert str(expected.value).startswith(f"{public}: {name}"), expected.value
        eager = lambda: adapter(x, **{name: value})                       # noqa: B023, E731
        traced = lambda: jax.jit(lambda x: routed(x, **{name: value}))(x)  # noqa: B023, E731
        for call in (eager, traced):
            with pytest.raises(ValueError) as err:
                call()
            assert str(err.value) == str(expected.value).replace(public, func, 1), err.value
        # float8 input without the options: the shared refusal, naming where fp8 is taken
        with pytest.raises(NotImplementedError, match=r"cuflash\.attention and cuflash\.attention_varlen"):
            adapter(x8)
        np.testing.assert_array_equal(np.asarray(adapter(x, **{name: None})), np.asarray(adapter(x)))


def test_the_missing_cupy_hint_names_both_installs(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "cupy", None)   # import cupy raises ImportError
    with pytest.raises(RuntimeError, match=r"pip install 'cuflash\[cuda12\]' .*source checkout pip install "
                                           r"'\.\[cuda12\]'"):
        cj._cupy()


def test_a_large_lse_cotangent_in_float16(rng):
    # lse's share of the gradient is carried in float16 operands: a cotangent past float16's range
    # (and one below its normal range) must arrive intact
    q, k, v = qkv(rng, shapes(1, 2, 1, 3, 4, 8, 8, "bhsd"), np.float16)
    u = np.array([[[9e4, -2e5, 3e-6], [1.5, -7e4, 1e5]]], np.float32)
    kw = dict(softmax_scale=0.05)   # gradients of about 1e4, inside float16's range
    g = jax.jit(jax.grad(lambda q, k: jnp.sum(cj.attention(q, k, v, return_lse=True, **kw)[1] * u),
                         argnums=(0, 1)))(q, k)
    e = oracle_grads_with_lse(np.zeros((1, 2, 3, 8)), u, q, k, v, **kw)
    for name, a, x in zip(("dq", "dk"), g, e):
        close(a, x, rel=2e-3, name=name)   # float16 rounding of the gradients (about 1e4)


def test_block_mask_gradients_match_the_oracle_eager_and_under_jit(rng, monkeypatch):
    """A block mask through jax.grad, eager and under jax.jit: the gradients of q, k, v and of a
    learned score_mod table against the float64 oracle with the dense mask_mod. The BlockMask is a static part of the call, hashed by identity:
    the same object traces the call once, an equal new one traces it again."""
    doc = np.repeat(np.arange(2, dtype=np.int32), (140, 20))
    bm = mods.document_block_mask(doc, causal=True, BLOCK_SIZE=64)
    assert set(np.unique(bm.to_dense())) == {0, 1, 2}   # empty, partial and full blocks
    q, k, v = qkv(rng, shapes(1, 2, 1, 160, 160, 8, 8, "bhsd"))
    w = rng.standard_normal(q.shape).astype(np.float32)
    table = rng.standard_normal((2, 9)).astype(np.float32)

    def loss(q, k, v, table=table, bm=bm):
        return jnp.sum(cj.attention(q, k, v, block_mask=bm, score_mod=mods.relative_position_bias(table, 4)) * w)

    t64 = table.astype(F64)
    kw = dict(mask_mod=bm.mask_mod, score_mod=mods.relative_position_bias(t64, 4))
    out, lse = ref.naive_attention(f64(q), f64(k), f64(v), return_lse=True, **kw)
    want = ref_backward(f64(w), f64(q), f64(k), f64(v), out, lse, return_dscore_mod=True, **kw)
    want = [*want[:3], want[3]["table"]]
    assert np.abs(want[3]).max() > 0.1
    arg = (0, 1, 2, 3)
    for g in (jax.grad(loss, argnums=arg)(q, k, v, table), jax.jit(jax.grad(loss, argnums=arg))(q, k, v, table)):
        for name, a, x in zip(("dq", "dk", "dv", "d table"), g, want):
            close(a, x, rel=1e-4, name=name)

    def masked(q, bm):   # no score_mod (its own trace count: the next test)
        return jnp.sum(cj.attention(q, k, v, block_mask=bm) * w)

    traces = []
    core = cj._core
    monkeypatch.setattr(cj, "_core", lambda *a: traces.append(a[-1]) or core(*a))   # runs once per trace of the call
    jax.grad(masked)(q, bm)
    jax.grad(masked)(q, bm)
    assert len(traces) == 1 and traces[0].options.modifiers.block_mask is bm   # the same BlockMask: traced once
    again = mods.document_block_mask(doc, causal=True, BLOCK_SIZE=64)
    jax.grad(masked)(q, again)
    jax.grad(masked)(q, again)
    assert len(traces) == 2 and traces[1].options.modifiers.block_mask is again   # an equal new one: once more


def test_a_score_mod_traces_the_call_once_whatever_its_captured_values(rng, monkeypatch):
    """An eager call with a score_mod traces its jitted computation once: a new closure of the
    same function over new values of the same shape reuses it (the values are traced inputs),
    and the result follows the new values. A table of another shape traces it again."""
    q, k, v = qkv(rng, shapes(1, 2, 1, 40, 40, 8, 8, "bhsd"))
    traces = []
    core = cj._core
    monkeypatch.setattr(cj, "_core", lambda *a: traces.append(a[-1]) or core(*a))   # runs once per trace of the call
    outs = []
    for seed in (1, 2):
        table = np.random.default_rng(seed).standard_normal((2, 9)).astype(np.float32)
        outs.append(np.asarray(cj.attention(q, k, v, score_mod=mods.relative_position_bias(table, 4))))
        want = ref.naive_attention(f64(q), f64(k), f64(v), score_mod=mods.relative_position_bias(table.astype(F64), 4))
        close(outs[-1], want, rel=1e-4, name=f"out, table {seed}")
    assert len(traces) == 1
    assert not np.array_equal(outs[0], outs[1])
    wider = np.zeros((2, 11), np.float32)
    cj.attention(q, k, v, score_mod=mods.relative_position_bias(wider, 5))
    assert len(traces) == 2


def test_block_mask_refusals_at_trace_time():
    doc = np.repeat(np.arange(2, dtype=np.int32), 64)
    bm = mods.document_block_mask(doc, BLOCK_SIZE=64)
    q = jnp.zeros((1, 2, 128, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"block_mask was built for \(Q_LEN, KV_LEN\) = \(128, 128\)"):
        jax.jit(lambda q: cj.attention(q, q, q, block_mask=bm))(q[:, :, :64])
    with pytest.raises(ValueError, match="mask_mod must be the function block_mask was built from"):
        cj.attention(q, q, q, block_mask=bm, mask_mod=mods.document_mask(doc, causal=True))
    with pytest.raises(TypeError, match="block_mask must be a BlockMask"):
        cj.attention(q, q, q, block_mask=bm.to_dense())
    with pytest.raises(TypeError, match="block_mask holds jax.*arrays, q is a JAX array on the CPU"):
        cj.attention(q, q, q, block_mask=bm.with_arrays(jnp.asarray))
    np.testing.assert_array_equal(cj.attention(q, q, q, block_mask=bm, mask_mod=bm.mask_mod),
                                  cj.attention(q, q, q, block_mask=bm))   # its own mask_mod is taken
