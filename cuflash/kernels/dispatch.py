"""The dispatcher: which forward kernel serves a validated attention call on a given arch.

Tiers, fastest first; the first that applies wins, so a problem the fast kernels cannot take
falls back visibly (:func:`describe_choice` names the tier, the variant, its tiles and, for a
fallback, why; the ``cuflash.dispatch`` logger logs the same line at DEBUG level):

1. tensor cores (:mod:`cuflash.kernels.attention_fwd_mma`): float16/bfloat16 on sm_80+, rows 16-byte
   aligned (head dims, strides and view offsets multiples of 8 elements);
2. portable SIMT (:mod:`cuflash.kernels.attention_fwd_simt`): every dtype, sm_75+.

The simulator (``backend="sim"``) asks with its emulated arch (``cuflash.sim.options(arch=...)``,
sm_90 by default), so it runs the variant an sm_90 device would get.
"""

from __future__ import annotations

import logging

from cuflash.kernels import (
    attention_bwd_mma,
    attention_bwd_simt,
    attention_fwd_mma,
    attention_fwd_simt,
)

log = logging.getLogger("cuflash.dispatch")

#: tiers in order of preference: (name, module); each module has ``unsupported_reason`` or
#: takes everything
TIERS = (("tensor-core mma.sync", attention_fwd_mma), ("portable SIMT", attention_fwd_simt))
#: the backward's tiers, likewise (:func:`backward_tier`)
BACKWARD_TIERS = (("tensor-core mma.sync", attention_bwd_mma), ("portable SIMT", attention_bwd_simt))


def _choose(problem, arch: int, arrays=None, tiers=TIERS):
    """``(module, reasons)``: the tier that runs ``problem`` and why each faster one does not."""
    reasons = []
    for name, mod in tiers:
        check = getattr(mod, "unsupported_reason", None)
        why = check(problem, arch, arrays) if check is not None else None
        if why is None:
            return mod, reasons
        reasons.append(f"{name} tier not used: {why}")
    raise AssertionError("cuflash: the SIMT tier takes every problem")  # never


def forward_tier(problem, arch: int, arrays=None):
    """The kernel module that runs ``problem`` on ``sm_<arch>``.

    A tier module provides ``forward(problem, q, k, v, out, return_lse, *, xp, arch, launch)``
    and ``choose_variant(...)``. ``arrays`` ((q, k, v) or (q, k, v, out)) lets a tier check the
    alignment of views; without it only shapes and dtypes decide.
    """
    return _choose(problem, arch, arrays)[0]


def backward_tier(problem, arch: int, arrays=None):
    """The kernel module that runs the backward of ``problem`` on ``sm_<arch>``: the tensor-core
    backward (float16/bfloat16, sm_80+, a tile of the head dims' bucket fitting the shared memory,
    rows 16-byte aligned) or the portable
    SIMT one. A tier module provides ``backward(problem, dout, q, k, v, out, lse, *, xp, arch,
    launch, deterministic)``; ``arrays`` is ``(q, k, v, out, dout)`` (alignment of views)."""
    mod, reasons = _choose(problem, arch, arrays, BACKWARD_TIERS)
    if log.isEnabledFor(logging.DEBUG):
        name = dict((m, n) for n, m in BACKWARD_TIERS)[mod]
        log.debug("sm_%d: backward on the %s tier%s", arch, name, "; " + "; ".join(reasons) if reasons else "")
    return mod


def describe_choice(problem, arch: int, arrays=None) -> str:
    """One line naming the tier, the variant and its tiles that run ``problem`` on ``sm_<arch>``,
    and why any faster tier was passed over, e.g.::

        sm_90: tensor-core mma.sync tier, cuflash_attn_fwd_mma_bf16_d128_m128_n64: 4 warps of 32 query rows, ...
        sm_90: portable SIMT tier, cuflash_attn_fwd_simt_f16_d128_m32_n32 (Br=32, Bc=32, ...);
            tensor-core mma.sync tier not used: D=59 is not a multiple of 8 (...)
    """
    mod, reasons = _choose(problem, arch, arrays)
    v = mod.choose_variant(problem.dtype, problem.head_dim, problem.head_dim_v, arch)
    name = dict((m, n) for n, m in TIERS)[mod]
    what = v.describe() if hasattr(v, "describe") else (
        f"{v.entry} (Br={v.block_m}, Bc={v.block_n}, {v.block[0]} threads, {v.smem_bytes} B shared memory)")
    line = f"sm_{arch}: {name} tier, {what}"
    if reasons:
        line += "; " + "; ".join(reasons)
    return line


def run_forward(problem, q, k, v, out, return_lse: bool, *, xp, arch: int, launch):
    """Run the forward on the tier :func:`forward_tier` picks."""
    arrays = (q, k, v, out)
    tier = forward_tier(problem, arch, arrays)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("%s", describe_choice(problem, arch, arrays))
    return tier.forward(problem, q, k, v, out, return_lse, xp=xp, arch=arch, launch=launch)
