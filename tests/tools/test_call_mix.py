"""``python -m cuflash roofline --call-mix``: the tiles of each path a call's grid runs, against a
brute-force enumeration of (query tile, key tile) pairs under docs/conventions.md's masks (key j
visible to row i iff 0 <= j < Sk and i + Sk - Sq - left <= j <= i + Sk - Sq + right), and the
call's totals on hand-written SASS. Pure arithmetic: no compiles."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cuflash.analysis import call_mix as cm
from cuflash.analysis import roofline, sass_count


def _brute(sq, sk, left, right, bm, bn, rows, order, local):
    """Per path, the passes a walk runs, found pair by pair: a CTA of ``bm`` rows (those the
    kernel computes, padding rows past Sq included) walks the key tiles between the first and the
    last holding a pair visible to one of its rows (all of them without ``local``); each group of
    ``rows`` rows takes the walk's first tile (``order``) as ``first`` and every other tile as the
    edges the mask cuts for its rows: left (a key left of a row's first visible key), right (a key
    right of a row's last visible one, or one at or past Sk)."""
    diag = sk - sq
    nq = -(-sq // bm) * bm
    nk = -(-sk // bn) * bn
    i = np.arange(nq)[:, None]
    j = np.arange(nk)[None, :]
    in_range = np.broadcast_to(j < sk, (nq, nk))
    before = (j < i + diag - left) if left >= 0 else np.zeros((nq, nk), bool)
    after = (j > i + diag + right) if right >= 0 else np.zeros((nq, nk), bool)
    visible = in_range & ~before & ~after
    counts = dict.fromkeys(cm.PATHS, 0)
    for m0 in range(0, nq, bm):
        if local:
            seen = [t for t in range(nk // bn) if visible[m0:m0 + bm, t * bn:(t + 1) * bn].any()]
            if not seen:
                continue
            walked = list(range(seen[0], seen[-1] + 1))
        else:
            walked = list(range(nk // bn))
        for r0 in range(m0, m0 + bm, rows):
            first = walked[0] if order == "up" else walked[-1]
            for t in walked:
                if t == first:
                    counts["first"] += 1
                    continue
                cols = slice(t * bn, (t + 1) * bn)
                cut_left = bool((before[r0:r0 + rows, cols] & in_range[r0:r0 + rows, cols]).any())
                cut_right = bool(after[r0:r0 + rows, cols].any() or (t + 1) * bn > sk)
                counts[("steady", "left", "right", "both")[cut_left + 2 * cut_right]] += 1
    return counts


WINDOWS = [(-1, -1), (-1, 0), (0, 0), (5, -1), (20, 3), (3, 20), (40, 0), (0, 7), (1, 1)]
LENGTHS = [1, 17, 40, 64, 100]


@pytest.mark.parametrize("left,right", WINDOWS)
def test_hopper_walk_equals_the_pairs(left, right):
    local = left >= 0 or right >= 0
    for sq in LENGTHS:
        for sk in LENGTHS:
            got = cm.hopper_walk(sq, sk, left=left, right=right, block_m=32, block_n=16, rows=16)
            assert got.tiles == _brute(sq, sk, left, right, 32, 16, 16, "up", local), (sq, sk)


@pytest.mark.parametrize("sq,sk,left,right", [(1000, 1000, -1, 0), (700, 1300, -1, 0), (1300, 700, -1, 0),
                                              (1000, 1000, 300, 0), (1000, 1000, 100, 100), (520, 900, -1, -1)])
def test_hopper_walk_equals_the_pairs_at_the_real_tile(sq, sk, left, right):
    got = cm.hopper_walk(sq, sk, left=left, right=right)
    assert got.tiles == _brute(sq, sk, left, right, 128, 128, 64, "up", left >= 0 or right >= 0)
    assert (got.rows, got.block_n, got.warps) == (64, 128, 4)


@pytest.mark.parametrize("order", ["down", "up"])
@pytest.mark.parametrize("left,right", WINDOWS)
def test_anchor_walk_equals_the_pairs(order, left, right):
    for sq in LENGTHS:
        for sk in LENGTHS:
            got = cm.anchor_walk(sq, sk, left=left, right=right, block_m=32, block_n=16, order=order)
            assert got.tiles == _brute(sq, sk, left, right, 32, 16, 32, order, True), (sq, sk)
            assert got.warps == 2


def test_the_8k_causal_walks_by_hand():
    # 64 query tiles of 128 rows; tile row i sees key tiles 0..i. Ours, per 64-row consumer:
    # tile 0 first, tiles 1..i-1 steady, tile i (the diagonal) right, for i >= 1.
    ours = cm.hopper_walk(8192, 8192, right=0).tiles
    assert ours == {"first": 2 * 64, "steady": 2 * sum(i - 1 for i in range(1, 64)), "right": 2 * 63,
                    "left": 0, "both": 0}
    assert ours["steady"] == 2 * 1953
    # walking down: the diagonal tile first, the i others steady
    fa3 = cm.anchor_walk(8192, 8192, right=0, order="down").tiles
    assert fa3 == {"first": 64, "steady": sum(range(64)), "right": 0, "left": 0, "both": 0} and fa3["steady"] == 2016
    # no mask: every tile but the first is steady (8192 is a multiple of 128: no Sk edge)
    assert cm.hopper_walk(8192, 8192).tiles == {"first": 128, "steady": 128 * 63, "right": 0, "left": 0, "both": 0}


def test_window_of():
    assert cm.window_of(False, None) == (-1, -1)
    assert cm.window_of(True, None) == (-1, 0)
    assert cm.window_of(True, (10, -1)) == (10, 0)
    with pytest.raises(ValueError, match="right bound is 0"):
        cm.window_of(True, (10, 3))
    with pytest.raises(ValueError, match=">= -1"):
        cm.window_of(False, (-2, 0))
    with pytest.raises(ValueError, match="--walk"):
        cm.anchor_walk(10, 10, order="left")
    with pytest.raises(ValueError, match="multiple of"):
        cm.hopper_walk(10, 10, block_m=96, rows=64)


def _count(n, **classes):
    classes = {k: classes.get(k, 0) for k in sass_count.CLASSES}
    classes["other"] = n - sum(classes.values())
    return sass_count.LoopCount("steady", n, classes, False)


def test_hopper_paths_in_code_order_and_refusals():
    loops = [{"steady": _count(n)} for n in (618, 683, 473, 613)]
    paths, first_as = cm.hopper_paths(loops, True)
    assert {p: c.instructions for p, c in paths.items()} == {"left": 618, "both": 683, "steady": 473, "right": 613,
                                                            "first": 683}
    assert first_as == "both"
    with pytest.raises(ValueError, match="2 loops"):
        cm.hopper_paths(loops, False)
    with pytest.raises(ValueError, match="not the shortest"):
        cm.hopper_paths([{"steady": _count(n)} for n in (618, 400, 473, 613)], True)


def test_mix_totals_by_hand():
    walk = cm.Walk({"first": 2, "steady": 5, "left": 0, "right": 1, "both": 0}, 64, 128, 4)
    steady, right = _count(10, tensor=2, fp32=3), _count(20, tensor=2, fp32=5)
    mix = cm.Mix("k", walk, {"first": right, "steady": steady, "right": right}, "right", batch_heads=3)
    # loops: (5 x 10 + 1 x 20) x 4 warps x 3 = 840; with the first tiles: + 2 x 20 x 4 x 3 = 480
    assert mix.total(first=False) == 840 and mix.total() == 1320
    assert mix.classes(first=False)["fp32"] == (5 * 3 + 1 * 5) * 12 and mix.classes()["tensor"] == 8 * 2 * 12
    assert mix.instructions("right") == 240 and mix.instructions("left") == 0


# A masking loop (0x00..0x40: 5 instructions) then a steady loop (0x50..0x70: 3), as
# tests/tools/test_sass_count.py's TWO_LOOPS.
TWO_LOOPS = """
        Function : two_loops
        /*0000*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0010*/                   FSEL R20, R21, -INF , P4 ;
        /*0020*/                   FSEL R22, R23, -INF , P4 ;
        /*0030*/                   ISETP.GE.AND P0, PT, R2, R8, PT ;
        /*0040*/              @P0 BRA 0x0 ;
        /*0050*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0060*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0070*/              @P1 BRA 0x50 ;
        /*0080*/                   EXIT ;
"""


def test_command_line_on_an_anchor(tmp_path, capsys):
    f = tmp_path / "k.sass"
    f.write_text(TWO_LOOPS)
    out = tmp_path / "mix.json"
    argv = ["--call-mix", "--sass-of", str(f), "--kernel", "two_loops", "--seqlen", "256", "--causal",
            "--block-m", "128", "--block-n", "128", "--walk", "down", "--heads", "2", "--json", str(out)]
    assert roofline.main(argv) == 0
    text = capsys.readouterr().out
    assert "not a speed" in text and "\nsteady " in text
    rec = json.loads(out.read_text())
    # query tile 0 sees key tile 0 (first); tile 1 sees 0..1: tile 1 first, tile 0 steady. 8 warps,
    # 2 heads: steady 1 x 8 x 3 x 2 = 48; first 2 x 8 x 5 x 2 = 160
    assert rec["paths"]["steady"] == {"tiles": 1, "instructions_per_warp": 3, "instructions": 48}
    assert rec["paths"]["first"]["instructions"] == 160
    assert (rec["total_loops_only"], rec["total"]) == (48, 208)
    # the steady pass: HGMMA, IADD3, @P1 BRA, x 16 warp passes
    assert {k: v for k, v in rec["classes_loops_only"].items() if v} == {"tensor": 16, "integer": 16, "predicate": 16}


@pytest.mark.parametrize("argv,message", [
    (["--causal"], "--causal applies to --call-mix only"),
    (["--call-mix"], "--call-mix needs --head-dim"),
    (["--call-mix", "--head-dim", "128", "--walk", "down"], "--walk describes the walk of a --sass-of kernel"),
    (["--call-mix", "--sass-of", "x.sass", "--kernel", "k", "--block-m", "128"], "needs the kernel's walk: --block-n, --walk"),
    (["--call-mix", "--head-dim", "128", "--decode"], "--decode with --call-mix"),
    (["--call-mix", "--head-dim", "128", "--window", "-2", "0"], "expected an integer >= -1"),
    (["--call-mix", "--head-dim", "128", "--seqlen-k", "0"], "expected a positive integer"),
])
def test_command_line_refusals(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        roofline.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_causal_window_with_a_right_bound_is_refused(tmp_path, capsys):
    f = tmp_path / "k.sass"
    f.write_text(TWO_LOOPS)
    assert roofline.main(["--call-mix", "--sass-of", str(f), "--kernel", "two_loops", "--causal", "--window", "4", "3",
                          "--block-m", "128", "--block-n", "128", "--walk", "down"]) == 2
    assert "with --causal the right bound is 0" in capsys.readouterr().err


def test_call_flags_are_spelled_as_intensity_spells_them():
    from cuflash.analysis import intensity

    def options(parser):
        return {o for a in parser._actions for o in a.option_strings}

    shared = {"--seqlen", "--seqlen-k", "--causal", "--no-causal", "--window", "--batch", "--heads", "--block-m",
              "--block-n", "--head-dim", "--dtype", "--device", "--json"}
    assert shared <= options(roofline._parser()) and shared <= options(intensity._parser())
    a = roofline._parser().parse_args(["--call-mix", "--window", "8", "0", "--no-causal"])
    b = intensity._parser().parse_args(["--window", "8", "0", "--no-causal"])
    assert (list(a.window), a.causal) == (list(b.window), b.causal)
