"""``cuflash.explain_varlen`` and ``cuflash.explain_kvcache``: what a packed, chunked-prefill or
KV-cache call would run, without running it.

Each answer is checked against the launches the real call makes on the simulator with its
launcher replaced by a recorder (the call plans everything as it would, nothing executes, no
kernel compiles), and every refusal against the real call's own refusal. Cheap: no simulator
run, no compile.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from test_one_path import FakeCudaTensor

import cuflash
from cuflash import sim
from cuflash.runtime.dtypes import bfloat16
from cuflash.sim.device import SimDevice


@pytest.fixture
def launches(monkeypatch):
    """The launch plans the real calls in the test make on the simulator (none executed)."""
    recorded = []
    monkeypatch.setattr(SimDevice, "launch", lambda self, launch_plan: recorded.append(launch_plan))
    return recorded


def _blocks(launch_plan) -> int:
    return math.prod(launch_plan.grid)


def _packed(dtype, d=64, hq=4, hk=2):
    cu_q = np.array([0, 3, 3, 140], np.int32)         # three sequences: 3, 0 and 137 queries
    cu_k = np.array([0, 5, 9, 209], np.int32)
    q = np.zeros((140, hq, d), dtype)
    k = np.zeros((209, hk, d), dtype)
    return q, k, k.copy(), cu_q, cu_k, 137, 200


# ------------------------------------------------------------------------------- packed batches


@pytest.mark.parametrize("dtype", [np.float16, bfloat16], ids=["f16", "bf16"])
def test_the_hopper_packed_form_on_sm90(dtype, launches):
    q, k, v, cq, ck, mq, mk = _packed(dtype)
    info = cuflash.explain_varlen(q, k, v, cq, ck, mq, mk, causal=True, arch=90)
    key = "f16" if dtype == np.float16 else "bf16"
    assert info["backend"] == "sim" and info["arch"] == 90 and info["tier"] == "attention_fwd_sm90"
    assert info["variant"] == f"{key}_d64_local_varlen" and info["entry"] == f"cuflash_attn_fwd_sm90_{key}_d64_local_varlen"
    assert info["choice"].startswith(f"sm_90: Hopper wgmma tier, {info['entry']}: packed sequences"), info["choice"]
    assert "not used" not in info["choice"]
    # 128-row query tiles of the longest sequence (137 rows: 2) per query head (4) and sequence (3)
    assert (info["block_m"], info["threads"], info["blocks"]) == (128, 384, 2 * 4 * 3)
    with sim.options(arch=90):
        cuflash.attention_varlen(q, k, v, cq, ck, mq, mk, causal=True, backend="sim")
    (launch,) = launches
    assert (launch.entry, _blocks(launch), launch.shared_mem_bytes) == (info["entry"], info["blocks"], info["smem_bytes"])


@pytest.mark.parametrize("kw, why", [
    (dict(dropout_p=0.1, dropout_seed=3), "dropout is not in the Hopper kernel yet"),
], ids=["dropout"])
def test_a_packed_call_the_hopper_form_cannot_take_goes_to_the_tensor_cores(kw, why, launches):
    q, k, v, cq, ck, mq, mk = _packed(np.float16)
    info = cuflash.explain_varlen(q, k, v, cq, ck, mq, mk, arch="sm_90", **kw)
    assert info["tier"] == "attention_fwd_mma" and info["variant"].endswith("_varlen_" + ("mods" if "softcap" in kw
                                                                                          else "dropout"))
    assert info["choice"].startswith(f"sm_90: tensor-core mma.sync tier, {info['entry']}")
    assert info["choice"].endswith(f"Hopper wgmma tier not used: {why}"), info["choice"]
    assert info["blocks"] == math.ceil(137 / info["block_m"]) * 4 * 3
    with sim.options(arch=90):
        cuflash.attention_varlen(q, k, v, cq, ck, mq, mk, backend="sim", **kw)
    assert [(p.entry, _blocks(p)) for p in launches if "varlen" in p.entry] == [(info["entry"], info["blocks"])]


def test_sm80_gets_the_tensor_core_packed_form_and_says_why():
    q, k, v, cq, ck, mq, mk = _packed(bfloat16)
    info = cuflash.explain_varlen(q, k, v, cq, ck, mq, mk, arch=80)
    assert (info["arch"], info["tier"]) == (80, "attention_fwd_mma") and info["variant"].endswith("_varlen")
    assert "Hopper wgmma tier not used: sm_90a code" in info["choice"] and "not on 8.0" in info["choice"]


def test_device_resident_indices_need_no_values():
    """CUDA arrays (metadata only, no GPU here) with device cu_seqlens: planned from shapes and
    max_seqlen_q, the values never asked for."""
    q, k = FakeCudaTensor((140, 4, 64)), FakeCudaTensor((209, 2, 64))
    cu_q, cu_k = FakeCudaTensor((4,), "int32"), FakeCudaTensor((4,), "int32")
    info = cuflash.explain_varlen(q, k, k, cu_q, cu_k, 137, 200, arch=90)
    assert (info["backend"], info["variant"], info["blocks"]) == ("cuda", "f16_d64_varlen", 2 * 4 * 3)
    with pytest.raises(ValueError, match=r"cuflash.explain_varlen: cu_seqlens_k.*\(4,\)"):
        cuflash.explain_varlen(q, k, k, cu_q, FakeCudaTensor((3,), "int32"), 137, 200, arch=90)


def test_chunked_prefill_split_count_from_shapes_on_device_indices():
    """Chunked prefill with device indices (metadata only): num_splits=0 on the Hopper form takes
    the split count from max_seqlen_q, the heads, the batch and the block table's width (2 tiles
    x 4 heads x 3 sequences = 24 blocks; 64 pages of 16 rows = 8 key tiles of 128: min(132 / 24
    -> 6, 8 / 2) = 4); on sm_100 the tensor-core form runs it unsplit and needs no SM count."""
    q, cache = FakeCudaTensor((140, 4, 64)), FakeCudaTensor((200, 16, 2, 64))
    cu_q, cu_k = FakeCudaTensor((4,), "int32"), FakeCudaTensor((4,), "int32")
    table = FakeCudaTensor((3, 64), "int32")
    info = cuflash.explain_varlen(q, cache, cache, cu_q, cu_k, 137, 200, block_table=table, num_splits=0, arch=90)
    assert (info["variant"], info["splits"], info["blocks"]) == ("f16_d64_local_varlen_kvcache", 4, 2 * 4 * 4 * 3)
    assert "4 key splits merged by the combine kernel" in info["choice"]
    info = cuflash.explain_varlen(q, cache, cache, cu_q, cu_k, 137, 200, block_table=table, num_splits=5, arch=90)
    assert info["splits"] == 5
    info = cuflash.explain_varlen(q, cache, cache, cu_q, cu_k, 137, 200, block_table=table, num_splits=np.int64(3),
                                  arch=90)
    assert info["splits"] == 3   # a NumPy integer is an int
    info = cuflash.explain_varlen(q, cache, cache, cu_q, cu_k, 137, 200, block_table=table, num_splits=0, arch=100)
    assert info["tier"] == "attention_fwd_mma" and info["splits"] == 1, info["choice"]
    # head dim 256: the Hopper chunked-prefill form runs unsplit whatever num_splits asks
    q, cache = FakeCudaTensor((140, 4, 256)), FakeCudaTensor((200, 16, 2, 256))
    info = cuflash.explain_varlen(q, cache, cache, cu_q, cu_k, 137, 200, block_table=table, num_splits=4, arch=90)
    assert (info["variant"], info["splits"]) == ("f16_d256_local_varlen_kvcache", 1)
    assert "unsplit (num_splits=4 asked: the head-dim-256 chunked-prefill form runs unsplit)" in info["choice"]


def test_numpy_path_and_chunked_prefill(launches):
    q, k, v, cq, ck, mq, mk = _packed(np.float16)
    info = cuflash.explain_varlen(q, k, v, cq, ck, mq, mk)
    assert info["backend"] == "numpy" and "each sequence" in info["choice"] and set(info) == {
        "backend", "block_m", "block_n", "threads", "choice"}
    # chunked prefill: the packed queries over a paged cache of 16-row pages
    cache = np.zeros((40, 16, 2, 64), np.float16)
    table = np.arange(38, -1, -1, dtype=np.int32).reshape(3, 13)
    cu_k = np.array([0, 40, 50, 250], np.int32)
    # on 8.0 the tensor-core KV-cache form, with pack-GQA: the group's 2 query heads in one tile of
    # block_m rows; 3 sequences, 2 kv heads
    info = cuflash.explain_varlen(q, cache, cache, cq, cu_k, mq, 200, block_table=table, causal=True, arch=80)
    assert info["tier"] == "attention_fwd_mma" and info["variant"].endswith("_varlen_kvcache") and info["splits"] == 1
    assert "chunked prefill: packed queries over a paged cache (40 pages of 16 rows)" in info["choice"]
    assert "Hopper wgmma tier not used: sm_80 is not compute capability 9.0" in info["choice"]
    assert info["blocks"] == math.ceil(137 * 2 / info["block_m"]) * 2 * 3
    # on 9.0 the Hopper chunked-prefill form: 2 query tiles of the longest sequence, 4 heads, 3 sequences
    info = cuflash.explain_varlen(q, cache, cache, cq, cu_k, mq, 200, block_table=table, causal=True, arch=90)
    assert info["tier"] == "attention_fwd_sm90" and info["variant"] == "f16_d64_local_varlen_kvcache"
    assert info["splits"] == 1 and info["blocks"] == 2 * 4 * 3 and (info["block_m"], info["block_n"]) == (128, 128)
    assert ("Hopper wgmma tier, chunked prefill: packed queries over a paged cache (40 pages of 16 rows), up to 137 "
            "query rows a sequence per 128-row tile, unsplit") in info["choice"]
    with sim.options(arch=90):
        cuflash.attention_varlen(q, cache, cache, cq, cu_k, mq, 200, block_table=table, causal=True, backend="sim")
    assert [(p.entry, _blocks(p)) for p in launches if "kvcache" in p.entry] == [(info["entry"], info["blocks"])]


# ------------------------------------------------------------------------------------ KV cache


def _decode(dtype=np.float16, paged=True, lengths=(500, 300)):
    q = np.zeros((2, 1, 16, 128), dtype)                      # decode: one token, 16 query heads, 2 kv heads
    if paged:
        cache = np.zeros((64, 16, 2, 128), dtype)             # 64 pages of 16 rows, 32 pages per sequence
        return q, cache, cache.copy(), dict(block_table=np.arange(64, dtype=np.int32).reshape(2, 32))
    cache = np.zeros((2, 512, 2, 128), dtype)
    return q, cache, cache.copy(), {}


def test_kvcache_gqa_packing_names_the_group_and_the_tiles(launches):
    """8 positions x 8 query heads of a kv head fill half a tile: the Hopper form's GQA packing,
    one block per (kv head, sequence, split), as launched."""
    q = np.zeros((2, 8, 16, 64), np.float16)
    kc = np.zeros((2, 512, 2, 64), np.float16)
    lengths = np.array([500, 300], np.int32)
    info = cuflash.explain_kvcache(q, kc, kc.copy(), lengths, num_splits=3, arch=90)
    assert info["tier"] == "attention_fwd_sm90" and info["variant"].endswith("_kvcache_gqa_tma"), info["choice"]
    assert ("keys and values: 128-key tiles of the contiguous cache load by TMA, the one across a sequence's end by "
            "cp.async gather" in info["choice"]), info["choice"]
    assert ("KV-cache form over a contiguous cache (2 x 512 rows), GQA packing: the 8 query heads of each kv head x 8 "
            "positions = 64 rows in 1 128-row tile (a consumer's row r: position r // 8 of its 8 positions, "
            "head r % 8), 3 key splits" in info["choice"]), info["choice"]
    assert info["blocks"] == 1 * 3 * 2 * 2
    with sim.options(arch=90):
        cuflash.attention_with_kvcache(q, kc, kc.copy(), lengths, num_splits=3, backend="sim")
    assert [_blocks(p) for p in launches if p.entry == info["entry"]] == [info["blocks"]]


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_kvcache_names_the_form_the_tiles_and_the_splits(paged, launches):
    q, kc, vc, kw = _decode(paged=paged)
    lengths = np.array([500, 300], np.int32)
    new = np.ones((2, 1, 2, 128), np.float16)
    info = cuflash.explain_kvcache(q, kc, vc, lengths, k=new, v=new, arch=90, **kw)
    assert info["tier"] == "attention_fwd_mma" and info["variant"].endswith("_kvcache")
    form = "a paged cache (64 pages of 16 rows)" if paged else "a contiguous cache (2 x 512 rows)"
    assert f"KV-cache form over {form}, 8 query heads per block (pack-GQA)" in info["choice"], info["choice"]
    assert info["choice"].endswith("Hopper wgmma tier not used: Sq*G=1*8=8 packed query rows would fill under half of "
                                   "the 128-row Hopper tile (from 64 on it runs here); the tensor-core decode kernel "
                                   "packs the 8 query heads of a GQA group into its tiles"), info["choice"]
    # 4 blocks unsplit (one tile of 8 packed rows per kv head and sequence) cannot fill 132 SMs:
    # split up to half the capacity's key tiles (512 rows: 8 tiles of 64 -> 4)
    assert (info["block_n"], info["splits"]) == (64, 4) and f"{info['splits']} key splits" in info["choice"]
    assert info["blocks"] == 1 * 2 * 2 * info["splits"]
    assert not kc.any() and not vc.any()      # nothing appended
    with sim.options(arch=90):
        cuflash.attention_with_kvcache(q, kc, vc, lengths, k=new, v=new, backend="sim", **kw)
    forward = [p for p in launches if p.entry == info["entry"]]
    assert [_blocks(p) for p in forward] == [info["blocks"]]
    assert sum("combine" in p.entry for p in launches) == 1


def test_kvcache_split_count_follows_the_capacity_and_num_splits_never_the_lengths():
    """A CUDA-graph replay keeps the captured plan while cache_seqlens change: the split count
    comes from the capacity (512 rows: 8 tiles of 64) and the shapes, whatever the host lengths."""
    q, kc, vc, kw = _decode()
    for lengths in (np.array([100, 30], np.int32), np.array([500, 300], np.int32), 0):
        info = cuflash.explain_kvcache(q, kc, vc, lengths, arch=90, **kw)
        assert info["splits"] == 4 and "4 key splits" in info["choice"]
        assert cuflash.explain_kvcache(q, kc, vc, lengths, num_splits=3, arch=90, **kw)["splits"] == 3
    assert cuflash.explain_kvcache(q, kc, vc, 5, num_splits=100, arch=90, **kw)["splits"] == 8
    # device lengths: the capacity's 8 tiles decide, as in the real call
    fq, fc = FakeCudaTensor((2, 1, 16, 128)), FakeCudaTensor((64, 16, 2, 128))
    table, lengths = FakeCudaTensor((2, 32), "int32"), FakeCudaTensor((2,), "int32")
    info = cuflash.explain_kvcache(fq, fc, fc, lengths, block_table=table, arch=90)
    assert (info["backend"], info["splits"], info["blocks"]) == ("cuda", 4, 16)
    with pytest.raises(ValueError, match="num_splits=0 chooses the split count from the device's SM count"):
        cuflash.explain_kvcache(fq, fc, fc, lengths, block_table=table, arch=100)
    # an arch the simulator does not emulate plans with its default 48 KB of shared memory: head dim 64 fits
    fq, fc = FakeCudaTensor((2, 1, 16, 64)), FakeCudaTensor((64, 16, 2, 64))
    assert cuflash.explain_kvcache(fq, fc, fc, lengths, block_table=table, arch=100, num_splits=2)["splits"] == 2


# ------------------------------------------------------------------------------------ refusals


def _refusal(fn, *args, **kwargs):
    with pytest.raises((TypeError, ValueError, NotImplementedError)) as e:
        fn(*args, **kwargs)
    return e.type, str(e.value).split(": ", 1)[1]


def _same_refusal(real, explain, args, kwargs, launches):
    """The real call and its explain refuse alike (type and message, the function's name aside),
    and the real call launched nothing."""
    kwargs = {"backend": "sim", **kwargs}
    with sim.options(arch=90):
        want = _refusal(real, *args, **kwargs)
    assert not launches
    assert _refusal(explain, *args, arch=90, **kwargs) == want


VARLEN_REFUSALS = {
    "q not 3-d": lambda q, k, v, cq, ck: ((q[None], k, v, cq, ck, 137, 200), {}),
    "cu_seqlens not int32": lambda q, k, v, cq, ck: ((q, k, v, cq.astype(np.int64), ck, 137, 200), {}),
    "cu_seqlens_q not starting at 0": lambda q, k, v, cq, ck: ((q, k, v, cq - 1, ck, 137, 200), {}),
    "max_seqlen_q too short": lambda q, k, v, cq, ck: ((q, k, v, cq, ck, 100, 200), {}),
    "seqused_k past the keys": lambda q, k, v, cq, ck: ((q, k, v, cq, ck, 137, 200),
                                                         {"seqused_k": np.array([6, 0, 0], np.int32)}),
    "window": lambda q, k, v, cq, ck: ((q, k, v, cq, ck, 137, 200), {"window_size": (-2, 0)}),
    "dropout without seed": lambda q, k, v, cq, ck: ((q, k, v, cq, ck, 137, 200), {"dropout_p": 0.1}),
    "softcap": lambda q, k, v, cq, ck: ((q, k, v, cq, ck, 137, 200), {"softcap": -1.0}),
    "float64 on a kernel backend": lambda q, k, v, cq, ck: ((q.astype(np.float64), k.astype(np.float64),
                                                            v.astype(np.float64), cq, ck, 137, 200), {}),
    "float32 NumPy with backend='cuda'": lambda q, k, v, cq, ck: ((q.astype(np.float32), k.astype(np.float32),
                                                                  v.astype(np.float32), cq, ck, 137, 200),
                                                                 {"backend": "cuda"}),
    "head dim above 256": lambda q, k, v, cq, ck: ((np.zeros((140, 4, 264), np.float16),
                                                   np.zeros((209, 2, 264), np.float16),
                                                   np.zeros((209, 2, 264), np.float16), cq, ck, 137, 200), {}),
    "chunked prefill, paged k not 4-d": lambda q, k, v, cq, ck: ((q, k, v, cq, ck, 137, 200),
                                                                 {"block_table": np.zeros((3, 4), np.int32)}),
    "chunked prefill, a page outside the cache": lambda q, k, v, cq, ck: (
        (q, np.zeros((20, 16, 2, 64), np.float16), np.zeros((20, 16, 2, 64), np.float16), cq, ck, 137, 200),
        {"block_table": np.full((3, 13), 20, np.int32)}),
    "chunked prefill, float32 has no KV-cache kernel": lambda q, k, v, cq, ck: (
        (q.astype(np.float32), np.zeros((20, 16, 2, 64), np.float32), np.zeros((20, 16, 2, 64), np.float32), cq, ck,
         137, 200), {"block_table": np.arange(39, dtype=np.int32).reshape(3, 13) % 20}),
    "a grid past the 1-d limit (tensor-core packed form)": lambda q, k, v, cq, ck: (
        (np.zeros((140, 64, 64), np.float16), np.zeros((209, 64, 64), np.float16), np.zeros((209, 64, 64), np.float16),
         cq, ck, 2**31 - 300, 200), {"dropout_p": 0.1, "dropout_seed": 1}),
    # (a negative scale: the tensor-core chunked-prefill form, whose grid is 1-d; the plain Hopper
    # forms take the row maximum on unscaled scores, so they pass it over)
    "a grid past the 1-d limit (chunked prefill)": lambda q, k, v, cq, ck: (
        (np.zeros((140, 64, 64), np.float16), np.zeros((20, 16, 64, 64), np.float16),
         np.zeros((20, 16, 64, 64), np.float16), cq, ck, 2**31 - 300, 200),
        {"block_table": np.arange(39, dtype=np.int32).reshape(3, 13) % 20, "softmax_scale": -1.0}),
}


@pytest.mark.parametrize("case", list(VARLEN_REFUSALS))
def test_explain_varlen_refuses_what_attention_varlen_refuses(case, launches):
    args, kwargs = VARLEN_REFUSALS[case](*_packed(np.float16)[:5])
    _same_refusal(cuflash.attention_varlen, cuflash.explain_varlen, args, kwargs, launches)


KVCACHE_REFUSALS = {
    "lengths past the cache": ({"cache_seqlens": np.array([600, 3], np.int32)}, {}),
    "lengths not int32": ({"cache_seqlens": np.array([5, 3], np.int64)}, {}),
    "k without v": ({}, {"k": np.ones((2, 1, 2, 128), np.float16)}),
    "rotary without k/v": ({}, {"rotary_cos": np.ones((600, 32), np.float16),
                                "rotary_sin": np.ones((600, 32), np.float16)}),
    "cache_batch_idx with a paged cache": ({}, {"cache_batch_idx": np.array([0, 1], np.int32)}),
    "leftpad past the lengths": ({}, {"cache_leftpad": np.array([9, 0], np.int32)}),
    "a page outside the cache": ({}, {"block_table": np.full((2, 32), 64, np.int32)}),
    "sinks of the wrong shape": ({}, {"sinks": np.zeros(3, np.float32)}),
    "float32 has no KV-cache kernel": ({"dtype": np.float32}, {}),
    "an fp8 cache with a score modifier has no kernel": ({"fp8": True}, {"softcap": 3.0}),
    "the new rows overlap the cache": ({"overlap": True}, {}),
}


@pytest.mark.parametrize("case", list(KVCACHE_REFUSALS))
def test_explain_kvcache_refuses_what_attention_with_kvcache_refuses(case, launches):
    how, extra = KVCACHE_REFUSALS[case]
    q, kc, vc, kw = _decode(how.get("dtype", np.float16))
    if how.get("fp8"):
        import ml_dtypes

        kc, vc = (np.zeros(c.shape, ml_dtypes.float8_e4m3fn) for c in (kc, vc))
    if how.get("overlap"):
        kw.update(k=kc[:2, :1], v=vc[:2, :1])
    kw.update(extra)
    lengths = how.get("cache_seqlens", np.array([5, 3], np.int32))
    before = kc.copy()
    _same_refusal(cuflash.attention_with_kvcache, cuflash.explain_kvcache, (q, kc, vc, lengths), kw, launches)
    assert np.array_equal(kc.view(np.uint8), before.view(np.uint8))


@pytest.mark.parametrize("real, explain", [("attention_varlen", "explain_varlen"),
                                           ("attention_with_kvcache", "explain_kvcache")])
def test_the_signature_is_the_calls_without_out_and_return_lse(real, explain):
    """Every argument of the call, same name, kind and default, but out and return_lse; then arch."""
    import inspect

    real, explain = getattr(cuflash, real), getattr(cuflash, explain)

    theirs = [p for n, p in inspect.signature(real).parameters.items() if n not in ("out", "return_lse")]
    mine = list(inspect.signature(explain).parameters.values())
    assert [p.name for p in mine if p.name != "arch"] == [p.name for p in theirs]
    for p in theirs:
        q = inspect.signature(explain).parameters[p.name]
        assert (q.kind, q.default) == (p.kind, p.default), p.name
    assert inspect.signature(explain).parameters["arch"].default is None


# ------------------------------------------------------------------ drawn input (support.bad_input)

#: the name each explain function's messages carry instead of the call's
EXPLAINS = {"attention_varlen": "explain_varlen", "attention_with_kvcache": "explain_kvcache"}


def _outcome(fn, args, kwargs):
    try:
        fn(*args, **kwargs)
    except Exception as e:   # noqa: BLE001 - compared below
        return type(e), str(e)
    return None


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["numpy", "sim"])
@pytest.mark.parametrize("entry", list(EXPLAINS))
def test_drawn_calls_are_refused_by_explain_exactly_when_the_call_refuses_them(entry, backend):
    """Valid and broken calls drawn by the bad-input strategy (NumPy, torch and JAX CPU arrays
    among them): explain refuses a call iff the call refuses it, with the same type and message.
    On the simulator a call explain accepts is not run (it would compile its kernel), so there the
    check is one way: what explain refuses, the call refuses alike, before any launch. Slow only:
    the first drawn call imports torch and starts JAX (seconds), past this file's default budget."""
    from hypothesis import HealthCheck, given, settings
    from support import bad_input as bi

    profile = bi.Profile() if backend == "numpy" else bi.Profile(dtypes=(bi.F16, bi.BF16, bi.F32), backend="sim",
                                                                   head_dims=(8, 16), max_len=4, mutations=(0, 1, 2))
    explain = getattr(cuflash, EXPLAINS[entry])

    @settings(max_examples=int(os.environ.get("CUFLASH_HYPOTHESIS_EXAMPLES", "300")), deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(bi.calls(entry, profile))
    def run(call):
        args, kwargs = bi.materialize(call)
        for name in ("out", "return_lse"):   # not explain's arguments: left out of both
            kwargs.pop(name, None)
        told = _outcome(explain, args, kwargs)
        if told is not None:
            told = (told[0], told[1].replace(f"cuflash.{EXPLAINS[entry]}", f"cuflash.{entry}"))
        elif backend == "sim":
            return
        with _no_launch():
            did = _outcome(getattr(cuflash, entry), args, kwargs)
        if told is None:   # the NumPy path may still refuse for its working memory, after validation
            assert did is None or did[0] is MemoryError, f"explain accepted what the call refused: {did}"
        else:
            assert did == told, f"{call.describe()}"

    run()


def test_an_int32_cache_beside_an_empty_float64_query_is_refused_by_explain_as_by_the_call():
    """A draw of the test above: float64 q with no query row, int32 caches (NumPy path). Both
    refuse it in the shared validation, naming k_cache, before anything is read or run."""
    q = np.zeros((1, 0, 1, 8))
    kc = np.zeros((1, 4, 1, 8), np.int32)
    for args, kw in (((q, kc, kc.copy(), np.array([2], np.int32)), {}),
                     ((q, kc[None, 0, :2].repeat(2, 0), kc[None, 0, :2].repeat(2, 0), 2),
                      {"block_table": np.array([[1, 0]], np.int32)})):
        told = _outcome(cuflash.explain_kvcache, args, kw)
        did = _outcome(cuflash.attention_with_kvcache, args, kw)
        assert did == (TypeError, "cuflash.attention_with_kvcache: k_cache.dtype=int32 must equal q.dtype=float64 or, "
                                  "for an fp8 cache, float8_e4m3fn (both caches)")
        assert told == (did[0], did[1].replace("attention_with_kvcache", "explain_kvcache"))


class _no_launch:
    """Any simulator launch inside fails the test (a refusal must come before device work)."""

    def __enter__(self):
        self.saved = SimDevice.launch

        def launch(device, launch_plan):
            raise AssertionError(f"launched {launch_plan.entry}")

        SimDevice.launch = launch

    def __exit__(self, *exc):
        SimDevice.launch = self.saved


def test_a_score_mod_on_a_packed_batch_is_explained_as_the_call_refuses_it():
    """explain_varlen takes score_mod as attention_varlen does, and says what that call says."""
    cu = np.array([0, 3, 10], np.int32)
    q = np.zeros((10, 2, 64), np.float16)
    mod = lambda s, b, h, i, j: s * 0.5   # noqa: E731
    with pytest.raises(NotImplementedError) as explained:
        cuflash.explain_varlen(q, q, q, cu, cu, 7, 7, score_mod=mod, backend="sim", arch=90)
    with pytest.raises(NotImplementedError) as real:
        cuflash.attention_varlen(q, q, q, cu, cu, 7, 7, score_mod=mod, backend="sim")
    assert "score_mod/mask_mod on a packed batch" in str(explained.value)
    assert str(explained.value).split(": ", 1)[1] == str(real.value).split(": ", 1)[1]
