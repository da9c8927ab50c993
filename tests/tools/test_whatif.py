"""``python -m cuflash roofline --what-if``: the per-instruction rules on hand-written SASS (each
figure from its source: the PTX shapes, the SASS NVRTC emits, the datasheets), and the model of a
TF32 and an m8n8k4 form derived from the real float16 kernels. Model figures, not speeds."""

from __future__ import annotations

import pytest

from cuflash.analysis import roofline

SASS = """
        Function : rules
        /*0000*/                   HMMA.16816.F32 R12, R8, R16, R12 ;
        /*0010*/                   HMMA.1688.F32 R12, R8, R16, R12 ;
        /*0020*/                   LDSM.16.M88.4 R8, [R3] ;
        /*0030*/                   LDSM.16.MT88.4 R8, [R3] ;
        /*0040*/                   F2FP.PACK_AB R4, R5, R6 ;
        /*0050*/                   LDGSTS.E.BYPASS.128 [R2], desc[UR4][R4.64] ;
        /*0060*/                   F2F.F16.F32 R4, R5 ;
        /*0070*/                   FFMA.FTZ R4, R5, R6, R7 ;
        /*0080*/                   EXIT ;
"""


def _rule(counts, index):
    c = counts(roofline.parse_sass(SASS, "rules")[index])
    return {k: v for k, v in c.items() if v}


def test_tf32_rules():
    """m16n8k16 f16 (2048 MACs) is two m16n8k8 tf32 (1024 each); 32-bit fragments are twice the
    bytes: Q/K by twice the ldmatrix, V by LDS.32 (512 B of f16 -> 1024 B, 8 x 128 B); a packed P
    pair is two cvt.rna.tf32.f32 of 3 instructions; a 16-byte cp.async of f16 is 32 B of f32
    rounded on the way (2 LDG.128 + 8 x 3 + 2 STS.128)."""
    assert _rule(roofline.tf32_counts, 0) == {"instructions": 2, "tensor": 2, "macs": 2048}
    assert _rule(roofline.tf32_counts, 2) == {"instructions": 2, "smem_read": 1024}
    assert _rule(roofline.tf32_counts, 3) == {"instructions": 8, "smem_read": 1024}
    assert _rule(roofline.tf32_counts, 4) == {"instructions": 6}
    assert _rule(roofline.tf32_counts, 5) == {"instructions": 28, "global_read": 1024, "smem_write": 1024}
    assert _rule(roofline.tf32_counts, 7) == {"instructions": 1, "fp32": 1}
    with pytest.raises(ValueError, match="replaces HMMA.16816, not HMMA.1688"):
        _rule(roofline.tf32_counts, 1)


def test_m8n8k4_rules():
    """m16n8k8 (1024 MACs per warp) is one m8n8k4 per warp, four HMMA.884 steps of 256 MACs; no
    ldmatrix on sm_70: LDS.64 (256 B per warp), every operand element loaded by two quad pairs; one
    more instruction per converted element of P (a shuffle and a select per packed pair)."""
    assert _rule(roofline.m8n8k4_counts, 1) == {"instructions": 4, "tensor": 4, "macs": 1024}
    assert _rule(roofline.m8n8k4_counts, 2) == {"instructions": 4, "smem_read": 1024}
    assert _rule(roofline.m8n8k4_counts, 3) == {"instructions": 4, "smem_read": 1024}
    assert _rule(roofline.m8n8k4_counts, 6) == {"instructions": 2}
    with pytest.raises(ValueError, match="replaces HMMA.1688, not HMMA.16816"):
        _rule(roofline.m8n8k4_counts, 0)


def test_form_rates_are_the_datasheets():
    """Dense TF32 is half of FP16 on the A100 (156 of 312 TFLOP/s: 512 MACs per cycle per SM) and on
    the H100/H200 (494.7 of 989.4: 1024 for wgmma, mma.sync at 60% of it); the V100's FP16 tensor
    peak is 125 TFLOP/s over 80 SMs (512)."""
    rate = {d: roofline.WHAT_IF_FORMS["tf32"].macs_per_cycle(roofline.RATES[d]) for d in ("a100", "h100", "h200")}
    assert rate["a100"] == pytest.approx(512) and rate["h100"] == rate["h200"] == pytest.approx(0.6 * 1024)
    assert roofline.WHAT_IF_FORMS["m8n8k4"].macs_per_cycle(roofline.RATES["v100"]) == pytest.approx(512)


def test_command_line_refusals(capsys):
    for argv, message in ((["--what-if", "m8n8k4"], "--what-if m8n8k4 models --device v100, not h200"),
                          (["--what-if", "tf32", "--device", "v100"], "models --device a100 or h100 or h200"),
                          (["--what-if", "tf32", "--backward"], "--backward with --what-if")):
        with pytest.raises(SystemExit) as exit_info:
            roofline.main(argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.fixture(scope="module")
def tools():
    if roofline.find_tool("cuobjdump") is None or roofline.find_tool("nvdisasm") is None:
        pytest.fail("cuobjdump/nvdisasm not found: install the test extra")


def test_tf32_on_the_a100_is_tensor_bound_at_its_tf32_peak(tools):
    """The float16 d64 forward (sm_80) as TF32: the same tile math, twice the tensor instructions and
    the operand bytes, so twice the tensor cycles; still tensor-bound in the model, at the datasheet's
    TF32 peak, 8x the portable float32 forward's ceiling (FP32-bound at the FP32 peak)."""
    w = roofline.what_if("tf32", "a100", 64)
    m, b = w.model, w.base
    assert m.macs_per_tile == b.macs_per_tile == m.block_m * m.block_n * 2 * 64
    assert m.tensor_per_tile == 2 * b.tensor_per_tile and m.pipes["tensor"] == pytest.approx(2 * b.pipes["tensor"])
    assert m.smem_read_bytes_per_tile == 2 * b.smem_read_bytes_per_tile
    assert m.instructions_per_tile > b.instructions_per_tile and m.masked_instructions_per_tile >= m.instructions_per_tile
    assert m.bound == "tensor" and m.ceiling_tflops == pytest.approx(156, rel=0.01) and m.ctas_per_sm >= 1
    assert w.today.bound == "fp32" and w.today.tensor_per_tile == 0 and w.gain == pytest.approx(8, rel=0.05)


@pytest.mark.slow
def test_m8n8k4_on_the_v100(tools, capsys):
    """The sm_75 form's d128 forward as m8n8k4: four times the tensor instructions at the same MACs
    and rate, twice the operand bytes; tensor-bound in the model at the V100's 125 TFLOP/s, 8x the
    portable tier's float16 ceiling. The command prints it as a model."""
    w = roofline.what_if("m8n8k4", "v100", 128)
    m, b = w.model, w.base
    assert m.macs_per_tile == b.macs_per_tile and m.tensor_per_tile == 4 * b.tensor_per_tile
    assert m.pipes["tensor"] == pytest.approx(b.pipes["tensor"])   # the same MACs at 512 per cycle per SM (T4, V100)
    assert m.smem_read_bytes_per_tile == 2 * b.smem_read_bytes_per_tile
    assert m.bound == "tensor" and m.ceiling_tflops == pytest.approx(125, rel=0.01)
    assert w.today.bound == "fp32" and w.gain == pytest.approx(8, rel=0.05)
    assert roofline.main(["--what-if", "m8n8k4", "--device", "v100", "--head-dim", "128", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "MODEL, not a measurement, of a kernel that does not exist" in out and "\n 128  128x32 " in out
