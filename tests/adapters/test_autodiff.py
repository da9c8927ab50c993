"""The public functions keep a framework's gradient: torch tensors that require grad, and JAX
tracers, run through :mod:`cuflash.torch` / :mod:`cuflash.jax` (``cuflash.autodiff``); entry
points without such a form refuse them, and the pipeline refuses any that reach it another way.

Expected gradients come from autograd (torch) or ``jax.grad`` through a float64 naive formula
written here, never from cuflash.
"""

import inspect
import math

import numpy as np
import pytest

import cuflash
from cuflash.api import attention as api_attention

torch = pytest.importorskip("torch")


def naive(q, k, v, causal=False):
    """float64 attention in torch operations (bottom-right causal), differentiable by autograd."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        sq, sk = q.shape[-2], k.shape[-2]
        i = torch.arange(sq)[:, None]
        j = torch.arange(sk)[None, :]
        s = s.masked_fill(j > i + sk - sq, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def leaves(shape_q=(1, 2, 8, 16), shape_k=(1, 2, 8, 16), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True) for s in (shape_q, shape_k, shape_k)]


def test_a_torch_gradient_reaches_every_input_through_cuflash_attention():
    # the reported case: attention's share of the gradient was missing and k.grad stayed None
    q, k, v = leaves(shape_k=(1, 2, 11, 16))
    (cuflash.attention(q, k, v, causal=True).pow(2).sum() + q.pow(2).sum()).backward()
    got = [t.grad.clone() for t in (q, k, v)]
    q2, k2, v2 = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    (naive(q2, k2, v2, causal=True).pow(2).sum() + q2.pow(2).sum()).backward()
    for name, a, b in zip("qkv", got, (q2.grad, k2.grad, v2.grad)):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-10, atol=1e-12, err_msg=f"d{name}")


def test_a_call_without_gradients_is_not_routed():
    q, k, v = leaves()
    with torch.no_grad():
        out = cuflash.attention(q, k, v)
    assert not out.requires_grad and out.grad_fn is None
    np.testing.assert_allclose(out.numpy(), naive(*(t.detach() for t in (q, k, v))).numpy(), rtol=1e-10, atol=1e-12)


def test_the_varlen_gradient_reaches_q_k_v():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(7, 2, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    cuflash.attention_varlen(q, k, v, cu, cu, 4, 4, causal=True).sum().backward()
    q2, k2, v2 = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    for a, b in ((0, 3), (3, 7)):   # each sequence alone, heads leading
        naive(*(t[a:b].transpose(0, 1) for t in (q2, k2, v2)), causal=True).sum().backward()
    for name, x, y in zip("qkv", (q, k, v), (q2, k2, v2)):
        np.testing.assert_allclose(x.grad.numpy(), y.grad.numpy(), rtol=1e-10, atol=1e-12, err_msg=f"d{name}")


@pytest.mark.parametrize("func, args", [
    ("attention_backward", lambda q, k, v: (torch.ones_like(q), q, k, v, q.detach(), torch.zeros(q.shape[:-1],
                                                                                                 dtype=q.dtype))),
])
def test_the_explicit_backward_refuses_tensors_that_require_grad(func, args):
    q, k, v = leaves()
    with pytest.raises(TypeError, match=rf"cuflash\.{func}: q requires grad.*no double backward"):
        getattr(cuflash, func)(*args(q, k, v))
    with torch.no_grad():   # the same call without gradients runs
        dq, dk, dv = getattr(cuflash, func)(*args(q, k, v))
    assert dq.shape == q.shape


def test_the_pipeline_refuses_a_gradient_it_would_drop():
    # a call that bypasses the routing (the api module's own function) is refused, not run detached
    q, k, v = leaves()
    with pytest.raises(TypeError, match=r"cuflash\.attention: q requires grad"):
        api_attention.attention(q, k, v)


def test_the_routed_functions_keep_their_signatures_and_documentation():
    for name in ("attention", "attention_backward", "attention_varlen", "attention_varlen_backward",
                 "attention_with_kvcache", "merge_attention", "softmax"):
        routed = getattr(cuflash, name)
        core = getattr(__import__(f"cuflash.api.{routed.__module__.split('.')[-1]}", fromlist=["x"]), name)
        assert inspect.signature(routed) == inspect.signature(core), name
        assert routed.__doc__ == core.__doc__ and "Parameters" in routed.__doc__, name


def test_a_jax_tracer_runs_through_cuflash_jax():
    jax = pytest.importorskip("jax")
    from cuflash import reference

    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 2, 8, 16)).astype(np.float32) for _ in range(3))
    # d/dq of sum(out): the float64 oracle's backward with dout = 1
    out, lse = reference.naive_attention(*(x.astype(np.float64) for x in (q, k, v)), causal=True, return_lse=True)
    want, _, _ = reference.attention_backward(np.ones_like(out), *(x.astype(np.float64) for x in (q, k, v)), out, lse,
                                              causal=True)
    got = jax.grad(lambda q: cuflash.attention(q, k, v, causal=True).sum())(jax.numpy.asarray(q))
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-5)
    jitted = jax.jit(lambda q, k, v: cuflash.attention(q, k, v, causal=True))(q, k, v)
    np.testing.assert_allclose(np.asarray(jitted), out, rtol=2e-5, atol=2e-6)


def test_a_jax_tracer_is_refused_where_cuflash_jax_has_no_form():
    jax = pytest.importorskip("jax")
    x = jax.numpy.zeros((2, 4), jax.numpy.float32)
    with pytest.raises(TypeError, match=r"cuflash\.attention_backward: dout is a JAX tracer.*cuflash\.jax"):
        jax.jit(lambda d: cuflash.attention_backward(d, x, x, x, x, x[:, 0]))(x)


def test_softmax_and_merge_keep_their_gradients():
    jax = pytest.importorskip("jax")
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 5))
    g = rng.standard_normal((3, 5))
    y = np.exp(x - x.max(-1, keepdims=True))
    y /= y.sum(-1, keepdims=True)
    want = y * (g - (g * y).sum(-1, keepdims=True))   # d/dx of sum(g * softmax(x))
    xt = torch.tensor(x, requires_grad=True)
    (cuflash.softmax(xt) * torch.tensor(g)).sum().backward()
    np.testing.assert_allclose(xt.grad.numpy(), want, rtol=1e-10, atol=1e-12)
    got = jax.grad(lambda x: (cuflash.softmax(x) * g.astype(np.float32)).sum())(jax.numpy.asarray(x, np.float32))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)
    # merge: d lse / d lse_i = exp(lse_i - lse), the softmax of the parts' lse
    lses = [torch.tensor([[0.5]], dtype=torch.float64, requires_grad=True),
            torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)]
    outs = [torch.ones(1, 1, 2, dtype=torch.float64), torch.zeros(1, 1, 2, dtype=torch.float64)]
    _, lse = cuflash.merge_attention(outs, lses)
    lse.sum().backward()
    w = np.exp([0.5, -1.0]) / np.exp([0.5, -1.0]).sum()
    np.testing.assert_allclose([lses[0].grad.item(), lses[1].grad.item()], w, rtol=1e-12)
