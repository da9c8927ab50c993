"""The portable attention backward (``kernels_cu/attention_bwd_simt.cu``): variants and planner.

Three stages, each its own variant of the one source file: ``dot`` (``Dd = rowsum(dO * O)``),
``main`` (dK, dV per key tile in registers, dQ into a float32 workspace with atomics) and
``convert`` (the workspace to the input dtype). Every dtype (fp16, bf16, fp32) on sm_75+.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from cuflash import _attention_simt, _plan, _variants

THREADS = 128
#: (Br, Bc) of the main stage by head-dim bucket; K, V, Q, dO tiles and P, dS live in shared
#: memory as float32 (see the kernel's layout), within sm_75's 64 KB opt-in limit
TILES = {32: (32, 32), 64: (32, 32), 128: (16, 32), 256: (8, 16)}
STAGES = ("dot", "main", "convert")
ARCHES = (75, 80, 90)


@dataclasses.dataclass(frozen=True)
class AttentionBwdSimt(_variants.Variant):
    """One stage of the portable backward for one dtype and head-dim bucket."""

    family: ClassVar[str] = "attn_bwd_simt"
    source: ClassVar[str] = "attention_bwd_simt.cu"

    stage: str
    dtype: str
    head_dim_max: int

    def __post_init__(self):
        if self.stage not in STAGES:
            raise ValueError(f"AttentionBwdSimt: stage={self.stage!r} must be one of {STAGES}")
        if self.dtype not in _variants.DTYPES:
            raise ValueError(f"AttentionBwdSimt: dtype={self.dtype!r} must be one of {sorted(_variants.DTYPES)}")
        if self.head_dim_max not in TILES:
            raise ValueError(f"AttentionBwdSimt: head_dim_max={self.head_dim_max} must be one of {tuple(TILES)}")

    def axes(self) -> tuple[str, ...]:
        if self.stage == "main":
            bm, bn = self.tile
            return (self.stage, self.dtype, f"d{self.head_dim_max}", f"m{bm}", f"n{bn}")
        return (self.stage, self.dtype)

    @property
    def tile(self) -> tuple[int, int]:
        return TILES[self.head_dim_max]

    @property
    def block(self) -> tuple[int, int, int]:
        return (THREADS, 1, 1)

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory of the main stage (0 for the others); the kernel checks it."""
        if self.stage != "main":
            return 0
        bm, bn = self.tile
        row = self.head_dim_max + 1
        return 4 * (2 * bn * row + 2 * bm * row + 2 * bm * (bn + 1) + 2 * bm)

    def defines(self) -> tuple[tuple[str, str], ...]:
        bm, bn = self.tile
        return super().defines() + (
            ("CUFLASH_T", _variants.DTYPES[self.dtype][0]),
            ("CUFLASH_BWD_STAGE", str(STAGES.index(self.stage))),
            ("CUFLASH_HEAD_DIM_MAX", str(self.head_dim_max)),
            ("CUFLASH_BLOCK_M", str(bm)),
            ("CUFLASH_BLOCK_N", str(bn)),
            ("CUFLASH_THREADS", str(THREADS)),
            ("CUFLASH_SMEM_BYTES", str(self.smem_bytes)),
        )


def all_variants(arch: int) -> tuple[AttentionBwdSimt, ...]:
    """Every backward variant the dispatcher can choose (the same on every arch >= sm_75)."""
    out = []
    for key in _variants.DTYPES:
        out += [AttentionBwdSimt("dot", key, 32), AttentionBwdSimt("convert", key, 32)]
        out += [AttentionBwdSimt("main", key, b) for b in TILES]
    return tuple(out)


def _i64(name, value):
    return _plan.ScalarArg(name, np.int64(value))


def _i32(name, value):
    return _plan.ScalarArg(name, np.int32(value))


def _strides3(prefix, a):
    item = a.dtype.itemsize
    return [_i64(f"{prefix}_{w}_stride", int(s) // item) for w, s in zip(("batch", "head", "row"), a.strides[:3])]


def backward(problem, dout, q, k, v, out, lse, *, xp, arch: int, launch):
    """Compute ``(dq, dk, dv)`` with the three stages; arrays of ``xp`` (NumPy for the simulator).

    ``lse`` is the forward's natural-log LSE; it is used as contiguous float32 (one small copy
    when it is not). Fresh outputs are NaN-poisoned on the simulator so unwritten elements show.
    """
    p = problem
    key = _variants.dtype_key(p.dtype)
    bucket = _attention_simt.head_dim_bucket(p.head_dim, p.head_dim_v)
    dq = xp.empty(q.shape, dtype=p.dtype)
    dk = xp.empty(k.shape, dtype=p.dtype)
    dv = xp.empty(v.shape, dtype=p.dtype)
    if xp is np:
        for a in (dq, dk, dv):
            a.fill(np.nan)
    lse32 = xp.ascontiguousarray(lse, dtype=np.float32)
    canon = lambda a: _attention_simt._canonical(a, p.layout, q.ndim)  # noqa: E731
    views = [canon(a) for a in (q, k, v, out, dout, dq, dk, dv)]
    lse_v = lse32[None] if (p.layout == "bhsd" and q.ndim == 2) else lse32
    stat_shape = views[0].shape[:-1]  # (*batch, Hq, Sq)
    dd = xp.empty(stat_shape, dtype=np.float32)
    dq_accum = xp.zeros(stat_shape + (p.head_dim,), dtype=np.float32)
    batches, inner = _attention_simt._batch_slices(p.batch_shape, views + [lse_v, dd, dq_accum])
    nb = len(p.batch_shape)
    v_dot, v_main, v_conv = (AttentionBwdSimt(s, key, 32 if s != "main" else bucket) for s in STAGES)
    bm, bn = v_main.tile
    for idx in batches:
        if idx is None:
            sel = [a.reshape((-1,) + a.shape[nb:]) for a in views + [lse_v, dd, dq_accum]]
        elif idx == ():
            sel = [a if p.batch_shape else a[None] for a in views + [lse_v, dd, dq_accum]]
        else:
            sel = [a[idx] for a in views + [lse_v, dd, dq_accum]]
        qs, ks, vs, os_, dos, dqs, dks, dvs, ls, dds, acc = sel
        ptr = _attention_simt._pointer
        rows = inner * p.num_heads_q * p.seqlen_q
        if rows:
            launch(_plan.LaunchPlan(v_dot, v_dot.entry, (-(-rows // (THREADS // 32)), 1, 1), v_dot.block, 0, (
                ptr("out", os_), ptr("dout", dos), ptr("dd", dds, writable=True),
                *_strides3("o", os_), *_strides3("do", dos),
                _i64("num_rows", rows), _i32("num_heads", p.num_heads_q), _i32("seqlen_q", p.seqlen_q),
                _i32("head_dim_v", p.head_dim_v),
            )))
        num_k_tiles = -(-p.seqlen_k // bn)
        grid = num_k_tiles * p.num_heads_k * inner
        if grid:
            item = np.dtype(np.float32).itemsize
            launch(_plan.LaunchPlan(v_main, v_main.entry, (grid, 1, 1), v_main.block, v_main.smem_bytes, (
                ptr("q", qs), ptr("k", ks), ptr("v", vs), ptr("dout", dos), ptr("lse", ls), ptr("dd", dds),
                ptr("dq_accum", acc, writable=True), ptr("dk", dks, writable=True), ptr("dv", dvs, writable=True),
                *_strides3("q", qs), *_strides3("k", ks), *_strides3("v", vs), *_strides3("do", dos),
                *_strides3("dk", dks), *_strides3("dv", dvs),
                _i64("lse_batch_stride", ls.strides[0] // item), _i64("lse_head_stride", ls.strides[1] // item),
                _i32("num_heads_k", p.num_heads_k), _i32("group_size", p.group_size),
                _i32("seqlen_q", p.seqlen_q), _i32("seqlen_k", p.seqlen_k),
                _i32("head_dim", p.head_dim), _i32("head_dim_v", p.head_dim_v),
                _i32("num_k_tiles", num_k_tiles), _plan.ScalarArg("softmax_scale", np.float32(p.softmax_scale)),
                _i32("window_left", p.window_left), _i32("window_right", p.window_right),
            )))
        total = rows * p.head_dim
        if total:
            launch(_plan.LaunchPlan(v_conv, v_conv.entry, (-(-total // THREADS), 1, 1), v_conv.block, 0, (
                ptr("dq_accum", acc), ptr("dq", dqs, writable=True), *_strides3("dq", dqs),
                _i64("total", total), _i32("num_heads", p.num_heads_q), _i32("seqlen_q", p.seqlen_q),
                _i32("head_dim", p.head_dim),
            )))
    return dq, dk, dv
