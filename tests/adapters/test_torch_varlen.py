"""cuflash.torch.attention_varlen: finite differences (gradcheck), torch's own float64 autograd of
the same attention written per sequence, the custom operators' schemas and fake kernels
(opcheck), and torch.compile(fullgraph=True)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import cuflash.torch as ct  # noqa: E402


def packed(gen, lengths, hq, hk, d, dv, dtype=torch.float64):
    lq = torch.tensor([a for a, _ in lengths])
    lk = torch.tensor([b for _, b in lengths])
    cq = torch.cat([torch.zeros(1, dtype=torch.int64), lq.cumsum(0)]).to(torch.int32)
    ck = torch.cat([torch.zeros(1, dtype=torch.int64), lk.cumsum(0)]).to(torch.int32)
    q = torch.randn(int(cq[-1]), hq, d, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    k = torch.randn(int(ck[-1]), hk, d, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    v = torch.randn(int(ck[-1]), hk, dv, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    return q, k, v, cq, ck, int(lq.max()), int(lk.max())


def explicit_varlen(q, k, v, cq, ck, used=None, causal=False, window=(-1, -1)):
    """Per sequence: softmax(q k^T / sqrt(D) + bottom-right mask) v in plain torch (autograd)."""
    outs = []
    g = q.shape[1] // k.shape[1]
    for b in range(len(cq) - 1):
        qs = q[cq[b]:cq[b + 1]]
        n = int(ck[b + 1] - ck[b]) if used is None else int(used[b])
        ks, vs = k[ck[b]:ck[b] + n].repeat_interleave(g, 1), v[ck[b]:ck[b] + n].repeat_interleave(g, 1)
        sq, sk = qs.shape[0], n
        s = torch.einsum("qhd,khd->hqk", qs, ks) / q.shape[-1] ** 0.5
        i = torch.arange(sq)[:, None] + sk - sq
        j = torch.arange(sk)[None, :]
        left, right = window
        if causal:
            right = 0
        ok = torch.ones(sq, sk, dtype=torch.bool)
        if left >= 0:
            ok &= j >= i - left
        if right >= 0:
            ok &= j <= i + right
        p = torch.softmax(s.masked_fill(~ok, float("-inf")), -1).nan_to_num(0.0)   # rows without keys: 0
        outs.append(torch.einsum("hqk,khd->qhd", p, vs))
    return torch.cat(outs) if outs else q.new_zeros(0, q.shape[1], v.shape[-1])


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(11)


LENGTHS = [(3, 5), (0, 2), (7, 8), (1, 0)]


@pytest.mark.parametrize("kw", [dict(causal=True), pytest.param(dict(window_size=(2, 1)), marks=pytest.mark.slow),
                                pytest.param(dict(), marks=pytest.mark.slow)])
def test_gradcheck_float64(kw, gen):   # (each about 25 s of NumPy-path calls; the default run: causal)
    q, k, v, cq, ck, mq, mk = packed(gen, LENGTHS, 4, 2, 8, 6)
    used = torch.tensor([4, 0, 8, 0], dtype=torch.int32)
    for seqused in (None, used):
        assert torch.autograd.gradcheck(
            lambda q, k, v: ct.attention_varlen(q, k, v, cq, ck, mq, mk, seqused_k=seqused, **kw),
            (q, k, v), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_matches_torch_autograd_of_explicit_attention(gen):
    q, k, v, cq, ck, mq, mk = packed(gen, LENGTHS, 4, 2, 8, 6)
    used = torch.tensor([4, 1, 6, 0], dtype=torch.int32)
    dout = torch.randn(q.shape[0], 4, 6, generator=gen, dtype=torch.float64)
    for kw in (dict(causal=True), dict(window=(3, 0))):
        out = ct.attention_varlen(q, k, v, cq, ck, mq, mk, seqused_k=used, causal=kw.get("causal", False),
                                  window_size=kw.get("window", (-1, -1)))
        grads = torch.autograd.grad(out, (q, k, v), dout)
        ref = explicit_varlen(q, k, v, cq, ck, used, **kw)
        ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_opcheck_custom_ops(gen):
    q, k, v, cq, ck, mq, mk = packed(gen, LENGTHS, 4, 2, 8, 6, dtype=torch.float32)
    args = (q, k, v, cq, ck, None, mq, mk, True, 0.3, -1, 0)
    out, lse = torch.ops.cuflash.attention_varlen_fwd(*args)
    assert out.shape == (q.shape[0], 4, 6) and lse.shape == (4, q.shape[0]) and lse.dtype == torch.float32
    torch.library.opcheck(torch.ops.cuflash.attention_varlen_fwd.default, args)
    used = torch.tensor([4, 0, 8, 0], dtype=torch.int32)
    dout = torch.randn(out.shape, generator=gen)
    torch.library.opcheck(
        torch.ops.cuflash.attention_varlen_bwd.default,
        (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, cq, ck, used, mq, mk, False, 0.3, 2, 1),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"),
    )


def test_torch_compile_fullgraph_matches_eager(gen):
    q, k, v, cq, ck, mq, mk = packed(gen, LENGTHS, 4, 2, 8, 8, dtype=torch.float32)
    dout = torch.randn(q.shape[0], 4, 8, generator=gen)

    def fn(q, k, v):
        return ct.attention_varlen(q * 2, k, v, cq, ck, mq, mk, causal=True) + 1

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)
    out_c = compiled(q, k, v)
    grads_c = torch.autograd.grad(out_c, (q, k, v), dout)
    out_e = fn(q, k, v)
    grads_e = torch.autograd.grad(out_e, (q, k, v), dout)
    torch.testing.assert_close(out_c, out_e, rtol=1e-6, atol=1e-6)
    for a, b in zip(grads_c, grads_e):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_validation(gen):
    q, k, v, cq, ck, mq, mk = packed(gen, LENGTHS, 4, 2, 8, 6)
    with pytest.raises(TypeError, match="cu_seqlens_q must be a torch.Tensor"):
        ct.attention_varlen(q, k, v, cq.numpy(), ck, mq, mk)
    with pytest.raises(TypeError, match="cu_seqlens_k must be int32"):
        ct.attention_varlen(q, k, v, cq, ck.long(), mq, mk)
    with pytest.raises(ValueError, match="max_seqlen_q=2 is smaller than sequence 2's length 7"):
        ct.attention_varlen(q, k, v, cq, ck, 2, mk)
