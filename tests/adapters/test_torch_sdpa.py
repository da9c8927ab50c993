"""cuflash.torch.scaled_dot_product_attention against torch's own SDPA (math backend).

Expected values come from ``F.scaled_dot_product_attention`` under ``SDPBackend.MATH`` in
float64; low-precision runs are held to the project's tolerance rule with torch's math SDPA in
the input dtype as the same-dtype baseline. The grid covers SDPA's documented cases: top-left
``is_causal`` with Sq < Sk, Sq == Sk, Sq > Sk; boolean and additive masks of several broadcast
shapes (rows left with no key included); leading batch dims broadcast; GQA with
``enable_gqa=True``; ``scale``; rank 2, 3, 5; odd lengths and head dims; an empty head dim.
Misuse is refused as SDPA refuses it, with errors that are both ValueError/TypeError and
RuntimeError.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import cuflash.torch as ct  # noqa: E402
from cuflash.reference import tolerance  # noqa: E402


def sdpa_math(*args, **kw):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(*args, **kw)


def rand(shape, dtype, gen):
    return torch.randn(shape, dtype=torch.float64, generator=gen).to(dtype).requires_grad_()


# (query, key, value shapes, keyword arguments, mask: None | (shape, "bool" | "float"))
GRID = [
    ((2, 3, 17, 40), (2, 3, 17, 40), (2, 3, 17, 40), dict(is_causal=True), None),          # Sq == Sk
    ((2, 3, 5, 40), (2, 3, 23, 40), (2, 3, 23, 24), dict(is_causal=True), None),           # Sq < Sk, Ev != E
    ((1, 2, 29, 72), (1, 2, 11, 72), (1, 2, 11, 72), dict(is_causal=True), None),          # Sq > Sk
    ((2, 4, 13, 32), (2, 2, 19, 32), (2, 2, 19, 32), dict(enable_gqa=True), None),         # GQA
    ((2, 6, 9, 16), (2, 1, 9, 16), (2, 1, 9, 16), dict(enable_gqa=True, is_causal=True), None),  # MQA
    ((2, 4, 7, 16), (1, 4, 12, 16), (1, 4, 12, 16), dict(), None),                         # batch broadcast
    ((2, 4, 7, 16), (2, 1, 12, 16), (2, 1, 12, 16), dict(scale=0.37), None),               # head broadcast
    ((11, 24), (14, 24), (14, 8), dict(is_causal=True), None),                             # rank 2
    ((3, 2, 4, 6, 16), (3, 2, 2, 10, 16), (3, 2, 2, 10, 16), dict(enable_gqa=True), None),  # rank 5, GQA
    ((2, 3, 10, 16), (2, 3, 15, 16), (2, 3, 15, 16), dict(), ((10, 15), "bool")),          # 2-D bool mask
    ((2, 3, 10, 16), (2, 3, 15, 16), (2, 3, 15, 16), dict(), ((2, 1, 10, 15), "bool")),    # per batch, rows empty
    ((2, 3, 10, 16), (2, 3, 15, 16), (2, 3, 15, 16), dict(), ((2, 1, 1, 15), "bool")),     # padding mask
    ((2, 3, 10, 16), (2, 3, 15, 16), (2, 3, 15, 16), dict(), ((3, 10, 15), "float")),      # additive per head
    ((2, 4, 10, 16), (2, 2, 15, 16), (2, 2, 15, 16), dict(enable_gqa=True), ((2, 4, 10, 15), "float")),
    ((2, 5, 0), (2, 6, 0), (2, 6, 3), dict(), None),                                       # E = 0
]


def make_mask(spec, gen, dtype):
    if spec is None:
        return None
    shape, kind = spec
    keep = torch.rand(shape, generator=gen) > 0.35
    if len(shape) == 4 and shape[-2] > 1:
        keep[0, :, 1] = False  # a row with no key (SDPA's math backend: 0, as cuflash)
    if kind == "bool":
        return keep
    bias = torch.randn(shape, dtype=torch.float64, generator=gen)
    return bias.masked_fill(~keep, -math.inf).to(dtype)


@pytest.mark.parametrize("case", range(len(GRID)))
def test_matches_torch_sdpa_float64(case):
    """Forward and backward equal torch's float64 math SDPA to float64 rounding."""
    qs, ks, vs, kw, mask_spec = GRID[case]
    gen = torch.Generator().manual_seed(case)
    q, k, v = (rand(s, torch.float64, gen) for s in (qs, ks, vs))
    mask = make_mask(mask_spec, gen, torch.float64)
    ref = sdpa_math(q, k, v, attn_mask=mask, **kw)
    out = ct.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not torch.isnan(ref).any()
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    grad = torch.randn(ref.shape, dtype=torch.float64, generator=gen)
    for name, a, b in zip("qkv", torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [1, 3, 10, 12])
def test_low_precision_tolerance_rule(case, dtype):
    """In float32/bfloat16 the error against float64 SDPA is at most twice that of torch's own
    math SDPA in the same dtype, plus the rule's floor (forward and dq)."""
    qs, ks, vs, kw, mask_spec = GRID[case]
    gen = torch.Generator().manual_seed(100 + case)
    q64, k64, v64 = (rand(s, torch.float64, gen) for s in (qs, ks, vs))
    mask64 = make_mask(mask_spec, gen, torch.float64)
    lowp = [t.detach().to(dtype).requires_grad_() for t in (q64, k64, v64)]
    mask = None if mask64 is None else (mask64 if mask64.dtype == torch.bool else mask64.to(torch.float32))
    ref = sdpa_math(q64, k64, v64, attn_mask=mask64, **kw)
    base = sdpa_math(*lowp, attn_mask=mask, **kw)
    ours_in = [t.detach().clone().requires_grad_() for t in lowp]
    out = ct.scaled_dot_product_attention(*ours_in, attn_mask=mask, **kw)
    floor = tolerance.floor_for({torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype])
    err_out = (out.double() - ref).abs().max().item()
    err_base = (base.double() - ref).abs().max().item()
    assert err_out <= 2 * err_base + floor, (err_out, err_base)
    grad = torch.randn(ref.shape, dtype=torch.float64, generator=gen)
    (dq_ref,) = torch.autograd.grad(ref, (q64,), grad)
    (dq_base,) = torch.autograd.grad(base, (lowp[0],), grad.to(dtype))
    (dq_out,) = torch.autograd.grad(out, (ours_in[0],), grad.to(dtype))
    err_dq = (dq_out.double() - dq_ref).abs().max().item()
    assert err_dq <= 2 * (dq_base.double() - dq_ref).abs().max().item() + 4 * floor, err_dq


def test_signature_is_sdpas():
    """Same parameters, defaults and kinds as torch's (scale and enable_gqa keyword-only)."""
    import inspect

    params = inspect.signature(ct.scaled_dot_product_attention).parameters
    assert list(params) == ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"]
    assert [p.default for p in params.values()][3:] == [None, 0.0, False, None, False]
    assert params["scale"].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["enable_gqa"].kind is inspect.Parameter.KEYWORD_ONLY
    q = torch.randn(2, 5, 8)
    with pytest.raises(TypeError):
        ct.scaled_dot_product_attention(q, q, q, None, 0.0, False, None)  # SDPA takes at most 6 positionals


def test_dropout_edges():
    """dropout_p <= 0: none (SDPA's math backend skips it); 1: zeros with zero gradients;
    in between: E[out] is the undropped output (each weight kept with 1 - p, scaled by 1/(1-p))."""
    gen = torch.Generator().manual_seed(7)
    q, k, v = (rand((2, 3, 6, 8), torch.float64, gen) for _ in range(3))
    plain = sdpa_math(q, k, v)
    torch.testing.assert_close(ct.scaled_dot_product_attention(q, k, v, dropout_p=-0.5), plain)
    zeros = ct.scaled_dot_product_attention(q, k, v, dropout_p=1.0)
    assert torch.equal(zeros, torch.zeros_like(plain))
    assert torch.equal(torch.autograd.grad(zeros.sum(), q)[0], torch.zeros_like(q))
    torch.manual_seed(0)
    mean = sum(ct.scaled_dot_product_attention(q, k, v, dropout_p=0.3) for _ in range(300)) / 300
    assert (mean - plain).abs().max().item() < 0.25


REFUSED = [  # (description, call arguments, what SDPA raises, what we raise)
    ("rank 1", lambda: ((torch.randn(8), torch.randn(8), torch.randn(8)), {}), RuntimeError, ct.SDPAError),
    ("mask with is_causal", lambda: ((torch.randn(2, 5, 8), torch.randn(2, 6, 8), torch.randn(2, 6, 8)),
                                     dict(attn_mask=torch.ones(5, 6, dtype=torch.bool), is_causal=True)),
     RuntimeError, ct.SDPAError),
    ("int mask", lambda: ((torch.randn(2, 5, 8), torch.randn(2, 6, 8), torch.randn(2, 6, 8)),
                          dict(attn_mask=torch.ones(5, 6, dtype=torch.int32))), RuntimeError, ct.SDPADtypeError),
    ("float64 mask, float32 q", lambda: ((torch.randn(2, 5, 8), torch.randn(2, 6, 8), torch.randn(2, 6, 8)),
                                         dict(attn_mask=torch.zeros(5, 6, dtype=torch.float64))),
     RuntimeError, ct.SDPADtypeError),
    ("mask shape", lambda: ((torch.randn(2, 5, 8), torch.randn(2, 6, 8), torch.randn(2, 6, 8)),
                            dict(attn_mask=torch.ones(5, 7, dtype=torch.bool))), RuntimeError, ct.SDPAError),
    ("mask of higher rank", lambda: ((torch.randn(2, 5, 8), torch.randn(2, 6, 8), torch.randn(2, 6, 8)),
                                     dict(attn_mask=torch.ones(3, 2, 5, 6, dtype=torch.bool))),
     RuntimeError, ct.SDPAError),
    ("heads without enable_gqa", lambda: ((torch.randn(2, 4, 5, 8), torch.randn(2, 2, 6, 8),
                                           torch.randn(2, 2, 6, 8)), {}), RuntimeError, ct.SDPAError),
    ("heads not dividing", lambda: ((torch.randn(2, 4, 5, 8), torch.randn(2, 3, 6, 8), torch.randn(2, 3, 6, 8)),
                                    dict(enable_gqa=True)), RuntimeError, ct.SDPAError),
    ("mixed dtypes", lambda: ((torch.randn(2, 5, 8), torch.randn(2, 6, 8).double(), torch.randn(2, 6, 8)), {}),
     RuntimeError, ct.SDPADtypeError),
    ("integer dtype", lambda: ((torch.ones(2, 5, 8, dtype=torch.int32),) * 3, {}), RuntimeError, ct.SDPADtypeError),
    ("E mismatch", lambda: ((torch.randn(2, 5, 8), torch.randn(2, 6, 7), torch.randn(2, 6, 8)), {}),
     RuntimeError, ct.SDPAError),
    ("S mismatch", lambda: ((torch.randn(2, 5, 8), torch.randn(2, 6, 8), torch.randn(2, 7, 8)), {}),
     RuntimeError, ct.SDPAError),
    ("batch mismatch", lambda: ((torch.randn(2, 5, 8), torch.randn(3, 6, 8), torch.randn(3, 6, 8)), {}),
     RuntimeError, ct.SDPAError),
    ("dropout_p > 1", lambda: ((torch.randn(2, 5, 8),) * 3, dict(dropout_p=1.5)), RuntimeError, ct.SDPAError),
    ("non-bool is_causal", lambda: ((torch.randn(2, 5, 8),) * 3, dict(is_causal=1)), TypeError, TypeError),
    ("str dropout_p", lambda: ((torch.randn(2, 5, 8),) * 3, dict(dropout_p="0.1")), TypeError, TypeError),
    ("list query", lambda: (([1.0], torch.randn(2, 6, 8), torch.randn(2, 6, 8)), {}), TypeError, TypeError),
]


@pytest.mark.parametrize("case", REFUSED, ids=[c[0] for c in REFUSED])
def test_refuses_what_sdpa_refuses(case):
    _, make, sdpa_error, our_error = case
    args, kw = make()
    with pytest.raises(sdpa_error):
        sdpa_math(*args, **kw)
    with pytest.raises(our_error) as info:
        ct.scaled_dot_product_attention(*args, **kw)
    assert isinstance(info.value, sdpa_error)
    if our_error is ct.SDPAError:
        assert isinstance(info.value, ValueError)
    assert "cuflash.torch.scaled_dot_product_attention" in str(info.value) or our_error is TypeError


def test_error_classes():
    assert issubclass(ct.SDPAError, ValueError) and issubclass(ct.SDPAError, RuntimeError)
    assert issubclass(ct.SDPADtypeError, TypeError) and issubclass(ct.SDPADtypeError, RuntimeError)


def test_readme_example_runs():
    """The README's SDPA example, as written."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- sdpa-example -->\s*```python\n(.*?)```", text, re.S)
    assert block, "README.md has no SDPA example after <!-- sdpa-example -->"
    scope = {}
    exec(compile(block.group(1), "README.md (SDPA example)", "exec"), scope)  # noqa: S102
    assert scope["out"].shape == (2, 8, 100, 64) and scope["q"].grad.shape == (2, 8, 100, 64)


def test_heads_without_enable_gqa_suggest_it():
    """Key heads that divide the query heads but do not broadcast: the error names enable_gqa;
    heads that do not divide get no such hint."""
    q, kv = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 6, 8)
    with pytest.raises(ct.SDPAError, match=r"must broadcast; got .*\(for grouped-query attention, pass enable_gqa=True\)"):
        ct.scaled_dot_product_attention(q, kv, kv)
    kv3 = torch.randn(2, 3, 6, 8)
    with pytest.raises(ct.SDPAError) as info:
        ct.scaled_dot_product_attention(q, kv3, kv3)
    assert "enable_gqa" not in str(info.value)
