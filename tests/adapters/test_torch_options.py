"""cuflash.torch takes every option of the public functions: the signatures, gradients of every
differentiable input against torch's own float64 autograd of a naive formula (written here, held
to cuflash.reference first), the options that have no gradient refused by name, backends (the
simulator with float16/bfloat16 tensors), dropout keys, out=, meta tensors, and softmax."""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cuflash  # noqa: E402
import cuflash.torch as ct  # noqa: E402
from cuflash import reference as ref  # noqa: E402
from cuflash import sim  # noqa: E402
from cuflash.api import attention as api_attention  # noqa: E402
from cuflash.api import kvcache as api_kvcache  # noqa: E402
from cuflash.api import softmax as api_softmax  # noqa: E402
from cuflash.api import varlen as api_varlen  # noqa: E402

F64 = torch.float64


@pytest.fixture
def gen(rng):
    return torch.Generator().manual_seed(int(rng.integers(2**31)))


def randn(gen, *shape, dtype=F64, grad=False):
    return torch.randn(*shape, generator=gen, dtype=F64).to(dtype).requires_grad_(grad)


def naive(q, k, v, *, causal=False, window_size=(-1, -1), softmax_scale=None, softcap=0.0, alibi_slopes=None,
          attn_bias=None, attn_mask=None, sinks=None, keep=None, dropout_p=0.0):
    """``(out, lse)`` of attention in plain torch ("bhsd", 4-D), differentiable by torch's autograd:
    scale, softcap, ALiBi and bias, the masks, softmax with the sink, dropout (``keep`` the mask)."""
    b, hq, sq, _ = q.shape
    sk = k.shape[-2]
    g = hq // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scale = 1 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    rows = torch.arange(sq)[:, None] + (sk - sq)
    cols = torch.arange(sk)[None, :]
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(F64).reshape(-1 if alibi_slopes.dim() == 2 else 1, hq, 1, 1)
        s = s - slopes * (rows - cols).abs()
    if attn_bias is not None:
        s = s + attn_bias
    left, right = window_size
    right = 0 if causal else right
    visible = torch.ones(sq, sk, dtype=torch.bool)
    if right >= 0:
        visible &= cols <= rows + right
    if left >= 0:
        visible &= cols >= rows - left
    if attn_mask is not None:
        visible = visible & attn_mask
    s = s.masked_fill(~visible, -math.inf)
    m = s.amax(-1, keepdim=True)
    if sinks is not None:
        m = torch.maximum(m, sinks.to(F64).reshape(1, hq, 1, 1))
    m = m.detach().clamp(min=-1e300)
    e = torch.exp(s - m)
    denom = e.sum(-1, keepdim=True)
    if sinks is not None:
        denom = denom + torch.exp(sinks.to(F64).reshape(1, hq, 1, 1) - m)
    p = e / denom
    if keep is not None:
        p = p * torch.from_numpy(keep) / (1 - dropout_p)
    return p @ v, (m + torch.log(denom)).squeeze(-1)


def grads(out, inputs, dout):
    return torch.autograd.grad(out, inputs, dout)


def assert_grads_close(got, want, names, **tol):
    for name, a, b in zip(names, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        torch.testing.assert_close(a, b, msg=name, **(tol or dict(rtol=1e-10, atol=1e-12)))


# ---------------------------------------------------------------------------- the contract


@pytest.mark.parametrize("torch_fn,public,extra", [
    (ct.attention, api_attention.attention, {"deterministic"}),
    (ct.attention_varlen, api_varlen.attention_varlen, {"deterministic"}),
    (ct.attention_with_kvcache, api_kvcache.attention_with_kvcache, set()),
    (ct.merge_attention, api_kvcache.merge_attention, set()),
    (ct.softmax, api_softmax.softmax, set()),
])
def test_signature_is_the_public_functions(torch_fn, public, extra):
    mine, theirs = inspect.signature(torch_fn).parameters, inspect.signature(public).parameters
    assert set(mine) == set(theirs) | extra
    for name, p in theirs.items():
        assert mine[name].default == p.default, name
        assert mine[name].kind == p.kind, name
    assert "softmax" in ct.__all__ and ct.softmax is cuflash.torch.softmax


# ---------------------------------------------------------------------------- gradients, float64


def test_every_modifier_and_dropout_gradient_matches_torch_autograd(gen):
    # GQA, softcap, constant ALiBi slopes, a broadcast bias and sinks that require grad, a mask,
    # a window, dropout with a given key: out, lse and every gradient against the naive formula
    b, hq, hk, sq, sk, d = 2, 4, 2, 5, 7, 4
    q, k, v = randn(gen, b, hq, sq, d, grad=True), randn(gen, b, hk, sk, d, grad=True), randn(gen, b, hk, sk, 3, grad=True)
    bias = randn(gen, 1, hq, 1, sk, grad=True)
    sinks = randn(gen, hq, dtype=torch.float32).to(F64).requires_grad_()
    slopes = torch.rand(b, hq, generator=gen, dtype=F64) * 0.5
    mask = torch.rand(sq, sk, generator=gen) > 0.3
    mask[:, -1] = True
    kw = dict(softcap=2.5, alibi_slopes=slopes, attn_mask=mask, window_size=(4, 1), softmax_scale=0.7)
    drop = dict(dropout_p=0.25, dropout_seed=123, dropout_offset=45)
    keep = ref.dropout_mask((b, hq, sq, sk), 0.25, 123, 45)
    want, want_lse = naive(q, k, v, attn_bias=bias, sinks=sinks, keep=keep, dropout_p=0.25, **kw)
    # the formula is the float64 oracle's
    oracle, oracle_lse = ref.naive_attention(*(x.detach().numpy() for x in (q, k, v)), attn_bias=bias.detach().numpy(),
                                             sinks=sinks.detach().numpy(), return_lse=True,
                                             **{n: (x.numpy() if torch.is_tensor(x) else x) for n, x in kw.items()},
                                             **drop)
    np.testing.assert_allclose(want.detach().numpy(), oracle, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(want_lse.detach().numpy(), oracle_lse, rtol=1e-12)
    out, lse = ct.attention(q, k, v, attn_bias=bias, sinks=sinks, return_lse=True, deterministic=True, **kw, **drop)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(lse, want_lse.detach(), rtol=1e-12, atol=1e-13)
    assert not lse.requires_grad and lse.grad_fn is None and out.requires_grad
    dout = randn(gen, *out.shape)
    inputs = (q, k, v, bias, sinks)
    assert_grads_close(grads(out, inputs, dout), grads(want, inputs, dout), ("dq", "dk", "dv", "dbias", "dsinks"))


def test_gradcheck_modifiers(gen):
    q, k, v = (randn(gen, 1, 2, 3, 4, grad=True) for _ in range(3))
    bias, sinks = randn(gen, 1, 2, 3, 3, grad=True), randn(gen, 2, grad=True)

    def fn(q, k, v, bias, sinks):
        return ct.attention(q, k, v, attn_bias=bias, sinks=sinks, softcap=3.0, causal=True, layout="bhsd")

    assert torch.autograd.gradcheck(fn, (q, k, v, bias, sinks), eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)


def test_a_loss_through_lse_gets_no_gradient_from_it(gen):
    q, k, v = (randn(gen, 1, 2, 4, 8, grad=True) for _ in range(3))
    out, lse = ct.attention(q, k, v, return_lse=True)
    assert not lse.requires_grad
    (out.sum() + lse.detach().sum()).backward()   # only out carries gradients back
    want, _ = naive(q, k, v)
    assert_grads_close([q.grad, k.grad, v.grad], grads(want.sum(), (q, k, v), torch.tensor(1.0, dtype=F64)),
                       ("dq", "dk", "dv"))
    with pytest.raises(RuntimeError):   # lse alone is not differentiable
        lse.sum().backward()


def test_dropout_key_given_or_drawn_from_torch(gen):
    q, k, v = (randn(gen, 1, 2, 4, 8) for _ in range(3))
    given = ct.attention(q, k, v, dropout_p=0.5, dropout_seed=9, dropout_offset=2)
    keep = ref.dropout_mask((1, 2, 4, 4), 0.5, 9, 2)
    np.testing.assert_allclose(given.numpy(), naive(q, k, v, keep=keep, dropout_p=0.5)[0].numpy(), rtol=1e-12)
    torch.manual_seed(3)
    a = ct.attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(3)
    assert torch.equal(a, ct.attention(q, k, v, dropout_p=0.5))
    assert not torch.equal(a, ct.attention(q, k, v, dropout_p=0.5))   # the generator moved on
    with pytest.raises(ValueError, match=r"cuflash.torch.attention: dropout_offset=4 needs dropout_seed"):
        ct.attention(q, k, v, dropout_p=0.5, dropout_offset=4)
    with pytest.raises(ValueError, match=r"cuflash.torch.attention: dropout_seed must be an int in \[0, 2\*\*32\)"):
        ct.attention(q, k, v, dropout_p=0.5, dropout_seed=2**32)


# ---------------------------------------------------------------------------- no gradient: refused


def test_out_is_written_without_grad_and_refused_with_it(gen):
    q, k, v = (randn(gen, 1, 2, 4, 8, grad=True) for _ in range(3))
    buf = torch.full((1, 2, 4, 8), float("nan"), dtype=F64)
    with torch.no_grad():
        got, lse = ct.attention(q, k, v, out=buf, causal=True, return_lse=True)
    want, want_lse = ref.naive_attention(*(x.detach().numpy() for x in (q, k, v)), causal=True, return_lse=True)
    assert got is buf and not lse.requires_grad
    np.testing.assert_allclose(buf.numpy(), want, rtol=1e-12)
    np.testing.assert_allclose(lse.numpy(), want_lse, rtol=1e-12)
    detached = [x.detach() for x in (q, k, v)]
    assert ct.attention(*detached, out=buf, softcap=2.0) is buf   # grad mode on, nothing needs a gradient
    np.testing.assert_allclose(buf.numpy(), ref.naive_attention(*(x.numpy() for x in detached), softcap=2.0),
                               rtol=1e-12)
    with pytest.raises(TypeError, match=r"cuflash.torch.attention: out= cannot be differentiated, and q, k, v "
                                        r"require grad \(grad mode is on\)"):
        ct.attention(q, k, v, out=buf)
    with pytest.raises(TypeError, match=r"cuflash.torch.attention: out= .* attn_bias requires grad"):
        ct.attention(*detached, out=buf, attn_bias=torch.zeros(1, 2, 4, 4, dtype=F64, requires_grad=True))


def test_alibi_slopes_that_require_grad_are_refused(gen):
    q, k, v = (randn(gen, 1, 2, 4, 8) for _ in range(3))
    slopes = torch.tensor([0.1, 0.3], requires_grad=True)
    with pytest.raises(TypeError, match=r"cuflash.torch.attention: alibi_slopes requires grad .* the backward computes "
                                        r"no gradient for the ALiBi slopes"):
        ct.attention(q, k, v, alibi_slopes=slopes)
    with torch.no_grad():
        ct.attention(q, k, v, alibi_slopes=slopes)
    cq = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(TypeError, match=r"cuflash.torch.attention_varlen: alibi_slopes requires grad"):
        ct.attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cq, cq, 4, 4,
                            alibi_slopes=slopes)


# ---------------------------------------------------------------------------- backends


def test_backend_names_and_moves_are_refused_as_the_public_functions_do(gen):
    q = randn(gen, 1, 2, 4, 8)
    cq = torch.tensor([0, 4], dtype=torch.int32)
    calls = {
        "attention": lambda b: ct.attention(q, q, q, backend=b),
        "attention_varlen": lambda b: ct.attention_varlen(*(q[0].transpose(0, 1),) * 3, cq, cq, 4, 4, backend=b),
        "attention_with_kvcache": lambda b: ct.attention_with_kvcache(*(q.transpose(1, 2).clone() for _ in range(3)),
                                                                      4, backend=b),
        "softmax": lambda b: ct.softmax(q, backend=b),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=rf"cuflash.torch.{name}: backend must be one of .* got 'gpu'"):
            call("gpu")
        with pytest.raises(ValueError, match=rf"cuflash.torch.{name}: backend='cuda' needs GPU arrays"):
            call("cuda")
        assert torch.equal(call("numpy"), call("auto"))
    with pytest.raises(NotImplementedError, match=r"cuflash.torch.attention: the kernels compute float16, bfloat16 "
                                                  r"and float32; float64 runs on the NumPy path only"):
        ct.attention(q, q, q, backend="sim")


def test_meta_tensors_are_refused_by_name():
    m = torch.empty(1, 2, 4, 8, device="meta")
    c = torch.tensor([0, 4], dtype=torch.int32)
    calls = {
        "attention": lambda: ct.attention(torch.zeros(1, 2, 4, 8), m, m),
        "attention_varlen": lambda: ct.attention_varlen(m[0], m[0], m[0], c, c, 4, 4),
        "attention_with_kvcache": lambda: ct.attention_with_kvcache(m, m, m, 3),
        "merge_attention": lambda: ct.merge_attention([m], [m[..., 0]]),
        "softmax": lambda: ct.softmax(m),
        "scaled_dot_product_attention": lambda: ct.scaled_dot_product_attention(m, m, m),
    }
    names = {"attention": "k", "merge_attention": r"outs\[0\]", "scaled_dot_product_attention": "query"}
    for func, call in calls.items():
        arg = names.get(func, "q" if func != "softmax" else "x")
        with pytest.raises(ValueError, match=rf"cuflash.torch.{func}: {arg} is on device meta"):
            call()
    with pytest.raises(ValueError, match=r"cuflash.attention: q is a torch.Tensor on device meta"):
        cuflash.attention(m, m, m)


# ---------------------------------------------------------------------------- varlen


def packed(gen, lengths, hq, hk, d, dv, dtype=F64):
    cq = torch.tensor([0] + np.cumsum([a for a, _ in lengths]).tolist(), dtype=torch.int32)
    ck = torch.tensor([0] + np.cumsum([b for _, b in lengths]).tolist(), dtype=torch.int32)
    return (randn(gen, int(cq[-1]), hq, d, dtype=dtype, grad=True), randn(gen, int(ck[-1]), hk, d, dtype=dtype, grad=True),
            randn(gen, int(ck[-1]), hk, dv, dtype=dtype, grad=True), cq, ck)


def naive_varlen(q, k, v, cq, ck, dropout=None, **kw):
    """Per sequence, :func:`naive` on its slices ("bshd" -> "bhsd"); ``dropout`` ``(p, seed, offset)``
    (the sequence's mask is batch index ``b`` of the packed mask)."""
    outs, lses = [], []
    for b in range(len(cq) - 1):
        qs, ks, vs = (x[None, lo:hi].transpose(1, 2) for x, lo, hi in ((q, cq[b], cq[b + 1]), (k, ck[b], ck[b + 1]),
                                                                        (v, ck[b], ck[b + 1])))
        extra = dict(kw)
        if "alibi_slopes" in kw and kw["alibi_slopes"].dim() == 2:
            extra["alibi_slopes"] = kw["alibi_slopes"][b:b + 1]
        if dropout is not None:
            p, seed, offset = dropout
            extra.update(keep=ref.dropout_mask((1, q.shape[1], qs.shape[2], ks.shape[2]), p, seed, offset, batch0=b),
                         dropout_p=p)
        o, lse = naive(qs, ks, vs, **extra)
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=-1)


def test_varlen_softcap_alibi_dropout_gradients_and_lse(gen):
    q, k, v, cq, ck = packed(gen, [(3, 5), (4, 6)], 4, 2, 4, 3)
    slopes = torch.rand(2, 4, generator=gen, dtype=F64) * 0.5
    kw = dict(causal=True, softcap=2.0, alibi_slopes=slopes)
    out, lse = ct.attention_varlen(q, k, v, cq, ck, 4, 6, return_lse=True, dropout_p=0.3, dropout_seed=5,
                                   dropout_offset=1, **kw)
    want, want_lse = naive_varlen(q, k, v, cq, ck, dropout=(0.3, 5, 1), **kw)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(lse, want_lse.detach(), rtol=1e-12, atol=1e-13)
    assert not lse.requires_grad
    dout = randn(gen, *out.shape)
    assert_grads_close(grads(out, (q, k, v), dout), grads(want, (q, k, v), dout), ("dq", "dk", "dv"))


def test_varlen_out_block_table_and_index_dtypes(gen):
    q, k, v, cq, ck = packed(gen, [(3, 5), (2, 4)], 2, 1, 4, 4)
    buf = torch.empty(q.shape[0], 2, 4, dtype=F64)
    with torch.no_grad():
        assert ct.attention_varlen(q, k, v, cq, ck, 3, 5, out=buf) is buf
    torch.testing.assert_close(buf, naive_varlen(q, k, v, cq, ck)[0].detach(), rtol=1e-12, atol=1e-13)
    with pytest.raises(TypeError, match=r"cuflash.torch.attention_varlen: out= cannot be differentiated"):
        ct.attention_varlen(q, k, v, cq, ck, 3, 5, out=buf)
    # a paged cache: sequence b's keys on pages block_table[b] (page_size 3)
    pages = torch.randn(4, 3, 1, 4, generator=gen, dtype=F64)
    vpages = torch.randn(4, 3, 1, 4, generator=gen, dtype=F64)
    table = torch.tensor([[2, 0], [3, 1]], dtype=torch.int32)
    ks = torch.cat([pages[table[0]].reshape(6, 1, 4)[:5], pages[table[1]].reshape(6, 1, 4)[:4]])
    vs = torch.cat([vpages[table[0]].reshape(6, 1, 4)[:5], vpages[table[1]].reshape(6, 1, 4)[:4]])
    with torch.no_grad():
        got = ct.attention_varlen(q, pages, vpages, cq, ck, 3, 5, block_table=table, causal=True)
    torch.testing.assert_close(got, naive_varlen(q.detach(), ks, vs, cq, ck, causal=True)[0], rtol=1e-12, atol=1e-13)
    with torch.no_grad():   # num_splits: a hint the NumPy path takes and ignores, into out= too; validated
        got = ct.attention_varlen(q, pages, vpages, cq, ck, 3, 5, block_table=table, causal=True, num_splits=0)
        assert ct.attention_varlen(q, pages, vpages, cq, ck, 3, 5, block_table=table, causal=True, num_splits=2,
                                   out=buf) is buf
    torch.testing.assert_close(got, naive_varlen(q.detach(), ks, vs, cq, ck, causal=True)[0], rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(buf, got, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"cuflash.torch.attention_varlen: num_splits must be in \[0, 256\]"):
        ct.attention_varlen(q, pages, vpages, cq, ck, 3, 5, block_table=table, num_splits=-1)
    with pytest.raises(TypeError, match=r"cuflash.torch.attention_varlen: block_table \(a paged KV cache\) has no "
                                        r"backward, and q requires grad \(grad mode is on\)"):
        ct.attention_varlen(q, pages, vpages, cq, ck, 3, 5, block_table=table)
    for name in ("cu_seqlens_q", "cu_seqlens_k", "seqused_k"):
        args = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, seqused_k=torch.tensor([5, 4], dtype=torch.int32))
        args[name] = args[name].long()
        with pytest.raises(TypeError, match=rf"cuflash.torch.attention_varlen: {name} must be int32, got "
                                            rf"{name}.dtype=torch.int64; pass {name}.int\(\)"):
            ct.attention_varlen(q, k, v, args["cu_seqlens_q"], args["cu_seqlens_k"], 3, 5, seqused_k=args["seqused_k"])


# ---------------------------------------------------------------------------- KV cache, merge


def test_kvcache_modifiers_out_and_append(gen):
    b, s, hq, hk, d = 2, 8, 2, 1, 4
    kc, vc = randn(gen, b, s, hk, d), randn(gen, b, s, hk, d)
    q, kn, vn = randn(gen, b, 1, hq, d), randn(gen, b, 1, hk, d), randn(gen, b, 1, hk, d)
    seqlens = torch.tensor([3, 5], dtype=torch.int32)
    mods = dict(softcap=2.0, alibi_slopes=torch.tensor([0.2, 0.4], dtype=F64), sinks=torch.tensor([0.5, -1.0], dtype=F64))
    buf = torch.empty(b, 1, hq, d, dtype=F64)
    got, lse = ct.attention_with_kvcache(q, kc, vc, seqlens, k=kn, v=vn, causal=True, out=buf, return_lse=True,
                                         backend="numpy", **mods)
    assert got is buf
    for i, n in enumerate((3, 5)):
        torch.testing.assert_close(kc[i, n], kn[i, 0])   # appended in place
        want, want_lse = naive(q[i:i + 1].transpose(1, 2), kc[i:i + 1, :n + 1].transpose(1, 2),
                               vc[i:i + 1, :n + 1].transpose(1, 2), causal=True, **mods)
        torch.testing.assert_close(buf[i], want[0].transpose(0, 1), rtol=1e-12, atol=1e-13)
        torch.testing.assert_close(lse[i], want_lse[0], rtol=1e-12, atol=1e-13)
    for name, tensor in (("q", q), ("k", kn), ("sinks", mods["sinks"])):
        tensor.requires_grad_()
        with pytest.raises(TypeError, match=rf"cuflash.torch.attention_with_kvcache: {name} requires grad \(grad mode "
                                            r"is on\), but attention_with_kvcache has no backward"):
            ct.attention_with_kvcache(q, kc, vc, seqlens, k=kn, v=vn, **mods)
        tensor.requires_grad_(False)
    with pytest.raises(TypeError, match=r"cuflash.torch.attention_with_kvcache: cache_seqlens must be int32, got "
                                        r"cache_seqlens.dtype=torch.int64; pass cache_seqlens.int\(\)"):
        ct.attention_with_kvcache(q, kc, vc, seqlens.long())


def test_merge_attention_takes_lists_and_ignores_empty_parts(gen):
    o1, o2 = randn(gen, 2, 3, 4, grad=True), torch.full((2, 3, 4), float("nan"), dtype=F64, requires_grad=True)
    l1, l2 = randn(gen, 2, 3, grad=True), torch.full((2, 3), -math.inf, dtype=F64, requires_grad=True)
    out, lse = ct.merge_attention((o1, o2), [l1, l2])   # a part with lse -inf adds nothing, NaN out or not
    torch.testing.assert_close(out, o1, rtol=0, atol=0)
    torch.testing.assert_close(lse, l1, rtol=0, atol=0)
    (out.sum() + lse.sum()).backward()
    assert torch.equal(o2.grad, torch.zeros_like(o2)) and torch.isfinite(l2.grad).all()
    assert torch.equal(o1.grad, torch.ones_like(o1))
    with pytest.raises(TypeError, match=r"cuflash.torch.merge_attention: outs must be a list or tuple"):
        ct.merge_attention(torch.stack([o1, o1]), [l1, l1])


# ---------------------------------------------------------------------------- softmax


def test_softmax_forward_gradient_and_errors(gen):
    x = randn(gen, 3, 5, 4, grad=True)
    for axis in (0, 1, -1):
        y = ct.softmax(x, axis)
        torch.testing.assert_close(y, torch.softmax(x, axis), rtol=1e-13, atol=1e-15)
    assert torch.autograd.gradcheck(lambda t: ct.softmax(t, axis=1), (x,), eps=1e-6, atol=1e-8, fast_mode=True)
    with pytest.raises(ValueError, match=r"cuflash.torch.softmax: axis=3 must be in \[-3, 2\]"):
        ct.softmax(x, 3)
    with pytest.raises(TypeError, match=r"cuflash.torch.softmax: axis must be an int"):
        ct.softmax(x, 1.0)
    with pytest.raises(TypeError, match=r"cuflash.torch.softmax: x must be a torch.Tensor"):
        ct.softmax(x.detach().numpy())


# ---------------------------------------------------------------------------- the simulator, 16-bit


def low_error(got, want, dtype):
    """Max error of a 16-bit result against float64, relative to its magnitude."""
    return ((got.double() - want).abs().max() / (want.abs().max() + 1e-3)).item()


def test_sim_attention_modifiers_and_out_fp16(gen):
    # the kernels of the tensor-core tier's modifier forms, forward and backward (dbias, dsinks)
    q, k, v = (randn(gen, 1, 2, 8, 64, dtype=torch.float16, grad=True) for _ in range(3))
    bias = randn(gen, 1, 2, 8, 8, dtype=torch.float32, grad=True)
    sinks = randn(gen, 2, dtype=torch.float32, grad=True)
    with sim.options(arch=80):
        out = ct.attention(q, k, v, attn_bias=bias, sinks=sinks, backend="sim")
        dout = randn(gen, *out.shape, dtype=torch.float16)
        got = grads(out, (q, k, v, bias, sinks), dout)
    exact = [x.detach().double().requires_grad_() for x in (q, k, v, bias, sinks)]
    want, _ = naive(exact[0], exact[1], exact[2], attn_bias=exact[3], sinks=exact[4])
    want_grads = grads(want, exact, dout.double())
    assert out.dtype == torch.float16 and low_error(out, want, torch.float16) < 4e-3
    for name, g, w, x in zip(("dq", "dk", "dv", "dbias", "dsinks"), got, want_grads, (q, k, v, bias, sinks)):
        assert g.dtype == x.dtype and low_error(g, w, torch.float16) < 1e-2, name
    # out= on the default simulated device (sm_90: the Hopper tier)
    qs, ks, vs = (x.detach() for x in (q, k, v))
    buf = torch.full((1, 2, 8, 64), float("nan"), dtype=torch.float16)
    assert ct.attention(qs, ks, vs, out=buf, causal=True, backend="sim") is buf
    assert low_error(buf, naive(*(x.double() for x in (qs, ks, vs)), causal=True)[0], torch.float16) < 4e-3


def test_sim_varlen_softcap_alibi_fp16(gen):
    q, k, v, cq, ck = packed(gen, [(3, 5), (4, 6)], 4, 2, 64, 64, dtype=torch.float16)
    slopes = torch.rand(2, 4, generator=gen) * 0.3
    kw = dict(causal=True, softcap=4.0, alibi_slopes=slopes)
    with sim.options(arch=80):
        out = ct.attention_varlen(q, k, v, cq, ck, 4, 6, backend="sim", **kw)
        dout = randn(gen, *out.shape, dtype=torch.float16)
        got = grads(out, (q, k, v), dout)
    exact = [x.detach().double().requires_grad_() for x in (q, k, v)]
    want, _ = naive_varlen(*exact, cq, ck, **{**kw, "alibi_slopes": slopes.double()})
    assert low_error(out, want, torch.float16) < 4e-3
    for name, g, w in zip(("dq", "dk", "dv"), got, grads(want, exact, dout.double())):
        assert g.dtype == torch.float16 and low_error(g, w, torch.float16) < 1e-2, name


def test_sim_kvcache_sinks_and_softmax_bf16(gen):
    b, hq, hk, d = 2, 4, 2, 64
    kc, vc = randn(gen, b, 40, hk, d, dtype=torch.float16), randn(gen, b, 40, hk, d, dtype=torch.float16)
    q = randn(gen, b, 3, hq, d, dtype=torch.float16)
    mods = dict(softcap=5.0, alibi_slopes=torch.rand(hq, generator=gen) * 0.3, sinks=torch.randn(hq, generator=gen))
    seqlens = torch.tensor([30, 17], dtype=torch.int32)
    with sim.options(arch=80):
        out = ct.attention_with_kvcache(q, kc, vc, seqlens, causal=True, num_splits=1, backend="sim", **mods)
    for i, n in enumerate((30, 17)):
        want, _ = naive(q[i:i + 1].double().transpose(1, 2), kc[i:i + 1, :n].double().transpose(1, 2),
                        vc[i:i + 1, :n].double().transpose(1, 2), causal=True,
                        **{m: (x.double() if torch.is_tensor(x) else x) for m, x in mods.items()})
        assert low_error(out[i], want[0].transpose(0, 1), torch.float16) < 4e-3
    x = randn(gen, 4, 33, dtype=torch.bfloat16, grad=True)
    y = ct.softmax(x, backend="sim")
    g = randn(gen, 4, 33, dtype=torch.bfloat16)
    (dx,) = grads(y, (x,), g)
    xe = x.detach().double().requires_grad_()
    ye = torch.softmax(xe, -1)
    assert y.dtype == torch.bfloat16 and low_error(y, ye, torch.bfloat16) < 1e-2
    assert dx.dtype == torch.bfloat16 and low_error(dx, grads(ye, (xe,), g.double())[0], torch.bfloat16) < 2e-2


# ---------------------------------------------------------------------------- torch.compile (slow: Inductor)


@pytest.mark.slow
def test_torch_compile_fullgraph_with_options(gen):
    q, k, v = (randn(gen, 1, 2, 6, 8, dtype=torch.float32, grad=True) for _ in range(3))
    bias, sinks = randn(gen, 1, 2, 6, 6, dtype=torch.float32, grad=True), randn(gen, 2, dtype=torch.float32, grad=True)
    x = randn(gen, 3, 7, dtype=torch.float32, grad=True)

    def fn(q, k, v, bias, sinks, x):
        out, lse = ct.attention(q, k, v, attn_bias=bias, sinks=sinks, return_lse=True, dropout_p=0.2,
                                dropout_seed=7, softcap=3.0, backend="numpy")
        return out.sum() + ct.softmax(x * 2, 0).pow(2).sum(), lse

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)
    inputs = (q, k, v, bias, sinks, x)
    loss_c, lse_c = compiled(*inputs)
    grads_c = grads(loss_c, inputs, torch.tensor(1.0))
    loss_e, lse_e = fn(*inputs)
    grads_e = grads(loss_e, inputs, torch.tensor(1.0))
    torch.testing.assert_close(loss_c, loss_e)
    torch.testing.assert_close(lse_c, lse_e)
    for a, b in zip(grads_c, grads_e):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_opcheck_the_new_operators(gen):
    # schemas (out= declared as mutated) and fake implementations against the real ones
    utils = ("test_schema", "test_faketensor")
    q, k, v = (randn(gen, 1, 2, 4, 8, dtype=torch.float32) for _ in range(3))
    bias, sinks = randn(gen, 1, 2, 4, 4, dtype=torch.float32), randn(gen, 2, dtype=torch.float32)
    mods = (2.0, None, bias, None, sinks)
    torch.library.opcheck(torch.ops.cuflash.attention_out.default,
                          (q, k, v, torch.empty_like(q), True, 0.3, -1, 0, "bhsd", 0.0, 0, 0, *mods, "numpy"),
                          test_utils=utils)
    torch.library.opcheck(torch.ops.cuflash.attention_mod_fwd.default,
                          (q, k, v, False, 0.3, -1, -1, "bhsd", False, 0.2, 7, 1, *mods, "auto"), test_utils=utils)
    cq = torch.tensor([0, 1, 4], dtype=torch.int32)
    qp, kp, vp = (x[0].transpose(0, 1).contiguous() for x in (q, k, v))
    torch.library.opcheck(torch.ops.cuflash.attention_varlen_out.default,
                          (qp, kp, vp, torch.empty_like(qp), cq, cq, None, None, 3, 3, True, 0.3, -1, 0, 0.0, 0, 0,
                           2.0, torch.tensor([0.1, 0.2]), "numpy"), test_utils=utils)
    torch.library.opcheck(torch.ops.cuflash.softmax_fwd.default, (q.transpose(-1, -2), 2, "auto"), test_utils=utils)
    kc, vc = randn(gen, 1, 6, 2, 8, dtype=torch.float32), randn(gen, 1, 6, 2, 8, dtype=torch.float32)
    torch.library.opcheck(torch.ops.cuflash.attention_with_kvcache.default,
                          (q.transpose(1, 2).contiguous(), kc, vc, None, 3, None, None, None, None, None, None, None,
                           True, True, 0.3, -1, 0, 0, torch.empty(1, 4, 2, 8), 2.0, None, sinks, "numpy"),
                          test_utils=utils)


def _doc_block_mask():
    """A causal document mask over 2 documents (140 + 20 tokens) in 64-blocks: empty, partial and
    full blocks."""
    doc = np.repeat(np.arange(2, dtype=np.int32), (140, 20))
    bm = cuflash.mods.document_block_mask(doc, causal=True, BLOCK_SIZE=64)
    assert set(np.unique(bm.to_dense())) == {0, 1, 2}
    return doc, bm


def test_block_mask_gradcheck_and_forward_on_the_numpy_path():
    doc, bm = _doc_block_mask()
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 160, 4, dtype=torch.float64, generator=gen, requires_grad=True)   # GQA 2:1
    k, v = (torch.randn(1, 1, 160, 4, dtype=torch.float64, generator=gen, requires_grad=True) for _ in range(2))
    table = torch.randn(2, 9, dtype=torch.float64, generator=gen, requires_grad=True)   # a learned score_mod table

    def f(q, k, v, table):
        return ct.attention(q, k, v, block_mask=bm, score_mod=cuflash.mods.relative_position_bias(table, 4))

    assert torch.autograd.gradcheck(f, (q, k, v, table), fast_mode=True)
    out = cuflash.attention(q, k, v, block_mask=bm)   # routed to cuflash.torch.attention (q requires grad)
    assert out.requires_grad
    want = ref.naive_attention(q.detach().numpy(), k.detach().numpy(), v.detach().numpy(), mask_mod=bm.mask_mod)
    np.testing.assert_allclose(out.detach().numpy(), want, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="mask_mod must be the function block_mask was built from"):
        ct.attention(q, k, v, block_mask=bm, mask_mod=cuflash.mods.document_mask(doc))
    with pytest.raises(ValueError, match=r"block_mask was built for \(Q_LEN, KV_LEN\) = \(160, 160\)"):
        ct.attention(q[:, :, :100], k, v, block_mask=bm)
    with pytest.raises(TypeError, match="block_mask must be a BlockMask"):
        ct.attention(q, k, v, block_mask=bm.to_dense())


@pytest.mark.slow
def test_block_mask_grads_on_the_simulator_within_the_rule(rng):
    """backend="sim" (the tensor-core kernels' _bs forms): the .grad of q, k, v within twice the
    same-dtype NumPy path's error against float64, plus grad_floor."""
    from support.grads import assert_grads_within_twice_the_numpy_path

    _, bm = _doc_block_mask()
    q0, k0, v0, dout = (rng.standard_normal(s).astype(np.float16) for s in ((1, 2, 160, 64), (1, 1, 160, 64),
                                                                          (1, 1, 160, 64), (1, 2, 160, 64)))
    q, k, v = (torch.from_numpy(x).requires_grad_() for x in (q0, k0, v0))
    with sim.options(arch=80):
        out = ct.attention(q, k, v, block_mask=bm, backend="sim")
        out.backward(torch.from_numpy(dout))
    grads = [t.grad.numpy() for t in (q, k, v)]
    assert_grads_within_twice_the_numpy_path(grads, q0, k0, v0, dout, np.float16, mask_mod=bm.mask_mod)


def test_fp8_calls_pass_mask_mod_and_block_mask_on():
    """fp8 input is forwarded to cuflash.attention with its mask_mod / block_mask (they were once
    dropped there): the result is the masked one, against the float64 oracle of the fp8 values."""
    doc = np.repeat(np.arange(2, dtype=np.int32), 64)
    bm = cuflash.mods.document_block_mask(doc, BLOCK_SIZE=64)
    q = torch.randn(1, 2, 128, 16, generator=torch.Generator().manual_seed(2)).to(torch.float8_e4m3fn)
    q64 = q.float().numpy().astype(np.float64)
    want = ref.naive_attention(q64, q64, q64, mask_mod=bm.mask_mod)
    for kw in (dict(mask_mod=cuflash.mods.document_mask(doc)), dict(block_mask=bm)):
        out = ct.attention(q, q, q, out_dtype=torch.float16, **kw)
        np.testing.assert_allclose(out.float().numpy(), want, rtol=0, atol=4e-3, err_msg=str(kw))
