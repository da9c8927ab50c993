"""The portable attention forward (``kernels_cu/attention_fwd_simt.cu``): variant and planner.

Every dtype (float16, bfloat16, float32) on every arch from sm_75. Compile-time axes are the
dtype, the head-dim bucket (the smallest of 32, 64, 128, 256 holding ``max(D, Dv)``) and the
tile shape; causal, windows, lengths, strides and the scale are run-time arguments.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import ClassVar

import numpy as np

from cuflash.runtime import plan, variants
from cuflash.runtime.validation_modifiers import refuse_modifiers

#: head-dim buckets: a variant serves every ``max(D, Dv)`` up to its bucket
HEAD_DIM_BUCKETS = (32, 64, 128, 256)
#: threads per block (4 warps)
THREADS = 128
#: tile shapes (Br, Bc) by bucket, in order of preference; the first that fits the device's
#: shared memory is used (see :func:`choose_variant`)
TILE_CANDIDATES = {
    32: ((32, 64),),
    64: ((32, 64), (32, 32)),
    128: ((32, 32), (16, 32)),
    256: ((8, 32), (8, 16)),
}
#: the arches the kernel targets (sm_75 is the oldest CUDA 13 supports)
ARCHES = (75, 80, 90)


@dataclasses.dataclass(frozen=True)
class AttentionFwdSimt(variants.TileVariant):
    """One compiled configuration of the portable forward kernel.

    Parameters
    ----------
    dtype : {"f16", "bf16", "f32"}
        Element type of q, k, v and out (arithmetic and LSE are float32).
    head_dim_max : int
        Bucket of ``max(D, Dv)``: 32, 64, 128 or 256.
    block_m, block_n : int
        Query rows (Br) and key rows (Bc) per tile.
    """

    family: ClassVar[str] = "attn_fwd_simt"
    source: ClassVar[str] = "attention_fwd_simt.cu"
    head_dim_buckets: ClassVar[tuple[int, ...]] = HEAD_DIM_BUCKETS
    threads: ClassVar[int] = THREADS

    def __post_init__(self):
        super().__post_init__()
        tpr = THREADS // self.block_m if self.block_m else 0
        if THREADS % max(self.block_m, 1) or not 1 <= tpr <= 32 or tpr & (tpr - 1) or self.block_n % tpr:
            raise ValueError(f"AttentionFwdSimt: tile ({self.block_m}, {self.block_n}) does not split over {THREADS} threads")

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory: Q (Br x Dmax), one K/V tile (Bc x Dmax), P (Br x Bc), float32,
        rows padded by one element. The kernel ``static_assert``s the same figure."""
        d = self.head_dim_max + 1
        return 4 * (self.block_m * d + self.block_n * d + self.block_m * (self.block_n + 1))


def choose_variant(dtype, head_dim: int, head_dim_v: int, arch: int) -> AttentionFwdSimt:
    """The tile heuristic: the preferred tile of the bucket that fits the device's shared memory."""
    key = variants.dtype_key(dtype)
    bucket = AttentionFwdSimt.bucket(head_dim, head_dim_v)
    candidates = (AttentionFwdSimt(key, bucket, bm, bn) for bm, bn in TILE_CANDIDATES[bucket])
    v = AttentionFwdSimt.first_fitting(candidates, plan.max_dynamic_smem(arch))
    if v is None:
        raise NotImplementedError(f"cuflash: no portable attention tile fits sm_{arch}'s shared memory for head dim {bucket}")
    return v


def all_variants(arch: int, *, varlen: bool = False) -> tuple[AttentionFwdSimt, ...]:
    """Every variant the dispatcher can choose on ``sm_<arch>`` (for the compile gate); with
    ``varlen``, their packed variable-length forms."""
    out = []
    for key in variants.DTYPES:
        for bucket in HEAD_DIM_BUCKETS:
            v = choose_variant(variants.DTYPES[key][1], bucket, bucket, arch)
            out.append(dataclasses.replace(v, varlen=True) if varlen else v)
    return tuple(dict.fromkeys(out))


def for_problem(variant, problem):
    """``variant`` in the form ``problem`` needs: its packed variable-length form for
    :func:`cuflash.attention_varlen` and its dropout form (compile-time axes), else itself."""
    if problem.varlen is not None:
        variant = dataclasses.replace(variant, varlen=True)
    if problem.dropout is not None:
        variant = dataclasses.replace(variant, dropout=True)
    return variant


# --------------------------------------------------------------------------------------------
# planning


def _pointer(name: str, x, *, writable: bool = False) -> plan.PointerArg:
    """Pointer to element 0 of the view ``x``; its base is the buffer that owns the memory, so the
    region (shape and strides of the view) is checked against the real allocation."""
    item = x.dtype.itemsize
    strides = tuple(int(s) // item for s in x.strides)
    shape = tuple(int(n) for n in x.shape)
    if isinstance(x, np.ndarray):
        root = x
        while isinstance(root.base, np.ndarray):
            root = root.base
        if root.base is not None or not (root.flags.c_contiguous or root.flags.f_contiguous):
            root = x  # memory owned by a foreign buffer: the view itself is the region
            return plan.PointerArg(name, root, 0, shape, strides, writable)
        flat = root.reshape(-1, order="A")
        offset = (x.__array_interface__["data"][0] - flat.__array_interface__["data"][0]) // item
        return plan.PointerArg(name, flat, offset, shape, strides, writable)
    import cupy  # CuPy input: the allocation behind the view

    mem = x.data.mem
    flat = cupy.ndarray((mem.size // item,), dtype=x.dtype, memptr=cupy.cuda.MemoryPointer(mem, 0))
    offset = (x.data.ptr - mem.ptr) // item
    return plan.PointerArg(name, flat, offset, shape, strides, writable)


def _canonical(x, layout: str, ndim_q: int):
    """``(*batch, H, S, D)`` view (no copy) of a q/k/v/out array in the caller's layout."""
    if layout == "bshd":
        return x.swapaxes(1, 2)
    if ndim_q == 2:
        return x[None]
    return x


def _batch_slices(batch_shape: tuple, arrays: list) -> tuple[list, int]:
    """Split leading batch dims into launches: ``(list of index tuples, inner batch count)``.

    All leading dims merge into one launch when, for every array, they collapse into a single
    stride; otherwise the last batch dim is the grid's and the others are looped over.
    """
    if len(batch_shape) <= 1:
        return [()], (batch_shape[0] if batch_shape else 1)
    nb = len(batch_shape)

    def mergeable(a):
        return all(batch_shape[i] == 1 or a.strides[i] == a.strides[i + 1] * batch_shape[i + 1] for i in range(nb - 1))

    if all(mergeable(a) for a in arrays):
        return [None], math.prod(batch_shape)
    return [idx for idx in np.ndindex(*batch_shape[:-1])], batch_shape[-1]


def _same_memory(a, b) -> bool:
    return a.size == 0 or plan.array_address(a) == plan.array_address(b)


def plan_forward(problem, q, k, v, out, lse, variant) -> list[plan.LaunchPlan]:
    """Launch plans of any forward kernel taking the forward argument list (q, k, v, out, lse,
    their batch/head/row strides, then the sizes, tile count, scale and window), one block per
    (``variant.block_m`` query tile, head, batch) on a 1-D grid. One launch unless the batch dims
    cannot merge into one stride. ``lse`` must be contiguous float32 of ``lse_shape``."""
    p = problem
    vl = p.varlen
    if vl is not None:   # packed: one (1, H, total, D) view; each block finds its sequence
        views = [_canonical(a[None], "bshd", 4) for a in (q, k, v, out)]
        lse_v = lse[None]
        batches, inner = [()], vl.batch
    else:
        views = [_canonical(a, p.layout, q.ndim) for a in (q, k, v, out)]
        lse_v = lse[None] if (p.layout == "bhsd" and q.ndim == 2) else lse  # (*batch, H, Sq)
        batches, inner = _batch_slices(p.batch_shape, views + [lse_v])
    # the modifier arrays with batch dims ride along with q's batches (sliced or merged alike)
    mods_on = getattr(variant, "mods", False)
    mviews = modifier_views(p, np if isinstance(q, np.ndarray) else _cupy()) if mods_on else {}
    batched = [n for n in _MOD_BATCHED if n in mviews]
    if vl is None and batched:
        batches, inner = _batch_slices(p.batch_shape, views + [lse_v] + [mviews[n] for n in batched])
    num_q_tiles = -(-p.seqlen_q // variant.block_m)
    plans = []
    for idx in batches:
        if idx is None:  # all batch dims merged into one
            nb = len(p.batch_shape)
            every = views + [lse_v] + [mviews[n] for n in batched]
            sel = [a.reshape((-1,) + a.shape[nb:]) for a in every]
            if not all(_same_memory(a, b) for a, b in zip(sel, every)):
                raise AssertionError("cuflash: merging batch dims copied an array")  # never: strides were checked
        elif idx == ():
            sel = [a if p.batch_shape or vl is not None else a[None]
                   for a in views + [lse_v] + [mviews[n] for n in batched]]
        else:
            sel = [a[idx] for a in views + [lse_v] + [mviews[n] for n in batched]]
        qs, ks, vs, os_, ls = sel[:5]
        launch_mods = dict(mviews, **dict(zip(batched, sel[5:])))
        grid = num_q_tiles * p.num_heads_q * inner
        if grid > plan.MAX_GRID_DIMS[0]:
            raise NotImplementedError(f"{p.func}: {grid} thread blocks exceed the grid limit {plan.MAX_GRID_DIMS[0]}")

        def st(a):   # element strides; a packed batch has one sequence index, not a batch stride
            t = tuple(int(s) // a.dtype.itemsize for s in a.strides)
            return (0,) + t[1:] if vl is not None else t

        qst, kst, vst, ost, lst = st(qs), st(ks), st(vs), st(os_), st(ls)
        args = (
            *forward_args(p, (qs, ks, vs, os_, ls), (qst, kst, vst, ost), lst,
                          p.seqlen_q if vl is None else vl.total_q, p.seqlen_k if vl is None else vl.total_k,
                          num_q_tiles),
            *varlen_args(p, q),
            *dropout_args(p, 0 if idx in (None, ()) else int(np.ravel_multi_index(idx + (0,), p.batch_shape)),
                          getattr(variant, "dropout", False)),
            *mods_args(p, launch_mods, q, mods_on),
        )
        plans.append(plan.LaunchPlan(variant, variant.entry, (grid, 1, 1), variant.block, variant.smem_bytes, args))
    return plans


#: the modifier arrays the kernels index with batch dims first (they are sliced with q's batches)
_MOD_BATCHED = ("alibi_slopes", "attn_bias", "attn_mask")
#: kernels_cu/score_mods.cuh: mod_flags bits (16: the backward writes its dbias workspace)
_MOD_FLAGS = {"alibi_slopes": 1, "attn_bias": 2, "attn_mask": 4, "sinks": 8, "dbias": 16}


def modifier_views(problem, xp) -> dict:
    """The modifier arrays of ``problem`` as views (no copy) in the shapes the kernels index
    (:class:`~cuflash.runtime.validation_modifiers.BroadcastArray`: stride 0 on broadcast axes),
    by name; absent ones are missing. ``xp`` is NumPy or CuPy (whose arrays the call holds)."""
    m = problem.modifiers
    out = {}
    for name in ("alibi_slopes", "attn_bias", "attn_mask", "sinks"):
        b = getattr(m, name, None) if m is not None else None
        if b is None:
            continue
        a = b.array
        item = a.dtype.itemsize
        out[name] = xp.lib.stride_tricks.as_strided(a, shape=b.shape, strides=tuple(st * item for st in b.strides))
    return out


def mods_args(problem, views: dict, like, enabled: bool) -> tuple:
    """The score-modifier variants' trailing arguments (``kernels_cu/score_mods.cuh``:
    ``CUFLASH_MODS_PARAMS``) from :func:`modifier_views` sliced to the launch (batch axis first,
    then head, row, key), or none for the other variants. ``like``: an array of the launch's kind."""
    if not enabled:
        return ()
    m = problem.modifiers
    none = _NO_INDEX if isinstance(like, np.ndarray) else _no_index_on(like.device.id)
    flags = sum(f for n, f in _MOD_FLAGS.items() if n in views)

    def st(name, rank):
        a = views.get(name)
        return (0,) * rank if a is None else tuple(int(x) // a.dtype.itemsize for x in a.strides)[-rank:]

    def ptr(name):
        a = views.get(name)
        return plan.PointerArg.of(name, a if a is not None else none)

    bias = views.get("attn_bias")
    return (plan.ScalarArg("mod_flags", np.int32(flags)), plan.ScalarArg("softcap", np.float32(m.softcap)),
            ptr("alibi_slopes"), *(plan.ScalarArg(f"alibi_{w}_stride", np.int64(x))
                                   for w, x in zip(("batch", "head"), st("alibi_slopes", 2))),
            ptr("attn_bias"), plan.ScalarArg("bias_f32", np.int32(bias is not None and bias.dtype == np.float32)),
            *(plan.ScalarArg(f"bias_{w}_stride", np.int64(x))
              for w, x in zip(("batch", "head", "row", "col"), st("attn_bias", 4))),
            ptr("attn_mask"), *(plan.ScalarArg(f"mask_{w}_stride", np.int64(x))
                                for w, x in zip(("batch", "head", "row", "col"), st("attn_mask", 4))),
            ptr("sinks"), plan.ScalarArg("sinks_stride", np.int64(st("sinks", 1)[0])))


def _cupy():
    import cupy

    return cupy


def dropout_args(problem, batch0: int, enabled: bool) -> tuple:
    """The dropout variants' trailing arguments ``dropout_seed, dropout_offset, dropout_threshold,
    dropout_scale, dropout_batch0`` (kernels_cu/dropout.cuh), or none for the other variants;
    ``batch0`` is the launch's first batch in the flattened batch index."""
    if not enabled:
        return ()
    d = problem.dropout
    return (plan.ScalarArg("dropout_seed", np.uint32(d.seed)), plan.ScalarArg("dropout_offset", np.uint32(d.offset)),
            plan.ScalarArg("dropout_threshold", np.uint32(d.threshold)),
            plan.ScalarArg("dropout_scale", np.float32(d.scale)),
            plan.ScalarArg("dropout_batch0", np.int64(d.batch0 + batch0)))


def unsupported_reason(problem, arch: int, arrays=None) -> str | None:
    """Why this portable kernel cannot take ``problem`` (None if it can): it has no dropout and
    no score modifiers."""
    why = refuse_modifiers(problem, "the portable kernel")   # score modifiers: none in this kernel yet
    if why is not None:
        return why
    if problem.dropout is not None:
        return ("dropout: the portable kernels have none (it runs on the tensor-core kernels: float16/bfloat16, "
                "head dims multiples of 8, 16-byte-aligned rows, sm_80+)")
    return None


def forward_args(problem, arrays, strides, lse_strides, seqlen_q: int, seqlen_k: int, num_q_tiles: int) -> tuple:
    """The forward kernels' leading arguments, up to ``window_right``: the pointers ``q, k, v,
    out, lse`` (``arrays``), the (batch, head, row) element strides of q, k, v and out
    (``strides``), lse's (batch, head) strides, then the sizes, the tile count, the scale (log2
    domain) and the window. Shared by every forward form (fixed, packed, KV-cache)."""
    p = problem
    q, k, v, out, lse = arrays
    return (
        _pointer("q", q), _pointer("k", k), _pointer("v", v),
        _pointer("out", out, writable=True), _pointer("lse", lse, writable=True),
        *(plan.ScalarArg(f"{n}_{w}_stride", np.int64(s[i]))
          for n, s in zip(("q", "k", "v", "o"), strides) for i, w in enumerate(("batch", "head", "row"))),
        plan.ScalarArg("lse_batch_stride", np.int64(lse_strides[0])),
        plan.ScalarArg("lse_head_stride", np.int64(lse_strides[1])),
        plan.ScalarArg("num_heads_q", np.int32(p.num_heads_q)),
        plan.ScalarArg("group_size", np.int32(p.group_size)),
        plan.ScalarArg("seqlen_q", np.int32(seqlen_q)),
        plan.ScalarArg("seqlen_k", np.int32(seqlen_k)),
        plan.ScalarArg("head_dim", np.int32(p.head_dim)),
        plan.ScalarArg("head_dim_v", np.int32(p.head_dim_v)),
        plan.ScalarArg("num_q_tiles", np.int32(num_q_tiles)),
        plan.ScalarArg("scale_log2", np.float32(p.softmax_scale * math.log2(math.e))),
        plan.ScalarArg("window_left", np.int32(p.window_left)),
        plan.ScalarArg("window_right", np.int32(p.window_right)),
    )


#: the empty index the fixed-shape launches pass (never read: varlen = 0)
_NO_INDEX = np.zeros(0, np.int32)


@functools.lru_cache(maxsize=None)
def _no_index_on(device_id: int):
    """An empty CuPy int32 array on device ``device_id``, made once (launches allocate nothing)."""
    import cupy

    with cupy.cuda.Device(device_id):
        return cupy.empty(0, np.int32)


def varlen_args(problem, like) -> tuple:
    """The attention kernels' trailing arguments ``cu_seqlens_q, cu_seqlens_k, seqused_k, varlen``
    (common.cuh: varlen_seq): the packed batch's index arrays (int32, on the arrays' device),
    or, for fixed shapes, ``varlen = 0`` and empty arrays the kernels never read. ``like`` is an
    array of the launch's kind (NumPy for the simulator, CuPy for the GPU)."""
    vl = problem.varlen
    none = _NO_INDEX if isinstance(like, np.ndarray) else _no_index_on(like.device.id)
    if vl is None:
        return (plan.PointerArg.of("cu_seqlens_q", none), plan.PointerArg.of("cu_seqlens_k", none),
                plan.PointerArg.of("seqused_k", none), plan.ScalarArg("varlen", np.int32(0)))
    used = vl.seqused_k
    return (plan.PointerArg.of("cu_seqlens_q", vl.cu_seqlens_q), plan.PointerArg.of("cu_seqlens_k", vl.cu_seqlens_k),
            plan.PointerArg.of("seqused_k", none if used is None else used),
            plan.ScalarArg("varlen", np.int32(1 | (0 if used is None else 2))))


#: fresh outputs start at this alignment (the tensor-core kernels move rows in 16-byte copies)
OUTPUT_ALIGN_BYTES = 16


def _aligned_empty(xp, shape, dtype):
    """``xp.empty`` at a 16-byte-aligned address (CuPy's allocations always are; NumPy's are on
    the usual 64-bit allocators, and otherwise a slice of a slightly larger buffer is used)."""
    a = xp.empty(shape, dtype=dtype)
    if xp is not np or a.size == 0 or plan.array_address(a) % OUTPUT_ALIGN_BYTES == 0:
        return a
    item = np.dtype(dtype).itemsize
    raw = np.empty(a.size + OUTPUT_ALIGN_BYTES // item, dtype=dtype)
    skip = (-plan.array_address(raw) % OUTPUT_ALIGN_BYTES) // item
    return raw[skip : skip + a.size].reshape(shape)


def run_variant(problem, q, k, v, out, return_lse: bool, variant, *, xp, launch):
    """Allocate what the caller did not pass, plan any forward kernel that takes this argument
    list (:func:`plan_forward`) with ``variant``, and launch with ``launch(plan)``.

    ``xp`` is NumPy (the simulator; fresh outputs are NaN-poisoned so an element the kernel never
    writes shows) or CuPy (the GPU). Fresh outputs from either are 16-byte aligned.
    """
    unchecked = problem.varlen is not None and not problem.varlen.checked
    if out is None:
        out = _aligned_empty(xp, problem.out_shape, problem.dtype)
        if xp is np:
            out.fill(np.nan)
    if unchecked:   # device-resident index: rows no tile covers (a bad index) read NaN, never stale data
        out.fill(np.nan)
    lse = xp.empty(problem.lse_shape, dtype=np.float32)
    if xp is np or unchecked:
        lse.fill(np.nan)
    if not problem.is_empty:
        for launch_plan in plan_forward(problem, q, k, v, out, lse, variant):
            launch(launch_plan)
    return (out, lse) if return_lse else out


def forward(problem, q, k, v, out, return_lse: bool, *, xp, arch: int, launch):
    """Run ``problem`` with this tier's variant for ``sm_<arch>`` (see :func:`run_variant`)."""
    variant = for_problem(choose_variant(problem.dtype, problem.head_dim, problem.head_dim_v, arch), problem)
    return run_variant(problem, q, k, v, out, return_lse, variant, xp=xp, launch=launch)
