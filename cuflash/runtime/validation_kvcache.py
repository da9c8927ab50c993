"""Validation of KV-cache attention (:func:`cuflash.attention_with_kvcache`, and
:func:`cuflash.attention_varlen` with a ``block_table``): pure checks on metadata, before any
work, so a refused call writes nothing into the cache.

Host (NumPy) index arrays and an int ``cache_seqlens`` are read and checked in full here.
Device-resident ones (CuPy, torch, JAX on q's device) are checked for dtype and shape only, since
reading them would synchronize the host; the kernels then clamp every index into the cache, skip
appends that would land outside it, and give NaN rows for a sequence whose index was out of range.
"""

from __future__ import annotations

import dataclasses
import numbers

import numpy as np

from cuflash.runtime import dtypes, validation
from cuflash.runtime.interop import ArrayInfo, describe
from cuflash.runtime.validation import AttentionProblem, check_flag, check_int, check_num_splits
from cuflash.runtime.validation_fp8 import check_fp8
from cuflash.runtime.validation_modifiers import check_modifiers

#: the array fields of :class:`KVCache`
_ARRAYS = ("k_cache", "v_cache", "cache_seqlens", "cache_leftpad", "cache_batch_idx", "block_table", "k_new", "v_new",
           "rotary_cos", "rotary_sin")
#: positions, lengths and page counts stay below this (32-bit kernel arithmetic with tile padding)
MAX_LENGTH = 2**31 - 256


@dataclasses.dataclass(frozen=True, eq=False)
class KVCache:
    """Where one call's keys live, and what it appends.

    Attributes
    ----------
    k_cache, v_cache : array
        Contiguous ``(B_cache, S_cache, Hk, D|Dv)`` or paged ``(num_pages, page_size, Hk, D|Dv)``.
    paged : bool
        True with a ``block_table``.
    page_size : int
        Rows per page (paged) or ``S_cache`` (contiguous).
    num_pages : int
        Pages (paged) or cache batches ``B_cache`` (contiguous): the range a page index or
        ``cache_batch_idx`` entry must lie in.
    capacity : int
        Cache indices a sequence can address: ``max_pages * page_size`` or ``S_cache``.
    cache_seqlens : array or None
        int32 ``(B,)``, keys in the cache before the append; None when an int was given
        (``cache_seqlen``). For :func:`cuflash.attention_varlen` with a block table, None: the
        key counts come from ``cu_seqlens_k``/``seqused_k``.
    cache_seqlen : int
    cache_leftpad, cache_batch_idx, block_table : array or None
    k_new, v_new : array or None
        ``(B, Snew, Hk, D|Dv)``, written into the cache before attending.
    seqlen_new : int
    rotary_cos, rotary_sin : array or None
        ``(seqlen_ro, rotary_dim / 2)``; ``rotary_dim`` even, ``<= D``.
    rotary_interleaved : bool
    num_splits : int
        Requested split-KV count (0 = chosen by the heuristic).
    checked : bool
        True when every index was read and checked on the host.
    """

    k_cache: object
    v_cache: object
    paged: bool
    page_size: int
    num_pages: int
    capacity: int
    cache_seqlens: object
    cache_seqlen: int
    cache_leftpad: object
    cache_batch_idx: object
    block_table: object
    k_new: object
    v_new: object
    seqlen_new: int
    rotary_cos: object
    rotary_sin: object
    rotary_interleaved: bool
    num_splits: int
    checked: bool

    def with_arrays(self, convert) -> "KVCache":
        """A copy whose arrays (caches, indices, new keys, rotary tables) are ``convert(array)``
        (a device call's imports; None stays None)."""
        return dataclasses.replace(self, **{n: convert(getattr(self, n)) for n in _ARRAYS})

    @property
    def rotary_dim(self) -> int:
        return 0 if self.rotary_cos is None else 2 * int(self.rotary_cos.shape[1])

    def host_seqlens(self, batch: int) -> np.ndarray:
        """Keys in the cache before the append, int64 ``(B,)`` (host indices only)."""
        if self.cache_seqlens is None:
            return np.full(batch, self.cache_seqlen, np.int64)
        return np.asarray(self.cache_seqlens, dtype=np.int64)

    def host_leftpad(self, batch: int) -> np.ndarray:
        if self.cache_leftpad is None:
            return np.zeros(batch, np.int64)
        return np.asarray(self.cache_leftpad, dtype=np.int64)


def _check_index(x, name: str, func: str, shape: tuple, q: ArrayInfo) -> ArrayInfo:
    return validation._check_index(x, name, func, None, q.kind, q.device, shape=shape)


def check_cache_arrays(func: str, q: ArrayInfo, k_cache, v_cache, block_table, batch: int, *, writable: bool,
                       fp8: bool = False):
    """The caches' shapes against q, and the block table's; ``(k_info, v_info, paged, page_size,
    num_pages, capacity)``. With ``fp8`` both caches may be float8_e4m3fn instead of q's dtype."""
    ki = describe(k_cache, "k_cache", func)
    vi = describe(v_cache, "v_cache", func)
    fp8_cache = fp8 and dtypes.is_fp8(ki.dtype)
    for name, info in (("k_cache", ki), ("v_cache", vi)):
        if info.kind != q.kind:
            raise TypeError(f"{func}: {name} is a {info.type_name} but q is a {q.type_name}; all arrays must be of "
                            f"one kind (no implicit copies between host and device)")
        if fp8_cache and not dtypes.same(info.dtype, ki.dtype):
            raise TypeError(f"{func}: {name}.dtype={info.dtype_name} must equal k_cache.dtype={ki.dtype_name} (an fp8 "
                            f"cache holds keys and values in fp8)")
        if not fp8_cache and not dtypes.same(info.dtype, q.dtype):
            also = " or, for an fp8 cache, float8_e4m3fn (both caches)" if fp8 else ""
            raise TypeError(f"{func}: {name}.dtype={info.dtype_name} must equal q.dtype={q.dtype_name}{also}")
        if info.device != q.device:
            raise ValueError(f"{func}: {name} is on device {info.device} but q is on device {q.device}")
        if info.ndim != 4:
            what = "(num_pages, page_size, Hk, D)" if block_table is not None else "(B_cache, S_cache, Hk, D)"
            raise ValueError(f"{func}: {name}.ndim must be 4 {what}; got {name}.shape={info.shape}")
        validation.check_strides(info, name, func, writable_out=writable)
        if writable and info.kind == "numpy":
            arr = k_cache if name == "k_cache" else v_cache
            if not arr.flags.writeable:
                raise ValueError(f"{func}: {name} is read-only, but k/v are to be appended into it")
    if ki.shape[:3] != vi.shape[:3]:
        raise ValueError(f"{func}: v_cache.shape={vi.shape} must match k_cache.shape={ki.shape} in its first three "
                         f"axes (pages or batch, rows, kv heads)")
    n0, rows = ki.shape[0], ki.shape[1]
    if block_table is None:
        return ki, vi, False, rows, n0, rows
    shape = describe(block_table, "block_table", func).shape
    if len(shape) != 2 or shape[0] != batch:
        raise ValueError(f"{func}: block_table.shape={shape} must be (B, max_pages) with B={batch}")
    bt = _check_index(block_table, "block_table", func, shape, q)
    if rows < 1:
        raise ValueError(f"{func}: k_cache.shape[1]={rows} is the page size and must be >= 1")
    return ki, vi, True, rows, n0, bt.shape[1] * rows


def _check_rotary(func, q: ArrayInfo, rotary_cos, rotary_sin, interleaved, head_dim: int, have_new: bool):
    interleaved = check_flag(interleaved, "rotary_interleaved", func)
    if rotary_cos is None and rotary_sin is None:
        return interleaved
    if rotary_cos is None or rotary_sin is None:
        raise ValueError(f"{func}: rotary_cos and rotary_sin go together; got only "
                         f"{'rotary_cos' if rotary_sin is None else 'rotary_sin'}")
    if not have_new:
        raise ValueError(f"{func}: rotary_cos/rotary_sin rotate the new k and q; pass k and v too (flash-attn applies "
                         f"rotary only with an append)")
    ci, si = describe(rotary_cos, "rotary_cos", func), describe(rotary_sin, "rotary_sin", func)
    for name, info in (("rotary_cos", ci), ("rotary_sin", si)):
        if info.kind != q.kind or info.device != q.device:
            raise ValueError(f"{func}: {name} must be a {q.type_name} on q's device {q.device}; got a "
                             f"{info.type_name} on {info.device}")
        if info.dtype is None or (info.dtype != q.dtype and info.dtype_name != "float32"):
            raise TypeError(f"{func}: {name}.dtype={info.dtype_name} must be "
                            f"{dtypes.q_dtype_or_float32(q.dtype_name)}")
        if info.ndim != 2:
            raise ValueError(f"{func}: {name}.ndim must be 2 (seqlen_ro, rotary_dim / 2); got {name}.shape={info.shape}")
        validation.check_strides(info, name, func)
    if ci.shape != si.shape:
        raise ValueError(f"{func}: rotary_sin.shape={si.shape} must equal rotary_cos.shape={ci.shape}")
    if ci.dtype != si.dtype:
        raise TypeError(f"{func}: rotary_sin.dtype={si.dtype_name} must equal rotary_cos.dtype={ci.dtype_name}")
    rotary_dim = 2 * ci.shape[1]
    if not 2 <= rotary_dim <= head_dim:
        raise ValueError(f"{func}: rotary_dim = 2 * rotary_cos.shape[1] = {rotary_dim} must be in [2, head dim "
                         f"{head_dim}]")
    return interleaved


def varlen_cache(func: str, q: ArrayInfo, k_cache, v_cache, block_table, batch: int, cu_seqlens_k, seqused_k,
                 index_checked: bool) -> KVCache:
    """The paged cache of :func:`cuflash.attention_varlen` with a ``block_table`` (chunked
    prefill): sequence ``b``'s keys are cache indices ``[0, n_b)`` of its pages, ``n_b`` its
    ``cu_seqlens_k`` length (``seqused_k[b]`` when given); host indices are checked to fit."""
    ki, vi, paged, page_size, num_pages, capacity = check_cache_arrays(func, q, k_cache, v_cache, block_table,
                                                                          batch, writable=False)
    if capacity >= MAX_LENGTH:
        raise ValueError(f"{func}: the cache holds {capacity} rows per sequence; at most {MAX_LENGTH - 1}")
    checked = index_checked and isinstance(block_table, np.ndarray)
    if index_checked:
        n = np.diff(np.asarray(cu_seqlens_k, dtype=np.int64))
        if seqused_k is not None:
            n = np.minimum(n, np.asarray(seqused_k, dtype=np.int64))
        bad = n > capacity
        if bad.any():
            b = _first(bad)
            raise ValueError(f"{func}: sequence {b} has {int(n[b])} keys but its block_table row addresses "
                             f"{capacity} (max_pages x page_size)")
        if checked:
            check_block_table(func, block_table, np.zeros_like(n), n, page_size, num_pages)
    return KVCache(k_cache, v_cache, paged, page_size, num_pages, capacity, None, 0, None, None, block_table, None,
                   None, 0, None, None, False, 1, checked)


def check_attention_with_kvcache(q, k_cache, v_cache, options, *, func: str = "cuflash.attention_with_kvcache",
                                 out=None, max_head_dim: int | None = validation.MAX_HEAD_DIM) -> AttentionProblem:
    """Validate one :func:`cuflash.attention_with_kvcache` call (``options.cache``: the
    :class:`~cuflash.runtime.options.CacheOptions`) and return its problem.

    The problem is ``B`` sequences of ``Sq`` queries over at most ``capacity`` keys in "bshd"
    terms (``seqlen_k`` is the capacity); ``kvcache`` says where the keys are.
    """
    options = validation.check_flags(options, func, "causal", "return_lse")
    causal, co = options.causal, options.cache
    cache_seqlens, k, v, block_table = co.cache_seqlens, co.k, co.v, co.block_table
    rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad = co.rotary_cos, co.rotary_sin, co.cache_batch_idx, co.cache_leftpad
    qi = describe(q, "q", func)
    if qi.dtype is None:
        raise TypeError(f"{func}: q.dtype={qi.dtype_name} is not supported")
    if dtypes.is_fp8(qi.dtype):
        raise NotImplementedError(f"{func}: q.dtype={qi.dtype_name}: with a KV cache q is float16, bfloat16 or float32 "
                                  f"(float64 on the NumPy path); the caches may be fp8 (float8_e4m3fn, with k_descale "
                                  f"and v_descale)")
    if qi.kind == "dlpack" and not qi.on_cuda:
        raise ValueError(f"{func}: q is a {qi.type_name} on the CPU; pass a NumPy array for the CPU path")
    if qi.ndim != 4:
        raise ValueError(f"{func}: q.ndim must be 4 (B, Sq, Hq, D); got q.shape={qi.shape}")
    validation.check_strides(qi, "q", func)
    batch, sq, hq, d = qi.shape
    have_new = k is not None or v is not None
    if (k is None) != (v is None):
        raise ValueError(f"{func}: k and v are appended together; got only {'k' if v is None else 'v'}")
    ki, vi, paged, page_size, num_pages, capacity = check_cache_arrays(func, qi, k_cache, v_cache, block_table,
                                                                          batch, writable=have_new, fp8=True)
    if have_new and isinstance(k_cache, np.ndarray) and validation._overlaps(k_cache, v_cache):
        raise ValueError(f"{func}: k_cache and v_cache share memory; the values appended would overwrite the keys "
                         f"(pass two separate caches)")
    if isinstance(k_cache, np.ndarray):   # device arrays: checked by address range on the CUDA path
        for name, x in (("q", q), ("k", k), ("v", v)):
            for cname, c in (("k_cache", k_cache), ("v_cache", v_cache)):
                if isinstance(x, np.ndarray) and validation._overlaps(x, c):
                    raise ValueError(f"{func}: {name} overlaps {cname} in memory; the append writes the cache while "
                                     f"the kernels read {name}: pass a separate array")
    hk, dk, dv = ki.shape[2], ki.shape[3], vi.shape[3]
    validation._check_heads_and_dims(func, (hq, hk, vi.shape[2]), (ki.shape[1], vi.shape[1]), (d, dk, dv), "2", "1",
                                     "cache rows", max_head_dim, names=("k_cache", "v_cache"))
    if not paged and batch and num_pages == 0:
        raise ValueError(f"{func}: k_cache.shape[0]=0 cache batches cannot serve B={batch} sequences")
    if not paged and cache_batch_idx is None and batch > num_pages:
        raise ValueError(f"{func}: q.shape[0]={batch} sequences but k_cache.shape[0]={num_pages} cache batches; "
                         f"sequence b uses cache batch b, so pass cache_batch_idx to map them (or a larger cache)")
    if paged and cache_batch_idx is not None:
        raise ValueError(f"{func}: cache_batch_idx selects rows of a contiguous cache; with a block_table the pages "
                         f"already say where each sequence lives (flash-attn refuses the pair too)")
    snew = 0
    if have_new:
        infos = {"k": describe(k, "k", func), "v": describe(v, "v", func)}
        for name, info in infos.items():
            want = (batch, None, hk, dk if name == "k" else dv)
            if info.kind != qi.kind or info.device != qi.device:
                raise ValueError(f"{func}: {name} must be a {qi.type_name} on q's device {qi.device}")
            if not dtypes.same(info.dtype, qi.dtype):
                raise TypeError(f"{func}: {name}.dtype={info.dtype_name} must equal q.dtype={qi.dtype_name}")
            if info.ndim != 4 or info.shape[0] != batch or info.shape[2:] != want[2:]:
                raise ValueError(f"{func}: {name}.shape={info.shape} must be (B={batch}, Snew, Hk={hk}, {want[3]})")
            validation.check_strides(info, name, func)
        if infos["k"].shape[1] != infos["v"].shape[1]:
            raise ValueError(f"{func}: v.shape[1]={infos['v'].shape[1]} must equal k.shape[1]={infos['k'].shape[1]} "
                             f"(Snew, the new tokens)")
        snew = infos["k"].shape[1]
    interleaved = _check_rotary(func, qi, rotary_cos, rotary_sin, co.rotary_interleaved, d, have_new)
    splits = check_num_splits(co.num_splits, func)

    # the indices
    seqlens_arr, seqlen_scalar = None, 0
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, (bool, np.bool_)):
        seqlen_scalar = check_int(cache_seqlens, "cache_seqlens", func)
    elif cache_seqlens is None or isinstance(cache_seqlens, (numbers.Number, bool, np.bool_)):
        raise TypeError(f"{func}: cache_seqlens must be an int or an int32 array (B,), got {cache_seqlens!r}")
    else:
        _check_index(cache_seqlens, "cache_seqlens", func, (batch,), qi)
        seqlens_arr = cache_seqlens
    if cache_leftpad is not None:
        _check_index(cache_leftpad, "cache_leftpad", func, (batch,), qi)
    if cache_batch_idx is not None:
        _check_index(cache_batch_idx, "cache_batch_idx", func, (batch,), qi)
    host = [x for x in (seqlens_arr, cache_leftpad, cache_batch_idx, block_table) if x is not None]
    checked = all(isinstance(x, np.ndarray) for x in host)
    if capacity >= MAX_LENGTH:
        raise ValueError(f"{func}: the cache holds {capacity} rows per sequence; at most {MAX_LENGTH - 1}")
    # an int is every sequence's length: with no sequence (B = 0) only its sign can be wrong
    if seqlens_arr is None and (seqlen_scalar < 0 or (batch and seqlen_scalar > capacity - snew)):
        raise ValueError(f"{func}: cache_seqlens={seqlen_scalar} plus Snew={snew} new keys must fit the cache's "
                         f"{capacity} rows per sequence (and be >= 0)")
    cache = KVCache(k_cache, v_cache, paged, page_size, num_pages, capacity, seqlens_arr, seqlen_scalar,
                    cache_leftpad, cache_batch_idx, block_table, k, v, snew, rotary_cos, rotary_sin, interleaved,
                    splits, checked)
    window = validation.check_window_size(options.window_size, causal, func)
    _check_host_indices(func, cache, batch, sq, causal or window != (-1, -1))

    scale = validation.check_softmax_scale(options.softmax_scale, d, func)
    left, right = validation.normalize_window(*window, sq, capacity)
    problem = AttentionProblem(
        func=func, kind=qi.kind, dtype=qi.dtype, layout="bshd", batch_shape=(batch,), num_heads_q=hq, num_heads_k=hk,
        seqlen_q=sq, seqlen_k=capacity, head_dim=d, head_dim_v=dv, softmax_scale=scale, causal=causal,
        window_left=left, window_right=right, out_shape=(batch, sq, hq, dv), lse_shape=(batch, hq, sq),
        device=qi.device, q=qi, k=ki, v=vi, kvcache=cache,
        modifiers=check_modifiers(func, qi, (batch,), hq, sq, capacity, options.modifiers),
        fp8=check_fp8(func, qi, {"k_cache": ki, "v_cache": vi}, (batch,), hk, options.fp8), options=options,
    )
    if out is not None:
        inputs = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
        if have_new:
            inputs.update(k=k, v=v)
        validation.check_out(out, problem, inputs)
    return problem


def rotates_per_row(problem) -> bool:
    """flash-attn's rule for rotating q: with causal or a finite window query row ``i`` is rotated
    at ``cache_seqlens + i``, otherwise every row at ``cache_seqlens``."""
    return problem.causal or (problem.window_left, problem.window_right) != (-1, -1)


def _first(bad: np.ndarray) -> int:
    return int(np.flatnonzero(bad)[0])


def _check_host_indices(func: str, c: KVCache, batch: int, sq: int, per_row_rotary: bool) -> None:
    """Every host index in range: lengths inside the cache, left padding inside the kept keys,
    cache batches and the pages a sequence reads or writes inside the cache, rotary tables long
    enough for every position rotated."""
    snew = c.seqlen_new
    seqlens = c.host_seqlens(batch) if (c.cache_seqlens is None or isinstance(c.cache_seqlens, np.ndarray)) else None
    if seqlens is not None:
        if (seqlens < 0).any():
            b = _first(seqlens < 0)
            raise ValueError(f"{func}: cache_seqlens[{b}]={int(seqlens[b])} must be >= 0 (keys already in the cache)")
        bad = seqlens + snew > c.capacity
        if bad.any():
            b = _first(bad)
            raise ValueError(f"{func}: cache_seqlens[{b}]={int(seqlens[b])} plus Snew={snew} new keys must be at most "
                             f"{c.capacity} (the cache's rows per sequence)")
    leftpad = None
    if c.cache_leftpad is None:
        leftpad = np.zeros(batch, np.int64)
    elif isinstance(c.cache_leftpad, np.ndarray):
        leftpad = c.cache_leftpad.astype(np.int64)
        if seqlens is not None:
            bad = (leftpad < 0) | (leftpad > seqlens)
            if bad.any():
                b = _first(bad)
                raise ValueError(f"{func}: cache_leftpad[{b}]={int(leftpad[b])} must be in [0, cache_seqlens[{b}]="
                                 f"{int(seqlens[b])}] (the first key the sequence keeps)")
    if isinstance(c.cache_batch_idx, np.ndarray):
        idx = c.cache_batch_idx.astype(np.int64)
        bad = (idx < 0) | (idx >= c.num_pages)
        if bad.any():
            b = _first(bad)
            raise ValueError(f"{func}: cache_batch_idx[{b}]={int(idx[b])} must be in [0, {c.num_pages}) (k_cache.shape[0])")
    if isinstance(c.block_table, np.ndarray) and seqlens is not None and leftpad is not None:
        check_block_table(func, c.block_table, leftpad, seqlens + snew, c.page_size, c.num_pages)
    if c.rotary_cos is not None and seqlens is not None and batch:
        need = int((seqlens + max(snew, sq if per_row_rotary else 1)).max())
        if need > c.rotary_cos.shape[0]:
            raise ValueError(f"{func}: rotary_cos.shape[0]={c.rotary_cos.shape[0]} positions, but position {need - 1} "
                             f"is rotated (cache_seqlens + new tokens)")


def check_block_table(func: str, block_table: np.ndarray, starts: np.ndarray, stops: np.ndarray, page_size: int,
                      num_pages: int) -> None:
    """The entries of the pages that sequences read or write (cache indices ``[starts[b],
    stops[b])``) lie in ``[0, num_pages)``; entries past them are not read and may hold anything."""
    bt = np.asarray(block_table, dtype=np.int64)
    for b in range(bt.shape[0]):
        if stops[b] <= starts[b]:
            continue
        p0, p1 = int(starts[b]) // page_size, -(-int(stops[b]) // page_size)
        row = bt[b, p0:p1]
        bad = (row < 0) | (row >= num_pages)
        if bad.any():
            j = p0 + _first(bad)
            raise ValueError(f"{func}: block_table[{b}, {j}]={int(bt[b, j])} must be in [0, {num_pages}) (num_pages); "
                             f"sequence {b} uses pages {p0}..{p1 - 1} of its row")
