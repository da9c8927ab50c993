"""Planning and running the forward kernels that take the common forward argument list.

The portable (``attention_fwd_simt.cu``) and tensor-core (``attention_fwd_mma.cu``) forwards
share one parameter list (:mod:`cuflash.kernels.launch_args`) and one grid: a block per (query
tile, head, batch) on a 1-D grid, a packed batch's blocks finding their sequence through its index.
A tier's host module chooses the variant; :func:`run_variant` allocates, plans and launches it.

Imports: :mod:`cuflash.kernels.launch_args` and :mod:`cuflash.runtime`.
"""

from __future__ import annotations

import numpy as np

from cuflash.kernels import launch_args as la
from cuflash.runtime import plan

__all__ = ["plan_forward", "run_variant"]


def _views(problem, q, k, v, out, lse):
    """``(views, lse view, batch shape)``: q, k, v, out as ``(*batch, H, S, D)`` and lse as
    ``(*batch, H, Sq)``; a packed batch is one ``(1, H, total, D)`` batch."""
    p = problem
    if p.varlen is not None:
        return [la.canonical(a[None], "bshd", 4) for a in (q, k, v, out)], lse[None], (1,)
    views = [la.canonical(a, p.layout, q.ndim) for a in (q, k, v, out)]
    lse_v = lse[None] if (p.layout == "bhsd" and q.ndim == 2) else lse
    return views, lse_v, p.batch_shape


def plan_forward(problem, q, k, v, out, lse, variant, call) -> list[plan.LaunchPlan]:
    """Launch plans of ``variant`` (any forward kernel of the common argument list) for
    ``problem``: one launch unless the batch dims cannot merge into one stride (the modifier
    arrays with batch dims ride along with q's batches). ``lse`` must be contiguous float32 of
    ``lse_shape``; the arrays are device arrays of ``call``."""
    p = problem
    vl = p.varlen
    views, lse_v, batch_shape = _views(p, q, k, v, out, lse)
    mods_on = getattr(variant, "mods", False)
    mviews = la.modifier_views(p, call) if mods_on else {}
    batched = [n for n in la.MOD_BATCHED if n in mviews] if vl is None else []
    every = views + [lse_v] + [mviews[n] for n in batched]
    batches, inner = ([()], vl.batch) if vl is not None else la.batch_slices(batch_shape, every)
    num_q_tiles = -(-p.seqlen_q // variant.block_m)
    grid = num_q_tiles * p.num_heads_q * inner
    if grid > plan.MAX_GRID_DIMS[0]:
        raise NotImplementedError(f"{p.func}: {grid} thread blocks exceed the grid limit {plan.MAX_GRID_DIMS[0]}")
    sizes = ((p.seqlen_q, p.seqlen_k) if vl is None else (vl.total_q, vl.total_k)) + (num_q_tiles,)

    def st(a):   # element strides; a packed batch has one sequence index, not a batch stride
        t = la.element_strides(a)
        return (0,) + t[1:] if vl is not None else t

    plans = []
    for idx in batches:
        sel = la.select_batches(idx, batch_shape, every)
        launch_mods = dict(mviews, **dict(zip(batched, sel[5:])))
        args = (
            *la.forward_args(p, sel[:5], [st(a) for a in sel[:4]], st(sel[4]), sizes, call),
            *la.varlen_args(p, call),
            *la.dropout_args(p, la.flat_batch(idx, batch_shape), getattr(variant, "dropout", False)),
            *la.mods_args(p, launch_mods, call, mods_on, bool(getattr(variant, "user_mod", 0)),
                          la.flat_batch(idx, batch_shape),
                          la.block_sparse_args(p, call, False, grid) if getattr(variant, "block_sparse", False) else ()),
        )
        plans.append(plan.LaunchPlan(variant, variant.entry, (grid, 1, 1), variant.block, variant.smem_bytes, args))
    return plans


def outputs(problem, out, call) -> tuple:
    """``(out, lse)`` of a forward on ``call``'s device: ``out`` as passed (or allocated) and a new
    float32 ``lse``; with a device-resident packed index (not checked on the host) both start as
    NaN, so rows no tile covers (an index that disagrees with ``max_seqlen_q``) read NaN, never
    stale data. Every forward tier's launch path allocates through it."""
    p = problem
    if out is None:
        out = call.empty(p.out_shape, p.out_dtype)   # (q's dtype, or an fp8 call's out_dtype)
    lse = call.empty(p.lse_shape, np.float32)
    if p.varlen is not None and not p.varlen.checked:
        out.fill(np.nan)
        lse.fill(np.nan)
    return out, lse


def run_variant(problem, q, k, v, out, variant, call):
    """``(out, lse)``: allocate what the caller did not pass (``out`` None) on ``call``'s device,
    plan ``variant`` (:func:`plan_forward`) and launch. With a device-resident packed index the
    outputs start as NaN, so rows no tile covers (a bad index) read NaN, never stale data."""
    p = problem
    out, lse = outputs(p, out, call)
    if not p.is_empty:
        for launch_plan in plan_forward(p, q, k, v, out, lse, variant, call):
            call.launch(launch_plan)
    return out, lse
