"""cuflash.torch: the autograd function against torch's own autograd, finite differences
(gradcheck), the float64 oracle, and torch.compile."""

from __future__ import annotations

import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ml_dtypes  # noqa: E402
from support.tolerance import check_close  # noqa: E402

import cuflash.torch as ct  # noqa: E402
from cuflash import reference as ref  # noqa: E402

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
TORCH_DTYPES = {np.dtype(np.float16): torch.float16, np.dtype(ml_dtypes.bfloat16): torch.bfloat16,
                np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64}


@pytest.fixture
def gen(rng):
    """A torch generator seeded from the test's numpy generator."""
    return torch.Generator().manual_seed(int(rng.integers(2**31)))


def make_qkv(gen, b, hq, hk, sq, sk, d, dv, *, layout="bhsd", dtype=torch.float64, requires_grad=True):
    if layout == "bshd":
        shapes = (b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, dv)
    else:
        shapes = (b, hq, sq, d), (b, hk, sk, d), (b, hk, sk, dv)
    return tuple(torch.randn(s, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(requires_grad)
                 for s in shapes)


def to_numpy(t):
    """Exact NumPy copy of a tensor (bfloat16 through float32, which holds it exactly)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.float().numpy().astype(ml_dtypes.bfloat16)
    return t.numpy()


def explicit_attention(q, k, v, *, causal=False, window_size=(-1, -1), softmax_scale=None, layout="bhsd"):
    """softmax(scale q k^T + mask) v with torch ops, the bottom-right mask built explicitly and
    GQA by repeating kv heads; differentiable by torch's own autograd. Every row must see a key."""
    if layout == "bshd":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    if q.dim() >= 3 and q.shape[-3] != k.shape[-3]:
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    sq, sk = q.shape[-2], k.shape[-2]
    scale = 1 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    s = (q @ k.transpose(-1, -2)) * scale
    rows = torch.arange(sq)[:, None] + (sk - sq)  # the diagonal of row i is key i + Sk - Sq
    cols = torch.arange(sk)[None, :]
    left, right = window_size
    if causal:
        right = 0
    visible = torch.ones(sq, sk, dtype=torch.bool)
    if right >= 0:
        visible &= cols <= rows + right
    if left >= 0:
        visible &= cols >= rows - left
    assert visible.any(dim=-1).all(), "explicit_attention needs every row to see a key"
    s = s.masked_fill(~visible, float("-inf"))
    out = torch.softmax(s, dim=-1) @ v
    return out.transpose(1, 2) if layout == "bshd" else out


def grads_of(fn, q, k, v, dout, **kw):
    for x in (q, k, v):
        x.grad = None
    out = fn(q, k, v, **kw)
    out.backward(dout)
    return out.detach(), [x.grad.detach().clone() for x in (q, k, v)]


# (B, Hq, Hk), Sq, Sk, D, Dv, options, layout
CASES = [
    ((1, 2, 2), 3, 6, 4, 3, dict(causal=True), "bhsd"),  # causal, Sq < Sk
    ((1, 2, 1), 6, 3, 3, 2, dict(causal=True), "bhsd"),  # causal, Sq > Sk: three rows see no key
    ((2, 4, 2), 5, 5, 3, 4, dict(), "bhsd"),  # GQA
    ((1, 2, 2), 5, 7, 2, 3, dict(window_size=(2, 1), softmax_scale=0.8), "bhsd"),
    ((1, 4, 2), 4, 5, 3, 3, dict(causal=True, window_size=(1, -1)), "bshd"),
]


@pytest.mark.parametrize("heads,sq,sk,d,dv,kw,layout", CASES)
def test_gradcheck_float64(heads, sq, sk, d, dv, kw, layout, gen):
    q, k, v = make_qkv(gen, *heads, sq, sk, d, dv, layout=layout)

    def fn(q, k, v):
        return ct.attention(q, k, v, layout=layout, **kw)

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_gradcheck_two_dim_input(gen):
    q = torch.randn(5, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(4, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(4, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v: ct.attention(q, k, v, causal=True), (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("heads,sq,sk,d,dv,kw,layout", CASES)
def test_forward_equals_oracle(dtype, heads, sq, sk, d, dv, kw, layout, gen):
    q, k, v = make_qkv(gen, *heads, sq, sk, d, dv, layout=layout, dtype=dtype, requires_grad=False)
    out = ct.attention(q, k, v, layout=layout, **kw)
    assert out.dtype == dtype and out.device == q.device
    assert tuple(out.shape) == (*q.shape[:-1], dv)
    qn, kn, vn = (to_numpy(x) for x in (q, k, v))
    if dtype == torch.float64:
        expected = ref.naive_attention(qn, kn, vn, layout=layout, **kw)
        np.testing.assert_allclose(out.numpy(), expected, rtol=1e-12, atol=1e-14)
    else:
        check_close(to_numpy(out).astype(np.float64), qn, kn, vn, layout=layout, **kw)


GRAD_CASES = [c for c in CASES if not (c[0] == (1, 2, 1) and c[1] > c[2])]  # every row sees a key


@pytest.mark.parametrize("heads,sq,sk,d,dv,kw,layout", GRAD_CASES)
def test_backward_equals_torch_autograd_float64(heads, sq, sk, d, dv, kw, layout, gen):
    q, k, v = make_qkv(gen, *heads, sq, sk, d, dv, layout=layout)
    dout = torch.randn(*q.shape[:-1], dv, generator=gen, dtype=torch.float64)
    out, grads = grads_of(ct.attention, q, k, v, dout, layout=layout, **kw)
    out_ref, grads_ref = grads_of(explicit_attention, q, k, v, dout, layout=layout, **kw)
    torch.testing.assert_close(out, out_ref, rtol=1e-12, atol=1e-14)
    for name, g, r in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert g.dtype == torch.float64 and g.shape == r.shape
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_backward_low_precision_within_twice_torch_error(dtype, gen):
    # flash-attn's rule: error against the float64 gradients at most twice the error of torch's
    # own autograd through explicit attention in the same dtype, plus a floor of a few units in
    # the last place at the gradient's magnitude (4 eps: it also absorbs, at these logits, the
    # float32 error of recomputing P from the stored lse, which the explicit softmax has not).
    q64, k64, v64 = make_qkv(gen, 2, 4, 2, 24, 40, 32, 16)
    dout64 = torch.randn(2, 4, 24, 16, generator=gen, dtype=torch.float64)
    kw = dict(causal=True)
    # the float64 truth of the inputs rounded to dtype
    q, k, v = (x.detach().to(dtype).requires_grad_() for x in (q64, k64, v64))
    dout = dout64.to(dtype)
    qr, kr, vr = (x.detach().double().requires_grad_() for x in (q, k, v))
    _, grads_ref = grads_of(explicit_attention, qr, kr, vr, dout.double(), **kw)
    _, grads = grads_of(ct.attention, q, k, v, dout, **kw)
    _, grads_pt = grads_of(explicit_attention, q, k, v, dout, **kw)
    eps = torch.finfo(dtype).eps
    for name, g, r, pt in zip(("dq", "dk", "dv"), grads, grads_ref, grads_pt):
        assert g.dtype == dtype
        err = (g.double() - r).abs().max().item()
        pt_err = (pt.double() - r).abs().max().item()
        floor = 4 * eps * (r.abs().max().item() + 0.3)
        assert err <= 2 * pt_err + floor, f"{name}: {err:.3g} > 2 * {pt_err:.3g} + {floor:.3g}"


def test_stride_zero_dout_and_transposed_inputs(gen):
    # out.sum() hands the backward a stride-0 (expanded) gradient; q is a transposed view.
    q = torch.randn(2, 9, 3, 8, generator=gen, dtype=torch.float64).transpose(1, 2).requires_grad_()
    k = torch.randn(2, 3, 12, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 3, 12, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    ct.attention(q, k, v, causal=True).sum().backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    explicit_attention(q, k, v, causal=True).sum().backward()
    for g, x in zip(grads, (q, k, v)):
        torch.testing.assert_close(g, x.grad, rtol=1e-10, atol=1e-12)


def test_empty_rows_have_zero_gradient(gen):
    # causal with Sq > Sk: the first Sq - Sk rows see no key; output 0, gradient of q exactly 0.
    q, k, v = make_qkv(gen, 1, 2, 2, 7, 3, 4, 4, dtype=torch.float32)
    out = ct.attention(q, k, v, causal=True)
    out.backward(torch.randn(out.shape, generator=gen))
    assert torch.equal(out[:, :, :4].detach(), torch.zeros(1, 2, 4, 4))
    assert torch.equal(q.grad[:, :, :4], torch.zeros(1, 2, 4, 4))
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))


def test_gradient_for_a_subset_of_inputs(gen):
    q, k, v = make_qkv(gen, 1, 2, 2, 5, 6, 4, 4)
    k.requires_grad_(False)
    out = ct.attention(q, k, v)
    out.backward(torch.ones_like(out))
    assert k.grad is None and q.grad is not None and v.grad is not None
    # every row's weights sum to one, so with dout = 1 each v row gets its total attention
    s = (q.detach() @ k.transpose(-1, -2)) / 2
    np.testing.assert_allclose(v.grad[..., 0].numpy(), torch.softmax(s, -1).sum(-2).numpy(), rtol=1e-12)


# ---------------------------------------------------------------------------- torch integration


def test_opcheck_custom_ops(gen):
    # schema, fake (meta) implementations against the real ones, autograd registration, and AOT
    # dispatch with dynamic shapes.
    q, k, v = make_qkv(gen, 1, 4, 2, 5, 7, 8, 6, dtype=torch.float32)
    out, lse = torch.ops.cuflash.attention_fwd(q, k, v, True, 0.3, -1, 0, "bhsd")
    assert lse.dtype == torch.float32 and lse.shape == (1, 4, 5)
    torch.library.opcheck(torch.ops.cuflash.attention_fwd.default, (q, k, v, True, 0.3, -1, 0, "bhsd"))
    qs, ks, vs = make_qkv(gen, 2, 6, 3, 2, 3, 6, 4, layout="bshd", dtype=torch.float64)
    torch.library.opcheck(torch.ops.cuflash.attention_fwd.default, (qs, ks, vs, False, 0.5, 2, 1, "bshd"))
    dout = torch.randn(out.shape, generator=gen)
    torch.library.opcheck(
        torch.ops.cuflash.attention_bwd.default,
        (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, True, 0.3, -1, 0, "bhsd"),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"),
    )


def test_torch_compile_fullgraph_matches_eager(gen):
    # Inductor on the CPU (needs a C++ compiler; ~10 s cold). fullgraph=True fails on any graph
    # break, so the custom operators and their fake implementations trace cleanly, forward and
    # backward.
    q, k, v = make_qkv(gen, 2, 4, 2, 9, 11, 8, 8, dtype=torch.float32)
    dout = torch.randn(2, 4, 9, 8, generator=gen)

    def fn(q, k, v):
        return ct.attention(q * 2, k, v, causal=True, window_size=(4, -1)) + 1

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)
    out_c, grads_c = grads_of(lambda q, k, v: compiled(q, k, v), q, k, v, dout)
    out_e, grads_e = grads_of(fn, q, k, v, dout)
    torch.testing.assert_close(out_c, out_e, rtol=1e-6, atol=1e-6)
    for g_c, g_e in zip(grads_c, grads_e):
        torch.testing.assert_close(g_c, g_e, rtol=1e-5, atol=1e-6)
    # and both are right: float64 explicit attention
    qr, kr, vr = (x.detach().double().requires_grad_() for x in (q, k, v))
    out_r, grads_r = grads_of(lambda q, k, v: explicit_attention(q * 2, k, v, causal=True, window_size=(4, -1)) + 1,
                              qr, kr, vr, dout.double())
    torch.testing.assert_close(out_c.double(), out_r, rtol=1e-5, atol=1e-5)
    for g_c, g_r in zip(grads_c, grads_r):
        torch.testing.assert_close(g_c.double(), g_r, rtol=1e-4, atol=1e-5)


def test_importing_cuflash_does_not_import_torch():
    code = (
        "import sys, cuflash\n"
        "assert 'torch' not in sys.modules, 'import cuflash imported torch'\n"
        "import cuflash.torch\n"
        "assert 'torch' in sys.modules and hasattr(cuflash.torch, 'attention')\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


# ---------------------------------------------------------------------------- errors


def test_device_backends(gen):
    # CPU tensors run the NumPy path, CUDA tensors the CUDA kernels (checked on a GPU by
    # tests/tools/test_gpu.py); a meta tensor (a shape without data) is refused by name before
    # any operator runs (the operators' fake implementations still give meta tensors their shapes).
    from cuflash.torch.tensors import backend_for

    assert backend_for(torch.empty(1), "f") == "numpy"
    with pytest.raises(ValueError, match=r"cuflash.torch.attention: the tensor is on device meta"):
        backend_for(torch.empty(1, device="meta"), "cuflash.torch.attention")
    q = torch.empty(1, 2, 4, 8, device="meta")
    with pytest.raises(ValueError, match=r"cuflash.torch.attention: q is on device meta \(a tensor with a shape but "
                                         r"no data\)"):
        ct.attention(q, q, q)
    out, lse = torch.ops.cuflash.attention_fwd(q, q, q, False, 0.5, -1, -1, "bhsd")
    assert out.shape == (1, 2, 4, 8) and out.device.type == "meta" and lse.shape == (1, 2, 4)


def test_validation_errors(gen):
    q, k, v = make_qkv(gen, 1, 2, 2, 4, 5, 8, 8, dtype=torch.float32)
    with pytest.raises(TypeError, match=r"cuflash.torch.attention: k must be a torch.Tensor, got numpy.ndarray"):
        ct.attention(q, k.detach().numpy(), v)
    with pytest.raises(ValueError, match=r"layout must be one of .* got 'sbhd'"):
        ct.attention(q, k, v, layout="sbhd")
    with pytest.raises(ValueError, match=r"window_size\[0\] must be >= -1"):
        ct.attention(q, k, v, window_size=(-2, 0))
    with pytest.raises(TypeError, match=r"causal must be a bool"):
        ct.attention(q, k, v, causal=1)
    with pytest.raises(ValueError, match=r"softmax_scale must be finite"):
        ct.attention(q, k, v, softmax_scale=float("nan"))
    with pytest.raises(ValueError, match=r"cuflash.torch.attention: k.shape\[-1\]=4 must equal q.shape\[-1\]=8"):
        ct.attention(q, k[..., :4], v)
    with pytest.raises(TypeError, match=r"cuflash.torch.attention: k.dtype=float64 must equal q.dtype=float32"):
        ct.attention(q, k.double(), v)


def test_gradcheck_through_score_mod_with_learned_captured_tensors(gen):
    """score_mod/mask_mod through autograd: a learned relative-position table and per-head slopes
    (captured tensors that require grad) get their gradients; an int document-id tensor and a
    detached tensor get none; gradcheck (float64 finite differences) on all five inputs."""
    from cuflash import mods

    h, s = 2, 5
    q, k, v = (torch.randn(1, h, s, 4, dtype=torch.float64, generator=gen, requires_grad=True) for _ in range(3))
    table = torch.randn(h, 2 * s - 1, dtype=torch.float64, generator=gen, requires_grad=True)
    slopes = torch.rand(h, dtype=torch.float64, generator=gen).add(0.2).requires_grad_()
    fixed = torch.randn(h, dtype=torch.float64, generator=gen)
    doc = torch.tensor([0, 0, 0, 1, 1], dtype=torch.int32)

    def fn(q, k, v, table, slopes):
        def score_mod(score, b, hh, i, j):
            return mods.tanh(score * slopes[hh]) * 2.0 + table[hh, j - i + s - 1] + fixed[hh]

        return ct.attention(q, k, v, causal=True, score_mod=score_mod,
                            mask_mod=lambda b, hh, i, j: doc[i] == doc[j])

    assert torch.autograd.gradcheck(fn, (q, k, v, table, slopes), eps=1e-6, atol=1e-7, rtol=1e-5)
    fn(q, k, v, table, slopes).sum().backward()
    assert table.grad is not None and slopes.grad is not None and fixed.grad is None
    assert table.grad[:, s:].abs().max() == 0   # causal: j - i + s - 1 < s never reaches those entries
    import cuflash   # only the captured table requires grad: cuflash.attention still routes it through autograd

    got = cuflash.attention(q.detach(), k.detach(), v.detach(), score_mod=lambda sc, b, hh, i, j: sc + table[hh, i])
    assert got.requires_grad
    with pytest.raises(NotImplementedError, match=r"cuflash.torch.attention_varlen: score_mod on a packed batch"):
        cu = torch.tensor([0, s], dtype=torch.int32)
        ct.attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu, s, s,
                            score_mod=lambda sc, b, hh, i, j: sc)
    with pytest.raises(TypeError, match=r"mask_mod's captured tensor 'w' requires grad"):
        w = torch.ones(s, dtype=torch.float64, requires_grad=True)
        ct.attention(q, k, v, mask_mod=lambda b, hh, i, j: w[j] > 0)
