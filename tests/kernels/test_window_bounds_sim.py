"""Window bounds up to INT32_MAX and beyond, on every backend, against the float64 oracle.

flash-attn users pass 2**31 - 1 to mean "unbounded", and a window wider than the sequence is
valid; a kernel that adds such a bound to an index in 32 bits wraps and empties rows, and a
bound >= 2**31 does not even fit the kernels' int arguments. Two defences, each tested:

* the host normalises once (:func:`cuflash.runtime.validation.normalize_window`): a bound of
  Sq + Sk or more excludes nothing and becomes -1, so any int >= -1 works on every backend;
* the kernels' range helpers (kernels_cu/common.cuh) are overflow-free for every bound an int
  holds: the four attention kernels (SIMT and tensor-core, forward and backward) are also run
  with the raw, un-normalised bounds at and just below INT32_MAX.

The NumPy oracle computes the mask in Python integers.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from support.device import on_device, sim_call
from support.grads import check_grads_close, make_qkv
from support.options import check_attention, check_varlen
from support.options import check_kvcache as check_attention_with_kvcache
from support.tolerance import check_close

import cuflash
from cuflash import reference as ref
from cuflash.kernels import (
    attention_bwd_mma,
    attention_bwd_simt,
    attention_fwd_mma,
    attention_fwd_simt,
    backward_run,
    dispatch,
)
from cuflash.runtime import validation

BIG = 2**31 - 1
#: (Sq, Sk, causal, window): the shapes where 32-bit sums wrapped
CASES = [
    (1, 1, False, (-1, BIG)),
    (120, 120, False, (-1, BIG - 50)),
    (120, 120, False, (BIG - 3, BIG - 100)),
    (200, 50, False, (BIG, -1)),
    (200, 50, True, (BIG, -1)),
    (37, 90, False, (BIG, 3)),
    # a left bound that cuts through key tiles while the right side is open: the tensor-core
    # forward must then mask a tile by its last row's bound, not its first row's
    (130, 300, False, (40, -1)),
    (200, 200, False, (70, BIG)),
]
#: (simulated arch, dtype, head dim, forward tier, backward tier)
TIERS = [
    ("sm_75", np.float32, 32, attention_fwd_simt, attention_bwd_simt),
    ("sm_80", np.float16, 64, attention_fwd_mma, attention_bwd_mma),
]


@pytest.mark.parametrize("arch,dtype,d,fwd_tier,bwd_tier", TIERS, ids=[t[0] for t in TIERS])
@pytest.mark.parametrize("sq,sk,causal,window", CASES, ids=[f"{c[0]}x{c[1]}-{'c' if c[2] else ''}{c[3]}" for c in CASES])
def test_bounds_near_int32_max(arch, dtype, d, fwd_tier, bwd_tier, sq, sk, causal, window, rng):
    q, k, v = make_qkv(rng, 1, 2, 1, sq, sk, d, d, dtype=dtype)
    kw = dict(causal=causal, window_size=window)
    problem = check_attention(q, k, v, **kw)
    with cuflash.sim.options(arch=arch):
        a = cuflash.sim.current_options().arch
        assert dispatch.forward_tier(problem, a, (q, k, v)) is fwd_tier
        assert dispatch.backward_tier(problem, a, (q, k, v, q, q)) is bwd_tier
        out, lse = cuflash.attention(q, k, v, return_lse=True, backend="sim", **kw)
        check_close(out, q, k, v, **kw)
        _, lse64 = ref.naive_attention(q, k, v, return_lse=True, **kw)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse64))  # no row emptied by a wrap
        dout = rng.standard_normal(out.shape).astype(dtype)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, backend="sim", **kw)
    check_grads_close(grads, dout, q, k, v, out, lse, **kw)


def test_host_normalises_bounds_that_reach_past_both_sequences():
    q = np.zeros((1, 1, 7, 8), np.float32)
    k = np.zeros((1, 1, 5, 8), np.float32)
    for window, want in [((12, 11), (-1, 11)), ((11, 12), (11, -1)), ((2**31 - 1, 2**70), (-1, -1)),
                         ((0, 0), (0, 0)), ((-1, 2**31), (-1, -1))]:
        p = check_attention(q, k, k, window_size=window)
        assert (p.window_left, p.window_right) == want, window
    assert check_attention(q, k, k, causal=True, window_size=(2**40, 3)).window_right == 0


@pytest.mark.parametrize("backend", ["numpy", "sim_simt", "sim_mma"])
@pytest.mark.parametrize("window", [(-1, 2**31), (2**31, 2**31 + 1), (2**63, 3), (40, 2**64)],
                         ids=["r2^31", "both", "l2^63", "r2^64"])
def test_bounds_at_and_past_2_31_on_every_backend(backend, window, rng):
    dtype = np.float32 if backend != "sim_mma" else np.float16
    q, k, v = make_qkv(rng, 1, 2, 1, 90, 70, 64, 64, dtype=dtype)
    kw = dict(window_size=window)
    arch = {"sim_simt": "sm_75", "sim_mma": "sm_80"}.get(backend)
    with cuflash.sim.options(**({"arch": arch} if arch else {})):
        out, lse = cuflash.attention(q, k, v, return_lse=True, backend=backend.split("_")[0], **kw)
        grads = cuflash.attention_backward(np.ones_like(out), q, k, v, out, lse, backend=backend.split("_")[0], **kw)
    check_close(out, q, k, v, **kw)
    check_grads_close(grads, np.ones_like(out), q, k, v, out, lse, **kw)


@pytest.mark.parametrize("arch,dtype,d,fwd_tier,bwd_tier", TIERS, ids=[t[0] for t in TIERS])
@pytest.mark.parametrize("sq,sk,causal,window", CASES[:4], ids=[f"{c[0]}x{c[1]}-{c[3]}" for c in CASES[:4]])
def test_kernels_with_raw_bounds_near_int32_max(arch, dtype, d, fwd_tier, bwd_tier, sq, sk, causal, window, rng):
    """The kernels' own index math, bypassing the host's normalisation: the problem is handed to
    the tiers with the bounds exactly as given."""
    q, k, v = make_qkv(rng, 1, 2, 1, sq, sk, d, d, dtype=dtype)
    kw = dict(causal=causal, window_size=window)
    problem = check_attention(q, k, v, return_lse=True, **kw)
    left, right = validation.check_window_size(window, causal, "test")
    raw = dataclasses.replace(problem, window_left=left, window_right=right)
    assert (raw.window_left, raw.window_right) != (problem.window_left, problem.window_right)
    with cuflash.sim.options(arch=arch), sim_call(q) as call:
        p, qd, kd, vd = on_device(call, raw, q, k, v)
        out, lse = fwd_tier.forward(p, qd, kd, vd, None, call)
        out, lse = call.export(out), call.export(lse)
        check_close(out, q, k, v, **kw)
        _, lse64 = ref.naive_attention(q, k, v, return_lse=True, **kw)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse64))
        dout = rng.standard_normal(out.shape).astype(dtype)
        main = bwd_tier.main_variant(p, call.arch)
        grads = backward_run.backward(p, *(call.import_array(x) for x in (dout, q, k, v, out, lse)), main, call)
        grads = tuple(call.export(g) for g in grads)
    check_grads_close(grads, dout, q, k, v, out, lse, **kw)


# The Hopper forward forms a row's window edges in 32 bits (a position of the last tile, diag = Sk
# - Sq and the bounds), so the dispatcher keeps a window whose shapes could carry those sums past
# 2**31 - 1 off that tier (attention_fwd_sm90.window_reason); the tensor-core tier takes it.
WIDE_TABLE = (1, 2**23 - 2)   # block-table columns x 256-row pages: a capacity of 2**31 - 512


def _wide_cache(rng, sq, window):
    """q (1, sq, 1, 64) over a paged cache whose block table is WIDE_TABLE of page 0 (one page of
    memory), 10 keys in use."""
    q = rng.standard_normal((1, sq, 1, 64)).astype(np.float16)
    kc, vc = (rng.standard_normal((1, 256, 1, 64)).astype(np.float16) for _ in range(2))
    kw = dict(cache_seqlens=10, block_table=np.zeros(WIDE_TABLE, np.int32), window_size=window, num_splits=1)
    return q, kc, vc, kw


def test_a_kvcache_window_past_32_bits_runs_on_the_tensor_core_tier(rng):
    """Sq + window_size[0] = 272 + 2**31 - 250 > 2**31 - 1 (a bound under Sq + capacity, so kept):
    on the Hopper form rows 0..11 wrapped and saw no key; the call runs on the tensor-core form and
    matches the float64 oracle."""
    window = (2**31 - 250, -1)
    q, kc, vc, kw = _wide_cache(rng, 272, window)
    info = cuflash.explain_kvcache(q, kc, vc, arch=90, **kw)
    assert info["tier"] == "attention_fwd_mma", info
    assert ("Hopper wgmma tier not used: window_size=(2147483398, -1) over up to 272 query rows and 2147483136 keys: "
            "the Hopper kernel's window arithmetic is 32-bit and would reach 2147483670 (past 2**31 - 1)") in info["choice"]
    with cuflash.sim.options(arch="sm_90"):
        out, lse = cuflash.attention_with_kvcache(q, kc, vc, return_lse=True, backend="sim", **kw)
    k, v = kc[:, :10], vc[:, :10]
    check_close(out, q, k, v, layout="bshd", window_size=window)
    _, lse64 = ref.naive_attention(q, k, v, layout="bshd", window_size=window, return_lse=True)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse64))


def test_the_hopper_window_rule_at_its_limits():
    """Each of the rule's sums one below 2**31 stays on the Hopper tier, at 2**31 it does not: Sq +
    left (the lowest edge), keys + right + 128 (the key end), keys - left + 128 + Bc (the left
    edge rounded to tiles); causal (right = 0) with the largest capacity stays. Shapes only: the
    fixed-shape, packed and KV-cache forms read the same rule (fixed: Sq, Sk; packed: the totals;
    KV cache: Sq and the capacity)."""
    from cuflash.kernels import attention_fwd_sm90 as sm90

    bc, top = sm90.BLOCK_N_MAX, 2**31
    q, kc, vc, kw = _wide_cache(np.random.default_rng(0), 272, (2**31 - 273, -1))
    cap = 2**31 - 512
    assert cuflash.explain_kvcache(q, kc, vc, arch=90, **kw)["tier"] == "attention_fwd_sm90"   # 272 + left = 2**31 - 1
    kv = check_attention_with_kvcache(q, kc, vc, **kw)
    assert (kv.window_left, kv.kvcache.capacity) == (2**31 - 273, cap)
    for left, right, stays in [(top - 273, -1, True), (top - 272, -1, False),
                               (-1, top - 129 - cap, True), (-1, top - 128 - cap, False), (-1, 0, True)]:
        p = dataclasses.replace(kv, window_left=left, window_right=right)
        why = sm90.kvcache_reason(p, 90)
        assert (why is None) == stays, (left, right, why)
        if not stays:
            assert "the Hopper kernel's window arithmetic is 32-bit" in why
    most = 2**31 - 257   # the largest capacity (validation_kvcache.MAX_LENGTH - 1)
    big = dataclasses.replace(kv, kvcache=dataclasses.replace(kv.kvcache, capacity=most))
    for left, right, stays in [(-1, 0, True), (most + 128 + bc - top + 1, -1, True), (most + 128 + bc - top, -1, False)]:
        assert (sm90.window_reason(dataclasses.replace(big, window_left=left, window_right=right)) is None) == stays

    x = np.zeros((1, 1, 130, 64), np.float16)
    fixed = check_attention(x, x, x)
    packed = check_varlen(x[0].transpose(1, 0, 2), x[0].transpose(1, 0, 2), x[0].transpose(1, 0, 2),
                          np.array([0, 130], np.int32), np.array([0, 130], np.int32), 130, 130)
    rows, keys = 2**30, 2**30 + 5
    for p in (dataclasses.replace(fixed, seqlen_q=rows, seqlen_k=keys),
              dataclasses.replace(packed, varlen=dataclasses.replace(packed.varlen, total_q=rows, total_k=keys))):
        assert sm90.window_extents(p) == (rows, keys)
        for left, right, stays in [(top - 1 - rows, -1, True), (top - rows, -1, False),
                                   (-1, top - 1 - keys - 128, True), (-1, top - keys - 128, False)]:
            lim = dataclasses.replace(p, window_left=left, window_right=right)
            assert (sm90.unsupported_reason(lim, 90) is None) == stays, (p.varlen, left, right)
            if not stays:
                assert "Hopper wgmma tier not used: window_size=" in dispatch.describe_choice(lim, 90)


@pytest.mark.slow
@pytest.mark.parametrize("seqlen", [1, 10])
def test_the_hopper_kvcache_form_at_the_rule_limit_matches_the_oracle(seqlen, rng):
    """Sq + window_size[0] = 2**31 - 1, the largest the rule keeps on the Hopper form: its sums stay
    in 32 bits (the first block's left edge m0 + Sk - Sq - left = Sk + 1 - 2**31) and it matches
    the float64 oracle, every row seeing its keys."""
    window = (2**31 - 273, -1)
    q, kc, vc, kw = _wide_cache(rng, 272, window)
    kw["cache_seqlens"] = seqlen
    assert cuflash.explain_kvcache(q, kc, vc, arch=90, **kw)["tier"] == "attention_fwd_sm90"
    with cuflash.sim.options(arch="sm_90"):
        out, lse = cuflash.attention_with_kvcache(q, kc, vc, return_lse=True, backend="sim", **kw)
    k, v = kc[:, :seqlen], vc[:, :seqlen]
    check_close(out, q, k, v, layout="bshd", window_size=window)
    assert not np.isneginf(lse).any()


def test_explain_says_why_a_window_over_2_30_positions_leaves_the_hopper_tier():
    """explain and explain_varlen (metadata only: broadcast views of 2**30 rows) give the reason."""
    n = 2**30
    x = np.broadcast_to(np.zeros((1, 1, 1, 64), np.float16), (1, 1, n, 64))
    packed, cu = x[0].transpose(1, 0, 2), np.array([0, n], np.int32)
    for info in (cuflash.explain(x, x, x, window_size=(n + 5, -1), arch=90),
                 cuflash.explain_varlen(packed, packed, packed, cu, cu, n, n, window_size=(n + 5, -1), arch=90)):
        assert info["tier"] == "attention_fwd_mma", info
        assert (f"Hopper wgmma tier not used: window_size=({n + 5}, -1) over up to {n} query rows and {n} keys: the "
                f"Hopper kernel's window arithmetic is 32-bit and would reach {2 * n + 5}") in info["choice"], info
