"""Validation of attention arguments: pure checks on metadata, run before any device work.

Every failure raises ``TypeError`` (not an array, unsupported or mixed dtypes or array kinds),
``ValueError`` (shapes, strides, devices, option values) or ``NotImplementedError`` (valid input
without a kernel), with a message naming the function, the argument, what was expected and
what was received. Nothing here reads array data, so it runs for CuPy and torch arrays on a
machine without a GPU.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator

import numpy as np

from cuflash.runtime import dtypes
from cuflash.runtime.interop import ArrayInfo, describe, device_type_name
from cuflash.runtime.options import Options
from cuflash.runtime.validation_fp8 import Fp8, check_fp8
from cuflash.runtime.validation_modifiers import Modifiers, check_modifiers

#: largest head dim (of q/k and of v) that the kernels support (docs/kernels.md).
MAX_HEAD_DIM = 256

LAYOUTS = ("bhsd", "bshd")


@dataclasses.dataclass(frozen=True)
class AttentionProblem:
    """A validated attention call, in the canonical ``(*batch, H, S, D)`` terms.

    ``window_left``/``window_right`` are the effective bounds (-1 = unbounded): with
    ``causal=True`` the right bound is 0, and a bound reaching past both sequences
    (``>= Sq + Sk``; in a packed batch ``Sq`` and ``Sk`` are ``max_seqlen`` or the total rows,
    whichever is smaller) is -1 (:func:`normalize_window`), so each lies in ``[-1, min(Sq + Sk, 2**31 - 1))``.
    ``out_shape`` and ``lse_shape`` are in the caller's layout.
    """

    func: str
    kind: str
    dtype: np.dtype
    layout: str
    batch_shape: tuple
    num_heads_q: int
    num_heads_k: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    head_dim_v: int
    softmax_scale: float
    causal: bool
    window_left: int
    window_right: int
    out_shape: tuple
    lse_shape: tuple
    device: tuple
    q: ArrayInfo
    k: ArrayInfo
    v: ArrayInfo
    #: a packed variable-length batch (:func:`check_attention_varlen`), else None
    varlen: "VarlenBatch | None" = None
    #: where the keys live for KV-cache attention (:mod:`cuflash.runtime.validation_kvcache`), else None
    kvcache: "object | None" = None
    #: attention dropout (:func:`check_dropout`), else None
    dropout: "Dropout | None" = None
    #: the score modifiers (softcap, ALiBi, bias, mask, sinks:
    #: :func:`cuflash.runtime.validation_modifiers.check_modifiers`), else None
    modifiers: "Modifiers | None" = None
    #: fp8 (float8_e4m3fn) input: descales and result type
    #: (:func:`cuflash.runtime.validation_fp8.check_fp8`), else None
    fp8: "Fp8 | None" = None
    #: the call's options with their flags validated (``return_lse``, ``deterministic``,
    #: ``return_dbias``, ...: what a backend asks of them beyond the fields above)
    options: Options = Options()

    def on_device(self, convert) -> "AttentionProblem":
        """A copy whose arrays (the modifiers', a packed batch's index, a KV cache's) are
        ``convert(array)``: a device call's imports. Shapes, strides and flags stay validated."""
        changes = {}
        if self.modifiers is not None:
            changes["modifiers"] = self.modifiers.with_arrays(convert)
        if self.varlen is not None:
            changes["varlen"] = self.varlen.with_arrays(convert)
        if self.kvcache is not None:
            changes["kvcache"] = self.kvcache.with_arrays(convert)
        if self.fp8 is not None:
            changes["fp8"] = self.fp8.with_arrays(convert)
        return dataclasses.replace(self, **changes)

    @property
    def out_dtype(self) -> np.dtype:
        """The result's dtype: q's, or for fp8 q the call's ``out_dtype`` (bfloat16 by default)."""
        return self.fp8.out_dtype if self.fp8 is not None else self.dtype

    @property
    def is_empty(self) -> bool:
        """True when the output has no element (a zero batch dim, Sq = 0 or no head)."""
        return math.prod(self.out_shape) == 0

    @property
    def group_size(self) -> int:
        """Query heads per kv head (1 for MHA, ``Hq`` for MQA)."""
        return self.num_heads_q // self.num_heads_k


@dataclasses.dataclass(frozen=True)
class Dropout:
    """Attention dropout of one call (:mod:`cuflash.reference.dropout` has the convention).

    Attributes
    ----------
    p : float
        Drop probability, in (0, 1).
    seed, offset : int
        The Philox key, each in ``[0, 2**32)``.
    """

    p: float
    seed: int
    offset: int
    #: the flattened batch index of the call's first batch (a packed batch's sequences run one
    #: call each on the NumPy path: sequence b's is b)
    batch0: int = 0

    @property
    def threshold(self) -> int:
        """A pair is kept iff its 32-bit draw is below this."""
        return min(2**32 - 1, max(0, int(round((1.0 - self.p) * 2.0**32))))

    @property
    def scale(self) -> float:
        """The survivors' scale, ``1 / (1 - p)``."""
        return 1.0 / (1.0 - self.p)


def check_dropout(dropout, func: str) -> "Dropout | None":
    """``dropout`` (:class:`~cuflash.runtime.options.DropoutOptions`): ``dropout_p`` a real
    number in ``[0, 1)``; with ``p > 0``, ``dropout_seed`` and ``dropout_offset`` ints in
    ``[0, 2**32)`` (the seed is required: the backward regenerates the mask from it). ``p = 0``
    is no dropout (None)."""
    dropout_p, dropout_seed, dropout_offset = dropout.p, dropout.seed, dropout.offset
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"{func}: dropout_p must be a real number in [0, 1), got {dropout_p!r} "
                        f"({type(dropout_p).__name__})")
    p = float(dropout_p)
    if not (0.0 <= p < 1.0):
        raise ValueError(f"{func}: dropout_p must be in [0, 1), got {p!r}")
    for name, value in (("dropout_seed", dropout_seed), ("dropout_offset", dropout_offset)):
        if value is None and name == "dropout_seed":
            if p > 0:
                raise ValueError(f"{func}: dropout_p={p} needs dropout_seed (an int in [0, 2**32)): the mask comes "
                                 f"from it, and the backward regenerates it from the same seed and offset")
            continue
        v = check_int(value, name, func)
        if not 0 <= v < 2**32:
            raise ValueError(f"{func}: {name} must be an int in [0, 2**32), got {v}")
    if p == 0.0:
        return None
    return Dropout(p, int(dropout_seed), int(dropout_offset))


def check_flag(value, name: str, func: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{func}: {name} must be a bool, got {value!r} ({type(value).__name__})")
    return bool(value)


def check_int(value, name: str, func: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{func}: {name} must be an int, got {value!r} ({type(value).__name__})")
    return operator.index(value)


#: the most key splits of one row (``num_splits``): the combine kernel's limit (the weights of a
#: warp's row live in its shared memory), which every split-KV form keeps to
MAX_SPLITS = 256


def check_num_splits(num_splits, func: str) -> int:
    """A split-KV count (``num_splits``): an int in [0, :data:`MAX_SPLITS`], 0 = chosen from the work
    and the device."""
    n = check_int(num_splits, "num_splits", func)
    if not 0 <= n <= MAX_SPLITS:
        raise ValueError(f"{func}: num_splits must be in [0, {MAX_SPLITS}] (0 = chosen from the work and the device), "
                         f"got {n}")
    return n


def check_block_sizes(block_m, block_n, func: str) -> tuple:
    """Tile sizes of the NumPy path: each an int >= 1, or None (chosen by the implementation)."""
    sizes = []
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if value is not None:
            value = check_int(value, name, func)
            if value < 1:
                raise ValueError(f"{func}: {name} must be >= 1 (or None), got {value}")
        sizes.append(value)
    return tuple(sizes)


def check_softmax_scale(softmax_scale, head_dim: int, func: str) -> float:
    """``None`` means ``1/sqrt(head_dim)``; ``0.0`` is a valid scale (uniform weights)."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    if isinstance(softmax_scale, (bool, np.bool_)) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(
            f"{func}: softmax_scale must be a real number or None, got {softmax_scale!r} "
            f"({type(softmax_scale).__name__})"
        )
    scale = float(softmax_scale)
    if not math.isfinite(scale):
        raise ValueError(f"{func}: softmax_scale must be finite, got {scale!r}")
    return scale


def check_window_size(window_size, causal: bool, func: str) -> tuple[int, int]:
    """Return the effective ``(left, right)``; -1 means unbounded; causal forces ``right = 0``."""
    if isinstance(window_size, (str, bytes)) or not hasattr(window_size, "__len__") or len(window_size) != 2:
        raise ValueError(
            f"{func}: window_size must be a pair (left, right) of ints >= -1 (-1 = unbounded), "
            f"got {window_size!r}"
        )
    left, right = (check_int(w, f"window_size[{i}]", func) for i, w in enumerate(window_size))
    for i, w in enumerate((left, right)):
        if w < -1:
            raise ValueError(
                f"{func}: window_size[{i}] must be >= -1 (-1 = unbounded), got {w} "
                f"(window_size={tuple(window_size)!r})"
            )
    if causal:
        right = 0
    return left, right


def normalize_window(left: int, right: int, seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    """The bounds with every bound that reaches past both sequences replaced by -1.

    ``seqlen_q`` and ``seqlen_k`` must bound the lengths of every sequence the bounds apply to. A
    bound ``>= seqlen_q + seqlen_k`` excludes no (query, key) pair, even for the kernels' padding
    rows, so it means "unbounded" exactly; so does a bound ``>= 2**31 - 1`` (a left bound excludes
    a key only below ``Sk - 1``, a right bound only below ``Sq - 1``, and the kernels' lengths are
    32-bit). Normalising once here keeps every bound a kernel sees in ``[-1, min(Sq + Sk, 2**31 -
    1))``: ``INT32_MAX`` (flash-attn's "unbounded") and any larger Python int work on every
    backend, and the kernels' 32-bit arguments never overflow.
    """
    reach = min(seqlen_q + seqlen_k, 2**31 - 1)
    return tuple(-1 if w >= reach else w for w in (left, right))


def check_layout(layout, func: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"{func}: layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def check_strides(info: ArrayInfo, name: str, func: str, *, writable_out: bool = False) -> None:
    """Unit stride on the last axis, no negative strides, strides in whole elements."""
    if math.prod(info.shape) == 0:
        return  # nothing is read or written; NumPy gives such arrays arbitrary strides
    if info.strides is None:
        raise ValueError(
            f"{func}: {name}.strides={info.byte_strides} (bytes) must be multiples of the item size "
            f"{info.dtype.itemsize if info.dtype is not None else '?'}"
        )
    if info.ndim and info.shape[-1] > 1 and info.strides[-1] != 1:
        raise ValueError(
            f"{func}: {name} must have unit stride on its last axis (head dim); got "
            f"{name}.strides={info.strides} in elements for shape {info.shape}. "
            f"Make it contiguous in the last axis first (e.g. with ascontiguousarray)"
        )
    for axis, (n, s) in enumerate(zip(info.shape, info.strides)):
        if n > 1 and s < 0:
            raise ValueError(
                f"{func}: {name} has a negative stride on axis {axis} ({name}.strides={info.strides} "
                f"in elements); negative strides are not supported, copy the array first"
            )
        if writable_out and n > 1 and s == 0:
            raise ValueError(
                f"{func}: {name} has stride 0 on axis {axis} of size {n} ({name}.strides={info.strides}); "
                f"an output must not alias its own elements"
            )


def describe_inputs(arrays: dict, func: str, *, fp8: bool = False) -> dict:
    """Describe each named array; check they are of one kind, one dtype, one device. fp8
    (``float8_e4m3fn``) is refused (``NotImplementedError``) unless ``fp8``: only the forward
    takes it."""
    infos = {name: describe(x, name, func) for name, x in arrays.items()}
    names = list(infos)
    first = infos[names[0]]
    for name in names[1:]:
        info = infos[name]
        if info.kind != first.kind:
            raise TypeError(
                f"{func}: {name} is a {info.type_name} but {names[0]} is a {first.type_name}; "
                f"all arrays must be of one kind (no implicit copies between host and device)"
            )
    for name, info in infos.items():
        if info.dtype is None:
            raise TypeError(
                f"{func}: {name}.dtype={info.dtype_name} is not supported; expected one of "
                f"{', '.join(dt.name for dt in dtypes.SUPPORTED)}"
            )
        if dtypes.is_fp8(info.dtype) and not fp8:
            raise NotImplementedError(f"{func}: {name}.dtype={info.dtype_name}: {_FP8_WHERE}" + (
                "; the fp8 forward is for inference: a backward in fp8 is out of scope (compute the backward in "
                "float16/bfloat16)" if "backward" in func else ""))
    for name in names[1:]:
        if not dtypes.same(infos[name].dtype, first.dtype):
            raise TypeError(
                f"{func}: {name}.dtype={infos[name].dtype_name} must equal {names[0]}.dtype={first.dtype_name}"
            )
    if first.kind == "dlpack":
        for name, info in infos.items():
            if not info.on_cuda:
                raise ValueError(
                    f"{func}: {name} is a {info.type_name} on {device_type_name(info.device[0])} "
                    f"(device {info.device}); here DLPack arrays must be on a CUDA device. For the CPU "
                    f"path pass a NumPy array (numpy.from_dlpack({name})); cuflash.attention, "
                    f"attention_backward and softmax take CPU DLPack arrays themselves"
                )
    for name in names[1:]:
        if infos[name].device != first.device:
            raise ValueError(
                f"{func}: {name} is on device {infos[name].device} but {names[0]} is on device "
                f"{first.device} (DLPack (type, id)); all arrays must be on one device"
            )
    return infos


_FP8_WHERE = ("fp8 input is taken by the forwards of cuflash.attention and cuflash.attention_varlen (q, k, v with "
              "q_descale, k_descale, v_descale) and as the k_cache/v_cache of cuflash.attention_with_kvcache only")


def _heads_and_batch(info: ArrayInfo, layout: str):
    """Return (batch_shape, heads, seqlen, dim) of one array in its layout."""
    s = info.shape
    if layout == "bshd":
        return (s[0],), s[2], s[1], s[3]
    if info.ndim == 2:
        return (), 1, s[0], s[1]
    return s[:-3], s[-3], s[-2], s[-1]


def _check_heads_and_dims(func: str, heads, key_lengths, dims, head_axis: str, seq_axis: str, seq_what: str,
                          max_head_dim, names=("k", "v")) -> None:
    """The shape rules q, k and v share in every layout: ``heads = (Hq, Hk, Hv)``, ``key_lengths
    = (k's, v's)`` along ``seq_axis``, ``dims = (D of q, D of k, Dv)``; the messages name the axes
    (and the key and value arrays by ``names``: the caches for KV-cache attention)."""
    kn, vn = names
    hq, hk, hv = heads
    sk, skv = key_lengths
    d, dk, dv = dims
    if hv != hk:
        raise ValueError(f"{func}: {vn}.shape[{head_axis}]={hv} (kv heads) must equal {kn}.shape[{head_axis}]={hk}")
    if skv != sk:
        raise ValueError(f"{func}: {vn}.shape[{seq_axis}]={skv} must equal {kn}.shape[{seq_axis}]={sk} ({seq_what})")
    if dk != d:
        raise ValueError(f"{func}: {kn}.shape[-1]={dk} must equal q.shape[-1]={d} (head dim)")
    if hk == 0 and hq != 0:
        raise ValueError(f"{func}: {kn}.shape[{head_axis}]=0 kv heads cannot serve q.shape[{head_axis}]={hq} query heads")
    if hk and hq % hk:
        raise ValueError(
            f"{func}: q.shape[{head_axis}]={hq} query heads must be a multiple of "
            f"{kn}.shape[{head_axis}]={hk} kv heads (GQA/MQA)"
        )
    for name, dim in (("q", d), (vn, dv)):
        if dim < 1:
            raise ValueError(f"{func}: {name}.shape[-1] (head dim) must be at least 1, got {dim}")
        if max_head_dim is not None and dim > max_head_dim:
            raise NotImplementedError(
                f"{func}: {name}.shape[-1]={dim} exceeds the largest supported head dim {max_head_dim}"
            )


def check_flags(options: Options, func: str, *names: str) -> Options:
    """``options`` with each named flag checked to be a bool (TypeError naming it) and made one."""
    return dataclasses.replace(options, **{n: check_flag(getattr(options, n), n, func) for n in names})


def check_attention(q, k, v, options: Options, *, func: str = "cuflash.attention", out=None,
                    max_head_dim: int | None = MAX_HEAD_DIM, dtypes: tuple | None = None,
                    fp8: bool = False) -> AttentionProblem:
    """Validate one attention call and return its :class:`AttentionProblem`.

    Parameters
    ----------
    q, k, v : arrays
        As :func:`cuflash.attention` documents them.
    options : Options
        The call's options (:mod:`cuflash.runtime.options`): causal, scale, window, layout,
        dropout and the score modifiers are read here.
    out : array, optional
        The output buffer (:func:`check_out`).
    max_head_dim : int or None
        Largest head dim accepted (``NotImplementedError`` above it); None for no limit (the
        float64 oracle).
    dtypes : tuple of numpy.dtype, optional
        dtypes this backend computes in (``NotImplementedError`` for the others).
    fp8 : bool
        Accept ``float8_e4m3fn`` q, k, v with their descales (the forward); otherwise fp8 is a
        ``NotImplementedError`` (the backward has no fp8 form).
    """
    options = check_flags(options, func, "causal", "return_lse")
    causal = options.causal
    layout = check_layout(options.layout, func)
    infos = describe_inputs({"q": q, "k": k, "v": v}, func, fp8=fp8)
    qi, ki, vi = infos["q"], infos["k"], infos["v"]
    if dtypes is not None and qi.dtype not in dtypes:
        raise NotImplementedError(
            f"{func}: dtype {qi.dtype_name} has no kernel on this backend; supported: "
            f"{', '.join(dt.name for dt in dtypes)}"
        )

    want = "== 4 for layout='bshd' (batch, seqlen, heads, head_dim)" if layout == "bshd" else ">= 2 for layout='bhsd' (..., seqlen, head_dim)"
    for name, info in infos.items():
        if (layout == "bshd" and info.ndim != 4) or (layout == "bhsd" and info.ndim < 2):
            raise ValueError(f"{func}: {name}.ndim must be {want}; got {name}.shape={info.shape}")
    if not (qi.ndim == ki.ndim == vi.ndim):
        raise ValueError(
            f"{func}: q, k and v must have the same number of dims; got q.shape={qi.shape}, "
            f"k.shape={ki.shape}, v.shape={vi.shape}"
        )
    for name, info in infos.items():
        check_strides(info, name, func)

    qb, hq, sq, d = _heads_and_batch(qi, layout)
    kb, hk, sk, dk = _heads_and_batch(ki, layout)
    vb, hv, skv, dv = _heads_and_batch(vi, layout)
    seq_axis = "1" if layout == "bshd" else "-2"
    head_axis = "2" if layout == "bshd" else "-3"
    if kb != qb or vb != qb:
        raise ValueError(
            f"{func}: batch dims must match: q.shape={qi.shape}, k.shape={ki.shape}, v.shape={vi.shape} "
            f"(batch dims {qb}, {kb}, {vb}); broadcasting is not done, use stride-0 views instead"
        )
    _check_heads_and_dims(func, (hq, hk, hv), (sk, skv), (d, dk, dv), head_axis, seq_axis, "key length", max_head_dim)
    scale = check_softmax_scale(options.softmax_scale, d, func)
    left, right = normalize_window(*check_window_size(options.window_size, causal, func), sq, sk)

    if layout == "bshd":
        out_shape = (qb[0], sq, hq, dv)
        lse_shape = (qb[0], hq, sq)
    else:
        out_shape = qi.shape[:-1] + (dv,)
        lse_shape = qi.shape[:-1]
    dropout = check_dropout(options.dropout, func)
    batch = tuple(qb) if layout == "bhsd" else (qb[0],)
    problem = AttentionProblem(
        func=func, kind=qi.kind, dtype=qi.dtype, layout=layout, batch_shape=tuple(qb),
        num_heads_q=hq, num_heads_k=hk, seqlen_q=sq, seqlen_k=sk, head_dim=d, head_dim_v=dv,
        softmax_scale=scale, causal=causal, window_left=left, window_right=right,
        out_shape=out_shape, lse_shape=lse_shape, device=qi.device, q=qi, k=ki, v=vi,
        dropout=dropout,
        modifiers=check_modifiers(func, qi, batch, hq, sq, sk, options.modifiers),
        fp8=check_fp8(func, qi, infos, batch, hk, options.fp8, dropout),
        options=options,
    )
    if out is not None:
        check_out(out, problem, {"q": q, "k": k, "v": v})
    return problem


def check_like_output(info: ArrayInfo, name: str, problem: AttentionProblem, rule: str = "for these q and v",
                      writable: bool = False) -> None:
    """An array of the output's kind, dtype, shape and device (``out=``, or a backward's ``out``
    and ``dout``), with the strides the kernels take (``writable``: no stride 0 either)."""
    func = problem.func
    if info.kind != problem.kind:
        raise TypeError(f"{func}: {name} is a {info.type_name} but q is a {problem.q.type_name}; they must be of one kind")
    if not dtypes.same(info.dtype, problem.out_dtype):
        if problem.fp8 is not None and problem.fp8.q_fp8:
            raise TypeError(f"{func}: {name}.dtype={info.dtype_name} must equal the result's dtype "
                            f"{problem.out_dtype.name} (out_dtype of fp8 input)")
        raise TypeError(f"{func}: {name}.dtype={info.dtype_name} must equal q.dtype={problem.dtype.name}")
    if info.shape != problem.out_shape:
        raise ValueError(f"{func}: {name}.shape={info.shape} must be {problem.out_shape} {rule}")
    if info.device != problem.device:
        raise ValueError(f"{func}: {name} is on device {info.device} but q is on device {problem.device}")
    check_strides(info, name, func, writable_out=writable)


def check_out(out, problem: AttentionProblem, inputs: dict) -> None:
    """``out=`` must match the result's kind, dtype and shape, be writable and not overlap inputs."""
    func = problem.func
    info = describe(out, "out", func)
    check_like_output(info, "out", problem, writable=True)
    if info.kind == "numpy":
        if not out.flags.writeable:
            raise ValueError(f"{func}: out is read-only")
        for name, x in inputs.items():
            if _overlaps(out, x):
                raise ValueError(f"{func}: out overlaps {name} in memory; pass a separate output buffer")


def _overlaps(a: np.ndarray, b: np.ndarray) -> bool:
    if not np.may_share_memory(a, b):
        return False
    try:
        return bool(np.shares_memory(a, b, max_work=100_000))
    except np.exceptions.TooHardError:
        return True  # cannot prove the buffers are disjoint: refuse rather than risk corruption


# --------------------------------------------------------------------------------------------
# variable-length (packed) batches


@dataclasses.dataclass(frozen=True, eq=False)
class VarlenBatch:
    """The sequence index of a packed batch (flash-attn's ``*_varlen`` convention).

    Attributes
    ----------
    cu_seqlens_q, cu_seqlens_k : array
        int32 ``(B + 1,)`` prefix sums: sequence ``b`` owns query rows ``[cu_seqlens_q[b],
        cu_seqlens_q[b + 1])`` and key rows ``[cu_seqlens_k[b], cu_seqlens_k[b + 1])``, as given
        (NumPy, CuPy or a DLPack array of the arrays' device).
    seqused_k : array or None
        int32 ``(B,)``: sequence ``b`` attends to its first ``seqused_k[b]`` keys only (FA3).
    batch, total_q, total_k, max_seqlen_q, max_seqlen_k : int
    checked : bool
        True when the indices were read and checked in full (NumPy), False for device-resident
        ones (checked for dtype and shape only; the kernels clamp every index into the arrays).
    """

    cu_seqlens_q: object
    cu_seqlens_k: object
    seqused_k: object
    batch: int
    total_q: int
    total_k: int
    max_seqlen_q: int
    max_seqlen_k: int
    checked: bool

    def with_arrays(self, convert) -> "VarlenBatch":
        """A copy whose index arrays are ``convert(array)`` (a device call's imports)."""
        return dataclasses.replace(self, **{n: convert(getattr(self, n)) for n in ("cu_seqlens_q", "cu_seqlens_k",
                                                                                 "seqused_k")})

    def used_keys(self) -> np.ndarray:
        """Keys each sequence attends to, int64 ``(B,)`` (host indices only): ``seqused_k``, or
        its key count."""
        if self.seqused_k is not None:
            return np.asarray(self.seqused_k, dtype=np.int64)
        return np.diff(np.asarray(self.cu_seqlens_k, dtype=np.int64))


def _check_index(x, name: str, func: str, length: int | None, kind: str, device, *, shape=None) -> ArrayInfo:
    """An int32 index array: 1-D of ``length`` entries (None: any), or of exactly ``shape``; on
    q's device (device arrays with device q only); unit stride on its last axis (the kernels index
    it densely)."""
    info = describe(x, name, func)
    if info.dtype_name != "int32":
        raise TypeError(f"{func}: {name} must be int32, got {name}.dtype={info.dtype_name}")
    if shape is not None:
        if info.shape != tuple(shape):
            raise ValueError(f"{func}: {name}.shape={info.shape} must be {tuple(shape)}")
    elif info.ndim != 1:
        raise ValueError(f"{func}: {name} must be 1-D, got {name}.shape={info.shape}")
    elif length is not None and info.shape[0] != length:
        raise ValueError(f"{func}: {name}.shape={info.shape} must be ({length},) (one entry per sequence"
                         f"{' plus one' if name.startswith('cu_') else ''})")
    if info.kind != "numpy":
        if kind == "numpy":
            raise TypeError(f"{func}: {name} is a {info.type_name} on a device but q is a NumPy array; the NumPy "
                            f"path reads its index on the host: pass a NumPy {name}")
        if info.device != device:
            raise ValueError(f"{func}: {name} is on device {info.device} but q is on device {device}")
    check_strides(info, name, func)
    return info


def check_host_cu_seqlens(func: str, cu_seqlens_q, cu_seqlens_k, seqused_k, total_q: int, total_k: int | None,
                          max_q: int, max_k: int) -> None:
    """Host index arrays of a packed batch: 0 first, non-decreasing, ending at the totals (no
    check of the key total when ``total_k`` is None: keys in a paged cache), no sequence longer
    than its ``max_seqlen``, ``seqused_k`` inside each sequence's keys."""
    for name, cu, total, mx, axis in (("cu_seqlens_q", cu_seqlens_q, total_q, max_q, "q"),
                                      ("cu_seqlens_k", cu_seqlens_k, total_k, max_k, "k")):
        cu = np.asarray(cu, dtype=np.int64)
        if cu[0] != 0:
            raise ValueError(f"{func}: {name}[0]={int(cu[0])} must be 0")
        lengths = np.diff(cu)
        if (lengths < 0).any():
            b = int(np.argmax(lengths < 0))
            raise ValueError(f"{func}: {name} must be non-decreasing; {name}[{b + 1}]={int(cu[b + 1])} < "
                             f"{name}[{b}]={int(cu[b])}")
        if total is not None and cu[-1] != total:
            raise ValueError(f"{func}: {name}[-1]={int(cu[-1])} must equal {axis}.shape[0]={total} "
                             f"(the total {'query' if axis == 'q' else 'key'} rows)")
        if lengths.size and lengths.max() > mx:
            b = int(np.argmax(lengths))
            raise ValueError(f"{func}: max_seqlen_{axis}={mx} is smaller than sequence {b}'s length "
                             f"{int(lengths[b])} ({name}[{b + 1}] - {name}[{b}])")
    if seqused_k is not None:
        used = np.asarray(seqused_k, dtype=np.int64)
        lk = np.diff(np.asarray(cu_seqlens_k, dtype=np.int64))
        bad = np.flatnonzero((used < 0) | (used > lk))
        if bad.size:
            b = int(bad[0])
            raise ValueError(f"{func}: seqused_k[{b}]={int(used[b])} must be in [0, {int(lk[b])}] (sequence {b}'s "
                             f"keys, cu_seqlens_k[{b + 1}] - cu_seqlens_k[{b}])")


def check_attention_varlen(q, k, v, options: Options, *, func: str = "cuflash.attention_varlen", out=None,
                           max_head_dim: int | None = MAX_HEAD_DIM, cache_check=None,
                           fp8: bool = False) -> AttentionProblem:
    """Validate one packed variable-length attention call (see :func:`cuflash.attention_varlen`).

    The problem is described as ``B`` sequences of ``max_seqlen_q`` query and ``max_seqlen_k``
    key rows in flash-attn's "bshd" terms; ``out_shape`` is ``(total_q, Hq, Dv)`` and
    ``lse_shape`` ``(Hq, total_q)``. NumPy index arrays are read and checked in full here;
    device-resident ones only for dtype and shape (reading them would synchronize the host).
    With ``block_table`` (chunked prefill over a paged KV cache), k and v are the caches
    ``(num_pages, page_size, Hk, D|Dv)``, ``cu_seqlens_k`` counts each sequence's keys in its
    pages, and ``kvcache`` says where they are: ``cache_check`` (required with a block table:
    :func:`cuflash.runtime.validation_kvcache.varlen_cache`, passed in so that this module does not
    import that one) checks the cache and returns its description. ``fp8``: accept
    ``float8_e4m3fn`` q, k, v with their descales (``(B, Hk)``, one row per sequence), as
    :func:`check_attention` does (the forward); not with a block table.
    """
    options = check_flags(options, func, "causal", "return_lse")
    causal = options.causal
    pk = options.packed
    cu_seqlens_q, cu_seqlens_k, seqused_k, block_table = pk.cu_seqlens_q, pk.cu_seqlens_k, pk.seqused_k, pk.block_table
    infos = describe_inputs({"q": q, "k": k, "v": v}, func, fp8=fp8)
    if block_table is not None and dtypes.is_fp8(infos["q"].dtype):
        raise NotImplementedError(f"{func}: float8_e4m3fn q, k, v with a block_table (chunked prefill over a paged "
                                  f"cache) are not supported; fp8 packed batches take k and v as packed rows")
    qi, ki, vi = infos["q"], infos["k"], infos["v"]
    if block_table is not None:
        for name, info in (("k", ki), ("v", vi)):
            if info.ndim != 4:
                raise ValueError(f"{func}: with a block_table, {name} is a paged cache (num_pages, page_size, Hk, "
                                 f"head_dim); got {name}.shape={info.shape}")
        ki, vi = (dataclasses.replace(i, shape=(i.shape[0] * i.shape[1],) + i.shape[2:]) for i in (ki, vi))
    for name, info in {"q": qi, "k": ki, "v": vi}.items():
        if block_table is not None and name != "q":
            check_strides(infos[name], name, func)
            continue
        if info.ndim != 3:
            raise ValueError(f"{func}: {name}.ndim must be 3 (total_{'q' if name == 'q' else 'k'}, heads, head_dim) "
                             f"for packed sequences; got {name}.shape={info.shape}")
        check_strides(info, name, func)
    total_q, hq, d = qi.shape
    total_k, hk, dk = ki.shape
    total_v, hv, dv = vi.shape
    _check_heads_and_dims(func, (hq, hk, hv), (total_k, total_v), (d, dk, dv), "1", "0", "total keys", max_head_dim)
    cq = _check_index(cu_seqlens_q, "cu_seqlens_q", func, None, qi.kind, qi.device)
    batch = cq.shape[0] - 1
    if batch < 0:
        raise ValueError(f"{func}: cu_seqlens_q must have at least one entry (0), got shape {cq.shape}")
    ck = _check_index(cu_seqlens_k, "cu_seqlens_k", func, batch + 1, qi.kind, qi.device)
    if seqused_k is not None:
        _check_index(seqused_k, "seqused_k", func, batch, qi.kind, qi.device)
    splits = check_num_splits(pk.num_splits, func)   # (a hint: only the Hopper chunked-prefill form splits)
    max_q = check_int(pk.max_seqlen_q, "max_seqlen_q", func)
    max_k = check_int(pk.max_seqlen_k, "max_seqlen_k", func)
    for name, value in (("max_seqlen_q", max_q), ("max_seqlen_k", max_k)):
        if not 0 <= value < 2**31 - 256:
            raise ValueError(f"{func}: {name}={value} must be in [0, 2**31 - 256)")
    checked = cq.kind == "numpy" and ck.kind == "numpy" and (seqused_k is None or isinstance(seqused_k, np.ndarray))
    cache = None
    if block_table is not None:
        if cache_check is None:
            raise TypeError(f"{func}: a block_table needs cache_check (validation_kvcache.varlen_cache)")
        cache = dataclasses.replace(cache_check(func, qi, k, v, block_table, batch, cu_seqlens_k, seqused_k, checked),
                                    num_splits=splits)
        checked = checked and cache.checked
        total_k = cache.capacity
    if checked:
        check_host_cu_seqlens(func, cu_seqlens_q, cu_seqlens_k, seqused_k, total_q,
                              None if cache is not None else total_k, max_q, max_k)
    scale = check_softmax_scale(options.softmax_scale, d, func)
    # each sequence's lengths are at most max_seqlen (checked above for host indices) and at most the totals
    # (the kernels clamp every index into the arrays): a max_seqlen above the longest sequence, which the
    # contract allows, must not keep a bound that reaches past every sequence
    left, right = normalize_window(*check_window_size(options.window_size, causal, func), min(max_q, total_q),
                                   min(max_k, total_k))
    dropout = check_dropout(options.dropout, func)
    problem = AttentionProblem(
        func=func, kind=qi.kind, dtype=qi.dtype, layout="bshd", batch_shape=(batch,),
        num_heads_q=hq, num_heads_k=hk, seqlen_q=max_q, seqlen_k=max_k, head_dim=d, head_dim_v=dv,
        softmax_scale=scale, causal=causal, window_left=left, window_right=right,
        out_shape=(total_q, hq, dv), lse_shape=(hq, total_q), device=qi.device, q=qi, k=ki, v=vi,
        varlen=VarlenBatch(cu_seqlens_q, cu_seqlens_k, seqused_k, batch, total_q, total_k, max_q, max_k, checked),
        kvcache=cache, dropout=dropout,
        modifiers=check_modifiers(func, qi, (batch,), hq, max_q, max_k, options.modifiers),
        fp8=check_fp8(func, qi, infos, (batch,), hk, options.fp8, dropout),
        options=options,
    )
    if out is not None:
        check_out(out, problem, {"q": q, "k": k, "v": v})
    return problem
