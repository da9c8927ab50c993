"""Tensor-core forms that do not exist, modelled: ``python -m cuflash roofline --what-if FORM``.

Two questions the roofline answers before anyone builds a kernel, each a **model figure, never a
speed**:

* ``tf32``: would a float32 forward on the tensor cores (``mma.sync.m16n8k8`` with ``.tf32``
  operands, sm_80 and newer) pay for float32 users, who run the portable (CUDA-core) tier today?
* ``m8n8k4``: would the V100's tensor cores (``mma.sync.m8n8k4``, sm_70) pay for a tier there,
  where float16 runs the portable tier today?

Method. The per-warp instructions of the nearest kernel that exists (the tensor-core forward in
float16 the dispatcher picks: sm_80/sm_90's for ``tf32``, the sm_75 form's for ``m8n8k4``) are
read from its SASS along the roofline's unmasked and masked passes, and each instruction is
replaced by what the form would issue in its place (:func:`tf32_counts`, :func:`m8n8k4_counts`;
every rule says where its figure comes from). The tile, the softmax and the bookkeeping are the
same work in either form, so they are kept as counted. The per-SM rate of the form's tensor
instruction comes from the datasheets (:data:`FORMS`). The result goes through the roofline's
own :func:`cuflash.analysis.roofline.model`, beside the model of the tier those users run today
(the portable forward, counted from its own SASS).

What the model leaves out: registers (TF32 fragments take twice the registers of 16-bit ones, and
the m8n8k4 operands are held twice, once per quad pair: a real kernel would take a smaller tile,
whose per-MAC counts the model assumes equal), bank conflicts of the 32-bit and 64-bit
shared-memory loads, and latency; as for every roofline figure, a GPU run has to confirm it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from cuflash.analysis import roofline, sass_count

__all__ = ["Form", "FORMS", "WhatIf", "tf32_counts", "m8n8k4_counts", "what_if", "format_table"]

#: instructions of one ``cvt.rna.tf32.f32`` on sm_80 and sm_90 (NVRTC 12.9's SASS: ``FSETP.GEU``
#: on |x| < inf, a predicated ``IADD`` of 0x1000, ``LOP3`` keeping the top 19 bits)
CVT_TF32 = 3


def tf32_counts(insn: sass_count.Insn) -> dict:
    """What one instruction of the float16 tensor-core forward (sm_80/sm_90 SASS) becomes in a TF32
    form of the same tile, as :func:`cuflash.analysis.roofline.insn_counts` counts it.

    * ``HMMA.16816`` (m16n8k16 f16, 2048 MACs) -> two ``HMMA.1688.F32.TF32`` (m16n8k8 tf32, 1024
      MACs each: the SASS NVRTC 12.9 emits for ``mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32``
      on sm_80 and sm_90).
    * ``LDSM`` (ldmatrix, 16-bit elements): the same fragments hold 32-bit elements, twice the bytes.
      Q and K (not transposed) stay ldmatrix, twice as many; V's ``.trans`` form moves 16-bit
      elements, so 32-bit V elements are read by ``LDS.32`` (128 B per warp instruction).
    * ``F2FP`` (P packed to f16x2) -> P rounded to tf32, two ``cvt.rna.tf32.f32`` of
      :data:`CVT_TF32` instructions (the accumulator's columns are then the A operand's up to an
      order of the keys, which V's rows follow: no shuffle).
    * ``LDGSTS`` (cp.async, 16 B = 8 float16 per lane) -> 32 B of float32 per lane rounded to tf32
      on the way: 2 ``LDG.128``, 8 x :data:`CVT_TF32`, 2 ``STS.128`` (cp.async cannot round).

    Everything else (softmax, masks, addresses, barriers) is the same work on the same tile.

    Raises
    ------
    ValueError
        For a tensor instruction other than ``HMMA.16816``.
    """
    c = roofline.insn_counts(insn)
    op, mods = insn.op, insn.mods
    if op in roofline.TENSOR_OPS:
        if op != "HMMA" or not mods.startswith(".16816"):
            raise ValueError(f"cuflash.roofline: --what-if tf32 replaces HMMA.16816, not {op}{mods}")
        return {**c, "instructions": 2, "tensor": 2}
    if op == "LDSM":
        nbytes = 2 * c["smem_read"]
        return {**c, "instructions": nbytes // 128 if ".MT88" in mods else 2, "smem_read": nbytes}
    if op == "F2FP":
        return {**c, "instructions": 2 * CVT_TF32}
    if op == "LDGSTS":
        width = c["global_read"] // 32   # bytes per lane, float16
        loads = 2 * width // 16
        return {**c, "instructions": 2 * loads + CVT_TF32 * (width // 2), "global_read": 2 * c["global_read"],
                "smem_write": 2 * c["smem_write"]}
    return c


def m8n8k4_counts(insn: sass_count.Insn) -> dict:
    """What one instruction of the sm_75 form (the float16 tensor-core forward built for Turing:
    m16n8k8, register-staged copies) becomes in an sm_70 form on ``mma.sync.m8n8k4``.

    * ``HMMA.1688`` (m16n8k8, 1024 MACs per warp) -> one m8n8k4 per warp (four quad pairs, each an
      8 x 8 x 4 product: 1024 MACs), which sm_70 runs as four ``HMMA.884.F32.F32`` steps of 256
      MACs (Jia et al. 2018, "Dissecting the NVIDIA Volta GPU Architecture via
      Microbenchmarking", section 4: a 16 x 16 x 16 wmma with float accumulation is 16 HMMA, 4
      sets of 4 steps).
    * ``LDSM`` (sm_70 has no ldmatrix) -> ``LDS.64`` (a thread's four 16-bit operand elements, 256 B
      per warp instruction). Each quad pair holds its own A and B, and a 16 x 16 warp tile is
      four quad pairs, so every operand element is loaded twice: twice the bytes. V is read the
      same way: m8n8k4 takes B row-major (``.row``), so V needs no transpose.
    * ``F2F.F16.F32`` (one element of P converted): one more instruction, for the exchange between
      threads that turns the m8n8k4 float accumulator's fragment into the A operand's (one
      ``SHFL`` and one ``SEL`` per packed register of P, an assumption of the model).

    The copies (``LDG`` + ``STS``, no cp.async before sm_80) and everything else stay as
    counted.

    Raises
    ------
    ValueError
        For a tensor instruction other than ``HMMA.1688``.
    """
    c = roofline.insn_counts(insn)
    op, mods = insn.op, insn.mods
    if op in roofline.TENSOR_OPS:
        if op != "HMMA" or not mods.startswith(".1688"):
            raise ValueError(f"cuflash.roofline: --what-if m8n8k4 replaces HMMA.1688, not {op}{mods}")
        return {**c, "instructions": 4, "tensor": 4}
    if op == "LDSM":
        nbytes = 2 * c["smem_read"]
        return {**c, "instructions": nbytes // 256, "smem_read": nbytes}
    if op == "F2F" and mods.startswith(".F16.F32"):
        return {**c, "instructions": 2}
    return c


@dataclass(frozen=True)
class Form:
    """A modelled tensor-core form: the devices it is asked about, the kernel it is derived from,
    the per-SM rate of its tensor instruction and the users' dtype today."""

    name: str
    title: str
    devices: tuple
    #: the per-instruction rule (:func:`tf32_counts`, :func:`m8n8k4_counts`)
    counts: Callable
    #: dense MACs per cycle per SM of the form's mma.sync, from the device's rates
    macs_per_cycle: Callable
    rate_source: str
    #: the arch whose float16 tensor-core kernel is the base (None: the device's)
    base_arch: int | None
    #: the dtype those users run on the portable tier today, and the form's operand bytes
    users_dtype: str
    operand_bytes: int


def _tf32_rate(rates: roofline.SmRates) -> float:
    # the datasheet's dense TF32 peak in MACs per cycle per SM; mma.sync on sm_90 at the same 60%
    # of wgmma's rate as the 16-bit form
    macs = rates.device.tf32_tensor_tflops * 1e12 / (rates.sms * 2 * rates.clock_ghz * 1e9)
    return macs * (rates.mma_sync_macs / rates.wgmma_macs if rates.wgmma_macs else 1.0)


#: the forms ``--what-if`` models
FORMS = {
    "tf32": Form(
        "tf32", "float32 on the tensor cores as TF32 (mma.sync m16n8k8 .tf32)", ("a100", "h100", "h200"),
        tf32_counts, _tf32_rate,
        "the datasheets' dense TF32 peaks, half their FP16 ones: A100 156 TFLOP/s (512 MACs per cycle per SM "
        "at 1.41 GHz), H100 and H200 SXM 494.7 TFLOP/s (1024 per SM at 1.83 GHz, for wgmma; mma.sync at the "
        "same 60% of it as in the 16-bit form)", None, "float32", 4),
    "m8n8k4": Form(
        "m8n8k4", "float16 on the V100's tensor cores (mma.sync m8n8k4)", ("v100",),
        m8n8k4_counts, lambda rates: rates.mma_sync_macs,
        "the V100 SXM2 datasheet's 125 TFLOP/s FP16 tensor peak (8 tensor cores of 64 FP16 FMA per cycle: "
        "512 MACs per cycle per SM at 1.53 GHz)", 75, "float16", 2),
}


@dataclass(frozen=True)
class WhatIf:
    """The model of one form at one head dim on one device: the form (``model``, a
    :class:`cuflash.analysis.roofline.Roofline` of the derived counts), the kernel it was derived
    from (``base``, as the roofline models it there), and the portable tier those users run today
    (``today``). Ceilings are predictions."""

    form: str
    device: str
    head_dim: int
    base: roofline.Roofline
    model: roofline.Roofline
    today: roofline.Roofline
    base_arch: int
    stages: int

    @property
    def masked_issue(self) -> float:
        """The issue pipe's cycles per tile and CTA on the masked path (the model's, for the form)."""
        return self.model.warps * self.model.masked_instructions_per_tile / roofline.RATES[self.device].issue

    @property
    def gain(self) -> float:
        """The form's predicted ceiling over today's tier's (model figures)."""
        return self.model.ceiling_tflops / self.today.ceiling_tflops if self.today.ceiling_tflops else float("inf")

    def as_dict(self) -> dict:
        return {"form": self.form, "device": self.device, "head_dim": self.head_dim, "base_arch": self.base_arch,
                "stages": self.stages, "gain": round(self.gain, 2), "base": self.base.as_dict(),
                "model": self.model.as_dict(), "today": self.today.as_dict()}


def base_variant(form: Form, variant, arch: int):
    """The float16 tile the form is derived from: the dispatcher's ``variant``, or where the form's
    operands (:attr:`Form.operand_bytes`) would not fit its shared memory on ``sm_<arch>``, the same
    tile with one K/V stage, then with half the keys per tile (down to 16)."""
    from cuflash.runtime import plan

    def fits(v):
        return form.operand_bytes // 2 * v.smem_bytes <= plan.max_dynamic_smem(arch)

    if not fits(variant):
        variant = dataclasses.replace(variant, single_stage=True)
    while not fits(variant) and variant.block_n > 16:
        variant = dataclasses.replace(variant, block_n=variant.block_n // 2)
    return variant


def _passes(variant, arch: int, measure):
    """(unmasked, masked) :class:`roofline.Counts` of the variant's main loop under ``measure``, and
    the ptxas resources."""
    text, res = roofline.compile_sass(variant, arch)
    insns = roofline.parse_sass(text, variant.entry)
    blocks, loops = sass_count.main_loops(insns, innermost=False)
    found = [sass_count.best_passes(insns, blocks, loop, measure,
                                    [lambda t: roofline.unmasked_pass(roofline._full(t)),
                                     lambda t: roofline.masked_pass(roofline._full(t))]) for loop in loops]
    unmasked = min((roofline.Counts(**roofline._full(f[0])) for f in found), key=lambda c: c.instructions)
    masked = max((roofline.Counts(**roofline._full(f[1])) for f in found), key=lambda c: c.instructions)
    return unmasked, masked, res


def what_if(form: str, device: str, head_dim: int, *, seqlen: int = 8192) -> WhatIf:
    """Model ``form`` (a key of :data:`FORMS`) for the forward at ``head_dim`` on ``device``.

    Raises
    ------
    ValueError
        For an unknown form, a device the form is not asked about, or a head dim no bucket serves.
    RuntimeError
        If NVRTC or the SASS tools fail or are missing.
    """
    import numpy as np

    from cuflash.kernels import attention_fwd_mma

    if form not in FORMS:
        raise ValueError(f"cuflash.roofline: what-if form {form!r} must be one of {sorted(FORMS)}")
    f = FORMS[form]
    if device not in f.devices:
        raise ValueError(f"cuflash.roofline: --what-if {form} models {', '.join(f.devices)}, not {device!r}")
    rates = roofline.RATES[device]
    arch = f.base_arch or rates.arch
    variant = base_variant(f, attention_fwd_mma.choose_variant(np.float16, head_dim, head_dim, arch), rates.arch)
    base = roofline.analyze(variant, device if arch == rates.arch else {75: "t4"}[arch])
    unmasked, masked, res = _passes(variant, arch, f.counts)
    smem = f.operand_bytes // 2 * variant.smem_bytes + res["static_smem"]
    direction, bm, bn, d, dv = roofline._shape_of(variant)
    kernel = roofline.Kernel(f"{variant.entry} as {form}", direction, bm, bn, d, dv, variant.threads,
                             res["registers"], res["spill_stores"] + res["spill_loads"], smem, f.operand_bytes)
    form_rates = dataclasses.replace(rates, mma_sync_macs=f.macs_per_cycle(rates))
    modelled = roofline.model(unmasked, masked, kernel, rates=form_rates, seqlen=seqlen)
    (portable,) = roofline.variants(rates.arch, backward=False, dtype=f.users_dtype, head_dim=head_dim)
    today = roofline.analyze(portable, device, seqlen=seqlen)
    return WhatIf(form, device, head_dim, base, modelled, today, arch, variant.stages)


def format_table(rows: list[WhatIf]) -> str:
    """One line per head dim: the form's tile, K/V stages, CTAs per SM, pipes (``issue*``: the
    masked path's issue cycles), bound and predicted ceiling; today's tier's bound and ceiling; the
    ratio of the two ceilings."""
    head = (f"{'D':>4} {'BrxBc':>7} {'st':>2} {'CTA/SM':>6} {'tensor':>6} {'smem':>6} {'issue':>6} {'issue*':>6} "
            f"{'bound':>7} {'TFLOP/s':>7} | {'today':>7} {'TFLOP/s':>7} | {'ratio':>5}")
    lines = [head, "-" * len(head)]
    for w in rows:
        m, p = w.model, w.model.pipes
        lines.append(f"{w.head_dim:>4} {f'{m.block_m}x{m.block_n}':>7} {w.stages:>2} {m.ctas_per_sm:>6} "
                     f"{p['tensor']:>6.0f} {p['smem']:>6.0f} {p['issue']:>6.0f} {w.masked_issue:>6.0f} {m.bound:>7} "
                     f"{m.ceiling_tflops:>7.0f} | "
                     f"{w.today.bound:>7} {w.today.ceiling_tflops:>7.0f} | {w.gain:>5.1f}")
    return "\n".join(lines)
