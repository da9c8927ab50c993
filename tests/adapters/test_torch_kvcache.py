"""cuflash.torch.attention_with_kvcache (a mutating custom operator) and cuflash.torch.merge_attention
(differentiable torch operations), on CPU tensors (issue 22)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cuflash  # noqa: E402
import cuflash.torch as ct  # noqa: E402
from cuflash import reference as ref  # noqa: E402
from cuflash.reference import kvcache as ref_kvcache  # noqa: E402


def _paged(rng, lengths, page, hk, d, pages):
    kc = torch.from_numpy(rng.standard_normal((pages, page, hk, d)).astype(np.float32))
    vc = torch.from_numpy(rng.standard_normal((pages, page, hk, d)).astype(np.float32))
    bt = torch.from_numpy(rng.permutation(pages).reshape(len(lengths), -1).astype(np.int32))
    return kc, vc, bt


def test_decode_step_matches_the_numpy_path_and_appends(rng):
    kc, vc, bt = _paged(rng, [5, 11], 4, 2, 32, 8)
    q = torch.randn(2, 1, 4, 32, dtype=torch.float32)
    k, v = torch.randn(2, 1, 2, 32), torch.randn(2, 1, 2, 32)
    seqlens = torch.tensor([5, 11], dtype=torch.int32)
    want_k, want_v = kc.numpy().copy(), vc.numpy().copy()
    want_out = cuflash.attention_with_kvcache(q.numpy(), want_k, want_v, seqlens.numpy(), k=k.numpy(), v=v.numpy(),
                                              block_table=bt.numpy(), causal=True)
    out, lse = ct.attention_with_kvcache(q, kc, vc, seqlens, k=k, v=v, block_table=bt, causal=True, return_lse=True)
    assert isinstance(out, torch.Tensor) and lse.shape == (2, 4, 1) and lse.dtype == torch.float32
    np.testing.assert_array_equal(out.numpy(), want_out)
    assert kc.numpy().tobytes() == want_k.tobytes() and vc.numpy().tobytes() == want_v.tobytes()


def test_compiles_fullgraph_and_mutates_the_cache(rng):
    kc, vc, bt = _paged(rng, [3, 3], 2, 1, 16, 6)
    q, k, v = torch.randn(2, 1, 2, 16), torch.randn(2, 1, 1, 16), torch.randn(2, 1, 1, 16)
    kc0 = kc.clone()

    @torch.compile(fullgraph=True, backend="eager")
    def step(q, kc, vc, k, v, bt):
        return ct.attention_with_kvcache(q, kc, vc, 3, k=k, v=v, block_table=bt) * 2

    out = step(q, kc, vc, k, v, bt)
    assert out.shape == (2, 1, 2, 16)
    for b in range(2):
        assert torch.equal(kc[bt[b, 1], 1], k[b, 0]) and not torch.equal(kc0[bt[b, 1], 1], k[b, 0])


def test_merge_attention_torch_matches_union_and_gradcheck(rng):
    q = torch.randn(1, 2, 3, 8, dtype=torch.float64)
    k = torch.randn(1, 2, 10, 8, dtype=torch.float64)
    v = torch.randn(1, 2, 10, 4, dtype=torch.float64)
    parts = [(0, 4), (4, 4), (4, 10)]   # the middle part is empty: lse -inf
    outs, lses = [], []
    for a, b in parts:
        o, s = ref.naive_attention(q.numpy(), k[..., a:b, :].numpy(), v[..., a:b, :].numpy(), return_lse=True)
        outs.append(torch.from_numpy(o).requires_grad_())
        lses.append(torch.from_numpy(s).requires_grad_())
    out, lse = ct.merge_attention(outs, lses)
    want, want_lse = ref.naive_attention(q.numpy(), k.numpy(), v.numpy(), return_lse=True)
    np.testing.assert_allclose(out.detach().numpy(), want, atol=1e-12)
    np.testing.assert_allclose(lse.detach().numpy(), want_lse, atol=1e-12)
    assert torch.autograd.gradcheck(lambda *t: ct.merge_attention(t[:3], t[3:]), (*outs, *lses))
    (out.sum() + lse.sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in outs + lses)
    empty = [torch.zeros(2, 3, requires_grad=True), torch.full((2,), -np.inf, requires_grad=True)]
    o, s = ct.merge_attention([empty[0]], [empty[1]])
    (o.sum() + torch.where(torch.isinf(s), 0.0, s).sum()).backward()
    assert (o == 0).all() and torch.isneginf(s).all() and torch.isfinite(empty[0].grad).all()


def test_merge_attention_torch_agrees_with_numpy(rng):
    outs = [rng.standard_normal((3, 5, 6)).astype(np.float32) for _ in range(3)]
    lses = [rng.standard_normal((3, 5)).astype(np.float32) for _ in range(3)]
    lses[1][0, 2] = -np.inf
    o_np, l_np = ref_kvcache.merge_attention(outs, lses)
    o_t, l_t = ct.merge_attention([torch.from_numpy(x) for x in outs], [torch.from_numpy(x) for x in lses])
    np.testing.assert_allclose(o_t.numpy(), o_np, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(l_t.numpy(), l_np, rtol=1e-6)


def test_bad_input(rng):
    kc, vc, bt = _paged(rng, [3], 4, 1, 16, 2)
    with pytest.raises(TypeError, match="cache_seqlens must be an int or an int32 torch.Tensor"):
        ct.attention_with_kvcache(torch.randn(1, 1, 1, 16), kc, vc, 3.0, block_table=bt)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        ct.attention_with_kvcache(np.zeros((1, 1, 1, 16)), kc, vc, 3, block_table=bt)
    with pytest.raises(ValueError, match="lses\\[0\\].shape"):
        ct.merge_attention([torch.zeros(2, 3)], [torch.zeros(3)])
