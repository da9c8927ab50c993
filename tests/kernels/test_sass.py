"""The tensor-core tier is really on tensor cores: disassemble the NVRTC-compiled fp16 and bf16
variants (no GPU needed) and find the instructions that prove it.

* ``HMMA.16816.F32`` (fp16) / ``HMMA.16816.F32.BF16`` (bf16): ``mma.sync.aligned.m16n8k16`` with
  float32 accumulators;
* ``LDSM.16.M88.4`` (``ldmatrix.x4``, Q and K) and ``LDSM.16.MT88.4`` (``ldmatrix.x4.trans``, V);
* ``LDGSTS`` (``cp.async``) with ``LDGDEPBAR`` / ``DEPBAR`` (commit / wait_group);
* no local memory (``LDL``/``STL``: spills) in the kernel.

``cuobjdump --dump-sass`` comes from the ``nvidia-cuda-cuobjdump`` wheel and needs ``nvdisasm``
(``nvidia-cuda-nvdisasm``) beside it; both are in the ``test`` extra. The 13.x tools read the
cubins NVRTC 12.9 makes.
"""

from __future__ import annotations

import collections
import re
import struct

import pytest

from cuflash.analysis import roofline
from cuflash.kernels import attention_fwd_mma
from cuflash.runtime import cuda_runner, source

ARCHS = attention_fwd_mma.ARCHES
_OPCODE = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)", re.M)




def sass_opcodes(variant, arch: int) -> collections.Counter:
    text, _ = roofline.compile_sass(variant, arch)
    ops = collections.Counter(_OPCODE.findall(text))
    assert ops, f"no SASS in cuobjdump's output:\n{text[:2000]}"
    return ops


def _variants():
    # the bar's bucket (128) and the one with Q re-read from shared memory (256), both dtypes
    return [(arch, attention_fwd_mma.choose_variant(dt, d, d, arch))
            for arch in ARCHS for dt in ("float16", "bfloat16") for d in (128, 256)]


def _declared_elf_end(image: bytes) -> int:
    """Where an ELF-64 file ends by its header (System V gABI): after the program or the section
    header table, whichever comes last."""
    phoff, shoff = struct.unpack_from("<QQ", image, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", image, 0x36)
    return max(phoff + phentsize * phnum, shoff + shentsize * shnum)


def test_complete_elf_pads_to_the_declared_end():
    head = bytearray(64)
    head[:5] = b"\x7fELF\x02"
    struct.pack_into("<QQ", head, 0x20, 0, 100)
    struct.pack_into("<HHHH", head, 0x36, 56, 0, 64, 2)
    assert len(cuda_runner.complete_elf(bytes(head) + b"x" * 163)) == 228
    assert cuda_runner.complete_elf(b"not an ELF") == b"not an ELF"


def test_nvrtc_compile_returns_the_whole_cubin():
    """CuPy 14's getCUBIN drops the image's last byte; nvrtc_compile hands back all of it."""
    variant = attention_fwd_mma.choose_variant("float16", 64, 64, 80)
    cubin, _ = cuda_runner.nvrtc_compile(source.build_source(variant), 80, name=variant.source)
    assert cubin[:5] == b"\x7fELF\x02"
    assert len(cubin) == _declared_elf_end(cubin)


@pytest.mark.parametrize("arch,variant", _variants(), ids=lambda x: str(getattr(x, "entry", x)))
def test_sass_proves_the_tensor_core_tier(arch, variant, cuobjdump):
    ops = sass_opcodes(variant, arch)
    hmma = "HMMA.16816.F32.BF16" if variant.dtype == "bf16" else "HMMA.16816.F32"
    # one k-loop iteration: (Dmax/16) * (Bc/8) mma for S, (Bc/16) * (Dmax/8) for P V
    d, bn = variant.head_dim_max, variant.block_n
    assert ops[hmma] >= (d // 16) * (bn // 8) + (bn // 16) * (d // 8), (hmma, dict(ops))
    other = "HMMA.16816.F32" if variant.dtype == "bf16" else "HMMA.16816.F32.BF16"
    assert ops[other] == 0, f"{variant.entry} mixes mma types: {dict(ops)}"
    assert ops["LDSM.16.M88.4"] > 0 and ops["LDSM.16.MT88.4"] > 0, dict(ops)
    assert sum(n for op, n in ops.items() if op.startswith("LDGSTS")) > 0, dict(ops)
    assert ops["LDGDEPBAR"] > 0 and sum(n for op, n in ops.items() if op.startswith("DEPBAR")) > 0, dict(ops)
    assert not any(op.startswith(("LDL", "STL")) for op in ops), f"local memory (spills) in {variant.entry}: {dict(ops)}"


# ---------------------------------------------------------------------------- tensor-core backward


def _bwd_variants():
    from cuflash.kernels import attention_bwd_mma

    return [(arch, v) for arch in attention_bwd_mma.ARCHES for v in attention_bwd_mma.all_variants(arch)]


@pytest.mark.parametrize("arch,variant", _bwd_variants(), ids=lambda x: str(getattr(x, "entry", x)))
def test_sass_proves_the_tensor_core_backward(arch, variant, cuobjdump):
    ops = sass_opcodes(variant, arch)
    hmma = "HMMA.16816.F32.BF16" if variant.dtype == "bf16" else "HMMA.16816.F32"
    # per query tile, the five products' MACs (Br*Bc*D each) split over the 8 warps, 2048 per mma
    d, bm, bn = variant.head_dim_max, variant.block_m, variant.block_n
    assert ops[hmma] >= 5 * bm * bn * d // (2048 * variant.threads // 32), (hmma, dict(ops))
    if arch >= 90:   # dQ leaves as red.global.add.v2.f32
        assert re.search(r"\bREDG\.\S*F32x2", roofline.compile_sass(variant, arch)[0]), variant.entry
    other = "HMMA.16816.F32" if variant.dtype == "bf16" else "HMMA.16816.F32.BF16"
    assert ops[other] == 0, f"{variant.entry} mixes mma types: {dict(ops)}"
    assert ops["LDSM.16.M88.4"] > 0 and ops["LDSM.16.MT88.4"] > 0, dict(ops)
    assert sum(n for op, n in ops.items() if op.startswith("LDGSTS")) > 0, dict(ops)
    assert ops["LDGDEPBAR"] > 0 and sum(n for op, n in ops.items() if op.startswith("DEPBAR")) > 0, dict(ops)
    assert not any(op.startswith(("LDL", "STL")) for op in ops), f"local memory (spills) in {variant.entry}: {dict(ops)}"


# ------------------------------------------------------------------------------- Hopper forward


def _sm90_variants():
    from cuflash.kernels import attention_fwd_sm90

    return [attention_fwd_sm90.Sm90ForwardVariant(dt, 128, 128, local) for dt in ("f16", "bf16") for local in (False, True)]


@pytest.mark.parametrize("variant", _sm90_variants(), ids=lambda v: v.entry)
def test_sass_hopper_forward_steady_loop_has_no_mask(variant, cuobjdump):
    """The Hopper forward's tiles run as separate loops (docs/roofline.md's counting rule): one
    steady loop with no mask code in it, and the masked loops (the right edge: the diagonal and
    Sk; with a window also the left edge and both), each with every HGMMA of a tile. The budgets
    are the instruction counts per warp and tile this kernel is held to (FlashAttention-3's bf16
    d128 steady loop counts 458 by the same rule)."""
    from cuflash.analysis import sass_count

    text, resources = roofline.compile_sass(variant, 90)
    assert resources["spill_stores"] == 0 and resources["spill_loads"] == 0, resources
    loops = sass_count.count_loops(sass_count.parse_functions(text)[variant.entry])
    assert len(loops) == (4 if variant.local else 2), loops
    passes = [counts["steady"] for counts in loops]   # each loop's shortest pass: around its rare branches
    assert all(c.tensor == 16 for c in passes), passes
    steady = min(passes, key=lambda c: c.instructions)
    assert steady.instructions <= 480, steady
    assert steady.classes["predicate"] <= 16, steady   # no per-score compare or select
    # every masked loop (the diagonal's, the last in code order, a causal call's only masked tiles;
    # a window's left edge, and both edges): within FlashAttention-3's masking loop (604 by the same rule)
    assert max(c.instructions for c in passes) <= 604, passes


def _exponentials_before_wait0(insns, blocks, loop) -> int:
    """The fewest ``MUFU.EX2`` any pass through ``loop`` issues between its ``wgmma.wait_group 1``
    and its ``wait_group 0`` (``WARPGROUP.DEPBAR.LE gsb0, 0x1`` / ``0x0``)."""
    starts, ends, succ = blocks
    h, body, _ = loop
    fewest = []

    def walk(b, seen, state, n):   # state 0: before wait 1; 1: between the waits
        for x in insns[starts[b]:ends[b]]:
            if x.op == "WARPGROUP" and "DEPBAR" in x.mods:
                if x.operands.strip().endswith("0x1"):
                    state = 1
                elif state == 1:
                    fewest.append(n)
                    return
            elif state == 1 and x.op == "MUFU" and "EX2" in x.mods:
                n += 1
        for c in succ[b]:
            if c in body and c != h and c not in seen:
                walk(c, seen | {c}, state, n)

    walk(h, {h}, 0, 0)
    assert fewest, "no pass from wait_group 1 to wait_group 0"
    return min(fewest)


@pytest.mark.slow
@pytest.mark.parametrize("nvrtc", ["12", "13"])
@pytest.mark.parametrize("variant", _sm90_variants(), ids=lambda v: v.entry)
def test_sass_hopper_forward_exponentials_overlap_p_v(variant, nvrtc, cuobjdump, monkeypatch):
    """FA3's intra-warpgroup overlap (Shah et al. 2024, section 3.2) in the SASS: in every loop of
    the walk, steady and masked, at least 14 of a tile's 66 exponentials issue before the
    ``wait_group 0`` that retires the previous tile's P V (FA3's bf16 d128 kernel: 14; counted
    46-56 here at d128 with NVRTC 12 and 13: the release of K's slot, which ptxas keeps before that
    wait, waits on the first row's softmax)."""
    from cuflash.analysis import sass_count

    monkeypatch.setenv("CUFLASH_NVRTC", nvrtc)
    roofline.compile_sass.cache_clear()
    try:
        text, _ = roofline.compile_sass(variant, 90)
    finally:
        roofline.compile_sass.cache_clear()
    insns = sass_count.parse_functions(text)[variant.entry]
    blocks, loops = sass_count.main_loops(insns)
    counts = [_exponentials_before_wait0(insns, blocks, loop) for loop in loops]
    assert len(counts) == (4 if variant.local else 2) and min(counts) >= 14, counts


def _steady_instructions(variant) -> int:
    from cuflash.analysis import sass_count

    text, resources = roofline.compile_sass(variant, 90)
    assert resources["spill_stores"] == 0 and resources["spill_loads"] == 0, resources
    loops = sass_count.count_loops(sass_count.parse_functions(text)[variant.entry])
    return min(counts["steady"].instructions for counts in loops)


@pytest.mark.slow
@pytest.mark.parametrize("local", [False, True], ids=["plain", "local"])
def test_sass_hopper_packed_form_keeps_the_steady_loop(local, cuobjdump):
    """The packed (varlen) form's steady loop is within 5% of the fixed form's instructions per warp
    and tile (bf16 d128; counted 469 against 466, and 467 against 468 causal), with no spills: the
    sequence's offsets only move the TMA boxes the producer issues."""
    from cuflash.kernels import attention_fwd_sm90

    fixed = attention_fwd_sm90.Sm90ForwardVariant("bf16", 128, 128, local)
    packed = attention_fwd_sm90.Sm90ForwardVariant("bf16", 128, 128, local, varlen=True)
    n_fixed, n_packed = _steady_instructions(fixed), _steady_instructions(packed)
    assert n_packed <= 1.05 * n_fixed, (n_packed, n_fixed)


@pytest.mark.parametrize("local", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["plain", "local"])
def test_sass_hopper_modifier_forms_stay_small(local, cuobjdump):
    """The modifier forms (bf16 d128) run each modifier that is on as one pass over the tile's
    scores behind one branch a tile, and tile 0 in the loop (one copy of the per-score code): the
    whole kernel within half the 19,864 / 17,664 SASS instructions of the form that inlined every
    modifier per score in two copies (counted 4,288 / 4,488 under NVRTC 12.9), no spills; one loop,
    whose pass with no modifier on stays within 720 instructions per warp and tile (668 / 660; the
    plain form's steady loop 450) and with every modifier on within 3,000 (2,781 / 2,822; 5,744
    before)."""
    from cuflash.analysis import sass_count
    from cuflash.kernels import attention_fwd_sm90

    variant = attention_fwd_sm90.Sm90ForwardVariant("bf16", 128, 128, local, True)
    text, resources = roofline.compile_sass(variant, 90)
    assert resources["spill_stores"] == 0 and resources["spill_loads"] == 0, resources
    insns = sass_count.parse_functions(text)[variant.entry]
    assert len(insns) <= (8832 if local else 9932), len(insns)
    (loop,) = sass_count.count_loops(insns)
    assert loop["steady"].tensor >= 16 and loop["steady"].instructions <= 720, loop["steady"]
    assert loop["masked"].instructions <= 3000, loop["masked"]


# ------------------------------------------------------------------------------- Hopper backward


@pytest.mark.parametrize("dtype", ["bf16", pytest.param("f16", marks=pytest.mark.slow)])
def test_sass_hopper_backward_loop_budgets(dtype, cuobjdump):
    """The Hopper backward at d128 (64-row query tiles, 128 keys a block), under every installed
    NVRTC: no spills, and the walk as four loops of one tile each, in code order: the causal
    diagonal (the lower bound only: 16 ``HSET2`` a warp and tile), the tiles before the steady ones
    that need both bounds (32 ``HSET2``), the steady loop (none) and the both-bound tiles after it,
    each with the tile's 32 HGMMA. Per warp and tile (docs/roofline.md's counting rule, each loop's
    longest pass) the steady loop stays within 396 instructions, the diagonal within 452 and each
    both-bound loop within 474 (counted 390-392, 441-446 and 463-470 under NVRTC 12.9 and 13).
    FlashAttention-3's bf16 d128 backward counts 59 (non-causal) and 69 (causal) non-tensor
    instructions per 100k MACs by the same rule, about 419 and 484 instructions of this tile."""
    from cuflash.analysis import sass_count
    from cuflash.kernels import attention_bwd_sm90
    from cuflash.runtime import nvrtc

    variant = attention_bwd_sm90.Sm90BackwardVariant(dtype, 128)
    majors = cuda_runner.nvrtc_majors()
    assert set(majors) >= set(nvrtc.MAJORS), majors   # both compilers: the test extra installs them
    for major in majors:
        cubin, log = cuda_runner.nvrtc_compile(source.build_source(variant), variant.target_arch, name=variant.source,
                                               extra_options=("-Xptxas=-v",), nvrtc=major)
        r = cuda_runner.ptxas_resources(log, variant.entry)
        where = f"{variant.entry} with NVRTC {major}.x"
        assert r["spill_stores"] == r["spill_loads"] == r["stack_frame"] == 0, (where, r)
        insns = sass_count.parse_functions(roofline.disassemble(cubin))[variant.entry]
        (starts, ends, _), found = sass_count.main_loops(insns)
        hset2 = [sum(x.op == "HSET2" for b in body for x in insns[starts[b]:ends[b]]) for _, body, _ in found]
        assert hset2 == [16, 32, 0, 32], (where, hset2)
        longest = [c["masked"] for c in sass_count.count_loops(insns)]
        assert all(c.tensor == 32 for c in longest), (where, longest)
        diagonal, before, steady, after = (c.instructions for c in longest)
        assert steady <= 396, (where, longest)
        assert diagonal <= 452, (where, longest)
        assert before <= 474 and after <= 474, (where, longest)
        assert max(c.per_100k_macs() for c in longest) <= 69, (where, longest)   # FA3's masked loop


# ------------------------------------------------------------------------ tensor-core backward loop


def _bwd_loop_paths(text: str, entry: str) -> dict:
    """Per warp and query tile of the tensor-core backward's main loop: the ``steady`` pass (every
    mma and copy, every dQ ``REDG`` issued, the fewest instructions: an interior tile) and the
    ``masked`` one (the same, the most instructions: a diagonal or sequence-edge tile), each as
    totals by class plus ``fp32_arith`` (FMUL/FFMA/FADD) and ``red``."""
    from cuflash.analysis import sass_count

    insns = sass_count.parse_functions(text)[entry]
    blocks, found = sass_count.main_loops(insns)
    assert len(found) == 1, found

    def measure(x):
        if x.op == "NOP":
            return {}
        c = {sass_count.classify(x.op): 1}
        c["copies"] = int(x.op in sass_count.COPIES)
        c["red"] = int(x.op.startswith("RED"))
        c["fp32_arith"] = int(x.op in ("FMUL", "FFMA", "FADD"))
        return c

    def key(sign):
        return lambda t: (t.get("tensor", 0), t.get("copies", 0), t.get("red", 0),
                          -sign * sum(t.get(k, 0) for k in sass_count.CLASSES))

    steady, masked = sass_count.best_passes(insns, blocks, found[0], measure, [key(1), key(-1)])
    for t in (steady, masked):
        t["instructions"] = sum(t.get(k, 0) for k in sass_count.CLASSES)
    return {"steady": steady, "masked": masked}


def _bwd_band_pass(text: str, entry: str) -> int:
    """The tensor-core backward's pass through a masked tile inside Sq and Sk with one window edge (a
    causal diagonal) in the atomic dQ mode: every mma, copy and dQ ``red``, the fewest instructions
    otherwise (interior copies and dQ adds), through a P/dS block that selects each of the lane's 32
    P and 32 dS (64 FSEL) with one compare per distinct offset from the diagonal (at most 14 at
    64 x 128), not one per score and bound."""
    from cuflash.analysis import sass_count

    insns = sass_count.parse_functions(text)[entry]
    blocks, found = sass_count.main_loops(insns)
    starts, ends, _ = blocks
    h, body, latches = found[0]
    ops = {b: collections.Counter(x.op for x in insns[starts[b]:ends[b]]) for b in body}
    band = [b for b in body if ops[b]["FSEL"] == 64 and ops[b]["MUFU"] == 32 and ops[b]["ISETP"] <= 14]
    assert band, "no P/dS block with one compare per offset from the diagonal"

    def measure(x):
        if x.op == "NOP":
            return {}
        return {"n": 1, "tensor": int(sass_count.classify(x.op) == "tensor"), "copies": int(x.op in sass_count.COPIES),
                "red": int(x.op.startswith("RED"))}

    def key(t):
        return (t.get("band", 0), t.get("tensor", 0), t.get("copies", 0), t.get("red", 0), -t.get("n", 0))

    passes = []
    for b in band:
        (p,) = sass_count.best_passes(insns, blocks, found[0], measure, [key], per_block={b: {"band": 1}})
        assert p["band"] == 1 and p["tensor"] == 320 and p["red"] == 16, p
        passes.append(p["n"])
    return max(passes)


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float16", marks=pytest.mark.slow)])
def test_sass_tensor_core_backward_loop_budget(dtype, cuobjdump):
    """The d128 backward on sm_90 (64 x 128 tile), under every installed NVRTC: no spills, and per
    warp and query tile at most 910 instructions on the steady path (FlashAttention-2's backward in
    PyTorch counts 1003 by the same rule, docs/roofline.md), at most 807 of them outside FP32
    arithmetic (FMUL/FFMA/FADD; FA2's 807), at most 1300 on the masked path (the most instructions
    with every dQ ``red``: a sequence-edge tile's predicated copies and per-row mask), and a causal
    diagonal tile inside Sq and Sk at most 1000 (FA2's causal kernel: 1085; with a compare per score
    and bound this kernel counted about 1084); 320 mma and 16 dQ ``red.global.add.v2.f32`` on each,
    none of them behind a branch of its own on the steady one. By the counter's rule (``python -m
    cuflash roofline --sass-of``), the longest masked pass at most MMA_BWD_LONGEST_MASKED, with no
    deterministic-mode dQ code in the loop (its own form)."""
    from cuflash.kernels import attention_bwd_mma
    from cuflash.runtime import nvrtc

    variant = attention_bwd_mma.choose_variant(dtype, 128, 128, 90)
    assert (variant.block_m, variant.block_n) == (64, 128), variant
    majors = cuda_runner.nvrtc_majors()
    assert set(majors) >= set(nvrtc.MAJORS), majors   # both compilers: the test extra installs them
    for major in majors:
        cubin, log = cuda_runner.nvrtc_compile(source.build_source(variant), 90, name=variant.source,
                                               extra_options=("-Xptxas=-v",), nvrtc=major)
        r = cuda_runner.ptxas_resources(log, variant.entry)
        where = f"{variant.entry} with NVRTC {major}.x"
        assert r["spill_stores"] == r["spill_loads"] == r["stack_frame"] == 0, (where, r)
        text = roofline.disassemble(cubin)
        paths = _bwd_loop_paths(text, variant.entry)
        steady, masked = paths["steady"], paths["masked"]
        for t in (steady, masked):
            assert t.get("tensor") == 320 and t.get("red") == 16, (where, t)
        assert steady["instructions"] <= 910, (where, steady)
        assert steady["instructions"] - steady["fp32_arith"] <= 807, (where, steady)
        assert steady.get("predicate", 0) <= 40, (where, steady)   # no per-element test or branch
        assert masked["instructions"] <= 1300, (where, masked)
        diagonal = _bwd_band_pass(text, variant.entry)
        assert diagonal <= 1000, (where, diagonal)
        # the counter's longest masked pass (python -m cuflash roofline --sass-of: the most instructions
        # with every mma and copy): deterministic mode's dQ is a form of its own, so no global load or
        # store of its read-modify-write is left in this loop (with it the pass counted 1338 / 1307)
        from cuflash.analysis import sass_count

        insns = sass_count.parse_functions(text)[variant.entry]
        (starts, ends, _), found = sass_count.main_loops(insns)
        body = found[0][1]
        loop_ops = {x.op.split(".")[0] for b in body for x in insns[starts[b]:ends[b]]}
        assert not loop_ops & {"LDG", "STG"}, (where, loop_ops & {"LDG", "STG"})
        longest = max((c for name, c in sass_count.count_loop(insns).items() if name.startswith("masked")),
                      key=lambda c: c.instructions)   # (masked, or masked+rescale / masked-rescale)
        assert longest.tensor == 320 and longest.instructions <= MMA_BWD_LONGEST_MASKED, (where, longest)


#: the tensor-core backward's longest masked pass by the counter, d128 sm_90 (FA2's causal loop: 1085):
#: 1082 / 1069 (NVRTC 12.9 / 13) with the padded dQ workspace (an edge tile adds like an interior
#: one), the band mask on edge tiles too, and the lse / Dd copies of rows past Sq ignoring their source
#: instead of selecting another address (1086 / 1073 with that select, 1137 / 1128 with a per-row key
#: range on edge tiles, 1215 / 1204 with a predicated add per element)
MMA_BWD_LONGEST_MASKED = 1082


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float16", marks=pytest.mark.slow)])
def test_sass_tensor_core_backward_d64_per_mac(dtype, cuobjdump):
    """The d64 backward on sm_90 takes FA2's 128 x 128 tile, under every installed NVRTC without spills,
    and spends no more instructions outside FP32 arithmetic (everything but FMUL/FFMA/FADD) per 100k
    MACs on its steady path (every mma, copy and dQ ``red``) than FlashAttention-2's d64 backward in
    PyTorch (974 per warp and 128 x 128 tile: 148.6; docs/roofline.md's rule); at most 900 per warp and
    tile (counted 894 / 887 under NVRTC 12.9 / 13; the 64 x 128 tile spends 529 per 64 rows, 161.4)."""
    from cuflash.kernels import attention_bwd_mma

    variant = attention_bwd_mma.choose_variant(dtype, 64, 64, 90)
    assert (variant.block_m, variant.block_n) == (128, 128), variant
    for major in cuda_runner.nvrtc_majors():
        cubin, log = cuda_runner.nvrtc_compile(source.build_source(variant), 90, name=variant.source,
                                               extra_options=("-Xptxas=-v",), nvrtc=major)
        r = cuda_runner.ptxas_resources(log, variant.entry)
        where = f"{variant.entry} with NVRTC {major}.x"
        assert r["spill_stores"] == r["spill_loads"] == r["stack_frame"] == 0, (where, r)
        steady = _bwd_loop_paths(roofline.disassemble(cubin), variant.entry)["steady"]
        assert steady.get("tensor") == 320 and steady.get("red") == 16, (where, steady)   # 655360 MACs a warp
        outside = steady["instructions"] - steady["fp32_arith"]
        assert outside <= 900 and outside / 655360 * 1e5 <= 148.6, (where, outside, steady)


# --------------------------------------------------------------------------- tensor-core forward


@pytest.mark.parametrize("arch,varlen", [(90, False), (90, True), (80, False)], ids=["fixed", "varlen", "fixed-sm_80"])
def test_sass_mma_forward_interior_tiles_copy_without_predicates(arch, varlen, cuobjdump):
    """The tensor-core forward's steady loop (bf16, d128, 128 x 64: sm_90 in the fixed and the
    packed form, sm_80 in the fixed one): an interior tile's 16 ``cp.async`` per thread carry no
    bounds checks, and the named paths (docs/roofline.md) stay within the budgets this kernel is
    held to, per warp and tile: steady at most 800 instructions, steady with both fragments' O
    rescale at most 928 (PyTorch's FA2 build counts 1220 on its steady path by the same rule), and
    in the fixed form a tile inside Sk with one window edge (a causal diagonal) at most 860, its
    mask one compare per offset from the diagonal rather than per score (911 that way). The longer
    of the two one-edge passes counts 849 / 854 on sm_90 and 855 / 858 on sm_80 (NVRTC 12.9 / 13.x).
    No spills. (On sm_80, ptxas 12.9 rebuilt each ldmatrix address with an IMAD when they were
    element pointers: 833 on the steady path.)"""
    from cuflash.analysis import sass_count

    variant = attention_fwd_mma.choose_variant("bfloat16", 128, 128, arch, varlen=varlen)
    assert (variant.block_m, variant.block_n) == (128, 64), variant.entry
    text, resources = roofline.compile_sass(variant, arch)
    assert resources["spill_stores"] == 0 and resources["spill_loads"] == 0, resources
    paths = sass_count.count_loop(sass_count.parse_functions(text)[variant.entry])
    steady, one = paths["steady-rescale"], paths["steady+rescale"]
    assert steady.tensor == one.tensor == 256, paths
    assert steady.instructions <= 800, steady
    # each of the warp's two 16-row fragments has its own rescale block (64 FMUL on its O)
    per_fragment = one.instructions - steady.instructions
    assert 64 <= per_fragment <= 70, paths
    assert steady.instructions + 2 * per_fragment <= 928, paths
    assert steady.classes["predicate"] <= 40, steady   # (with the copies' bounds checks in it: 87)
    if not varlen:   # (the packed form: test_sass_mma_forward_causal_band_in_both_forms)
        diagonal = _band_mask_pass(text, variant.entry, rows=2, key_blocks=8)
        assert diagonal <= 860, diagonal   # (911 on sm_90 with a compare per score and row)


@pytest.mark.parametrize("arch", [90, 80])
def test_sass_mma_forward_causal_band_in_both_forms(arch, cuobjdump):
    """The tensor-core forward (bf16, d128, 128 x 64) masks a causal tile with one compare per offset
    from the diagonal in the packed form too: its diagonal tile's pass is within 2% of the fixed
    form's (the per-row mask counted 945-958 against 845-854). The causal tile across Sk (the last
    tile, so no copy: its keys past Sk hidden by the diagonal) takes the band pass too, at most 860
    per warp and tile in both forms (the per-row mask counted 879-903). No spills."""
    counts = {}
    for varlen in (False, True):
        variant = attention_fwd_mma.choose_variant("bfloat16", 128, 128, arch, varlen=varlen)
        assert (variant.block_m, variant.block_n) == (128, 64), variant.entry
        text, resources = roofline.compile_sass(variant, arch)
        assert resources["spill_stores"] == 0 and resources["spill_loads"] == 0, (variant.entry, resources)
        diagonal = _band_mask_pass(text, variant.entry, rows=2, key_blocks=8, right_edge_only=True)
        straddle = _band_mask_pass(text, variant.entry, rows=2, key_blocks=8, right_edge_only=True, copies=False)
        assert straddle <= 860, (variant.entry, straddle)
        counts[varlen] = diagonal
    assert counts[False] <= 860 and counts[True] <= 1.02 * counts[False], counts


def _band_mask_pass(text: str, entry: str, *, rows: int, key_blocks: int, right_edge_only: bool = False,
                    copies: bool = True) -> int:
    """The tensor-core forward's pass through a masked tile inside Sk with one window edge (a causal
    diagonal; ``rows`` 16-row fragments per warp, ``key_blocks`` 8-key blocks per tile): every mma and
    copy, no O rescale, and a mask block that selects each of the lane's 32 ``rows`` scores (FSEL)
    with one compare per distinct offset from the diagonal (2 (key_blocks + 2 rows - 1) ISETP), not
    one per score. The longest such pass (the left and the right edge each have their block; with
    ``right_edge_only``, the causal one's: where there are two, its block opens with a compare, the
    bound formed before the branch, where the left edge's first forms its bound). With ``copies``
    False, the pass without the next tile's copy (the last tile)."""
    from cuflash.analysis import sass_count

    insns = sass_count.parse_functions(text)[entry]
    blocks, found = sass_count.main_loops(insns)
    starts, ends, _ = blocks
    h, body, latches = found[0]
    ops = {b: collections.Counter(x.op for x in insns[starts[b]:ends[b]]) for b in body}
    band = [b for b in body if ops[b]["FSEL"] == 32 * rows and not ops[b]["MUFU"]
            and ops[b]["ISETP"] <= 2 * (key_blocks + 2 * rows - 1)]
    assert band, "no mask block with one compare per offset from the diagonal"
    if right_edge_only and len(band) > 1:
        band = [b for b in band if insns[starts[b]].op == "ISETP"]
    assert not right_edge_only or len(band) == 1, band
    heavy = {b: {"heavy": 1} for b in body if ops[b]["FMUL"] >= 64}   # O rescales, the scale <= 0 pre-scale

    def measure(x):
        if x.op == "NOP":
            return {}
        return {"n": 1, "tensor": int(sass_count.classify(x.op) == "tensor"), "copies": int(x.op in sass_count.COPIES)}

    def key(t):
        return (t.get("band", 0), t.get("tensor", 0), t.get("copies", 0) if copies else -t.get("copies", 0),
                -t.get("heavy", 0), -t.get("n", 0))

    passes = []
    for b in band:
        (p,) = sass_count.best_passes(insns, blocks, found[0], measure, [key], per_block={**heavy, b: {"band": 1}})
        assert p["band"] == 1 and not p.get("heavy"), p
        passes.append(p["n"])
    return max(passes)
