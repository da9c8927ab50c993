"""cuflash.jax.attention on CPU JAX: the forward against the float64 oracle and ``jax.grad``
against the float64 gradients, eagerly and under ``jax.jit`` and ``jax.vmap``, for causal, GQA,
windows and odd shapes; agreement with ``jax.nn.dot_product_attention`` where the conventions
meet; validation at trace time; the README's example."""

from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
from support.tolerance import check_close  # noqa: E402
from support.grads import check_grads_close  # noqa: E402

import cuflash  # noqa: E402
import cuflash.jax as cj  # noqa: E402

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]

# (B, Hq, Hk), Sq, Sk, D, Dv, options
CASES = [
    ((2, 4, 2), 9, 11, 16, 8, dict(causal=True)),
    ((1, 3, 1), 17, 5, 40, 40, dict()),
    ((2, 2, 2), 1, 33, 8, 24, dict(window_size=(4, 2))),
    ((1, 8, 2), 40, 9, 32, 32, dict(causal=True)),   # rows without keys (Sq > Sk)
    ((3, 2, 1), 13, 13, 72, 64, dict(causal=True, window_size=(3, -1))),
]


def make(rng, b, hq, hk, sq, sk, d, dv, dtype=np.float32, layout="bhsd"):
    if layout == "bshd":
        shapes = (b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, dv)
    else:
        shapes = (b, hq, sq, d), (b, hk, sk, d), (b, hk, sk, dv)
    return tuple(rng.standard_normal(s).astype(dtype) for s in shapes)


@pytest.mark.parametrize("heads,sq,sk,d,dv,kw", CASES)
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_forward_and_grad_match_the_float64_oracle(heads, sq, sk, d, dv, kw, mode, rng):
    q, k, v = make(rng, *heads, sq, sk, d, dv)
    w = rng.standard_normal((heads[0], heads[1], sq, dv)).astype(np.float32)

    def loss(q, k, v):
        return jnp.sum(cj.attention(q, k, v, **kw) * w)

    fwd = (lambda *a: cj.attention(*a, **kw))
    grad = jax.grad(loss, argnums=(0, 1, 2))
    if mode == "jit":
        fwd, grad = jax.jit(fwd), jax.jit(grad)
    out = np.asarray(fwd(q, k, v))
    check_close(out, q, k, v, **kw)
    grads = [np.asarray(g) for g in grad(q, k, v)]
    _, lse = cuflash.attention(q, k, v, return_lse=True, **kw)
    check_grads_close(grads, w, q, k, v, out, lse, **kw)


def test_vmap_over_a_leading_axis_and_unbatched_kv(rng):
    q = rng.standard_normal((3, 2, 4, 10, 16)).astype(np.float32)   # mapped axis first
    k, v = make(rng, 2, 4, 2, 1, 12, 16, 16)[1:]
    f = jax.jit(jax.vmap(lambda q: cj.attention(q, k, v, causal=True)))
    out = np.asarray(f(q))
    for i in range(3):
        check_close(out[i], q[i], k, v, causal=True)
    g = jax.jit(jax.grad(lambda q, k: jnp.sum(jax.vmap(lambda q: cj.attention(q, k, v))(q) ** 2), argnums=(0, 1)))
    gq, gk = g(q, k)
    # against the batch as one call: the mapped axis is a batch axis, k's gradient sums over it
    qq = jnp.asarray(q).reshape(6, 4, 10, 16)
    kk = jnp.broadcast_to(k, (3,) + k.shape).reshape(6, 2, 12, 16)
    vv = jnp.broadcast_to(v, (3,) + v.shape).reshape(6, 2, 12, 16)
    ref_q, ref_k = jax.grad(lambda q, k: jnp.sum(cj.attention(q, k, vv) ** 2), argnums=(0, 1))(qq, kk)
    np.testing.assert_allclose(np.asarray(gq), np.asarray(ref_q).reshape(q.shape), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(gk), np.asarray(ref_k).reshape(3, *k.shape).sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal,sq,sk,hk", [(False, 12, 20, 4), (True, 16, 16, 2), (False, 1, 7, 1)])
def test_agrees_with_jax_nn_dot_product_attention(causal, sq, sk, hk, rng):
    # "bshd" is jax.nn's BTNH; GQA through its own head grouping; causal where both align (Sq == Sk)
    q, k, v = make(rng, 2, 4, hk, sq, sk, 32, 32, layout="bshd")
    ours = cj.attention(q, k, v, causal=causal, layout="bshd")
    theirs = jax.nn.dot_product_attention(q, k, v, is_causal=causal)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=2e-5, atol=2e-5)
    g1 = jax.grad(lambda q, k, v: jnp.sum(jnp.sin(cj.attention(q, k, v, causal=causal, layout="bshd"))),
                  argnums=(0, 1, 2))(q, k, v)
    g2 = jax.grad(lambda q, k, v: jnp.sum(jnp.sin(jax.nn.dot_product_attention(q, k, v, is_causal=causal))),
                  argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_bfloat16_and_the_softmax_scale(rng):
    q, k, v = (x.astype(jnp.bfloat16) for x in make(rng, 1, 2, 2, 30, 31, 64, 64))
    out = cj.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), softmax_scale=0.05, causal=True)
    assert out.dtype == jnp.bfloat16
    check_close(np.asarray(out), np.asarray(q), np.asarray(k), np.asarray(v), softmax_scale=0.05, causal=True)


def test_validation_happens_at_trace_time(rng):
    q, k, v = make(rng, 1, 4, 2, 5, 6, 16, 16)
    with pytest.raises(ValueError, match=r"cuflash.jax.attention: k.shape\[-1\]=8 must equal q.shape\[-1\]=16"):
        jax.jit(lambda q, k: cj.attention(q, k[..., :8], v[..., :8]))(q, k)
    with pytest.raises(ValueError, match="query heads must be a multiple of"):
        cj.attention(q[:, :3], k, v)
    with pytest.raises(TypeError, match="causal must be a bool"):
        cj.attention(q, k, v, causal=1)
    with pytest.raises(TypeError, match="q must be a jax.Array"):
        cj.attention([1.0], k, v)


def test_readme_example_runs():
    text = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- jax-example -->\s*```python\n(.*?)```", text, re.S)
    assert block, "README.md has no JAX example after <!-- jax-example -->"
    code = block.group(1)
    assert len(code.strip().splitlines()) <= 6
    exec(compile(code, "README.md (JAX example)", "exec"), {})


def test_attention_varlen_forward_and_grad_under_jit(rng):
    from support.inputs import make_batch
    from support.tolerance import check_packed_backward as check_backward
    from support.tolerance import check_packed_forward as check_forward

    q, k, v, cq, ck, mq, mk, used = make_batch(rng, [(17, 1), (0, 3), (40, 33), (5, 5)], 4, 2, 32, 24, np.float32,
                                               used="some")
    kw = dict(causal=True, window_size=(9, -1))
    w = rng.standard_normal((q.shape[0], 4, 24)).astype(np.float32)
    f = jax.jit(lambda q, k, v: cj.attention_varlen(q, k, v, jnp.asarray(cq), jnp.asarray(ck), mq, mk,
                                                    seqused_k=jnp.asarray(used), **kw))
    out = np.asarray(f(q, k, v))
    _, lse = cuflash.attention_varlen(q, k, v, cq, ck, mq, mk, seqused_k=used, return_lse=True, **kw)
    check_forward(out, lse, q, k, v, cq, ck, used, **kw)
    g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) * w), argnums=(0, 1, 2)))(q, k, v)
    check_backward([np.asarray(x) for x in g], w, q, k, v, out, lse, cq, ck, used, **kw)
    with pytest.raises(TypeError, match="cu_seqlens_k must be int32"):
        cj.attention_varlen(q, k, v, cq, ck.astype(np.int64), mq, mk)
    with pytest.raises(ValueError, match=r"cu_seqlens_k.shape=\(4,\) must be \(5,\)"):
        cj.attention_varlen(q, k, v, cq, ck[:-1], mq, mk)


def test_grad_through_score_mod_reaches_captured_arrays(rng):
    """jax.grad (eager and under jax.jit) through a score_mod with a learned relative-position
    table and a mask_mod over document ids: the table's and q's gradients match the float64
    oracle (cuflash.reference.attention_backward with return_dscore_mod)."""
    from cuflash import mods
    from cuflash import reference as ref

    h, s = 2, 6
    q, k, v = (rng.standard_normal((1, h, s, 8)).astype(np.float32) for _ in range(3))
    table = rng.standard_normal((h, 2 * s - 1)).astype(np.float32)
    doc = np.array([0, 0, 0, 1, 1, 1], np.int32)

    def loss(table, q):
        out = cj.attention(q, jnp.asarray(k), jnp.asarray(v), causal=True,
                           score_mod=lambda sc, b, hh, i, j: sc * 0.5 + mods.tanh(table[hh, j - i + s - 1]),
                           mask_mod=lambda b, hh, i, j: doc[i] == doc[j])
        return (out * out).sum()

    t64 = table.astype(np.float64)
    kw = dict(causal=True, score_mod=lambda sc, b, hh, i, j: sc * 0.5 + mods.tanh(t64[hh, j - i + s - 1]),
              mask_mod=lambda b, hh, i, j: doc[i] == doc[j])
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    out, lse = ref.naive_attention(q64, k64, v64, return_lse=True, **kw)
    want = ref.attention_backward(2 * out, q64, k64, v64, out, lse, return_dscore_mod=True, **kw)
    assert np.abs(want[3]["t64"]).max() > 0.1
    for grad in (jax.grad(loss, argnums=(0, 1)), jax.jit(jax.grad(loss, argnums=(0, 1)))):
        dtable, dq = grad(jnp.asarray(table), jnp.asarray(q))
        assert dtable.dtype == jnp.float32 and dtable.shape == table.shape
        np.testing.assert_allclose(np.asarray(dtable), want[3]["t64"], rtol=2e-4, atol=2e-5)
        np.testing.assert_allclose(np.asarray(dq), want[0], rtol=2e-4, atol=2e-5)
    # jax.vmap over a leading axis, the table unmapped: each element as the unmapped call (run per element)
    qs = jnp.stack([jnp.asarray(q), jnp.asarray(q) * 0.5])
    mapped = jax.vmap(lambda x: cj.attention(x, jnp.asarray(k), jnp.asarray(v), causal=True,
                                             score_mod=lambda sc, b, hh, i, j: sc + table[hh, j - i + s - 1]))(qs)
    for e in range(2):
        one = cj.attention(qs[e], jnp.asarray(k), jnp.asarray(v), causal=True,
                           score_mod=lambda sc, b, hh, i, j: sc + table[hh, j - i + s - 1])
        np.testing.assert_array_equal(np.asarray(mapped[e]), np.asarray(one))
