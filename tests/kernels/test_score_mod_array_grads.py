"""Gradients of a traced score_mod's captured float arrays in the tensor-core backward
(``return_dscore_mod``; kernels_cu/score_mods.cuh: CUFLASH_USER_MOD bit 4) on the CUDA simulator:
per-head slopes (ALiBi-like) and a learned relative-position table, held to the gradient rule
against the float64 oracle (whose captured-array gradients are checked by finite differences in
tests/reference/test_score_mods.py). The default run compiles one backward variant (the forward
comes from the NumPy path); the others run under ``slow``."""

from __future__ import annotations

import numpy as np
import pytest

from support.grads import assert_grads_within_twice_the_numpy_path, grad_floor

import cuflash
from cuflash import mods, sim
from cuflash.runtime import dtypes
from cuflash.sim import launcher

B, HQ, HK, SQ, SK, D = 1, 2, 1, 37, 70, 64
RADIUS = 6   # the table's relative positions: -RADIUS..RADIUS, clamped


def _qkv(rng, dtype, b=B, hq=HQ, hk=HK, sq=SQ, sk=SK, d=D):
    return tuple(rng.standard_normal(s).astype(dtype) for s in ((b, hq, sq, d), (b, hk, sk, d), (b, hk, sk, d)))


def _slopes_and_table(slopes, table, cap=8.0):
    """A softcapped ALiBi with per-head slopes plus a learned table of clamped relative positions:
    the slopes' derivative depends on the score score_mod receives (through the tanh), the
    table's does not."""

    def score_fn(score, b, h, q_idx, kv_idx):
        rel = mods.minimum(mods.maximum(kv_idx - q_idx, -RADIUS), RADIUS) + RADIUS
        return cap * mods.tanh((score - slopes[h] * abs(q_idx - kv_idx)) / cap) + table[h, rel]

    return score_fn


def _backward_on_the_simulator(rng, dtype, q, k, v, score_fn, arch=80, checked=False, **kw):
    out, lse = cuflash.attention(q, k, v, return_lse=True, score_mod=score_fn, **kw)   # the NumPy path's forward
    dout = rng.standard_normal(out.shape).astype(dtype)
    with sim.options(arch=arch, checked=checked):
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, backend="sim", score_mod=score_fn,
                                           return_dscore_mod=True, **kw)
    return grads, dout


def test_slopes_and_table_gradients_match_the_oracle(rng):
    """f16, GQA, causal (bottom-right, Sk > Sq: hidden pairs add nothing): the kernel's dq, dk, dv
    and both arrays' gradients within twice the error of the same-dtype NumPy path, the arrays'
    shapes and dtypes kept."""
    dtype = dtypes.float16
    q, k, v = _qkv(rng, dtype)
    slopes = rng.uniform(0.05, 0.5, HQ).astype(np.float32)
    table = rng.standard_normal((HQ, 2 * RADIUS + 1)).astype(np.float32)
    score_fn = _slopes_and_table(slopes, table)
    plan = cuflash.explain(q, k, v, backend="sim", arch=80, score_mod=score_fn, causal=True)
    assert plan["tier"] == "attention_fwd_mma" and "_mods_um" in plan["variant"], plan
    grads, dout = _backward_on_the_simulator(rng, dtype, q, k, v, score_fn, causal=True)
    got = grads[-1]
    assert sorted(got) == ["slopes", "table"]
    assert got["slopes"].shape == slopes.shape and got["table"].shape == table.shape
    assert got["slopes"].dtype == np.float32 and got["table"].dtype == np.float32
    assert np.abs(got["table"]).max() > 0.1 and np.abs(got["slopes"]).max() > 0.1
    assert_grads_within_twice_the_numpy_path(grads, q, k, v, dout, dtype, score_mod=score_fn, causal=True)


@pytest.mark.slow
def test_bf16_head_dim_128_sm90_and_checked_mode(rng, without_hopper_tier):
    """bf16 at bucket 128 on sm_90 (the red.global.add dQ path; the Hopper backward, which takes
    this call too, is tested in test_hopper_backward_mods.py) without a mask; new values of the
    arrays run the same compiled module; then checked mode (races, uninitialized reads, bounds)
    on the default case's variant: clean."""
    dtype = dtypes.bfloat16
    q, k, v = _qkv(rng, dtype, b=2, hq=4, hk=2, sq=50, sk=45, d=128)
    for n in range(2):
        slopes = rng.uniform(0.05, 0.5, 4).astype(np.float32)
        table = rng.standard_normal((4, 2 * RADIUS + 1)).astype(np.float32)
        score_fn = _slopes_and_table(slopes, table)
        loaded = len(launcher._modules)
        grads, dout = _backward_on_the_simulator(rng, dtype, q, k, v, score_fn, arch=90)
        assert n == 0 or len(launcher._modules) == loaded   # the second values: no new module
        assert_grads_within_twice_the_numpy_path(grads, q, k, v, dout, dtype, score_mod=score_fn)

    dtype = dtypes.float16
    q, k, v = _qkv(rng, dtype)
    slopes = rng.uniform(0.05, 0.5, HQ).astype(np.float32)
    table = rng.standard_normal((HQ, 2 * RADIUS + 1)).astype(np.float32)
    score_fn = _slopes_and_table(slopes, table)
    grads, dout = _backward_on_the_simulator(rng, dtype, q, k, v, score_fn, checked=True, causal=True)
    assert_grads_within_twice_the_numpy_path(grads, q, k, v, dout, dtype, score_mod=score_fn, causal=True)


@pytest.mark.slow
def test_torch_learned_table_grad_on_the_simulator(rng):
    """cuflash.torch.attention with backend="sim": a learned table's and slopes' ``.grad`` (the
    kernel's atomics) within twice the error of the same-dtype NumPy path's (backend="numpy")
    against float64, and q's too."""
    torch = pytest.importorskip("torch")
    import cuflash.torch as ct

    gen = torch.Generator().manual_seed(3)
    f64 = [torch.randn(s, dtype=torch.float64, generator=gen) for s in ((B, HQ, SQ, D), (B, HK, SK, D),
                                                                      (B, HK, SK, D))]
    dout = torch.randn(B, HQ, SQ, D, dtype=torch.float64, generator=gen)
    table0 = torch.randn(HQ, 2 * RADIUS + 1, dtype=torch.float64, generator=gen)
    slopes0 = torch.rand(HQ, dtype=torch.float64, generator=gen) * 0.4 + 0.05

    def run(dtype, backend):
        q, k, v = (x.to(dtype).clone().requires_grad_() for x in f64)   # (fresh leaves each run)
        table = table0.to(torch.float32 if dtype != torch.float64 else dtype).clone().requires_grad_()
        slopes = slopes0.to(table.dtype).clone().requires_grad_()
        score_fn = _slopes_and_table(slopes, table)
        with sim.options(arch=80):
            out = ct.attention(q, k, v, causal=True, score_mod=score_fn, backend=backend)
            (out.double() * dout).sum().backward()
        return {"q": q.grad.double(), "table": table.grad.double(), "slopes": slopes.grad.double()}, table.grad

    exact, _ = run(torch.float64, "numpy")
    same, _ = run(torch.float16, "numpy")
    got, table_grad = run(torch.float16, "sim")
    assert table_grad.dtype == torch.float32 and table_grad.shape == table0.shape
    for name in ("q", "table", "slopes"):
        x = exact[name].numpy()
        base_err = float(np.abs(same[name].numpy() - x).max())
        err = np.abs(got[name].numpy() - x)
        assert (err <= 2 * base_err + grad_floor(x, np.float16) + 1e-6).all(), (name, err.max(), base_err)


@pytest.mark.slow
def test_block_sparse_form_with_array_gradients(rng):
    """The block-sparse backward (_bs) with the captured-array gradients: a causal document mask
    over 3 documents as a 64-block mask; the gradients held to the rule against the dense
    mask_mod's oracle."""
    s, dtype = 150, dtypes.float16
    q, k, v = _qkv(rng, dtype, sq=s, sk=s)
    slopes = rng.uniform(0.05, 0.5, HQ).astype(np.float32)
    table = rng.standard_normal((HQ, 2 * RADIUS + 1)).astype(np.float32)
    score_fn = _slopes_and_table(slopes, table)
    mask_fn = mods.document_mask(np.repeat(np.arange(3), 50).astype(np.int32), causal=True)
    block_mask = cuflash.create_block_mask(mask_fn, None, None, s, s, BLOCK_SIZE=64)
    grads, dout = _backward_on_the_simulator(rng, dtype, q, k, v, score_fn, mask_mod=mask_fn, block_mask=block_mask)
    assert_grads_within_twice_the_numpy_path(grads, q, k, v, dout, dtype, score_mod=score_fn, mask_mod=mask_fn)
