"""Gradients of a traced score_mod's captured float arrays in the tensor-core backward
(``return_dscore_mod``; kernels_cu/score_mods.cuh: CUFLASH_USER_MOD bit 4) on the CUDA simulator:
per-head slopes (ALiBi-like) and a learned relative-position table, held to the gradient rule
against the float64 oracle (whose captured-array gradients are checked by finite differences in
tests/reference/test_score_mods.py). The default run compiles one backward variant (the forward
comes from the NumPy path) and checks the deterministic form's exact sums on the host; the others
run under ``slow``."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from support.grads import assert_grads_within_twice_the_numpy_path, grad_floor

import cuflash
from cuflash import mods, sim
from cuflash.kernels import attention_bwd_mma, backward_run
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


def _torch_inputs(torch, seed):
    """float64 q, k, v (a list), dout, a table and slopes from torch's generator seeded ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    f64 = [torch.randn(s, dtype=torch.float64, generator=gen) for s in ((B, HQ, SQ, D), (B, HK, SK, D),
                                                                      (B, HK, SK, D))]
    dout = torch.randn(B, HQ, SQ, D, dtype=torch.float64, generator=gen)
    table0 = torch.randn(HQ, 2 * RADIUS + 1, dtype=torch.float64, generator=gen)
    return f64, dout, table0, torch.rand(HQ, dtype=torch.float64, generator=gen) * 0.4 + 0.05


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
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "exact"])
def test_head_dim_256_sm90(rng, deterministic, without_hopper_tier):
    """f16 at bucket 256 on sm_90, causal: the traced forms whose k-step loops are not unrolled in
    full (attention_bwd_mma.cu), float-atomic and exact, within twice the NumPy path's error."""
    dtype = dtypes.float16
    q, k, v = _qkv(rng, dtype, sq=37, sk=70, d=256)
    slopes = rng.uniform(0.05, 0.5, HQ).astype(np.float32)
    table = rng.standard_normal((HQ, 2 * RADIUS + 1)).astype(np.float32)
    score_fn = _slopes_and_table(slopes, table)
    out, lse = cuflash.attention(q, k, v, return_lse=True, score_mod=score_fn, causal=True)
    dout = rng.standard_normal(out.shape).astype(dtype)
    with sim.options(arch=90):
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, backend="sim", score_mod=score_fn, causal=True,
                                           return_dscore_mod=True, deterministic=deterministic)
    assert np.abs(grads[-1]["table"]).max() > 0.1 and np.abs(grads[-1]["slopes"]).max() > 0.1
    assert_grads_within_twice_the_numpy_path(grads, q, k, v, dout, dtype, score_mod=score_fn, causal=True)


@pytest.mark.slow
def test_torch_learned_table_grad_on_the_simulator(rng):
    """cuflash.torch.attention with backend="sim": a learned table's and slopes' ``.grad`` (the
    kernel's atomics) within twice the error of the same-dtype NumPy path's (backend="numpy")
    against float64, and q's too."""
    torch = pytest.importorskip("torch")
    import cuflash.torch as ct

    f64, dout, table0, slopes0 = _torch_inputs(torch, 3)

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


def _limbs(values) -> np.ndarray:
    """The deterministic form's workspace of one element after adding ``values`` (float32), built
    with Python integers from the layout kernels_cu/attention_bwd_mma.cu documents: limb i weighs
    2^(24 i - 149); a finite x = m 2^(pos - 149) adds m << (pos mod 24), signed, into limbs
    pos // 24 (its low 24 bits) and pos // 24 + 1 (the rest); NaN / +inf / -inf OR 1 / 2 / 4
    into the flag word."""
    w, n = attention_bwd_mma.EXACT_GRAD_BITS, attention_bwd_mma.EXACT_GRAD_LIMBS
    acc, flag = [0] * (n + 1), 0
    for x in np.asarray(values, dtype=np.float32):
        bits = int(x.view(np.uint32))
        ex, m = (bits >> 23) & 255, bits & 0x7FFFFF
        if ex == 255:
            flag |= 1 if m else 4 if bits >> 31 else 2
            continue
        m |= 0x800000 if ex else 0
        pos = max(ex, 1) - 1
        val = (-1 if bits >> 31 else 1) * (m << (pos % w))
        acc[pos // w] += val & ((1 << w) - 1)
        acc[pos // w + 1] += val >> w
    acc[n] = flag
    return np.array(acc, dtype=np.int64)


@pytest.mark.parametrize("case", ["wide", "cancel", "tiny", "huge"])
def test_deterministic_form_exact_sums_round_once(rng, case):
    """The exact form's limbs back to float32 (host side, no kernel): within one float32 step of
    the rational sum of the terms, for terms spanning float32's range with mixed signs (the sum of
    1e30, 1 and -1e30 is 1, which float32 adds in that order lose), subnormals, and sums past
    float32's largest value (inf)."""
    f32 = np.finfo(np.float32)
    if case == "wide":
        vals = [rng.standard_normal(40).astype(np.float32) * np.float32(2.0) ** rng.integers(-100, 100, 40)
                for _ in range(6)]
    elif case == "cancel":
        vals = [np.array([1e30, 1.0, -1e30, 3e-5], np.float32), np.array([-2.5, 1e-3, 2.5, -1e-3], np.float32)]
    elif case == "tiny":   # subnormal and least normal steps
        vals = [np.array([f32.smallest_subnormal] * 3 + [-f32.tiny], np.float32), rng.standard_normal(7).astype(np.float32) * f32.tiny]
    else:
        vals = [np.array([f32.max, f32.max / 2], np.float32), np.array([-f32.max, -f32.max, 1.0], np.float32),
                np.array([f32.max, -f32.max / 4], np.float32)]
    got = attention_bwd_mma.exact_grad_sum(np.stack([_limbs(v) for v in vals]), np)
    assert got.dtype == np.float32 and got.shape == (len(vals),)
    for g, v in zip(got, vals):
        exact = sum((Fraction(float(x)) for x in v), Fraction(0))
        if abs(exact) > Fraction(float(f32.max)) * (1 + Fraction(1, 2 ** 25)):
            assert g == (np.inf if exact > 0 else -np.inf), (case, g, float(exact))
            continue
        step = np.spacing(np.abs(np.float32(float(exact))))
        assert abs(Fraction(float(g)) - exact) <= Fraction(float(step)), (case, g, float(exact))
    nonfinite = np.stack([_limbs([1.0, np.nan]), _limbs([np.inf, 2.0]), _limbs([-np.inf, 1.0]), _limbs([np.inf, -np.inf])])
    got = attention_bwd_mma.exact_grad_sum(nonfinite, np)
    assert np.isnan(got[0]) and got[1] == np.inf and got[2] == -np.inf and np.isnan(got[3])


@pytest.mark.slow
def test_deterministic_array_gradients_same_bits_for_any_order_and_split(rng, monkeypatch):
    """deterministic=True on the simulator: the captured arrays' gradients (and dk, dv) are the same
    bits under several thread orders, block workers and numbers of key-tile splits (1, 3, 4),
    dq the same bits per split count; and every gradient within twice the same-dtype NumPy
    path's error against the float64 oracle. The float atomics' form differs between two of these
    orders (so the orders do vary the adds)."""
    dtype, sk = dtypes.float16, 200   # 4 key tiles of 64
    q, k, v = _qkv(rng, dtype, sk=sk)
    slopes = rng.uniform(0.05, 0.5, HQ).astype(np.float32)
    table = rng.standard_normal((HQ, 2 * RADIUS + 1)).astype(np.float32)
    score_fn = _slopes_and_table(slopes, table)
    out, lse = cuflash.attention(q, k, v, return_lse=True, score_mod=score_fn, causal=True)
    dout = rng.standard_normal(out.shape).astype(dtype)
    splits_seen, real = [], backward_run.deterministic_splits
    monkeypatch.setattr(backward_run, "deterministic_splits", lambda *a: splits_seen.append(real(*a)) or splits_seen[-1])
    runs = []
    for seed, workers, max_splits in ((0, None, 16), (5, 1, 16), (3, None, 1), (7, 2, 3), (11, None, 3)):
        monkeypatch.setattr(backward_run, "MAX_DETERMINISTIC_SPLITS", max_splits)
        with sim.options(arch=80, seed=seed, workers=workers):
            runs.append(cuflash.attention_backward(dout, q, k, v, out, lse, backend="sim", score_mod=score_fn,
                                                   causal=True, return_dscore_mod=True, deterministic=True))
    assert splits_seen == [4, 4, 1, 3, 3]
    first = runs[0]
    for r in runs[1:]:
        assert all(np.array_equal(r[-1][n], first[-1][n]) for n in ("slopes", "table"))
        assert np.array_equal(r[1], first[1]) and np.array_equal(r[2], first[2])
    assert np.array_equal(runs[1][0], runs[0][0]) and np.array_equal(runs[4][0], runs[3][0])
    assert np.abs(first[-1]["table"]).max() > 0.1 and np.abs(first[-1]["slopes"]).max() > 0.1
    assert_grads_within_twice_the_numpy_path(first, q, k, v, dout, dtype, score_mod=score_fn, causal=True)
    floats = []   # the float32 atomics' form (deterministic=False) under two of these orders: they differ
    for seed in (0, 5):
        with sim.options(arch=80, seed=seed, workers=1):
            floats.append(cuflash.attention_backward(dout, q, k, v, out, lse, backend="sim", score_mod=score_fn,
                                                     causal=True, return_dscore_mod=True)[-1]["table"])
    assert not np.array_equal(floats[0], floats[1])


@pytest.mark.slow
def test_torch_learned_table_deterministic_on_the_simulator():
    """cuflash.torch.attention with deterministic=True and backend="sim" (the exact form): a learned
    table's ``.grad`` the same bits under two thread orders, and within twice the same-dtype NumPy
    path's error against float64."""
    torch = pytest.importorskip("torch")
    import cuflash.torch as ct

    f64, dout, table0, _ = _torch_inputs(torch, 5)
    slopes = np.full(HQ, 0.25, np.float32)

    def run(dtype, backend, seed=0):
        q, k, v = (x.to(dtype) for x in f64)
        table = table0.to(torch.float32 if dtype != torch.float64 else dtype).clone().requires_grad_()
        with sim.options(arch=80, seed=seed):
            out = ct.attention(q, k, v, causal=True, score_mod=_slopes_and_table(slopes, table), backend=backend,
                               deterministic=True)
            (out.double() * dout).sum().backward()
        return table.grad

    exact = run(torch.float64, "numpy").numpy()
    same = run(torch.float16, "numpy").double().numpy()
    got = [run(torch.float16, "sim", seed) for seed in (0, 5)]
    assert got[0].dtype == torch.float32 and torch.equal(got[0], got[1])
    err = np.abs(got[0].double().numpy() - exact)
    assert (err <= 2 * np.abs(same - exact).max() + grad_floor(exact, np.float16) + 1e-6).all(), err.max()
