"""The portable attention backward (``kernels_cu/attention_bwd_simt.cu``): variants and planner.

Three stages, each its own variant of the one source file: ``dot`` (``Dd = rowsum(dO * O)``),
``main`` (dK, dV per key tile in registers, dQ into a float32 workspace with atomics) and
``convert`` (the workspace to the input dtype). Every dtype (fp16, bf16, fp32) on sm_75+.

``deterministic=True`` (:func:`deterministic_splits`): the main stage runs ``num_splits`` blocks
per (kv head, batch); block s takes key tiles s, s + num_splits, ... in order (in successive
launches, one tile per block each, for both main-stage kernels) and adds its dQ to its own float32 partial buffer, one add per element at a time, so the order never
varies; the convert stage sums the partials in split order. Cost: a workspace of ``num_splits``
(at most :data:`MAX_DETERMINISTIC_SPLITS`) float32 copies of dq instead of one, fewer blocks in
flight when ``batch * kv heads`` is small, and ``num_k_tiles / num_splits`` launches.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from cuflash.kernels import attention_fwd_simt
from cuflash.runtime import plan, variants
from cuflash.runtime.validation_modifiers import refuse_modifiers

THREADS = 128
#: (Br, Bc) of the main stage by head-dim bucket; K, V, Q, dO tiles and P, dS live in shared
#: memory as float32 (see the kernel's layout), within sm_75's 64 KB opt-in limit
TILES = {32: (32, 32), 64: (32, 32), 128: (16, 32), 256: (8, 16)}
#: __launch_bounds__ minimum blocks per SM of the main stage by bucket (128 threads: 4 -> at
#: most 128 registers, 3 -> 168)
MIN_BLOCKS = {32: 4, 64: 4, 128: 3, 256: 3}
STAGES = ("dot", "main", "convert")
#: deterministic mode: at most this many dQ partial buffers (the workspace is that many float32
#: copies of dq) ...
MAX_DETERMINISTIC_SPLITS = 16
#: ... and about this many main-stage blocks in all (a property of the shape, never of the device,
#: so the reduction order and hence the bits are the same on every GPU)
DETERMINISTIC_TARGET_BLOCKS = 256
ARCHES = (75, 80, 90)


@dataclasses.dataclass(frozen=True)
class AttentionBwdSimt(variants.BucketTiledVariant):
    """One stage of the portable backward for one dtype and head-dim bucket (the ``dot`` and
    ``convert`` stages have no head-dim or tile axis: they are built with bucket 32)."""

    family: ClassVar[str] = "attn_bwd_simt"
    source: ClassVar[str] = "attention_bwd_simt.cu"
    head_dim_buckets: ClassVar[tuple[int, ...]] = tuple(TILES)
    tiles: ClassVar[dict[int, tuple[int, int]]] = TILES
    threads: ClassVar[int] = THREADS

    stage: str
    dtype: str
    head_dim_max: int

    def __post_init__(self):
        if self.stage not in STAGES:
            raise ValueError(f"AttentionBwdSimt: stage={self.stage!r} must be one of {STAGES}")
        super().__post_init__()

    def axes(self) -> tuple[str, ...]:
        if self.stage == "main":
            return (self.stage,) + super().axes()
        return (self.stage, self.dtype)

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory of the main stage (0 for the others); the kernel checks it."""
        if self.stage != "main":
            return 0
        bm, bn = self.tile
        row = self.head_dim_max + 1
        return 4 * (2 * bn * row + 2 * bm * row + 2 * bm * (bn + 1) + 2 * bm)

    def defines(self) -> tuple[tuple[str, str], ...]:
        return super().defines() + (
            ("CUFLASH_BWD_STAGE", str(STAGES.index(self.stage))),
            ("CUFLASH_MIN_BLOCKS", str(MIN_BLOCKS[self.head_dim_max])),
        )


def all_variants(arch: int, *, varlen: bool = False) -> tuple[AttentionBwdSimt, ...]:
    """Every backward variant the dispatcher can choose (the same on every arch >= sm_75); with
    ``varlen``, the main stage's packed variable-length forms (the other stages take both)."""
    out = []
    for key in variants.DTYPES:
        if not varlen:
            out += [AttentionBwdSimt("dot", key, 32), AttentionBwdSimt("convert", key, 32)]
        out += [AttentionBwdSimt("main", key, b, varlen=varlen) for b in TILES]
    return tuple(out)


def choose_variant(dtype, head_dim: int, head_dim_v: int, arch: int) -> AttentionBwdSimt:
    """The main-stage variant the backward runs for these head dims (the dot and convert stages
    have one variant per dtype)."""
    return AttentionBwdSimt("main", variants.dtype_key(dtype), AttentionBwdSimt.bucket(head_dim, head_dim_v))


def _i64(name, value):
    return plan.ScalarArg(name, np.int64(value))


def _i32(name, value):
    return plan.ScalarArg(name, np.int32(value))


def _strides3(prefix, a, varlen=None):
    """Batch, head and row strides (elements); a packed batch's batch stride is 0 (each block
    finds its sequence through the index)."""
    item = a.dtype.itemsize
    st = [int(s) // item for s in a.strides[:3]]
    if varlen is not None:
        st[0] = 0
    return [_i64(f"{prefix}_{w}_stride", s) for w, s in zip(("batch", "head", "row"), st)]


def unsupported_reason(problem, arch: int, arrays=None) -> str | None:
    """Why the portable backward cannot take ``problem`` (None if it can): it has no dropout and
    no score modifiers."""
    why = refuse_modifiers(problem, "the portable backward")   # score modifiers: none in this kernel yet
    if why is not None:
        return why
    return attention_fwd_simt.unsupported_reason(problem, arch, arrays)


def deterministic_splits(num_k_tiles: int, kv_blocks: int) -> int:
    """Partial dQ buffers of the deterministic mode for ``num_k_tiles`` key tiles and
    ``kv_blocks = batch * kv heads`` (a function of the shape only)."""
    want = -(-DETERMINISTIC_TARGET_BLOCKS // max(kv_blocks, 1))
    return max(1, min(num_k_tiles, MAX_DETERMINISTIC_SPLITS, want))


def backward(problem, dout, q, k, v, out, lse, *, xp, arch: int, launch, deterministic: bool = False,
             main_variant=None, return_dbias: bool = False, return_dsinks: bool = False):
    """Compute ``(dq, dk, dv)`` with the three stages; arrays of ``xp`` (NumPy for the simulator).

    ``deterministic``: no atomics, bit-identical results run to run (see the module docstring).
    ``main_variant``: another main stage with this one's arguments (the tensor-core backward's).

    ``lse`` is the forward's natural-log LSE; it is used as contiguous float32 (one small copy
    when it is not). Fresh outputs are NaN-poisoned on the simulator so unwritten elements show.

    With score modifiers (a ``mods`` main variant): ``return_dbias`` appends ``d attn_bias``
    (the main stage writes dS into a zeroed float32 ``(*batch, Hq, Sq, Sk)`` workspace, one
    writer per element, which is then summed over the bias's broadcast axes in a fixed order and
    cast to its dtype); ``return_dsinks`` appends ``d sinks`` = ``-sum over batch and rows of
    exp(sink - lse) * Dd`` (float32 ``(Hq,)``), from the dot stage's Dd.
    """
    p = problem
    vl = p.varlen
    key = variants.dtype_key(p.dtype)
    bucket = AttentionBwdSimt.bucket(p.head_dim, p.head_dim_v)
    dq = xp.empty(q.shape, dtype=p.dtype)
    dk = xp.empty(k.shape, dtype=p.dtype)
    dv = xp.empty(v.shape, dtype=p.dtype)
    if xp is np or (vl is not None and not vl.checked):   # unwritten rows show (or stay NaN)
        for a in (dq, dk, dv):
            a.fill(np.nan)
    lse32 = xp.ascontiguousarray(lse, dtype=np.float32)
    if vl is not None:   # packed: one (1, H, total, D) view; the main stage finds each sequence
        canon = lambda a: attention_fwd_simt._canonical(a[None], "bshd", 4)  # noqa: E731
        lse_v = lse32[None]
    else:
        canon = lambda a: attention_fwd_simt._canonical(a, p.layout, q.ndim)  # noqa: E731
        lse_v = lse32[None] if (p.layout == "bhsd" and q.ndim == 2) else lse32
    views = [canon(a) for a in (q, k, v, out, dout, dq, dk, dv)]
    stat_shape = views[0].shape[:-1]  # (*batch, Hq, Sq), or (1, Hq, total_q) packed
    mods_on = getattr(main_variant, "mods", False)
    mviews = attention_fwd_simt.modifier_views(p, xp) if mods_on else {}
    dbias_full = None
    if return_dbias:   # (*batch, Hq, Sq, Sk): dS of every pair, zero where no block writes
        dbias_full = xp.zeros(p.modifiers.attn_bias.shape, dtype=np.float32)
        mviews["dbias"] = dbias_full
    batched = [n for n in ("alibi_slopes", "attn_bias", "attn_mask", "dbias") if n in mviews] if vl is None else []
    seqlen_q = p.seqlen_q if vl is None else vl.total_q   # rows of the Dd / workspace layout
    dd = xp.empty(stat_shape, dtype=np.float32)
    v_dot, v_main, v_conv = (AttentionBwdSimt(s, key, 32 if s != "main" else bucket) for s in STAGES)
    if main_variant is not None:
        v_main = main_variant
    v_main = attention_fwd_simt.for_problem(v_main, p)
    bn = v_main.block_n
    num_k_tiles = -(-p.seqlen_k // bn)
    # the batch split of the launches depends on the arrays' strides only, not on the workspace
    if vl is not None:
        batch_shape, main_inner = (1,), vl.batch
    else:
        batch_shape = p.batch_shape
        _, main_inner = attention_fwd_simt._batch_slices(batch_shape, views + [lse_v, dd] + [mviews[n] for n in batched])
    splits = deterministic_splits(num_k_tiles, main_inner * p.num_heads_k) if deterministic else 1
    # (splits, *stat_shape, D): a split's partial buffer is one contiguous block
    dq_accum = xp.zeros((splits,) + stat_shape + (p.head_dim,), dtype=np.float32)
    split_stride = int(np.prod(stat_shape, dtype=np.int64)) * p.head_dim
    extra = [mviews[n] for n in batched]
    batches, inner = attention_fwd_simt._batch_slices(batch_shape, views + [lse_v, dd, dq_accum[0]] + extra)
    if vl is None:
        main_inner = inner
    nb = len(batch_shape)
    for idx in batches:
        # acc keeps the split axis first (the kernels step between partials by split_stride)
        if idx is None:
            sel = [a.reshape((-1,) + a.shape[nb:]) for a in views + [lse_v, dd] + extra]
            acc = dq_accum.reshape((splits, -1) + dq_accum.shape[1 + nb:])
        elif idx == ():
            sel = [a if batch_shape else a[None] for a in views + [lse_v, dd] + extra]
            acc = dq_accum if batch_shape else dq_accum[:, None]
        else:
            sel = [a[idx] for a in views + [lse_v, dd] + extra]
            acc = dq_accum[(slice(None),) + idx]
        qs, ks, vs, os_, dos, dqs, dks, dvs, ls, dds = sel[:10]
        launch_mods = dict(mviews, **dict(zip(batched, sel[10:])))
        ptr = attention_fwd_simt._pointer
        rows = inner * p.num_heads_q * seqlen_q
        if rows:
            launch(plan.LaunchPlan(v_dot, v_dot.entry, (-(-rows // (THREADS // 32)), 1, 1), v_dot.block, 0, (
                ptr("out", os_), ptr("dout", dos), ptr("dd", dds, writable=True),
                *_strides3("o", os_), *_strides3("do", dos),
                _i64("num_rows", rows), _i32("num_heads", p.num_heads_q), _i32("seqlen_q", seqlen_q),
                _i32("head_dim_v", p.head_dim_v),
            )))
        blocks_per_head = splits if deterministic else num_k_tiles
        grid = blocks_per_head * p.num_heads_k * main_inner
        # one key tile per block: deterministic mode launches once per round of splits
        step = blocks_per_head
        item = np.dtype(np.float32).itemsize
        for tile0 in range(0, num_k_tiles if grid else 0, max(step, 1)):
            launch(plan.LaunchPlan(v_main, v_main.entry, (grid, 1, 1), v_main.block, v_main.smem_bytes, (
                ptr("q", qs), ptr("k", ks), ptr("v", vs), ptr("dout", dos), ptr("lse", ls), ptr("dd", dds),
                ptr("dq_accum", acc, writable=True), ptr("dk", dks, writable=True), ptr("dv", dvs, writable=True),
                *_strides3("q", qs, vl), *_strides3("k", ks, vl), *_strides3("v", vs, vl), *_strides3("do", dos, vl),
                *_strides3("dk", dks, vl), *_strides3("dv", dvs, vl),
                _i64("lse_batch_stride", 0 if vl else ls.strides[0] // item), _i64("lse_head_stride", ls.strides[1] // item),
                _i32("num_heads_k", p.num_heads_k), _i32("group_size", p.group_size),
                _i32("seqlen_q", seqlen_q), _i32("seqlen_k", p.seqlen_k if vl is None else vl.total_k),
                _i32("head_dim", p.head_dim), _i32("head_dim_v", p.head_dim_v),
                _i32("num_k_tiles", num_k_tiles), plan.ScalarArg("softmax_scale", np.float32(p.softmax_scale)),
                _i32("window_left", p.window_left), _i32("window_right", p.window_right),
                _i32("num_splits", blocks_per_head), _i64("dq_split_stride", split_stride),
                _i32("deterministic", int(bool(deterministic))),
                _i32("tile0", tile0), _i32("tile_end", min(tile0 + step, num_k_tiles)),
                *attention_fwd_simt.varlen_args(p, q),
                *attention_fwd_simt.dropout_args(
                    p, 0 if idx in (None, ()) else int(np.ravel_multi_index(idx + (0,), batch_shape)), v_main.dropout),
                *_dbias_args(p, launch_mods, q, mods_on),
            )))
        total = rows * p.head_dim
        if total:
            launch(plan.LaunchPlan(v_conv, v_conv.entry, (-(-total // THREADS), 1, 1), v_conv.block, 0, (
                ptr("dq_accum", acc), ptr("dq", dqs, writable=True), *_strides3("dq", dqs),
                _i64("total", total), _i32("num_heads", p.num_heads_q), _i32("seqlen_q", seqlen_q),
                _i32("head_dim", p.head_dim), _i32("num_splits", splits), _i64("split_stride", split_stride),
                plan.ScalarArg("softmax_scale", np.float32(p.softmax_scale)),
            )))
    grads = (dq, dk, dv)
    if return_dbias:
        b = p.modifiers.attn_bias
        grads += (dbias_full.sum(axis=b.broadcast_axes, keepdims=True).reshape(b.own_shape).astype(b.dtype),)
    if return_dsinks:   # d sink_h = -sum over batch and rows of exp(sink_h - lse) Dd (DESIGN.md §3.2)
        sinks = mviews["sinks"].astype(np.float32)
        head_axis = dd.ndim - 2
        w = xp.exp(sinks.reshape((-1, 1)) - lse_v.reshape(dd.shape)) * dd
        grads += ((-w.sum(axis=tuple(a for a in range(dd.ndim) if a != head_axis))).astype(np.float32),)
    return grads


def _dbias_args(problem, launch_mods: dict, like, enabled: bool) -> tuple:
    """The backward's modifier arguments: :func:`~cuflash.kernels.attention_fwd_simt.mods_args`
    (``mod_flags`` bit 16 when ``launch_mods`` holds the ``"dbias"`` workspace), then the workspace
    pointer (an empty array the kernel never writes without it) and its strides."""
    if not enabled:
        return ()
    ws = launch_mods.get("dbias")
    none = attention_fwd_simt._NO_INDEX if isinstance(like, np.ndarray) else attention_fwd_simt._no_index_on(like.device.id)
    st = (0, 0, 0) if ws is None else tuple(int(x) // 4 for x in ws.strides[:3])
    return (*attention_fwd_simt.mods_args(problem, launch_mods, like, True),
            attention_fwd_simt._pointer("dbias", ws if ws is not None else none, writable=True),
            *(_i64(f"dbias_{w}_stride", x) for w, x in zip(("batch", "head", "row"), st)))
