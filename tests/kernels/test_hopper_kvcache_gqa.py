"""GQA packing on the Hopper forward (``attention_fwd_sm90``'s ``gqa`` forms: the KV-cache ones and
the plain fixed-shape ones) on the simulator.

Decode-like calls (``Sq`` under a tile) whose ``Sq * G`` rows (G = Hq / Hk query heads per kv head)
fill half a 128-row tile or more run one block per kv head, the group's heads at consecutive
positions in its rows. Each case asserts the dispatcher's choice and ``explain``'s line, runs
``cuflash.attention_with_kvcache`` on the simulator (its append, the packed form, the combine with
several splits), holds each sequence's output and LSE to the float64 oracle over the keys the cache
holds after the append, and the caches to what the append must leave, byte for byte. Unused cache
rows, rows before the left padding and unused pages hold NaN, so a read of any of them shows.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from support.grids import case_id
from support.kvcache import check_result, expected_cache, make_case
from support.options import check_kvcache

import cuflash
from cuflash.kernels import attention_fwd_sm90, dispatch, kvcache_run
from cuflash.sim.device import SimDevice
from cuflash.runtime import dtypes
from support.tolerance import check_close

DTYPES = {"f16": dtypes.float16, "bf16": dtypes.bfloat16}
MASKS = {"none": (False, (-1, -1)), "causal": (True, (-1, -1)), "window": (False, (9, 4)),
         "causal_win": (True, (20, -1)), "right": (False, (-1, 2))}


def make_mods(rng, names, b, hq):
    """softcap 4; ALiBi slopes (Hq,) or per sequence (B, Hq); sinks with one head's far above its
    scores and one -inf (adds nothing). Each row of a packed tile takes its own head's."""
    mods = {}
    if "softcap" in names:
        mods["softcap"] = 4.0
    if "alibi" in names:
        mods["alibi_slopes"] = rng.uniform(0.02, 0.4, (b, hq) if "alibi_b" in names else (hq,)).astype(np.float32)
    if "sinks" in names:
        s = rng.standard_normal(hq).astype(np.float32)
        s[1], s[-1] = 6.0, -np.inf
        mods["sinks"] = s
    return mods


def run_case(rng, lengths, sq, snew, page, heads, mask, d, splits, names, extra, dtype_key, *, checked=False,
             force=False):
    """One call on the packed form; ``force``: below the dispatcher's threshold (``Sq * G`` under 64
    rows), the threshold lowered so that the packed form runs a mostly empty tile."""
    if extra == "batch_idx" and page is not None:
        extra = "plain"
    dt = DTYPES[dtype_key]
    q, kc, vc, lengths, kw = make_case(rng, lengths, sq, snew, page, heads, d, dt, "none", extra)
    causal, window = MASKS[mask]
    mods = make_mods(rng, names, len(lengths), heads[0])
    with mock.patch.object(attention_fwd_sm90, "KVCACHE_MIN_ROWS", 1 if force else attention_fwd_sm90.KVCACHE_MIN_ROWS):
        problem = check_kvcache(q, kc, vc, lengths, causal=causal, window_size=window, num_splits=splits, **kw, **mods)
        info = dispatch.explain_forward(problem, 90, (q, kc, vc), sm_count=cuflash.sim.sm_count(90))
        assert info["tier"] == "attention_fwd_sm90" and "_kvcache_gqa" in info["variant"], info["choice"]
        g = heads[0] // heads[1]
        assert f"GQA packing: the {g} query heads" in info["choice"], info["choice"]
        assert info["blocks"] == -(-sq // (2 * (64 // g))) * info["splits"] * heads[1] * len(lengths)
        assert f"(a consumer's row r: position r // {g} of its {64 // g} position" in info["choice"], info["choice"]
        want_k, want_v = expected_cache(kc, vc, lengths, kw, page)
        k1, v1 = kc.copy(), vc.copy()
        grids = []
        real = SimDevice.launch
        with mock.patch.object(SimDevice, "launch", lambda self, plan: (grids.append((plan.entry, plan.grid)),
                                                                        real(self, plan))[1]):
            with cuflash.sim.options(arch=90, checked=checked, seed=11):
                out, lse = cuflash.attention_with_kvcache(q, k1, v1, lengths, causal=causal, window_size=window,
                                                          num_splits=splits, return_lse=True, backend="sim", **kw,
                                                          **mods)
    assert [g[0] * g[1] * g[2] for e, g in grids if e == info["entry"]] == [info["blocks"]], grids
    assert k1.tobytes() == want_k.tobytes() and v1.tobytes() == want_v.tobytes()
    assert out.shape == q.shape and out.dtype == dt and lse.shape == (len(lengths), heads[0], sq)
    check_result(out, lse, q, want_k, want_v, lengths, kw, page, causal, window, **mods)


#: (cache lengths, Sq, new rows, page size (None: contiguous), (Hq, Hk), mask, D, splits, modifiers, extra, dtype)
DEFAULT = [([0, 1, 37], 4, 1, 3, (32, 2), "causal", 64, 3, (), "leftpad", "f16"),   # G 16: 64 rows, split 3
           # G 4, forced (8 rows), per-row ALiBi (B, Hq) and sinks over 2 splits
           ([1, 0, 20], 2, 1, None, (8, 2), "window", 64, 2, ("alibi", "alibi_b", "sinks"), "batch_idx", "f16"),
           # groups that are not powers of two: G 7 (9 positions a consumer, 1 dead row of 64) over 2 tiles,
           # paged, split 2; G 3 (21 positions, 1 dead row) contiguous, window
           ([3, 40], 19, 1, 16, (14, 2), "causal", 64, 2, (), "leftpad", "f16"),
           ([0, 30], 22, 0, None, (6, 2), "window", 64, 1, (), "plain", "f16")]
SLOW = [
    ([5, 300], 8, 1, 1, (8, 1), "causal", 64, 3, (), "plain", "f16"),
    ([0, 1, 130], 32, 0, 16, (4, 2), "window", 128, 1, (), "leftpad", "bf16"),
    ([200, 77], 64, 3, 256, (4, 2), "none", 64, 3, (), "plain", "bf16"),
    ([150, 9], 16, 1, None, (16, 4), "causal_win", 192, 3, (), "batch_idx", "bf16"),
    ([40, 1, 260], 33, 0, 3, (8, 4), "right", 128, 1, (), "leftpad", "f16"),
    ([90, 0], 9, 2, None, (64, 8), "causal", 64, 3, (), "leftpad", "f16"),
    ([300, 21], 100, 1, 16, (4, 2), "causal", 192, 3, ("softcap",), "plain", "bf16"),
    ([64, 129], 8, 0, None, (8, 1), "window", 128, 3, ("softcap", "alibi", "sinks"), "batch_idx", "f16"),
    ([17, 0, 3], 1, 1, 1, (64, 1), "none", 64, 1, ("softcap",), "plain", "bf16"),
    ([250, 17], 16, 0, 16, (8, 2), "causal", 128, 3, ("alibi", "sinks"), "leftpad", "bf16"),
    ([0, 1, 37], 20, 1, 3, (16, 2), "causal_win", 96, 1, ("softcap", "alibi", "alibi_b"), "plain", "f16"),
    # groups that are not powers of two (P = 64 // G positions a consumer, 64 - P * G dead rows)
    ([5, 300], 30, 1, 1, (6, 2), "causal", 128, 3, (), "plain", "bf16"),                       # G 3: P 21
    ([0, 1, 130], 40, 0, 16, (10, 2), "window", 96, 1, (), "leftpad", "f16"),                  # G 5: 2 tiles
    ([64, 129], 13, 1, 16, (40, 8), "causal", 128, 2, (), "plain", "bf16"),                    # G 5 (40 / 8)
    ([200, 77], 64, 3, 256, (12, 2), "none", 192, 3, (), "plain", "bf16"),                     # G 6: 4 tiles
    ([150, 9], 20, 1, None, (28, 4), "causal_win", 64, 3, ("softcap", "alibi", "sinks"), "batch_idx", "f16"),  # G 7
    ([40, 1, 260], 9, 0, 3, (24, 2), "right", 128, 1, ("alibi", "alibi_b"), "leftpad", "bf16"),   # G 12: P 5
    ([90, 0], 3, 2, None, (48, 1), "causal", 64, 3, (), "leftpad", "f16"),                     # G 48: P 1, 2 tiles
    ([33, 250], 10, 1, 3, (21, 3), "window", 192, 3, ("sinks",), "plain", "bf16"),             # G 7, d192
]


def test_kvcache_gqa_default(rng):
    run_case(rng, *DEFAULT[0])
    run_case(rng, *DEFAULT[1], force=True)


def test_kvcache_gqa_other_groups_default(rng):
    run_case(rng, *DEFAULT[2])
    run_case(rng, *DEFAULT[3])


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW, ids=[case_id(c) for c in SLOW])
def test_kvcache_gqa_grid(case, rng):
    run_case(rng, *case)


@pytest.mark.slow
@pytest.mark.checked
@pytest.mark.parametrize("case", [DEFAULT[0], SLOW[7], DEFAULT[2], SLOW[15]], ids=case_id)
def test_kvcache_gqa_checked(case, rng):
    run_case(rng, *case, checked=True)


def _problem(sq, hq, hk, **kw):
    q = np.zeros((1, sq, hq, 64), dtypes.float16)
    kc = np.zeros((1, 80, hk, 64), dtypes.float16)
    return check_kvcache(q, kc, kc, np.array([70], np.int32), **kw)


def test_kvcache_gqa_routing():
    """Which calls pack, and the reasons ``explain`` gives for those that do not."""
    hopper = lambda p: kvcache_run.hopper_reason(p, 90) is None   # noqa: E731
    p = _problem(8, 8, 1)   # 8 positions x 8 heads: 64 rows
    assert hopper(p) and attention_fwd_sm90.kvcache_variant(p).gqa and attention_fwd_sm90.gqa_pack(p) == 8
    assert attention_fwd_sm90.kvcache_query_tiles(p) == 1 and attention_fwd_sm90.kvcache_heads(p) == 1
    assert "unused" not in dispatch.explain_forward(p, 90, sm_count=132)["choice"]   # (64 = 8 x 8: no dead row)
    p = _problem(1, 8, 1)   # single-token decode: 8 rows, the tensor-core decode kernel
    assert "Sq*G=1*8=8 packed query rows would fill under half" in kvcache_run.hopper_reason(p, 90)
    p = _problem(1, 7, 1)   # G 7, one position: 7 rows
    assert "Sq*G=1*7=7 packed query rows would fill under half" in kvcache_run.hopper_reason(p, 90)
    p = _problem(16, 12, 2)   # G 6: 10 positions (60 rows) a consumer, 20 a tile
    assert hopper(p) and attention_fwd_sm90.kvcache_variant(p).gqa and attention_fwd_sm90.gqa_pack(p) == 6
    assert attention_fwd_sm90.kvcache_query_tiles(p) == 1 and attention_fwd_sm90.kvcache_heads(p) == 2
    info = dispatch.explain_forward(p, 90, sm_count=132)
    assert ("the 6 query heads of each kv head x 16 positions = 96 rows in 1 128-row tile (a consumer's row r: "
            "position r // 6 of its 10 positions, head r % 6); each consumer's 64 rows hold 10 positions (60 rows, "
            "4 unused)") in info["choice"], info["choice"]
    assert info["blocks"] == 2 * info["splits"]
    p = _problem(50, 35, 5)   # G 7: 9 positions a consumer, 18 a tile: 3 tiles
    assert attention_fwd_sm90.gqa_pack(p) == 7 and attention_fwd_sm90.kvcache_query_tiles(p) == 3
    p = _problem(100, 33, 1)   # G 33 at Sq 100: 50 packed tiles against 33 unpacked, so the unpacked form
    assert hopper(p) and not attention_fwd_sm90.kvcache_variant(p).gqa and attention_fwd_sm90.kvcache_heads(p) == 33
    why = "packing takes 50 tiles per kv head against 33 unpacked"
    assert why in dispatch.explain_forward(p, 90, sm_count=132)["choice"]
    p = _problem(63, 33, 1)   # under 64 positions packing stays within G tiles: 32 here
    assert hopper(p) and attention_fwd_sm90.gqa_pack(p) == 33 and attention_fwd_sm90.kvcache_query_tiles(p) == 32
    p = _problem(16, 8, 1, alibi_slopes=np.ones(8, np.float32), sinks=np.zeros(8, np.float32))   # per row
    assert hopper(p) and attention_fwd_sm90.kvcache_variant(p).gqa and attention_fwd_sm90.kvcache_variant(p).mods
    p = _problem(64, 130, 2)   # G 65: past the packed groups, Sq fills half a tile unpacked
    assert hopper(p) and not attention_fwd_sm90.kvcache_variant(p).gqa
    assert ("GQA packing not used: a group of 65 query heads per kv head (GQA packing takes groups of 2..64)"
            in dispatch.explain_forward(p, 90, sm_count=132)["choice"])
    p = _problem(16, 65, 1)   # G 65, 16 rows: the tensor-core decode kernel, and why it is not packed
    assert "GQA packing not used: a group of 65" in kvcache_run.hopper_reason(p, 90)
    q = np.zeros((1, 64, 8, 256), dtypes.float16)   # head dim 256: unpacked (the packed form would spill)
    p = check_kvcache(q, np.zeros((1, 80, 1, 256), dtypes.float16), np.zeros((1, 80, 1, 256), dtypes.float16),
                      np.array([70], np.int32))
    assert hopper(p) and "head dim 256 (bucket 256)" in attention_fwd_sm90.gqa_pack_reason(p)
    p = _problem(130, 4, 2)   # Sq of a whole tile: unpacked
    assert attention_fwd_sm90.gqa_pack(p) == 1 and "fills 128-row tiles" in attention_fwd_sm90.gqa_pack_reason(p)
    forms = attention_fwd_sm90.all_variants(kvcache=True, gqa=True) + attention_fwd_sm90.all_variants(
        kvcache=True, mods=True, gqa=True)
    assert forms and all(v.gqa and v.kvcache and not v.varlen for v in forms)
    assert not attention_fwd_sm90.all_variants(varlen=True, kvcache=True, gqa=True)
    for bad in (dict(varlen=True), dict(kvcache=True, head_dim=256)):   # packed batches; head dim 256
        with pytest.raises(ValueError, match="GQA packing"):
            attention_fwd_sm90.Sm90ForwardVariant(**{"dtype": "f16", "head_dim": 64, "head_dim_v": 64, "local": True,
                                                     "gqa": True, **bad})


# ------------------------------------------------------------------ fixed shapes (cuflash.attention)

#: (layout, causal, window, (Hq, Hk), Sq, Sk, D, Dv, dtype)
FIXED_DEFAULT = [("bhsd", True, (-1, -1), (8, 1), 5, 150, 64, 64, "f16"),
                 ("bshd", False, (7, 3), (16, 4), 9, 70, 64, 64, "f16"),
                 ("bhsd", True, (-1, -1), (12, 2), 23, 60, 64, 64, "f16")]   # G 6: 10 positions a consumer, 2 tiles
FIXED_SLOW = [("bhsd", False, (-1, -1), (4, 2), 100, 300, 128, 128, "bf16"),
              ("bshd", True, (-1, -1), (64, 2), 2, 1, 96, 96, "bf16"),
              ("bhsd", True, (30, -1), (2, 1), 127, 400, 192, 128, "f16"),
              ("bshd", False, (-1, 0), (32, 4), 3, 33, 40, 40, "bf16"),
              ("bhsd", True, (-1, -1), (6, 2), 50, 130, 128, 128, "bf16"),    # G 3: 2 tiles of 42 positions
              ("bshd", False, (12, 5), (35, 5), 31, 77, 96, 96, "f16"),       # G 7
              ("bhsd", False, (-1, -1), (48, 1), 5, 200, 192, 128, "bf16"),   # G 48: 1 position a consumer
              ("bshd", True, (-1, -1), (24, 2), 17, 40, 64, 64, "f16"),       # G 12: 2 tiles of 10 positions
              ("bhsd", True, (20, -1), (10, 2), 100, 300, 64, 64, "f16")]     # G 5: 5 tiles


def run_fixed(rng, layout, causal, window, heads, sq, sk, d, dv, dtype_key, *, checked=False):
    """``cuflash.attention`` GQA-packed: the variant, explain's blocks, the launch's grid, and the
    output and lse against the float64 oracle (NumPy arrays: each layout's strides)."""
    from cuflash.sim.device import SimDevice

    hq, hk = heads
    dt = DTYPES[dtype_key]
    shp = (lambda h, s, e: (2, h, s, e)) if layout == "bhsd" else (lambda h, s, e: (2, s, h, e))
    q, k = (rng.standard_normal(shp(h, s, d)).astype(dt) for h, s in ((hq, sq), (hk, sk)))
    v = rng.standard_normal(shp(hk, sk, dv)).astype(dt)
    kw = dict(causal=causal, window_size=window, layout=layout)
    info = cuflash.explain(q, k, v, arch=90, backend="sim", **kw)
    assert info["variant"].endswith("_gqa") and "GQA packing" in info["choice"], info["choice"]
    g = hq // hk
    assert f"(a consumer's row r: position r // {g} of its {64 // g} position" in info["choice"], info["choice"]
    assert info["blocks"] == -(-sq // (2 * (64 // g))) * hk * 2
    grids = []
    real = SimDevice.launch
    with mock.patch.object(SimDevice, "launch", lambda self, plan: (grids.append(plan.grid), real(self, plan))[1]):
        with cuflash.sim.options(arch=90, checked=checked, seed=3):
            out, lse = cuflash.attention(q, k, v, return_lse=True, backend="sim", **kw)
    assert [g[0] * g[1] * g[2] for g in grids] == [info["blocks"]], grids
    check_close(out, q, k, v, lse=lse, **kw)


def test_fixed_gqa_default(rng):
    for case in FIXED_DEFAULT:
        run_fixed(rng, *case)


@pytest.mark.slow
@pytest.mark.parametrize("case", FIXED_SLOW, ids=[case_id(c) for c in FIXED_SLOW])
def test_fixed_gqa_grid(case, rng):
    run_fixed(rng, *case)


@pytest.mark.slow
@pytest.mark.checked
@pytest.mark.parametrize("case", [FIXED_DEFAULT[0], FIXED_DEFAULT[2]], ids=case_id)
def test_fixed_gqa_checked(case, rng):
    run_fixed(rng, *case, checked=True)


def test_fixed_gqa_routing():
    """Fixed shapes pack with Sq under a tile, a group of 2..64, no score modifiers, one batch dim; explain
    names the packing, or why a GQA call with Sq under a tile is not packed (the KV-cache calls' rule)."""
    def info(sq, hq, hk, d=64, **kw):
        q = np.zeros((1, hq, sq, d), dtypes.float16)
        k = np.zeros((1, hk, 90, d), dtypes.float16)
        return cuflash.explain(q, k, k, arch=90, backend="sim", **kw)

    variant = lambda *a, **kw: info(*a, **kw)["variant"]   # noqa: E731
    assert variant(8, 8, 1).endswith("_gqa") and variant(1, 2, 1).endswith("_gqa")
    assert not variant(128, 8, 1).endswith("_gqa")              # Sq fills the tile
    assert "GQA packing not used" not in info(128, 8, 1)["choice"]
    i = info(8, 6, 2)                                            # G 3: 21 positions a consumer
    assert i["variant"].endswith("_gqa") and i["blocks"] == 2, i
    assert ("GQA packing: the 3 query heads of each kv head x 8 positions = 24 rows in 1 128-row tile (a consumer's "
            "row r: position r // 3 of its 21 positions, head r % 3); each consumer's 64 rows hold 21 positions "
            "(63 rows, 1 unused)") in i["choice"]
    assert variant(5, 48, 1).endswith("_gqa")                    # G 48: 1 position a consumer
    # packing only where it takes no more tiles per kv head than unpacked (G x 1): G 33 at Sq 100 would
    # take ceil(100 / 2) = 50; powers of two never take more (G 32 at Sq 127: ceil(127 / 4) = 32)
    i = info(100, 33, 1)
    assert not i["variant"].endswith("_gqa") and i["blocks"] == 33, i
    assert ("GQA packing not used: a group of 33 at Sq=100 (1 position a consumer): packing takes 50 tiles per kv "
            "head against 33 unpacked") in i["choice"], i["choice"]
    assert not variant(120, 22, 1).endswith("_gqa")             # P 2: ceil(120 / 4) = 30 > 22
    assert variant(66, 33, 1).endswith("_gqa")                   # 33 tiles against 33
    assert variant(127, 32, 1).endswith("_gqa") and info(127, 32, 1)["blocks"] == 32
    assert variant(127, 8, 2).endswith("_gqa") and info(127, 8, 2)["blocks"] == 4 * 2   # G 4: 32 positions a tile
    i = info(8, 8, 1, d=256)                                     # head dim 256
    assert not i["variant"].endswith("_gqa") and "GQA packing not used: head dim 256 (bucket 256)" in i["choice"]
    i = info(8, 8, 1, softcap=3.0)                               # modifiers: unpacked
    assert not i["variant"].endswith("_gqa")
    assert "GQA packing not used: score modifiers on a fixed-shape call" in i["choice"], i["choice"]
    i = info(8, 65, 1)                                           # G 65
    assert not i["variant"].endswith("_gqa") and "GQA packing not used: a group of 65" in i["choice"]
    forms = attention_fwd_sm90.all_variants(gqa=True)
    assert forms and all(v.gqa and not v.kvcache and not v.mods for v in forms)
    assert not attention_fwd_sm90.all_variants(gqa=True, mods=True)
    with pytest.raises(ValueError, match="GQA packing"):
        attention_fwd_sm90.Sm90ForwardVariant("f16", 64, 64, True, True, gqa=True)


def test_one_gqa_pack_rule():
    """One rule decides GQA packing for the fixed-shape and the KV-cache calls (``gqa_pack_reason``), and
    explain gives its words: fp8 and more than one batch dim are not packed, the KV-cache form packs
    its score modifiers and a fixed-shape call does not."""
    import dataclasses

    p = _problem(16, 12, 2)
    assert attention_fwd_sm90.gqa_pack_reason(p) is None and attention_fwd_sm90.gqa_pack(p) == 6
    why = attention_fwd_sm90.gqa_pack_reason(dataclasses.replace(p, batch_shape=(1, 1)))
    assert why == "batch dims (1, 1): GQA packing takes one batch dim"
    assert attention_fwd_sm90.gqa_pack_reason(_problem(16, 12, 2, softcap=2.0)) is None
    e4m3 = dtypes.float8_e4m3fn
    q, k = np.zeros((1, 12, 8, 64), e4m3), np.zeros((1, 2, 90, 64), e4m3)
    info = cuflash.explain(q, k, k, arch=90, backend="sim", out_dtype="bfloat16")
    assert "GQA packing not used: fp8 (float8_e4m3fn) calls are not GQA-packed" in info["choice"], info["choice"]
    q, k = np.zeros((1, 12, 8, 64), dtypes.float16), np.zeros((1, 2, 90, 64), dtypes.float16)
    assert "GQA packing not used: score modifiers on a fixed-shape call" in cuflash.explain(
        q, k, k, arch=90, backend="sim", softcap=2.0)["choice"]
