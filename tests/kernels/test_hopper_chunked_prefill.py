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
256 rows, GQA up to 8, causal, windows, softcap and ALiBi; and split-KV (``num_splits``: explicit
counts and the shapes' choice, the partials merged by the combine kernel, checked that the
combine ran), including a graph-like replay of one plan with new lengths.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from support.device import on_device, sim_call
from support.grids import case_id
from support.kvcache import check_prefill, make_prefill
from support.options import check_varlen

import cuflash
from cuflash.kernels import attention_combine, attention_fwd_sm90, kvcache_run
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


def expected_splits(num_splits, variant, bt, page, max_seqlen_q, hq):
    """The split count the documentation promises (``attention_varlen``'s ``num_splits``): the
    request, at most the capacity's key tiles; 0: enough for a block per SM of the simulated H100
    (132), at least two key tiles of the capacity per split; head dim 256 unsplit."""
    if variant.head_dim == 256:
        return 1
    tiles = -(-bt.shape[1] * page // variant.block_n)
    if num_splits:
        return min(num_splits, tiles)
    blocks = -(-max_seqlen_q // 128) * hq * bt.shape[0]
    return max(1, min(-(-cuflash.sim.sm_count(90) // blocks), tiles // 2))


def run_case(rng, chunks, page, heads, mask, d, used, dtype_key, names=(), *, checked=False, num_splits=1,
             width=None, backends=("numpy", "sim")):
    """``num_splits`` is passed to attention_varlen (``width``: the block table widened to that
    many pages with entries never read, a larger capacity for the split choice)."""
    q, kc, vc, cq, ck, mq, mk, seqused, bt = make_prefill(rng, chunks, page, heads, d, DTYPES[dtype_key], used)
    if width is not None:
        bt = np.concatenate([bt, np.full((bt.shape[0], width - bt.shape[1]), 2**30, np.int32)], axis=1)
    causal, window = MASKS[mask]
    mods = make_mods(rng, names, len(chunks), heads[0])
    kw = dict(causal=causal, window_size=window, seqused_k=seqused, block_table=bt, num_splits=num_splits, **mods)
    info = cuflash.explain_varlen(q, kc, vc, cq, ck, mq, mk, backend="sim", arch=90, **kw)
    assert info["tier"] == "attention_fwd_sm90", info["choice"]
    assert "_varlen_kvcache" in info["variant"] and ("_mods" in info["variant"]) == bool(mods), info["variant"]
    variant = attention_fwd_sm90.kvcache_variant(check_varlen(q, kc, vc, cq, ck, mq, mk, **kw))
    splits = expected_splits(num_splits, variant, bt, page, mq, heads[0])
    assert "chunked prefill" in info["choice"] and info["splits"] == splits, (info["choice"], splits)
    assert ("key splits merged by the combine kernel" in info["choice"]) == (splits > 1), info["choice"]
    for backend in backends:
        with cuflash.sim.options(arch=90, checked=checked), \
                mock.patch.object(attention_combine, "plan_combine", wraps=attention_combine.plan_combine) as combine:
            out, lse = cuflash.attention_varlen(q, kc, vc, cq, ck, mq, mk, return_lse=True, backend=backend, **kw)
        assert combine.call_count == (backend == "sim" and splits > 1)   # (the split path ran)
        assert out.shape == q.shape and out.dtype == q.dtype
        check_prefill(out, lse, q, kc, vc, cq, ck, seqused, bt, page, causal, window, **mods)
    return splits


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


# --------------------------------------------------------------------------------------------
# split-KV (num_splits): each split's partial rows in the packed (head, total_q row) order, merged
# by the combine kernel

#: (chunks, page, heads, mask, D, used, dtype, modifiers), num_splits, block-table width (None: as
#: make_prefill leaves it); sequence 0's keys span several tiles, so the splits share them
SPLIT_DEFAULT = ([(70, 300), (0, 7), (1, 2)], 3, (4, 2), "causal", 64, "some", "f16", ())
SPLIT_SLOW = [
    (([(130, 300), (1, 33), (64, 64)], 1, (8, 1), "window", 128, "all", "bf16", ()), 3, None),
    (([(64, 200), (5, 5), (17, 60)], 16, (2, 2), "causal_win", 256, "some", "f16", ()), 0, 40),
    (([(70, 300), (3, 200)], 3, (4, 1), "causal", 192, "all", "bf16", ()), 4, None),
    (([(100, 400), (0, 4), (1, 1)], 256, (4, 1), "none", 64, "all", "bf16", ()), 2, None),
    (([(1, 33), (64, 64), (2, 300)], 3, (4, 2), "causal", 96, "all", "f16", ()), 0, 300),
    (([(70, 200), (0, 0), (9, 300)], 16, (2, 1), "causal", 64, "some", "f16", ("softcap", "alibi")), 3, None),
    (([(65, 400), (1, 1), (20, 17)], 3, (4, 4), "window", 128, "all", "bf16", ("alibi", "alibi_b")), 256, None),
]


def test_chunked_prefill_hopper_splits_default(rng):
    """num_splits=2, and 0 (auto: 3 here, from the shapes: 12 blocks, a capacity of 260 pages of 3
    rows = 7 key tiles); lengths 0 and 1, a sequence with no key, NaN in every row not read."""
    assert run_case(rng, *SPLIT_DEFAULT, num_splits=2, backends=("sim",)) == 2
    assert run_case(rng, *SPLIT_DEFAULT, num_splits=0, width=260) == 3


@pytest.mark.slow
@pytest.mark.parametrize("case, num_splits, width", SPLIT_SLOW, ids=[case_id(c[0]) + f"-s{c[1]}" for c in SPLIT_SLOW])
def test_chunked_prefill_hopper_splits_grid(case, num_splits, width, rng):
    splits = run_case(rng, *case, num_splits=num_splits, width=width, backends=("sim",))
    assert splits == 1 if case[4] == 256 else splits > 1   # (d256 runs unsplit)


@pytest.mark.slow
@pytest.mark.checked
@pytest.mark.parametrize("case, num_splits, width", [(SPLIT_DEFAULT, 0, 260), SPLIT_SLOW[5]], ids=["default", "mods"])
def test_chunked_prefill_hopper_splits_checked(case, num_splits, width, rng):
    assert run_case(rng, *case, checked=True, num_splits=num_splits, width=width, backends=("sim",)) > 1


def test_chunked_prefill_replay_with_new_lengths_keeps_its_plan(rng):
    """A CUDA-graph replay of chunked prefill on the Hopper form: the launches of one call
    (num_splits=0: the split count from the shapes and the capacity) are recorded, as a graph
    captures them, and run again after new query and key lengths are written into the device
    cu_seqlens_q, cu_seqlens_k and seqused_k the plans point at: longer ones (up to the capacity)
    and shorter ones (0 and 1). Every run holds to the float64 oracle over the keys its lengths
    give; cache rows past them hold NaN, which must never be read."""
    hq, hk, d, page, width, total_q, max_q = 4, 2, 64, 16, 32, 72, 72
    q = rng.standard_normal((total_q, hq, d)).astype(dtypes.float16)
    kc = rng.standard_normal((3 * width, page, hk, d)).astype(dtypes.float16)
    vc = rng.standard_normal((3 * width, page, hk, d)).astype(dtypes.float16)
    bt = rng.permutation(3 * width).astype(np.int32).reshape(3, width)
    runs = [([70, 1, 1], [300, 5, 1], [200, 5, 0]),        # (query rows, keys, seqused_k) at capture
            ([2, 70, 0], [512, 512, 3], [512, 400, 3]),    # longer keys, up to the capacity
            ([0, 1, 71], [0, 1, 130], [0, 1, 129])]        # shorter ones
    cq, ck = (np.zeros(4, np.int32) for _ in range(2))
    used = np.zeros(3, np.int32)

    def write(lq, lk, uk):   # (in place: the device views see them, as a graph's input buffers)
        cq[1:], ck[1:], used[...] = np.cumsum(lq), np.cumsum(lk), uk

    kw = dict(causal=True, block_table=bt, num_splits=0)
    plans_for = set()
    for run in runs:   # the plan never depends on the lengths
        write(*run)
        p = check_varlen(q, kc, vc, cq, ck, max_q, 512, seqused_k=used, **kw)
        plans_for.add(kvcache_run.choose(p, 90, (q, kc, vc), cuflash.sim.sm_count(90)))
    assert len(plans_for) == 1, plans_for
    variant, splits = plans_for.pop()
    assert isinstance(variant, attention_fwd_sm90.Sm90ForwardVariant) and variant.varlen and splits == 2
    write(*runs[0])
    problem = check_varlen(q, kc, vc, cq, ck, max_q, 512, seqused_k=used, **kw)
    recorded = []
    with cuflash.sim.options(arch="sm_90"), sim_call(q) as call:
        p, qd = on_device(call, problem, q)
        launch = call.launch

        def record(launch_plan):
            recorded.append(launch_plan)
            launch(launch_plan)

        for i, run in enumerate(runs):
            write(*run)
            k_run, v_run = kc.copy(), vc.copy()
            for b, n in enumerate(run[2]):   # (NaN from each sequence's seqused_k on)
                for j in range(n, width * page):
                    kc[bt[b, j // page], j % page], vc[bt[b, j // page], j % page] = np.nan, np.nan
            if i == 0:
                with mock.patch.object(call, "launch", record):
                    out, lse = kvcache_run.run_kvcache(p, qd, None, call)
                assert [r.entry for r in recorded][-2:] == [variant.entry, attention_combine.AttentionCombine("f16").entry]
            else:
                for launch_plan in recorded:
                    call.launch(launch_plan)
            got, got_lse = np.asarray(out.view(np.ndarray)), np.asarray(lse.view(np.ndarray))
            check_prefill(got, got_lse, q, k_run, v_run, cq, ck, used, bt, page, True, (-1, -1))
            kc[...], vc[...] = k_run, v_run


@pytest.mark.parametrize("value, error", [(1.5, TypeError), (True, TypeError), (np.bool_(True), TypeError),
                                          ("2", TypeError), (-1, ValueError), (257, ValueError)])
def test_num_splits_is_validated(rng, value, error):
    """num_splits is an int in [0, 256] (a NumPy integer too, a bool refused), with or without a
    block_table: checked by the NumPy backend's call and by explain_varlen planning for the
    simulator, before any work."""
    q, kc, vc, cq, ck, mq, mk, _, bt = make_prefill(rng, [(3, 5)], 3, (2, 1), 32, DTYPES["f16"], "all")
    for table, (k, v) in ((bt, (kc, vc)), (None, (q, q))):
        with pytest.raises(error, match="num_splits"):
            cuflash.attention_varlen(q, k, v, cq, cq if table is None else ck, mq, mk, block_table=table,
                                     num_splits=value, backend="numpy")
    with pytest.raises(error, match="cuflash.explain_varlen: num_splits"):
        cuflash.explain_varlen(q, kc, vc, cq, ck, mq, mk, block_table=bt, num_splits=value, backend="sim", arch=90)


def test_num_splits_is_a_hint_where_nothing_splits(rng):
    """The tensor-core kernel (max_seqlen_q under 64 here) runs chunked prefill unsplit, and a
    packed batch without a block_table has no splits; explain_varlen reports 1 / no split count."""
    q, kc, vc, cq, ck, mq, mk, _, bt = make_prefill(rng, [(5, 40), (9, 23)], 16, (4, 2), 64, DTYPES["f16"], "all")
    info = cuflash.explain_varlen(q, kc, vc, cq, ck, mq, mk, block_table=bt, num_splits=4, backend="sim", arch=90)
    assert info["tier"] == "attention_fwd_mma" and info["splits"] == 1, info["choice"]
    assert ("unsplit (num_splits=4 asked: the tensor-core tier does not split packed batches (chunked prefill))"
            in info["choice"]), info["choice"]
    # a fixed batch whose cache holds one key tile (64 rows) has no keys to split
    info = cuflash.explain_kvcache(q[:1].reshape(1, 1, 4, 64), kc[:4].reshape(1, 64, 2, 64),
                                   vc[:4].reshape(1, 64, 2, 64), np.array([30], np.int32), num_splits=4,
                                   backend="sim", arch=90)
    assert info["splits"] == 1, info["choice"]
    assert f"unsplit (num_splits=4 asked: the cache's capacity of 64 rows is one {info['block_n']}-key tile)" in (
        info["choice"]), info["choice"]
    info = cuflash.explain_varlen(q, q, q, cq, cq, mq, mq, num_splits=4, backend="sim", arch=90)
    assert "splits" not in info and info["variant"].endswith("_varlen"), info
