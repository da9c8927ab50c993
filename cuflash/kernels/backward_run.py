"""The backward's three stages, around any main-stage variant of the common argument list.

``dot`` (``Dd = rowsum(dO * O)``, one warp per row), ``main`` (per key tile: dK and dV in
registers, dQ added into a float32 workspace, ``(*batch, Hq, Sq, D)``, or for the tensor-core
tier's fixed plain forms rows padded to the query tile and a pitch of the head-dim bucket) and ``convert`` (the workspace, or the sum of the
deterministic mode's partials, to the input dtype). The dot and convert stages are the portable
kernels of ``kernels_cu/attention_bwd_simt.cu``; the main stage is the tier's (the portable one,
or the tensor-core one of ``attention_bwd_mma.cu``, which takes the same arguments).

``deterministic`` (:func:`deterministic_splits`): the main stage runs ``num_splits`` blocks per
(kv head, batch); block s takes key tiles s, s + num_splits, ... in order (one tile per block per
launch) and adds its dQ to its own float32 partial buffer, so the order never varies; the
convert stage sums the partials in split order. Cost: a workspace of ``num_splits`` (at most
:data:`MAX_DETERMINISTIC_SPLITS`) float32 copies of dq instead of one, fewer blocks in flight
when ``batch * kv heads`` is small, and ``num_k_tiles / num_splits`` launches.

Imports: :mod:`cuflash.kernels.launch_args`, the SIMT backward's variants and :mod:`cuflash.runtime`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from cuflash.kernels import attention_bwd_mma
from cuflash.kernels import launch_args as la
from cuflash.kernels.attention_bwd_simt import THREADS, AttentionBwdSimt
from cuflash.runtime import plan, score_mod, variants

__all__ = ["backward", "deterministic_splits", "MAX_DETERMINISTIC_SPLITS", "DETERMINISTIC_TARGET_BLOCKS"]

#: deterministic mode: at most this many dQ partial buffers (the workspace is that many float32
#: copies of dq) ...
MAX_DETERMINISTIC_SPLITS = 16
#: ... and about this many main-stage blocks in all (a property of the shape, never of the device,
#: so the reduction order and hence the bits are the same on every GPU)
DETERMINISTIC_TARGET_BLOCKS = 256


def deterministic_splits(num_k_tiles: int, kv_blocks: int) -> int:
    """Partial dQ buffers of the deterministic mode for ``num_k_tiles`` key tiles and
    ``kv_blocks = batch * kv heads`` (a function of the shape only)."""
    want = -(-DETERMINISTIC_TARGET_BLOCKS // max(kv_blocks, 1))
    return max(1, min(num_k_tiles, MAX_DETERMINISTIC_SPLITS, want))


def _strides3(prefix, a, packed=False):
    """Batch, head and row strides (elements); a packed batch's batch stride is 0 (each block
    finds its sequence through the index)."""
    st = list(la.element_strides(a)[:3])
    if packed:
        st[0] = 0
    return [la.i64(f"{prefix}_{w}_stride", s) for w, s in zip(("batch", "head", "row"), st)]


class _Workspace:
    """The device arrays of one backward: gradients, the canonical views, Dd and the dQ
    accumulator (``(splits, *stat_shape, D)``: a split's partial buffer is one contiguous block)."""

    def __init__(self, problem, arrays, main, call):
        p = problem
        self.main = main
        dout, q, k, v, out, lse = arrays
        packed = p.varlen is not None
        self.grads = tuple(call.empty(x.shape, p.dtype) for x in (q, k, v))
        if packed and not p.varlen.checked:   # a device-resident index: rows no tile covers stay NaN
            for g in self.grads:
                g.fill(np.nan)
        lse32 = call.xp.ascontiguousarray(lse, dtype=np.float32)
        if packed:   # one (1, H, total, D) view; the main stage finds each sequence
            self.views = [la.canonical(a[None], "bshd", 4) for a in (q, k, v, out, dout, *self.grads)]
            self.lse = lse32[None]
            self.batch_shape = (1,)
        else:
            self.views = [la.canonical(a, p.layout, q.ndim) for a in (q, k, v, out, dout, *self.grads)]
            self.lse = lse32[None] if (p.layout == "bhsd" and q.ndim == 2) else lse32
            self.batch_shape = p.batch_shape
        stat_shape = self.views[0].shape[:-1]   # (*batch, Hq, Sq), or (1, Hq, total_q) packed
        self.mods = la.modifier_views(p, call) if main.mods else {}
        self.dbias = None
        if p.options.return_dbias:   # (*batch, Hq, Sq, Sk): dS of every pair, zero where no block writes
            self.dbias = call.xp.zeros(p.modifiers.attn_bias.shape, dtype=np.float32)
            self.mods["dbias"] = self.dbias
        #: the captured arrays' gradients (``return_dscore_mod``): a zeroed float32 workspace per float
        #: array of the score_mod, by slot; the main stage adds into them when it has the form
        self.darrays = {}
        if p.options.return_dscore_mod:
            t = p.modifiers.score_mod
            if getattr(main, "agrad_exact", False):   # deterministic: integer limbs per element, summed exactly
                self.darrays = {n: attention_bwd_mma.exact_grad_workspace(t.arrays[n].shape, call, t.names[n])
                                for n in score_mod.float_slots(t)}
            else:
                self.darrays = {n: call.xp.zeros(t.arrays[n].shape, dtype=np.float32) for n in score_mod.float_slots(t)}
        self.batched = [n for n in la.MOD_BATCHED if n in self.mods] if not packed else []
        self.dd = call.empty(stat_shape, np.float32)
        self.num_k_tiles = -(-p.seqlen_k // main.block_n)
        # the batch split of the launches depends on the arrays' strides only, not on the workspace
        every = self.views + [self.lse, self.dd] + [self.mods[n] for n in self.batched]
        _, kv_inner = ([()], p.varlen.batch) if packed else la.batch_slices(self.batch_shape, every)
        # (a main stage with a plan of its own, the Hopper tier's, orders its adds into one buffer)
        self.splits = (deterministic_splits(self.num_k_tiles, kv_inner * p.num_heads_k)
                       if p.options.deterministic and getattr(main, "plan_main", None) is None else 1)
        # the tensor-core plain fixed forms' padded layout (AttentionBwdMma.dq_padded): rows per head a
        # multiple of the query tile, row pitch the head-dim bucket; else (*batch, Hq, Sq, D)
        self.ws_rows, self.ws_pitch = stat_shape[-1], p.head_dim
        if getattr(main, "dq_padded", False):
            self.ws_rows, self.ws_pitch = -(-stat_shape[-1] // main.block_m) * main.block_m, main.head_dim_max
        self.dq_accum = call.xp.zeros((self.splits,) + stat_shape[:-1] + (self.ws_rows, self.ws_pitch), dtype=np.float32)
        self.split_stride = int(np.prod(self.dq_accum.shape[1:], dtype=np.int64))
        self.batches, self.inner = la.batch_slices(self.batch_shape, every + [self.dq_accum[0]])
        #: the main stage's blocks per (kv head, split): a packed batch's sequences, else the batches
        self.main_inner = p.varlen.batch if packed else self.inner
        self.every = every

    def launch_views(self, idx):
        """``(views of q..dv, lse, dd, modifiers by name, dq accumulator)`` for launch ``idx``
        (the accumulator keeps its split axis first: the kernels step between partials by
        ``split_stride``)."""
        sel = la.select_batches(idx, self.batch_shape, self.every)
        nb, acc = len(self.batch_shape), self.dq_accum
        if idx is None:
            acc = acc.reshape((self.splits, -1) + acc.shape[1 + nb:])
        elif idx == ():
            acc = acc if self.batch_shape else acc[:, None]
        else:
            acc = acc[(slice(None),) + idx]
        mods = dict(self.mods, **dict(zip(self.batched, sel[10:])))
        return sel[:8], sel[8], sel[9], mods, acc


def _dot_plan(p, ws, views, dds, call, seqlen_q):
    """The dot stage's plan for one launch (None without rows)."""
    key = variants.dtype_key(p.dtype)
    v_dot = AttentionBwdSimt("dot", key, 32)
    os_, dos = views[3], views[4]
    rows = ws.inner * p.num_heads_q * seqlen_q
    if not rows:
        return None
    return plan.LaunchPlan(v_dot, v_dot.entry, (-(-rows // (THREADS // 32)), 1, 1), v_dot.block, 0, (
        call.pointer("out", os_), call.pointer("dout", dos), call.pointer("dd", dds, writable=True),
        *_strides3("o", os_), *_strides3("do", dos),
        la.i64("num_rows", rows), la.i32("num_heads", p.num_heads_q), la.i32("seqlen_q", seqlen_q),
        la.i32("head_dim_v", p.head_dim_v)))


def _main_args(p, ws, launch, call, seqlen_q) -> tuple:
    """The main stage's arguments for one launch: ``launch`` is ``(views, lse, dd, mods, acc,
    idx, tile0)``."""
    views, ls, dds, mods, acc, idx, tile0 = launch
    qs, ks, vs, _, dos, dqs, dks, dvs = views
    packed = p.varlen is not None
    blocks_per_head = ws.splits if p.options.deterministic else ws.num_k_tiles
    return (
        call.pointer("q", qs), call.pointer("k", ks), call.pointer("v", vs), call.pointer("dout", dos),
        call.pointer("lse", ls), call.pointer("dd", dds), call.pointer("dq_accum", acc, writable=True),
        call.pointer("dk", dks, writable=True), call.pointer("dv", dvs, writable=True),
        *_strides3("q", qs, packed), *_strides3("k", ks, packed), *_strides3("v", vs, packed),
        *_strides3("do", dos, packed), *_strides3("dk", dks, packed), *_strides3("dv", dvs, packed),
        la.i64("lse_batch_stride", 0 if packed else la.element_strides(ls)[0]),
        la.i64("lse_head_stride", la.element_strides(ls)[1]),
        la.i32("num_heads_k", p.num_heads_k), la.i32("group_size", p.group_size),
        la.i32("seqlen_q", seqlen_q), la.i32("seqlen_k", p.seqlen_k if not packed else p.varlen.total_k),
        la.i32("head_dim", p.head_dim), la.i32("head_dim_v", p.head_dim_v),
        la.i32("num_k_tiles", ws.num_k_tiles), plan.ScalarArg("softmax_scale", np.float32(p.softmax_scale)),
        la.i32("window_left", p.window_left), la.i32("window_right", p.window_right),
        la.i32("num_splits", blocks_per_head), la.i64("dq_split_stride", ws.split_stride),
        la.i32("deterministic", int(p.options.deterministic)),
        la.i32("tile0", tile0), la.i32("tile_end", min(tile0 + blocks_per_head, ws.num_k_tiles)),
        *la.varlen_args(p, call),
        *la.dropout_args(p, la.flat_batch(idx, ws.batch_shape), ws.main.dropout),
        *la.dbias_args(p, mods, call, ws.main.mods, bool(ws.main.user_mod), la.flat_batch(idx, ws.batch_shape),
                       (la.block_sparse_args(p, call, True, blocks_per_head * p.num_heads_k * ws.main_inner)
                        if getattr(ws.main, "block_sparse", False) else ())
                       + (la.array_grad_args(ws.darrays, call) if getattr(ws.main, "agrad_c", "") else ())),
    )


def backward(problem, dout, q, k, v, out, lse, main, call) -> tuple:
    """``(dq, dk, dv)`` (then ``dbias``, ``dsinks`` when ``problem.options`` asks for them) on
    ``call``'s device, with ``main`` as the main stage (a variant of the common argument list).

    ``lse`` is the forward's natural-log LSE; it is used as contiguous float32 (one small copy
    when it is not). With score modifiers (a ``mods`` main variant): ``return_dbias`` has the main
    stage write dS into a zeroed float32 ``(*batch, Hq, Sq, Sk)`` workspace, one writer per
    element, which is then summed over the bias's broadcast axes in a fixed order and cast to its
    dtype; ``return_dsinks`` gives ``d sinks = -sum over batch and rows of exp(sink - lse) * Dd``
    (float32 ``(Hq,)``), from the dot stage's Dd.
    """
    p = problem
    main = dataclasses.replace(main, varlen=main.varlen or p.varlen is not None,
                               dropout=main.dropout or p.dropout is not None)   # the forms the call needs
    if isinstance(main, attention_bwd_mma.AttentionBwdMma):   # (and the dQ form of the mode)
        main = attention_bwd_mma.with_dq_mode(main, p.options.deterministic)
    ws = _Workspace(p, (dout, q, k, v, out, lse), main, call)
    seqlen_q = p.seqlen_q if p.varlen is None else p.varlen.total_q   # rows of the Dd / workspace layout
    blocks_per_head = ws.splits if p.options.deterministic else ws.num_k_tiles
    grid = blocks_per_head * p.num_heads_k * ws.main_inner
    key = variants.dtype_key(p.dtype)
    v_conv = AttentionBwdSimt("convert", key, 32)
    for idx in ws.batches:
        views, ls, dds, mods, acc = ws.launch_views(idx)
        rows = ws.inner * p.num_heads_q * seqlen_q
        dot = _dot_plan(p, ws, views, dds, call, seqlen_q)
        if dot is not None:
            call.launch(dot)
        plan_main = getattr(main, "plan_main", None)   # a main stage with arguments of its own (the Hopper tier's)
        if plan_main is not None and grid:
            # (the captured arrays' gradient workspaces, where the call asks for them)
            call.launch(plan_main(p, views, ls, dds, acc, call, **({"darrays": ws.darrays} if ws.darrays else {})))
        for tile0 in range(0, ws.num_k_tiles if grid and plan_main is None else 0, max(blocks_per_head, 1)):
            call.launch(plan.LaunchPlan(main, main.entry, (grid, 1, 1), main.block, main.smem_bytes,
                                        _main_args(p, ws, (views, ls, dds, mods, acc, idx, tile0), call, seqlen_q)))
        total = rows * p.head_dim
        if total:
            dqs = views[5]
            call.launch(plan.LaunchPlan(v_conv, v_conv.entry, (-(-total // THREADS), 1, 1), v_conv.block, 0, (
                call.pointer("dq_accum", acc), call.pointer("dq", dqs, writable=True), *_strides3("dq", dqs),
                la.i64("total", total), la.i32("num_heads", p.num_heads_q), la.i32("seqlen_q", seqlen_q),
                la.i32("head_dim", p.head_dim), la.i32("ws_rows", ws.ws_rows), la.i32("ws_pitch", ws.ws_pitch),
                la.i32("num_splits", ws.splits), la.i64("split_stride", ws.split_stride),
                plan.ScalarArg("softmax_scale", np.float32(p.softmax_scale)))))
    grads = ws.grads
    if p.options.return_dbias:
        b = p.modifiers.attn_bias
        grads += (ws.dbias.sum(axis=b.broadcast_axes, keepdims=True).reshape(b.own_shape).astype(b.dtype),)
    if p.options.return_dsinks:   # d sink_h = -sum over batch and rows of exp(sink_h - lse) Dd
        # (docs/conventions.md, "Score modifiers")
        dd = ws.dd
        sinks = ws.mods["sinks"].astype(np.float32)
        head_axis = dd.ndim - 2
        w = call.xp.exp(sinks.reshape((-1, 1)) - ws.lse.reshape(dd.shape)) * dd
        grads += ((-w.sum(axis=tuple(a for a in range(dd.ndim) if a != head_axis))).astype(np.float32),)
    if p.options.return_dscore_mod:   # {variable name: gradient} in each array's shape and dtype
        t = p.modifiers.score_mod
        if getattr(main, "agrad_exact", False):
            ws.darrays = {n: attention_bwd_mma.exact_grad_sum(w, call.xp) for n, w in ws.darrays.items()}
        grads += ({t.names[n]: w.astype(t.arrays[n].dtype) for n, w in ws.darrays.items()},)
    return grads
