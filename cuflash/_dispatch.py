"""The dispatcher: which forward kernel serves a validated attention call on a given arch.

Today there is one kernel tier, the portable SIMT kernel (every dtype, sm_75+). Faster tiers
(tensor cores on sm_80+, Hopper) register here, each with the condition under which it applies;
the first applicable tier wins, so a problem the fast kernels cannot take falls back visibly.
"""

from __future__ import annotations

from cuflash import _attention_simt


def forward_tier(problem, arch: int, arrays=None):
    """The kernel module that runs ``problem`` on ``sm_<arch>``.

    A tier module provides ``forward(problem, q, k, v, out, return_lse, *, xp, arch, launch)``
    and ``choose_variant(...)``. ``arrays`` (q, k, v) lets a tier check alignment of views.
    """
    return _attention_simt


def run_forward(problem, q, k, v, out, return_lse: bool, *, xp, arch: int, launch):
    """Run the forward on the tier :func:`forward_tier` picks."""
    tier = forward_tier(problem, arch, (q, k, v))
    return tier.forward(problem, q, k, v, out, return_lse, xp=xp, arch=arch, launch=launch)
