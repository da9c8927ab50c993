"""``python -m cuflash roofline --sass-of FILE --kernel NAME`` on hand-written SASS: each expected
figure is counted by hand from the fixture (the comments list the instructions), never read from
the tool. No compiles; fast."""

from __future__ import annotations

import re

import pytest

from cuflash.analysis import roofline, sass_count

# An outer persistent tile loop (header 0x20, back edge at 0x110, one HGMMA of its own) around
# the inner K/V loop (header 0x60, latch 0xf0, two HGMMA). Inside the inner loop: a mask branch
# (@P0 BRA 0x1c0) to an out-of-line block placed after the function's EXIT, which branches back
# to 0xa0; a rescale branch (@P1 BRA 0xf0) around four FMULs on the O accumulator (0xb0..0xe0).
SASS = """
        Function : _Z6outer_innerv
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_CTAID.X ;
        /*0020*/                   IADD3 R2, R0, 0x1, RZ ;
        /*0030*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ ;
        /*0040*/                   FMUL R3, R3, R4 ;
        /*0050*/                   NOP ;
        /*0060*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24 ;
        /*0070*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR12], R24 ;
        /*0080*/                   MUFU.EX2 R5, R6 ;
        /*0090*/              @P0 BRA 0x1c0 ;
        /*00a0*/              @P1 BRA 0xf0 ;
        /*00b0*/                   FMUL R24, R24, R9 ;
        /*00c0*/                   FMUL R25, R25, R9 ;
        /*00d0*/                   FMUL R26, R26, R9 ;
        /*00e0*/                   FMUL R27, R27, R9 ;
        /*00f0*/              @P2 BRA 0x60 ;
        /*0100*/                   STG.E desc[UR4][R6.64], R24 ;
        /*0110*/              @P3 BRA 0x20 ;
        /*0120*/                   EXIT ;
        /*01c0*/                   FSEL R20, R21, -INF , P4 ;
        /*01d0*/                   FSEL R22, R23, -INF , P4 ;
        /*01e0*/                   ISETP.GE.AND P4, PT, R2, R8, PT ;
        /*01f0*/                   BRA 0xa0 ;
        /*0200*/                   BRA 0x200 ;
        Function : _Z5otherv
        /*0000*/                   EXIT ;
        Function : _Z5other2v
        /*0000*/                   EXIT ;
"""


def _insns():
    return sass_count.parse_functions(SASS)["_Z6outer_innerv"]


def test_the_inner_tensor_loop_is_chosen_not_the_outer_persistent_loop():
    insns = _insns()
    head, body, latches, (starts, ends, _) = sass_count.main_loop(insns)
    addrs = {insns[starts[b]].addr for b in body}
    assert insns[starts[head]].addr == 0x60
    # the inner loop's blocks: 0x60 (header), 0xa0, 0xb0, 0xf0 (latch) and the out-of-line 0x1c0
    assert addrs == {0x60, 0xa0, 0xb0, 0xf0, 0x1c0}
    assert {insns[starts[b]].addr for b in latches} == {0xf0}


def test_named_paths_count_the_out_of_line_mask_block_and_the_rescale():
    sass_count.RESCALE_FMULS, keep = 4, sass_count.RESCALE_FMULS
    try:
        paths = sass_count.count_loop(_insns())
    finally:
        sass_count.RESCALE_FMULS = keep
    assert set(paths) == {"steady+rescale", "steady-rescale", "masked+rescale", "masked-rescale"}
    # steady-rescale: HGMMA, HGMMA, MUFU, @P0 BRA, @P1 BRA, @P2 BRA = 6
    s = paths["steady-rescale"]
    assert (s.instructions, s.tensor, s.classes["mufu"], s.classes["predicate"], s.classes["fp32"]) == (6, 2, 1, 3, 0)
    # + the four FMULs
    assert paths["steady+rescale"].instructions == 10 and paths["steady+rescale"].classes["fp32"] == 4
    # masked: + the out-of-line block FSEL, FSEL, ISETP, BRA
    m = paths["masked+rescale"]
    assert (m.instructions, m.classes["predicate"], m.classes["fp32"]) == (14, 3 + 4, 4)
    assert paths["masked-rescale"].instructions == 10
    assert m.per_16_tensor() == 16 * 14 / 2


def test_without_a_rescale_block_only_steady_and_masked():
    paths = sass_count.count_loop(_insns())   # four FMULs are below the default threshold
    assert set(paths) == {"steady", "masked"}
    assert (paths["steady"].instructions, paths["masked"].instructions) == (6, 14)


def test_command_line_on_a_sass_text(tmp_path, capsys):
    f = tmp_path / "k.sass"
    f.write_text(SASS)
    assert roofline.main(["--sass-of", str(f), "--kernel", "outer_inner"]) == 0
    out = capsys.readouterr().out
    assert "_Z6outer_innerv" in out and "\nsteady " in out and "\nmasked " in out


def test_errors(tmp_path, capsys, monkeypatch):
    f = tmp_path / "k.sass"
    f.write_text(SASS)
    assert roofline.main(["--sass-of", str(f), "--kernel", "nope"]) == 2
    assert "no function of" in capsys.readouterr().err
    assert roofline.main(["--sass-of", str(f), "--kernel", "other"]) == 2
    err = capsys.readouterr().err
    assert "matches 2 functions" in err and "more exact name" in err
    empty = tmp_path / "e.txt"
    empty.write_text("no sass here\n")
    assert roofline.main(["--sass-of", str(empty), "--kernel", "k"]) == 2
    assert "holds no SASS functions" in capsys.readouterr().err
    assert roofline.main(["--sass-of", str(tmp_path / "missing.so"), "--kernel", "k"]) == 2
    assert "no such file" in capsys.readouterr().err
    binary = tmp_path / "lib.so"
    binary.write_bytes(b"\0ELF")
    monkeypatch.setattr(sass_count, "find_tool", lambda name: None)
    assert roofline.main(["--sass-of", str(binary), "--kernel", "k"]) == 1
    assert "cuobjdump not found" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        roofline.main(["--sass-of", str(f)])
    assert "--sass-of and --kernel go together" in capsys.readouterr().err


# Masked tiles compiled as a loop of their own (FA3's form): a masking loop (0x00..0x40: HGMMA,
# FSEL, FSEL, ISETP, @P0 BRA) then a steady loop (0x50..0x70: HGMMA, IADD3, @P1 BRA).
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


def test_a_separate_masking_loop_gives_the_masked_path_and_the_other_the_steady():
    insns = sass_count.parse_functions(TWO_LOOPS)["two_loops"]
    paths = sass_count.count_loop(insns)
    assert (paths["steady"].instructions, paths["masked"].instructions) == (3, 5)
    # per loop, in code order: the masking loop's one pass (5), then the steady loop's (3)
    assert [c["steady"].instructions for c in sass_count.count_loops(insns)] == [5, 3]
    assert paths["masked"].classes["predicate"] == 4 and paths["steady"].classes["integer"] == 1


def test_macs_per_warp_and_per_100k():
    paths = sass_count.count_loop(_insns())
    # two HGMMA.64x128x16 per pass: 2 x 64 x 128 x 16 / 4 MACs per warp; steady: 4 non-tensor
    assert paths["steady"].macs == 2 * 64 * 128 * 16 // 4
    assert paths["steady"].per_100k_macs() == pytest.approx(1e5 * 4 / (2 * 64 * 128 * 16 // 4))


# A skippable block of 8 FMULs on the S accumulator (R88: its HGMMA starts from RZ every pass, as
# a prescale of the scores does) is no O rescale; a skippable copy into shared memory (the next
# tile's load) is on the steady pass.
PRESCALE_AND_COPY = """
        Function : prescale_copy
        /*0000*/                   HGMMA.64x128x16.F32.BF16 R88, gdesc[UR4], RZ, !UPT ;
        /*0010*/                   HGMMA.64x128x16.F32.BF16 R24, R152, gdesc[UR8].tnspB, R24, gsb0 ;
        /*0020*/              @P0 BRA 0xb0 ;
        /*0030*/                   FMUL R88, R88, R9 ;
        /*0040*/                   FMUL R89, R89, R9 ;
        /*0050*/                   FMUL R90, R90, R9 ;
        /*0060*/                   FMUL R91, R91, R9 ;
        /*0070*/                   FMUL R92, R92, R9 ;
        /*0080*/                   FMUL R93, R93, R9 ;
        /*0090*/                   FMUL R94, R94, R9 ;
        /*00a0*/                   FMUL R95, R95, R9 ;
        /*00b0*/              @P1 BRA 0xd0 ;
        /*00c0*/                   LDGSTS.E.BYPASS.128 [R2], desc[UR4][R4.64] ;
        /*00d0*/              @P2 BRA 0x0 ;
        /*00e0*/                   EXIT ;
"""


def test_fmuls_on_a_fresh_accumulator_are_no_rescale_and_steady_makes_the_copy():
    paths = sass_count.count_loop(sass_count.parse_functions(PRESCALE_AND_COPY)["prescale_copy"])
    assert set(paths) == {"steady", "masked"}
    # steady: HGMMA, HGMMA, @P0 BRA, @P1 BRA, LDGSTS, @P2 BRA; masked: + the 8 FMULs
    assert (paths["steady"].instructions, paths["steady"].classes["memory"]) == (6, 1)
    assert (paths["masked"].instructions, paths["masked"].classes["fp32"]) == (14, 8)
    # the same FMULs on the carried O accumulator (R24) are the rescale
    on_o = re.sub(r"FMUL R(\d+), R\1,", lambda m: f"FMUL R{int(m.group(1)) - 64}, R{int(m.group(1)) - 64},",
                  PRESCALE_AND_COPY)
    assert on_o.count("FMUL R24, R24,") == 1
    assert set(sass_count.count_loop(sass_count.parse_functions(on_o)["prescale_copy"])) == {
        "steady+rescale", "steady-rescale", "masked+rescale", "masked-rescale"}
