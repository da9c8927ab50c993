"""Launch arguments every attention kernel family shares: views, batch splits and the argument
groups of ``kernels_cu/common.cuh``, ``dropout.cuh`` and ``score_mods.cuh``.

A kernel's parameter list is a sequence of such groups: the forward's leading arguments
(:func:`forward_args`: q, k, v, out, lse, their strides, sizes, scale and window), the packed
batch's index (:func:`varlen_args`), the dropout key (:func:`dropout_args`) and the score
modifiers (:func:`mods_args`; the backward adds its dbias workspace, :func:`dbias_args`). Each
builder takes the launch's device call (:class:`cuflash.runtime.device_call.DeviceCall`): its
pointers are based on the allocation behind each view, and an absent array is the device's empty
index.

Imports: :mod:`cuflash.runtime` only.
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import numpy as np

from cuflash.runtime import plan

__all__ = ["canonical", "batch_slices", "select_batches", "forward_args", "varlen_args", "dropout_args",
           "modifier_views", "mods_args", "dbias_args", "element_strides", "i32", "i64", "MOD_BATCHED",
           "block_sparse_args", "counting_tiles"]

#: the modifier arrays the kernels index with batch dims first (they are sliced with q's batches);
#: ``dbias`` is the backward's workspace, indexed likewise
MOD_BATCHED = ("alibi_slopes", "attn_bias", "attn_mask", "dbias")
#: kernels_cu/score_mods.cuh: mod_flags bits (16: the backward writes its dbias workspace)
MOD_FLAGS = {"alibi_slopes": 1, "attn_bias": 2, "attn_mask": 4, "sinks": 8, "dbias": 16}


def i32(name: str, value) -> plan.ScalarArg:
    return plan.ScalarArg(name, np.int32(value))


def i64(name: str, value) -> plan.ScalarArg:
    return plan.ScalarArg(name, np.int64(value))


def element_strides(a) -> tuple[int, ...]:
    """``a``'s strides in elements."""
    return tuple(int(s) // a.dtype.itemsize for s in a.strides)


def canonical(x, layout: str, ndim_q: int):
    """``(*batch, H, S, D)`` view (no copy) of a q/k/v/out array in the caller's layout."""
    if layout == "bshd":
        return x.swapaxes(1, 2)
    if ndim_q == 2:
        return x[None]
    return x


def batch_slices(batch_shape: tuple, arrays: list) -> tuple[list, int]:
    """Split leading batch dims into launches: ``(list of index tuples, inner batch count)``.

    All leading dims merge into one launch (the list ``[None]``) when, for every array, they
    collapse into a single stride; otherwise the last batch dim is the grid's and the others are
    looped over. One batch dim or none: ``[()]``.
    """
    if len(batch_shape) <= 1:
        return [()], (batch_shape[0] if batch_shape else 1)
    nb = len(batch_shape)

    def mergeable(a):
        return all(batch_shape[i] == 1 or a.strides[i] == a.strides[i + 1] * batch_shape[i + 1] for i in range(nb - 1))

    if all(mergeable(a) for a in arrays):
        return [None], math.prod(batch_shape)
    return [idx for idx in np.ndindex(*batch_shape[:-1])], batch_shape[-1]


def select_batches(idx, batch_shape: tuple, arrays: list) -> list:
    """The views of ``arrays`` (each ``(*batch_shape, ...)``) for the launch ``idx`` of
    :func:`batch_slices`: merged into one batch axis (``None``), given one (``()``; a missing
    batch axis is added), or indexed."""
    nb = len(batch_shape)
    if idx is None:
        # the merged extent given (not -1, which is ambiguous for an array with no element)
        sel = [a.reshape((math.prod(a.shape[:nb]),) + a.shape[nb:]) for a in arrays]
        if not all(a.size == 0 or plan.array_address(a) == plan.array_address(b) for a, b in zip(sel, arrays)):
            raise AssertionError("cuflash: merging batch dims copied an array")   # never: strides were checked
        return sel
    if idx == ():
        return [a if batch_shape else a[None] for a in arrays]
    return [a[idx] for a in arrays]


def flat_batch(idx, batch_shape: tuple) -> int:
    """The flattened batch index of the first batch of launch ``idx`` (:func:`batch_slices`)."""
    return 0 if idx in (None, ()) else int(np.ravel_multi_index(idx + (0,), batch_shape))


def forward_args(problem, arrays, strides, lse_strides, sizes, call) -> tuple:
    """The forward kernels' leading arguments, up to ``window_right``: the pointers ``q, k, v,
    out, lse`` (``arrays``), the (batch, head, row) element strides of q, k, v and out
    (``strides``), lse's (batch, head) strides, then the sizes ``(seqlen_q, seqlen_k,
    num_q_tiles)``, the scale (log2 domain) and the window. Shared by every forward form (fixed,
    packed, KV-cache)."""
    p = problem
    q, k, v, out, lse = arrays
    seqlen_q, seqlen_k, num_q_tiles = sizes
    return (
        call.pointer("q", q), call.pointer("k", k), call.pointer("v", v),
        call.pointer("out", out, writable=True), call.pointer("lse", lse, writable=True),
        *(i64(f"{n}_{w}_stride", s[i]) for n, s in zip(("q", "k", "v", "o"), strides)
          for i, w in enumerate(("batch", "head", "row"))),
        i64("lse_batch_stride", lse_strides[0]), i64("lse_head_stride", lse_strides[1]),
        i32("num_heads_q", p.num_heads_q), i32("group_size", p.group_size),
        i32("seqlen_q", seqlen_q), i32("seqlen_k", seqlen_k),
        i32("head_dim", p.head_dim), i32("head_dim_v", p.head_dim_v), i32("num_q_tiles", num_q_tiles),
        plan.ScalarArg("scale_log2", np.float32(p.softmax_scale * math.log2(math.e))),
        i32("window_left", p.window_left), i32("window_right", p.window_right),
    )


def varlen_args(problem, call) -> tuple:
    """The attention kernels' trailing arguments ``cu_seqlens_q, cu_seqlens_k, seqused_k, varlen``
    (common.cuh: varlen_seq): the packed batch's index arrays (int32, device arrays), or, for fixed
    shapes, ``varlen = 0`` and the device's empty index, which the kernels never read."""
    vl = problem.varlen
    none = call.empty_index
    if vl is None:
        return (plan.PointerArg.of("cu_seqlens_q", none), plan.PointerArg.of("cu_seqlens_k", none),
                plan.PointerArg.of("seqused_k", none), i32("varlen", 0))
    used = vl.seqused_k
    return (plan.PointerArg.of("cu_seqlens_q", vl.cu_seqlens_q), plan.PointerArg.of("cu_seqlens_k", vl.cu_seqlens_k),
            plan.PointerArg.of("seqused_k", none if used is None else used),
            i32("varlen", 1 | (0 if used is None else 2)))


def dropout_args(problem, batch0: int, enabled: bool) -> tuple:
    """The dropout variants' trailing arguments ``dropout_seed, dropout_offset, dropout_threshold,
    dropout_scale, dropout_batch0`` (kernels_cu/dropout.cuh), or none for the other variants;
    ``batch0`` is the launch's first batch in the flattened batch index."""
    if not enabled:
        return ()
    d = problem.dropout
    return (plan.ScalarArg("dropout_seed", np.uint32(d.seed)), plan.ScalarArg("dropout_offset", np.uint32(d.offset)),
            plan.ScalarArg("dropout_threshold", np.uint32(d.threshold)),
            plan.ScalarArg("dropout_scale", np.float32(d.scale)), i64("dropout_batch0", d.batch0 + batch0))


def modifier_views(problem, call) -> dict:
    """The modifier arrays of ``problem`` (device arrays) as views (no copy) in the shapes the
    kernels index (:class:`~cuflash.runtime.validation_modifiers.BroadcastArray`: stride 0 on
    broadcast axes), by name; absent ones are missing."""
    m = problem.modifiers
    out = {}
    for name in ("alibi_slopes", "attn_bias", "attn_mask", "sinks"):
        b = getattr(m, name, None) if m is not None else None
        if b is None:
            continue
        item = b.array.dtype.itemsize
        out[name] = call.as_strided(b.array, b.shape, tuple(st * item for st in b.strides))
    return out


def user_args(problem, call, batch0: int) -> tuple:
    """The traced score_mod / mask_mod's arguments (``kernels_cu/score_mods.cuh``:
    ``CUFLASH_USER_PARAMS``): the captured arrays (the score_mod's, then the mask_mod's; device
    arrays of ``call``), the device's empty index for unused slots, their element strides (0 past
    an array's rank) and ``batch0``, the launch's first batch in the flattened batch index."""
    m = problem.modifiers
    arrays = [a for t in (m.score_mod, m.mask_mod) if t is not None for a in t.arrays]
    ptrs, strides = [], []
    for n in range(4):
        a = arrays[n] if n < len(arrays) else None
        ptrs.append(plan.PointerArg.of(f"user_a{n}", a if a is not None else call.empty_index))
        st = () if a is None else element_strides(a)
        strides += [i64(f"user_s{n}{axis}", st[axis] if axis < len(st) else 0) for axis in range(3)]
    return (*ptrs, *strides, i64("user_batch0", batch0))


def array_grad_args(workspaces: dict, call) -> tuple:
    """The backward's captured-array gradient workspaces (``kernels_cu/score_mods.cuh``:
    ``CUFLASH_AGRAD_PARAMS``): ``workspaces`` maps a score_mod array's slot to its float32
    workspace (a device array of ``call`` in the array's shape); the device's empty index (never
    written) for the other slots; then their element strides (0 past an array's rank)."""
    ptrs, strides = [], []
    for n in range(4):
        w = workspaces.get(n)
        ptrs.append(call.pointer(f"user_g{n}", w if w is not None else call.empty_index, writable=True))
        st = () if w is None else element_strides(w)
        strides += [i64(f"user_gs{n}{axis}", st[axis] if axis < len(st) else 0) for axis in range(3)]
    return (*ptrs, *strides)


#: the tiles block-sparse launches entered, while :func:`counting_tiles` collects them
_TILE_COUNTS: contextvars.ContextVar = contextvars.ContextVar("cuflash_tile_counts", default=None)


@contextlib.contextmanager
def counting_tiles():
    """Collect the simulator's count of the tiles each block-sparse launch entered: yields a list
    that gets one int32 array ``(grid, 2)`` per launch (per thread block: the partial tiles and the
    full tiles its loop ran). The kernels count only when compiled for the simulator
    (``CUFLASH_SIM``); device launches add nothing to the list."""
    found: list = []
    token = _TILE_COUNTS.set(found)
    try:
        yield found
    finally:
        _TILE_COUNTS.reset(token)


def block_sparse_args(problem, call, transposed: bool, grid: int) -> tuple:
    """The block mask's arguments (``kernels_cu/score_mods.cuh``: ``CUFLASH_BSPARSE_PARAMS``): the
    forward's key-block lists (``kv_*``), or with ``transposed`` the backward's query-block lists
    (``q_*``), their strides, the outer and inner block sizes, and the simulator's tile counter
    (:func:`counting_tiles`; a launch of ``grid`` blocks)."""
    bm = problem.modifiers.block_mask
    pre = "q" if transposed else "kv"
    num, idx = getattr(bm, f"{pre}_num_blocks"), getattr(bm, f"{pre}_indices")
    full_num, full_idx = getattr(bm, f"full_{pre}_num_blocks"), getattr(bm, f"full_{pre}_indices")
    ns, js = element_strides(num), element_strides(idx)
    bcast = [n > 1 for n in num.shape[:2]]   # a broadcast batch or head axis: stride 0
    outer, inner = bm.BLOCK_SIZE[::-1] if transposed else bm.BLOCK_SIZE
    found = _TILE_COUNTS.get()
    counting = found is not None and getattr(call.device, "backend", "") == "sim"
    counts = call.xp.zeros((grid, 2), np.int32) if counting else call.empty_index
    if counting:
        found.append(call.device.to_host_kind(counts))   # (a host view of the simulator's memory)
    return (plan.PointerArg.of("bs_num", num), plan.PointerArg.of("bs_idx", idx),
            plan.PointerArg.of("bs_full_num", full_num), plan.PointerArg.of("bs_full_idx", full_idx),
            i64("bs_num_bs", ns[0] * bcast[0]), i64("bs_num_hs", ns[1] * bcast[1]),
            i64("bs_idx_bs", js[0] * bcast[0]), i64("bs_idx_hs", js[1] * bcast[1]), i64("bs_idx_rs", js[2]),
            i32("bs_outer", outer), i32("bs_inner", inner),
            call.pointer("bs_counts", counts, writable=True), i32("bs_count", int(counting)))


def mods_args(problem, views: dict, call, enabled: bool, user: bool = False, batch0: int = 0,
              sparse: tuple = ()) -> tuple:
    """The score-modifier variants' trailing arguments (``kernels_cu/score_mods.cuh``:
    ``CUFLASH_MODS_PARAMS``) from :func:`modifier_views` sliced to the launch (batch axis first,
    then head, row, key), or none for the other variants; with ``user`` (a variant with a traced
    score_mod / mask_mod) followed by :func:`user_args`, and by ``sparse`` (a block-sparse
    variant's :func:`block_sparse_args`). A call without modifiers that a modifier
    form runs (the portable packed forward at head dim 256) passes every modifier off."""
    if not enabled:
        return ()
    tail = (user_args(problem, call, batch0) + tuple(sparse)) if user else ()
    m = problem.modifiers
    flags = sum(f for n, f in MOD_FLAGS.items() if n in views and n != "dbias")

    def st(name, rank):
        a = views.get(name)
        return (0,) * rank if a is None else element_strides(a)[-rank:]

    def ptr(name):
        a = views.get(name)
        return plan.PointerArg.of(name, a if a is not None else call.empty_index)

    bias = views.get("attn_bias")
    return (i32("mod_flags", flags), plan.ScalarArg("softcap", np.float32(m.softcap if m is not None else 0.0)),
            ptr("alibi_slopes"), *(i64(f"alibi_{w}_stride", x) for w, x in zip(("batch", "head"), st("alibi_slopes", 2))),
            ptr("attn_bias"), i32("bias_f32", bias is not None and bias.dtype == np.float32),
            *(i64(f"bias_{w}_stride", x) for w, x in zip(("batch", "head", "row", "col"), st("attn_bias", 4))),
            ptr("attn_mask"), *(i64(f"mask_{w}_stride", x)
                                for w, x in zip(("batch", "head", "row", "col"), st("attn_mask", 4))),
            ptr("sinks"), i64("sinks_stride", st("sinks", 1)[0]), *tail)


def dbias_args(problem, views: dict, call, enabled: bool, user: bool = False, batch0: int = 0,
               sparse: tuple = ()) -> tuple:
    """The backward's modifier arguments: :func:`mods_args` (``mod_flags`` bit 16 when ``views``
    holds the ``"dbias"`` workspace; ``user``, ``batch0`` and ``sparse`` as there), then the workspace pointer
    (the empty index, never written, without it) and its strides."""
    if not enabled:
        return ()
    ws = views.get("dbias")
    args = mods_args(problem, views, call, True, user, batch0, sparse)
    if ws is not None:
        args = (i32("mod_flags", int(args[0].value) | MOD_FLAGS["dbias"]),) + args[1:]
    st = (0, 0, 0) if ws is None else tuple(int(x) // 4 for x in ws.strides[:3])
    return (*args, call.pointer("dbias", ws if ws is not None else call.empty_index, writable=True),
            *(i64(f"dbias_{w}_stride", x) for w, x in zip(("batch", "head", "row"), st)))
