"""Attention dropout (issue 24): Philox 4x32-10 against Random123's known answers in NumPy and in
the CUDA text on the simulator; the keep mask bit for bit across them; its statistics; dropout in
the forward and the backward against the float64 oracle given the same mask, on the NumPy path and
the simulator (normal and checked); the argument checks; torch's generator."""

from __future__ import annotations

import numpy as np
import pytest

import cuflash
from cuflash.kernels import dropout_mask as dm
from cuflash.reference import dropout as rd
from cuflash.sim import launcher
from support.grids import default_share
from support.device import to_device

#: Random123 kat_vectors, the three philox4x32 10 lines: counter, key, output
KAT = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
       ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
       ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]


@pytest.mark.parametrize("counter,key,want", KAT)
def test_philox_known_answers_numpy(counter, key, want):
    assert tuple(int(w) for w in rd.philox4x32_10(counter, key)) == want


@pytest.mark.parametrize("checked", [False, True])
def test_philox_known_answers_cuda_text(checked):
    for counter, key, want in KAT:
        c = to_device(np.array([counter], np.uint32))
        w = to_device(np.zeros((1, 4), np.uint32))
        with cuflash.sim.options(checked=checked):
            launcher.run(dm.plan_raw(c, w, key))
        assert tuple(int(x) for x in w[0]) == want


@pytest.mark.parametrize("p,seed,offset", [(0.1, 0, 0), (0.5, 123456789, 7), (0.9, 2**32 - 1, 2**32 - 1)])
def test_mask_is_bit_identical_on_the_simulator(p, seed, offset):
    shape = (2, 3, 17, 45)
    want = rd.dropout_mask(shape, p, seed, offset, batch0=5)
    got = to_device(np.full(shape, 7, np.uint8))
    launcher.run(dm.plan_mask(got, 5, seed, offset, rd.keep_threshold(p)))
    assert np.array_equal(got.astype(bool), want) and set(np.unique(got)) <= {0, 1}


@pytest.mark.parametrize("p", [0.05, 0.3, 0.75])
def test_kept_fraction_and_independence(p):
    """Kept fraction within 4 standard errors of 1 - p over 2**21 pairs; masks of other seeds and
    offsets agree with it no more than independent ones would (4 standard errors)."""
    shape = (2, 4, 256, 1024)
    n = int(np.prod(shape))
    m = rd.dropout_mask(shape, p, 42, 0)
    se = np.sqrt(p * (1 - p) / n)
    assert abs(m.mean() - (1 - p)) < 4 * se
    for other in (rd.dropout_mask(shape, p, 43, 0), rd.dropout_mask(shape, p, 42, 1)):
        both = (m & other).mean()
        expect = (1 - p) ** 2
        assert abs(both - expect) < 4 * np.sqrt(expect * (1 - expect) / n)
    assert rd.keep_threshold(0.0) == 2**32 - 1 and rd.keep_threshold(0.5) == 2**31


# --------------------------------------------------------------------------------------------
# attention with dropout against the float64 oracle given the same mask

from support.tolerance import check_close  # noqa: E402
from allpairspy import AllPairs  # noqa: E402
from support.grads import check_grads_close  # noqa: E402

from cuflash.runtime import dtypes  # noqa: E402

SHAPES = [(1, 1), (37, 45), (64, 64), (130, 70)]
HEADS = [(2, 2), (4, 2), (4, 1)]
HEAD_DIMS = [40, 64, 96, 128, 256]
MASKS = {"none": (False, (-1, -1)), "causal": (True, (-1, -1)), "window": (False, (9, 4)),
         "causal_win": (True, (20, -1))}
PS = [0.1, 0.5, 0.9]
DTYPES = {"f16": dtypes.float16, "bf16": dtypes.bfloat16}
ARCHS = ["sm_90", "sm_80"]
GRID = [tuple(c) for c in AllPairs([SHAPES, HEADS, HEAD_DIMS, list(MASKS), PS, list(DTYPES), ARCHS])]


def run_dropout_case(rng, shape, heads, d, mask, p, dtype_key, arch, *, checked=False, seed=0, mods=None):
    sq, sk = shape
    hq, hk = heads
    dt = DTYPES[dtype_key] if dtype_key != "f32" else np.dtype(np.float32)
    q = rng.standard_normal((2, hq, sq, d)).astype(dt)
    k = rng.standard_normal((2, hk, sk, d)).astype(dt)
    v = rng.standard_normal((2, hk, sk, d)).astype(dt)
    causal, window = MASKS[mask]
    drop = dict(dropout_p=p, dropout_seed=int(rng.integers(2**32)), dropout_offset=int(rng.integers(2**32)))
    kw = dict(causal=causal, window_size=window, **drop, **(mods or {}))
    dout = rng.standard_normal((2, hq, sq, d)).astype(dt)
    for backend in ("numpy", "sim"):
        with cuflash.sim.options(arch=arch, checked=checked, seed=seed):
            out, lse = cuflash.attention(q, k, v, return_lse=True, backend=backend, **kw)
            check_close(out, q, k, v, lse=lse, **kw)
            grads = cuflash.attention_backward(dout, q, k, v, out, lse, backend=backend, **kw)
        check_grads_close(grads, dout, q, k, v, out, lse, **kw)


@pytest.mark.parametrize("case", default_share(GRID, ["-".join(map(str, c)) for c in GRID]))
def test_dropout_pairwise(case, rng):
    run_dropout_case(rng, *case)


#: float32 runs on the portable tier (its ``dropout`` forms): the same design without the dtype axis
F32_GRID = [tuple(c) for c in AllPairs([SHAPES, HEADS, HEAD_DIMS, list(MASKS), PS, ARCHS[::-1] + ["sm_75"]])]
#: the default run's share: one case (head dim 64: one forward and one backward variant)
F32_DEFAULT = ((37, 45), (4, 2), 64, "causal_win", 0.5, "sm_90")


@pytest.mark.parametrize("case", [pytest.param(c, id="-".join(map(str, c)),
                                               marks=() if c == F32_DEFAULT else (pytest.mark.slow,))
                                  for c in [F32_DEFAULT] + [c for c in F32_GRID if c != F32_DEFAULT]])
def test_dropout_float32_portable(case, rng):
    shape, heads, d, mask, p, arch = case
    q = np.zeros((1, 1, 2, d), np.float32)
    assert cuflash.explain(q, q, q, backend="sim", arch=int(arch[3:]))["tier"] == "attention_fwd_simt"
    run_dropout_case(rng, shape, heads, d, mask, p, "f32", arch)


@pytest.mark.slow
@pytest.mark.parametrize("dtype_key,arch", [("f32", "sm_90"), ("f32", "sm_75"), ("f16", "sm_80"), ("bf16", "sm_90")])
def test_dropout_with_modifiers_on_the_portable_tier(dtype_key, arch, rng):
    """Dropout with score modifiers: the portable tier's ``_dropout_mods`` forms (the tensor-core
    tier takes each alone, not both), forward and backward against the float64 oracle."""
    mods = dict(softcap=3.0, attn_bias=rng.standard_normal((2, 4, 70, 150)).astype(np.float32),
                attn_mask=rng.random((2, 1, 70, 150)) > 0.3, sinks=rng.standard_normal(4).astype(np.float32))
    run_dropout_case(rng, (70, 150), (4, 2), 64, "causal", 0.3, dtype_key, arch, mods=mods)


@pytest.mark.slow
@pytest.mark.checked
@pytest.mark.parametrize("arch,shape,mask", [("sm_75", (70, 150), "causal"), ("sm_90", (37, 45), "window")])
def test_dropout_with_modifiers_on_the_portable_tier_checked(arch, shape, mask, rng):
    """Checked mode (races, bounds, uninitialised reads) on the float32 ``_dropout_mods`` forms,
    forward and backward, with a strided bias (a view of a NaN-filled buffer) and a mask."""
    buf = np.full((2, 4, shape[0], 2 * shape[1]), np.nan, np.float32)
    buf[..., ::2] = rng.standard_normal((2, 4) + shape)
    mods = dict(softcap=2.0, alibi_slopes=rng.uniform(0.02, 0.4, 4).astype(np.float32), attn_bias=buf[..., ::2],
                attn_mask=rng.random((2, 1) + shape) > 0.3, sinks=rng.standard_normal(4).astype(np.float32))
    run_dropout_case(rng, shape, (4, 2), 64, mask, 0.3, "f32", arch, checked=True, seed=3, mods=mods)


@pytest.mark.parametrize("arch", ["sm_90", pytest.param("sm_75", marks=pytest.mark.slow)])
def test_float32_keep_bits_are_the_numpy_paths(arch, rng):
    """The portable kernels' keep bits, read off exactly: with q = k = 0 every visible weight is
    1 / Sk, so with V the identity out[i, j] = Z[i, j] / ((1 - p) Sk), and with dO the identity
    too, dV[j, i] = Z[i, j] / ((1 - p) Sk); Z must be the NumPy path's mask bit for bit, on the
    emulated sm_90 and sm_75 alike."""
    b, h, s, p, seed, offset = 2, 3, 45, 0.4, 2024, 77
    q = np.zeros((b, h, s, 16), np.float32)
    eye = np.broadcast_to(np.eye(s, dtype=np.float32), (b, h, s, s)).copy()
    drop = dict(dropout_p=p, dropout_seed=seed, dropout_offset=offset)
    with cuflash.sim.options(arch=arch):
        out, lse = cuflash.attention(q, q, eye, return_lse=True, backend="sim", **drop)
        _, _, dv = cuflash.attention_backward(eye, q, q, eye, out, lse, backend="sim", **drop)
    want = rd.dropout_mask((b, h, s, s), p, seed, offset)
    assert 0.4 < want.mean() < 0.8
    for got in (out, dv.swapaxes(-1, -2)):
        bits = got * ((1 - p) * s)
        assert np.abs(bits - np.round(bits)).max() < 1e-4
        assert np.array_equal(np.round(bits).astype(bool), want)


#: a share of the grid in checked mode: every fourth case, one in six of them in the default run
CHECKED = [pytest.param(c, id="-".join(map(str, c)), marks=() if i % 6 == 0 else (pytest.mark.slow,))
           for i, c in enumerate(GRID[::4])]


@pytest.mark.checked
@pytest.mark.parametrize("case", CHECKED)
def test_dropout_checked(case, rng):
    run_dropout_case(rng, *case, checked=True, seed=2)


def test_dropout_changes_the_result_and_p0_is_the_plain_kernel(rng):
    """The mask really applies (a different seed changes the output); ``dropout_p=0`` runs the
    kernel without the dropout axis (the dispatcher picks the plain variant)."""
    from cuflash.kernels import dispatch
    from support.options import check_attention

    q, k, v = (rng.standard_normal((1, 2, 40, 64)).astype(dtypes.float16) for _ in range(3))
    a = cuflash.attention(q, k, v, dropout_p=0.5, dropout_seed=1, backend="sim")
    b = cuflash.attention(q, k, v, dropout_p=0.5, dropout_seed=2, backend="sim")
    assert not np.array_equal(a, b)
    assert np.array_equal(cuflash.attention(q, k, v, dropout_p=0.0, dropout_seed=1, backend="sim"),
                          cuflash.attention(q, k, v, backend="sim"))
    plain = check_attention(q, k, v)
    dropped = check_attention(q, k, v, dropout_p=0.5, dropout_seed=1)
    assert "dropout" not in dispatch.describe_choice(plain, 90, (q, k, v))
    tier = dispatch.forward_tier(dropped, 90, (q, k, v))
    assert tier.choose_variant(q.dtype, 64, 64, 90, dropout=True).name.endswith("_dropout")


def test_dropout_on_a_packed_batch_counts_each_sequence(rng):
    """attention_varlen with dropout: sequence b uses batch index b and its own row and key
    positions (each sequence against a fixed-shape call of its slices with batch0 = b), on the
    NumPy path and the simulator, forward and backward."""
    from support.inputs import make_batch, sequences

    q, k, v, cq, ck, mq, mk, used = make_batch(rng, [(5, 7), (0, 3), (33, 40)], 4, 2, 64, 64, dtypes.bfloat16)
    drop = dict(dropout_p=0.3, dropout_seed=99, dropout_offset=4)
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    results = {}
    for backend in ("numpy", "sim"):
        out, lse = cuflash.attention_varlen(q, k, v, cq, ck, mq, mk, causal=True, return_lse=True, backend=backend,
                                            **drop)
        g = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, mq, mk, causal=True,
                                              backend=backend, **drop)
        results[backend] = g
        for b, (rq, rk, _) in enumerate(sequences(cq, ck, used)):
            if rq.stop == rq.start:
                continue
            zb = rd.dropout_mask((1, 4, rq.stop - rq.start, rk.stop - rk.start), 0.3, 99, 4, batch0=b)
            err = np.abs(out[None, rq].astype(np.float64) - _batch0_oracle(q[None, rq], k[None, rk], v[None, rk], zb))
            assert err.max() < 2e-2, (backend, b, err.max())
    # the backward: the kernels against the NumPy path (whose per-sequence mask the forward check
    # above pins down), gradient by gradient
    for got, want in zip(results["sim"], results["numpy"]):
        want = want.astype(np.float64)
        assert np.abs(got.astype(np.float64) - want).max() <= 2e-2 * max(1.0, np.abs(want).max())
        assert np.abs(want).max() > 0


def _batch0_oracle(q, k, v, keep):
    """float64 attention of one "bshd" sequence with an explicit keep mask (B, H, Sq, Sk)."""
    q64, k64, v64 = (x.astype(np.float64).swapaxes(1, 2) for x in (q, k, v))
    g = q64.shape[1] // k64.shape[1]
    k64, v64 = np.repeat(k64, g, axis=1), np.repeat(v64, g, axis=1)
    s = q64 @ k64.swapaxes(-1, -2) / np.sqrt(q64.shape[-1])
    sq, sk = s.shape[-2:]
    s = np.where(np.tril(np.ones((sq, sk), bool), sk - sq), s, -np.inf)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(m), m, 0))
    l = e.sum(-1, keepdims=True)
    o = (e * keep / 0.7) @ v64 / np.where(l > 0, l, 1)
    return o.swapaxes(1, 2)


BAD = [
    (dict(dropout_p=1.0, dropout_seed=1), ValueError, r"dropout_p must be in \[0, 1\), got 1.0"),
    (dict(dropout_p=-0.1, dropout_seed=1), ValueError, r"dropout_p must be in \[0, 1\)"),
    (dict(dropout_p="0.1", dropout_seed=1), TypeError, "dropout_p must be a real number"),
    (dict(dropout_p=float("nan"), dropout_seed=1), ValueError, "dropout_p must be in"),
    (dict(dropout_p=0.1), ValueError, "needs dropout_seed"),
    (dict(dropout_p=0.1, dropout_seed=2**32), ValueError, r"dropout_seed must be an int in \[0, 2\*\*32\)"),
    (dict(dropout_p=0.1, dropout_seed=1.5), TypeError, "dropout_seed must be an int"),
    (dict(dropout_p=0.1, dropout_seed=1, dropout_offset=-1), ValueError, "dropout_offset must be an int"),
]


@pytest.mark.parametrize("kw,exc,match", BAD, ids=[m for _, _, m in BAD])
def test_bad_dropout_arguments(kw, exc, match):
    q = np.zeros((1, 1, 4, 8), np.float32)
    with pytest.raises(exc, match=match):
        cuflash.attention(q, q, q, **kw)
    with pytest.raises(exc, match=match if "needs dropout_seed" not in match else "dropout_seed must be an int"):
        rd.dropout_mask((1, 1, 4, 8), kw["dropout_p"], kw.get("dropout_seed"), kw.get("dropout_offset", 0))
    with pytest.raises(exc, match=match):
        cuflash.attention_backward(q, q, q, q, q, np.zeros((1, 1, 4), np.float32), **kw)


def test_torch_manual_seed_reproduces_and_gradcheck():
    torch = pytest.importorskip("torch")
    import cuflash.torch as ct

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 9, 16, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(3))

    def run(seed):
        torch.manual_seed(seed)
        return ct.attention(q, k, v, dropout_p=0.3, causal=True)

    assert torch.equal(run(5), run(5)) and not torch.equal(run(5), run(6))
    torch.manual_seed(5)
    seed, offset = (int(x) for x in torch.randint(0, 2**32, (2,), dtype=torch.int64))
    want = cuflash.reference.naive_attention(*(x.detach().numpy() for x in (q, k, v)), causal=True, dropout_p=0.3,
                                             dropout_seed=seed, dropout_offset=offset)
    np.testing.assert_allclose(run(5).detach().numpy(), want, atol=1e-12)
    assert torch.autograd.gradcheck(lambda *t: (torch.manual_seed(5), ct.attention(*t, dropout_p=0.3))[1], (q, k, v))


def test_readme_example_runs():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    head = "import numpy as np, cuflash\nq, k, v = (np.random.randn(2, 4, 100, 64)"
    scope: dict = {}
    exec(head + text.split("```python\n" + head)[1].split("```")[0], scope)   # noqa: S102 - the README's example
    keep = scope["keep"]
    assert keep.shape == (2, 4, 100, 100) and abs(keep.mean() - 0.9) < 0.01 and scope["dq"].shape == (2, 4, 100, 64)


@pytest.mark.slow
@pytest.mark.parametrize("d", [64, 128])
def test_dropout_on_the_sm75_tensor_core_form(d, rng):
    """The tensor-core tier's sm_75 (Turing) form with dropout, float16: the forward at head dims
    64 and 128, the backward at 64 (its one bucket; 128 runs the portable backward), the same
    Philox mask as the other tiers (the oracle applies it)."""
    from cuflash.kernels import attention_fwd_mma, dispatch
    from support.options import check_attention

    q = np.zeros((1, 1, 2, d), np.float16)
    problem = check_attention(q, q, q, dropout_p=0.3, dropout_seed=1)
    assert dispatch.forward_tier(problem, 75, (q, q, q)) is attention_fwd_mma
    run_dropout_case(rng, (70, 150), (4, 2), d, "causal", 0.3, "f16", "sm_75")
