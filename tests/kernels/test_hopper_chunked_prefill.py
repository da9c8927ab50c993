"""Chunked prefill on the Hopper forward (``attention_fwd_sm90``'s ``varlen`` + ``kvcache`` forms)
on the simulator: ``cuflash.attention_varlen`` with a ``block_table``, packed queries over a paged
KV cache.

Each case asserts that the dispatcher chose the Hopper chunked-prefill form (compute capability
9.0, ``max_seqlen_q`` from 64 on) and that ``explain_varlen`` names it, then holds each sequence's
output and LSE to the float64 oracle over its cache keys (support/kvcache.py's ``check_prefill``,
the checks of the tensor-core chunked-prefill tests), with the NumPy path run on the same inputs
and held to the same oracle. Every cache row no sequence may read holds NaN (unused pages, rows
past ``seqused_k``), so a read of any of them shows in the output. The grid covers query lengths
0, 1, under a tile and several tiles, key counts 0, 1 and several tiles, pages of 1, 3, 16 and
256 rows, GQA up to 8, causal, windows, softcap and ALiBi.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.grids import case_id
from support.kvcache import check_prefill, make_prefill

import cuflash
from cuflash.kernels import attention_fwd_sm90
from cuflash.runtime import dtypes

DTYPES = {"f16": dtypes.float16, "bf16": dtypes.bfloat16}
MASKS = {"none": (False, (-1, -1)), "causal": (True, (-1, -1)), "window": (False, (9, 4)),
         "causal_win": (True, (20, -1))}


def make_mods(rng, names, b, hq):
    mods = {}
    if "softcap" in names:
        mods["softcap"] = 4.0
    if "alibi" in names:   # (Hq,) or per sequence (B, Hq)
        mods["alibi_slopes"] = rng.uniform(0.02, 0.4, (b, hq) if "alibi_b" in names else (hq,)).astype(np.float32)
    return mods


def run_case(rng, chunks, page, heads, mask, d, used, dtype_key, names=(), *, checked=False):
    q, kc, vc, cq, ck, mq, mk, seqused, bt = make_prefill(rng, chunks, page, heads, d, DTYPES[dtype_key], used)
    causal, window = MASKS[mask]
    mods = make_mods(rng, names, len(chunks), heads[0])
    kw = dict(causal=causal, window_size=window, seqused_k=seqused, block_table=bt, **mods)
    info = cuflash.explain_varlen(q, kc, vc, cq, ck, mq, mk, backend="sim", arch=90, **kw)
    assert info["tier"] == "attention_fwd_sm90", info["choice"]
    assert info["variant"].endswith("_varlen_kvcache") and ("_mods" in info["variant"]) == bool(mods), info["variant"]
    assert "chunked prefill" in info["choice"] and info["splits"] == 1, info["choice"]
    for backend in ("numpy", "sim"):
        with cuflash.sim.options(arch=90, checked=checked):
            out, lse = cuflash.attention_varlen(q, kc, vc, cq, ck, mq, mk, return_lse=True, backend=backend, **kw)
        assert out.shape == q.shape and out.dtype == q.dtype
        check_prefill(out, lse, q, kc, vc, cq, ck, seqused, bt, page, causal, window, **mods)


#: (query rows, keys) per sequence, page size, (Hq, Hk), mask, D, keys used ("some": seqused_k), dtype, modifiers
DEFAULT = ([(70, 200), (0, 5), (1, 1), (3, 0)], 3, (4, 2), "causal", 64, "some", "f16")
SLOW = [
    ([(130, 300), (1, 33), (64, 64)], 1, (8, 1), "window", 128, "all", "bf16"),
    ([(64, 64), (5, 5), (17, 60)], 16, (2, 2), "causal_win", 256, "some", "f16"),
    ([(70, 100), (3, 200)], 3, (4, 1), "causal", 192, "all", "bf16"),
    ([(100, 400), (0, 4), (1, 1)], 256, (4, 1), "none", 64, "all", "bf16"),
    ([(1, 33), (64, 64), (2, 130)], 3, (4, 2), "causal", 96, "all", "f16"),
    ([(70, 200), (0, 0), (9, 300)], 16, (2, 1), "causal", 64, "some", "f16", ("softcap", "alibi")),
    ([(65, 130), (1, 1), (20, 17)], 3, (4, 4), "window", 128, "all", "bf16", ("alibi", "alibi_b")),
]


def test_chunked_prefill_hopper_default(rng):
    run_case(rng, *DEFAULT)


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW, ids=[case_id(c) for c in SLOW])
def test_chunked_prefill_hopper_grid(case, rng):
    run_case(rng, *case)


@pytest.mark.slow
@pytest.mark.checked
@pytest.mark.parametrize("case", [DEFAULT, SLOW[4]], ids=["default", "mods"])
def test_chunked_prefill_hopper_checked(case, rng):
    run_case(rng, *case, checked=True)


def test_chunked_prefill_below_half_a_tile_stays_on_the_tensor_core_tier(rng):
    """max_seqlen_q under 64: the tensor-core kernel packs the GQA group, and explain says why."""
    q, kc, vc, cq, ck, mq, mk, _, bt = make_prefill(rng, [(5, 40), (9, 23)], 16, (4, 2), 64, DTYPES["f16"], "all")
    info = cuflash.explain_varlen(q, kc, vc, cq, ck, mq, mk, block_table=bt, backend="sim", arch=90)
    assert info["tier"] == "attention_fwd_mma", info["choice"]
    assert "max_seqlen_q=9 query rows would fill under half of the 128-row Hopper tile" in info["choice"]


def test_chunked_prefill_forms_are_listed():
    forms = attention_fwd_sm90.all_variants(90, varlen=True, kvcache=True)
    mods = attention_fwd_sm90.all_variants(90, varlen=True, kvcache=True, mods=True)
    assert len(forms) == len(mods) == 12
    assert all(v.local and v.varlen and v.kvcache and v.entry.endswith("_varlen_kvcache") for v in forms)
    assert all(v.entry.endswith("_mods_varlen_kvcache") for v in mods)
    assert "chunked prefill" in forms[0].describe()


def test_chunked_prefill_past_the_grid_stays_on_the_tensor_core_tier(rng):
    """More sequences than gridDim.z holds: the Hopper form (a block per query tile, head and
    sequence) passes, and explain says why."""
    n = 65536
    lq = np.zeros(n, np.int64)
    lq[0] = 64
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(np.ones(n, np.int64))]).astype(np.int32)
    q = np.zeros((64, 2, 64), np.float16)
    cache = np.zeros((1, 16, 2, 64), np.float16)
    bt = np.zeros((n, 1), np.int32)
    info = cuflash.explain_varlen(q, cache, cache, cq, ck, 64, 1, block_table=bt, backend="sim", arch=90)
    assert info["tier"] == "attention_fwd_mma", info["choice"]
    assert "65536 packed sequences exceed the grid's 65535 (gridDim.z)" in info["choice"]
