"""Hypothesis strategies for the bad-input property test (tests/api/test_bad_input.py): random
calls of every public entry point, valid and broken, and the contract every call must keep.

A :class:`Call` is drawn in two steps: a valid call (shapes, strides, dtypes, layouts, masks,
windows, index arrays, modifiers, ``out=`` buffers; every array a view of a NaN-filled NumPy
buffer, so a read outside a view shows), then zero, one or two *mutations* that break (or merely
bend) one argument each, each naming the arguments an error about it may name. Arrays are then
handed over as the call's kind: NumPy, a torch CPU tensor sharing the buffer, or a JAX CPU array.

:func:`check` runs a call and asserts the contract: either a ``TypeError``, ``ValueError``,
``NotImplementedError`` or ``MemoryError`` whose message begins with the function's name and a
colon and names an argument (one of the mutated ones when the call was broken on purpose), or
results within the project's tolerance rule of the float64 oracle (:mod:`cuflash.reference`);
and every input buffer unchanged, except ``out=`` and the KV caches an append writes (which must
then hold exactly what the oracle's append puts there). Anything else (an ``IndexError``, a NumPy
internal error, an assertion inside cuflash) is a bug.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
from hypothesis import strategies as st

import cuflash
from cuflash import reference as ref
from cuflash.reference import kvcache as ref_kvcache
from cuflash.reference import tolerance
from cuflash.runtime import dtypes

F16, BF16, F32, F64 = np.dtype(np.float16), np.dtype(dtypes.bfloat16), np.dtype(np.float32), np.dtype(np.float64)
FLOATS = (F16, BF16, F32, F64)
ALLOWED = (TypeError, ValueError, NotImplementedError, MemoryError)
#: exceptions that are bugs even though they subclass an allowed one (NumPy's AxisError is an IndexError)
NEVER = (IndexError, KeyError, ArithmeticError, AssertionError)
ENTRIES = ("attention", "attention_backward", "attention_varlen", "attention_varlen_backward",
           "attention_with_kvcache", "merge_attention", "softmax", "explain")
#: positional parameters of each entry point, in order
POSITIONAL = {
    "attention": ("q", "k", "v"),
    "explain": ("q", "k", "v"),
    "attention_backward": ("dout", "q", "k", "v", "out", "lse"),
    "attention_varlen": ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"),
    "attention_varlen_backward": ("dout", "q", "k", "v", "out", "lse", "cu_seqlens_q", "cu_seqlens_k",
                                  "max_seqlen_q", "max_seqlen_k"),
    "attention_with_kvcache": ("q", "k_cache", "v_cache", "cache_seqlens"),
    "merge_attention": ("outs", "lses"),
    "softmax": ("x",),
}
#: array arguments an entry point may write (on success only)
WRITES = {"attention": ("out",), "attention_varlen": ("out",), "attention_with_kvcache": ("out", "k_cache", "v_cache")}


# --------------------------------------------------------------------------------------------
# arrays: views of NaN-filled buffers


@dataclasses.dataclass
class Arr:
    """One array argument: its NumPy view, the buffer it lives in, and how it is handed over."""

    view: np.ndarray
    buffer: np.ndarray
    kind: str = "numpy"        # "numpy", "torch", "jax", or "list" (a nested list, not an array)
    readonly: bool = False


def _poison(dtype):
    dt = np.dtype(dtype)
    if dt.kind == "f" or dt == BF16 or dt.kind == "c":
        return np.nan
    if dt.kind == "b":
        return True
    return 7 if dt.kind == "u" else -7


def place(data: np.ndarray, form: str, rng) -> Arr:
    """``data`` copied into a view of a larger buffer filled with garbage, by ``form``:
    ``contig`` (a C-contiguous buffer of its own), ``padded`` (a slice of a buffer longer on every
    axis), ``permuted`` (storage order of the non-last axes shuffled), ``stepped`` (every other
    row of a non-last axis), ``broadcast`` (stride 0 on the size-1-able leading axes: the data's
    first entry along them is repeated)."""
    shape, dtype = data.shape, data.dtype
    nd = data.ndim
    if form == "padded" and nd:
        big = tuple(n + int(rng.integers(0, 3)) for n in shape)
        buf = np.full(big, _poison(dtype), dtype)
        view = buf[tuple(slice(0, n) for n in shape)]
    elif form == "permuted" and nd >= 3:
        order = list(rng.permutation(nd - 1)) + [nd - 1]
        buf = np.full(tuple(shape[i] for i in order), _poison(dtype), dtype)
        view = buf.transpose(np.argsort(order))
    elif form == "stepped" and nd >= 2:
        ax = int(rng.integers(0, nd - 1))
        big = list(shape)
        big[ax] = 2 * shape[ax]
        buf = np.full(big, _poison(dtype), dtype)
        view = buf[(slice(None),) * ax + (slice(None, None, 2),)]
    elif form == "broadcast" and nd >= 2 and min(shape) > 0:
        ax = int(rng.integers(0, nd - 1))
        small = list(shape)
        small[ax] = 1
        buf = np.full(small, _poison(dtype), dtype)
        buf[...] = data[(slice(None),) * ax + (slice(0, 1),)]
        view = np.broadcast_to(buf, shape)
        return Arr(view, buf)
    else:
        buf = np.full(shape, _poison(dtype), dtype)
        view = buf
    view[...] = data
    return Arr(view, buf)


def randn(rng, shape, dtype, scale=1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(dtype)


FORMS = ("contig", "contig", "padded", "permuted", "stepped", "broadcast")
OUT_FORMS = ("contig", "padded", "permuted", "stepped")


# --------------------------------------------------------------------------------------------
# the call


@dataclasses.dataclass
class Call:
    """One drawn call of ``cuflash.<entry>``: arguments by name (arrays as :class:`Arr`, lists of
    them for ``outs``/``lses``), the mutations applied, and what the oracle needs."""

    entry: str
    args: dict
    backend: str = "numpy"
    mutations: list = dataclasses.field(default_factory=list)   # (description, names an error may name)
    meta: dict = dataclasses.field(default_factory=dict)

    @property
    def func(self) -> str:
        return f"cuflash.{self.entry}"

    def describe(self) -> str:
        parts = []
        for n, a in self.args.items():
            parts.append(f"{n}={_show(a)}")
        return (f"{self.func}({', '.join(parts)}, backend={self.backend!r})  mutations={[m for m, _ in self.mutations]}")

    def arrays(self):
        """``(name, Arr)`` of every array argument (list entries as ``outs[i]``)."""
        for n, a in self.args.items():
            if isinstance(a, Arr):
                yield n, a
            elif isinstance(a, list):
                for i, x in enumerate(a):
                    if isinstance(x, Arr):
                        yield f"{n}[{i}]", x


def _show(a):
    if isinstance(a, Arr):
        v = a.view
        return (f"<{a.kind} {v.dtype} {v.shape} strides={tuple(s // max(v.itemsize, 1) for s in v.strides)}"
                f"{' ro' if a.readonly else ''}>")
    if isinstance(a, list):
        return "[" + ", ".join(_show(x) for x in a) + "]"
    return repr(a)


def _handover(a: Arr):
    """The argument as the callee gets it: NumPy view, torch tensor on the buffer, JAX copy, list."""
    v = a.view
    if a.kind == "list":
        return v.tolist()
    if a.kind == "torch":
        import torch

        if v.dtype.byteorder not in "=|" or any(s < 0 for s in v.strides) or v.dtype == BF16 and False:
            return v
        flat = np.ascontiguousarray(a.buffer).reshape(-1) if a.buffer.flags.c_contiguous else None
        if flat is None:
            return v
        try:
            if v.dtype == BF16:
                base = torch.from_numpy(flat.view(np.int16)).view(torch.bfloat16)
            else:
                base = torch.from_numpy(flat)
        except TypeError:
            return v     # a dtype torch has no tensor for: handed over as NumPy (a mixed-kind call)
        item = v.itemsize
        offset = (v.__array_interface__["data"][0] - a.buffer.__array_interface__["data"][0]) // item
        return base.as_strided(v.shape, tuple(s // item for s in v.strides), offset)
    if a.kind == "jax":
        import jax.numpy as jnp

        if v.size > 2**20:   # a huge stride-0 view: JAX arrays are dense, so it stays NumPy (mixed kinds)
            return v
        try:
            x = jnp.asarray(np.ascontiguousarray(v))
        except TypeError:
            return v
        a.view = np.asarray(x)   # what JAX holds (float64 becomes float32 unless x64 is enabled)
        return x
    if a.readonly:
        w = v.view()
        w.flags.writeable = False
        return w
    return v


def materialize(call: Call) -> tuple[tuple, dict]:
    """``(args, kwargs)`` for the function; ``call.meta["kind"]`` is the first array's kind as
    handed over (a torch view NumPy can have but torch cannot stays NumPy)."""
    vals = {}
    for n, a in call.args.items():
        if isinstance(a, Arr):
            vals[n] = _handover(a)
        elif isinstance(a, list):
            vals[n] = [(_handover(x) if isinstance(x, Arr) else x) for x in a]
        else:
            vals[n] = a
    first = next((x for x in vals.values() if x is not None and not isinstance(x, (bool, int, float, str, tuple))),
                 None)
    if isinstance(first, list):
        first = first[0] if first else None
    call.meta["kind"] = _kind_name(first)
    pos = POSITIONAL[call.entry]
    args = tuple(vals.pop(n) for n in pos if n in vals)
    if call.backend != "numpy" and call.entry != "merge_attention":
        vals["backend"] = call.backend
    return args, vals


# --------------------------------------------------------------------------------------------
# drawing valid calls


def _rng(draw):
    return np.random.default_rng(draw(st.integers(0, 2**32 - 1)))


def _window(draw, sq, sk):
    side = st.one_of(st.just(-1), st.integers(0, sq + sk + 1), st.sampled_from([2**31 - 1, 2**40]))
    return (draw(side), draw(side)) if draw(st.booleans()) else (-1, -1)


def _scale(draw):
    return draw(st.one_of(st.none(), st.just(0.0), st.floats(-2.0, 2.0, allow_nan=False, width=32),
                          st.sampled_from([1, np.float32(0.25), np.float64(0.7)])))


def _bias_shape(draw, full):
    """A shape broadcastable to ``full``: each axis full or 1, leading axes maybe dropped."""
    shape = [n if draw(st.booleans()) else 1 for n in full]
    drop = draw(st.integers(0, len(full) - 2))
    return tuple(shape[drop:])


@dataclasses.dataclass
class Profile:
    """What one test draws: array kinds, dtypes, backend, head-dim and length ranges, features."""

    kinds: tuple = ("numpy",)
    dtypes: tuple = FLOATS
    backend: str = "numpy"
    max_len: int = 5
    head_dims: tuple = (1, 2, 3, 4, 5, 8, 9)
    modifiers: bool = True
    dropout: bool = True
    masks: bool = True
    gqa: bool = True
    forms: tuple = FORMS
    #: how many mutations a call gets, drawn from these
    mutations: tuple = (0, 1, 1, 1, 2)


def _modifiers(draw, rng, p: Profile, dtype, batch, hq, sq, sk, allowed=("softcap", "alibi_slopes", "attn_bias",
                                                                         "attn_mask", "sinks")) -> dict:
    if not p.modifiers or not draw(st.booleans()):
        return {}
    kw = {}
    pdt = F64 if dtype == F64 and draw(st.booleans()) else F32
    for name in allowed:
        if not draw(st.integers(0, 2)) == 0:
            continue
        if name == "softcap":
            kw["softcap"] = draw(st.sampled_from([0.0, 0.5, 3.0, 30.0, 1]))
        elif name == "alibi_slopes":
            shape = (hq,) if draw(st.booleans()) else tuple(batch) + (hq,)
            kw["alibi_slopes"] = place(np.abs(randn(rng, shape, pdt, 0.5)), draw(st.sampled_from(("contig", "padded"))), rng)
        elif name == "sinks":
            kw["sinks"] = place(randn(rng, (hq,), pdt), "contig", rng)
        elif name in ("attn_bias", "attn_mask"):
            full = tuple(batch) + (hq, sq, sk)
            shape = _bias_shape(draw, full)
            if name == "attn_bias":
                bdt = draw(st.sampled_from([dtype, F32]))
                data = randn(rng, shape, bdt)
                if draw(st.booleans()) and data.size:
                    data[rng.random(shape) < 0.2] = -np.inf
            else:
                data = rng.random(shape) < 0.7
            kw[name] = place(data, draw(st.sampled_from(("contig", "padded", "broadcast", "stepped"))), rng)
    return kw


def _qkv(draw, rng, p: Profile, dtype, layout, ndim=4):
    hk = draw(st.integers(1, 2)) if p.gqa else 1
    hq = hk * (draw(st.integers(1, 3)) if p.gqa else 1)
    sq, sk = draw(st.integers(0, p.max_len)), draw(st.integers(0, p.max_len + 1))
    d, dv = draw(st.sampled_from(p.head_dims)), draw(st.sampled_from(p.head_dims))
    if layout == "bshd":
        batch = (draw(st.integers(0, 2)),)
        shapes = ((batch[0], sq, hq, d), (batch[0], sk, hk, d), (batch[0], sk, hk, dv))
    else:
        nb = ndim - 3
        if ndim == 2:
            hq = hk = 1
            batch = ()
            shapes = ((sq, d), (sk, d), (sk, dv))
        else:
            batch = tuple(draw(st.integers(0 if i == 0 else 1, 2)) for i in range(nb))
            shapes = (batch + (hq, sq, d), batch + (hk, sk, d), batch + (hk, sk, dv))
    scale = draw(st.sampled_from([1.0, 1.0, 3.0]))
    arrs = [place(randn(rng, s, dtype, scale), draw(st.sampled_from(p.forms)), rng) for s in shapes]
    return arrs, dict(batch=batch, hq=hq, hk=hk, sq=sq, sk=sk, d=d, dv=dv)


def _forward_options(draw, p: Profile, dims):
    kw = {}
    if p.masks and draw(st.booleans()):
        kw["causal"] = draw(st.sampled_from([True, False, np.bool_(True)]))
    if p.masks and draw(st.booleans()):
        kw["window_size"] = _window(draw, dims["sq"], dims["sk"])
    if draw(st.booleans()):
        kw["softmax_scale"] = _scale(draw)
    return kw


@st.composite
def attention_calls(draw, p: Profile, entry="attention"):
    rng = _rng(draw)
    dtype = draw(st.sampled_from(p.dtypes))
    layout = draw(st.sampled_from(["bhsd", "bshd"]))
    ndim = 4 if layout == "bshd" else draw(st.sampled_from([2, 3, 4, 4, 5]))
    (q, k, v), dims = _qkv(draw, rng, p, dtype, layout, ndim)
    args = {"q": q, "k": k, "v": v}
    if layout == "bshd" or draw(st.booleans()):
        args["layout"] = layout
    args.update(_forward_options(draw, p, dims))
    batch = dims["batch"] if layout == "bhsd" else dims["batch"]
    args.update(_modifiers(draw, rng, p, dtype, batch, dims["hq"], dims["sq"], dims["sk"]))
    out_shape = (q.view.shape[:-1] + (dims["dv"],)) if layout == "bhsd" else (batch[0], dims["sq"], dims["hq"],
                                                                              dims["dv"])
    lse_shape = q.view.shape[:-1] if layout == "bhsd" else (batch[0], dims["hq"], dims["sq"])
    if entry == "attention":
        if draw(st.booleans()):
            args["return_lse"] = draw(st.sampled_from([True, False]))
        if p.dropout and draw(st.integers(0, 3)) == 0:
            args["dropout_p"] = draw(st.sampled_from([0.0, 0.25, 0.5, 0.9]))
            args["dropout_seed"] = draw(st.integers(0, 2**32 - 1))
            if draw(st.booleans()):
                args["dropout_offset"] = draw(st.integers(0, 2**32 - 1))
        if draw(st.integers(0, 2)) == 0:
            args["out"] = place(np.full(out_shape, np.nan, dtype), draw(st.sampled_from(OUT_FORMS)), rng)
    elif entry == "explain":
        for name in ("dropout_p",):
            args.pop(name, None)
        if draw(st.integers(0, 3)) == 0:
            args["arch"] = draw(st.sampled_from([80, "sm_90", "90", 75]))
    elif entry == "attention_backward":
        q64, k64, v64 = (np.ascontiguousarray(a.view, F64) for a in (q, k, v))
        fkw = {n: _value(args[n]) for n in args if n not in ("q", "k", "v")}
        if p.dropout and draw(st.integers(0, 3)) == 0:
            fkw["dropout_p"] = args["dropout_p"] = draw(st.sampled_from([0.25, 0.5]))
            fkw["dropout_seed"] = args["dropout_seed"] = draw(st.integers(0, 2**32 - 1))
        o64, l64 = ref.naive_attention(q64, k64, v64, return_lse=True, **_kw64(_oracle_kw(fkw)))
        ldt = F64 if dtype == F64 else F32
        args["out"] = place(o64.astype(dtype), draw(st.sampled_from(FORMS)), rng)
        args["lse"] = place(l64.astype(ldt), draw(st.sampled_from(("contig", "padded"))), rng)
        args["dout"] = place(randn(rng, out_shape, dtype), draw(st.sampled_from(FORMS)), rng)
        if draw(st.booleans()):
            args["deterministic"] = draw(st.booleans())
        if "attn_bias" in args and draw(st.booleans()):
            args["return_dbias"] = True
        if "sinks" in args and draw(st.booleans()):
            args["return_dsinks"] = True
    call = Call(entry, args, p.backend, meta=dict(dims=dims, layout=layout, out_shape=out_shape,
                                                  lse_shape=lse_shape, dtype=dtype))
    return call


def _value(a):
    if isinstance(a, Arr):
        return a.view
    return a


def _oracle_kw(kw: dict) -> dict:
    """Keywords the oracle (naive_attention) takes, from a call's."""
    keep = ("causal", "softmax_scale", "window_size", "layout", "dropout_p", "dropout_seed", "dropout_offset",
            "softcap", "alibi_slopes", "attn_bias", "attn_mask", "sinks")
    return {n: (v.view if isinstance(v, Arr) else v) for n, v in kw.items() if n in keep}


def _kw64(kw: dict) -> dict:
    """Oracle keywords for float64 q, k, v: the modifier arrays in float64 (a mask stays bool)."""
    out = dict(kw)
    for n in ("attn_bias", "alibi_slopes", "sinks"):
        if out.get(n) is not None and np.asarray(out[n]).dtype != np.bool_:
            out[n] = np.asarray(out[n], F64)
    return out


def _lengths(draw, n_seq, top):
    return [draw(st.integers(0, top)) for _ in range(n_seq)]


@st.composite
def varlen_calls(draw, p: Profile, entry="attention_varlen"):
    rng = _rng(draw)
    dtype = draw(st.sampled_from(p.dtypes))
    n_seq = draw(st.integers(0, 3))
    lq, lk = _lengths(draw, n_seq, p.max_len), _lengths(draw, n_seq, p.max_len + 1)
    hk = draw(st.integers(1, 2)) if p.gqa else 1
    hq = hk * (draw(st.integers(1, 3)) if p.gqa else 1)
    d, dv = draw(st.sampled_from(p.head_dims)), draw(st.sampled_from(p.head_dims))
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    tq, tk = int(cq[-1]), int(ck[-1])
    paged = entry == "attention_varlen" and draw(st.integers(0, 3)) == 0
    args = {}
    if paged:
        page = draw(st.integers(1, 3))
        max_pages = max([-(-n // page) for n in lk] + [1]) + draw(st.integers(0, 1))
        num_pages = n_seq * max_pages + draw(st.integers(0, 2))
        args["q"] = place(randn(rng, (tq, hq, d), dtype), draw(st.sampled_from(p.forms)), rng)
        kc = randn(rng, (num_pages, page, hk, d), dtype)
        vc = randn(rng, (num_pages, page, hk, dv), dtype)
        args["k"] = place(kc, draw(st.sampled_from(p.forms)), rng)
        args["v"] = place(vc, draw(st.sampled_from(p.forms)), rng)
        perm = rng.permutation(max(num_pages, 1))[: n_seq * max_pages] if num_pages else np.zeros(0, int)
        table = np.full((n_seq, max_pages), -1, np.int32)
        flat = perm.astype(np.int32)
        for b in range(n_seq):
            used = -(-lk[b] // page)
            table[b, :used] = flat[b * max_pages: b * max_pages + used]
            table[b, used:] = rng.integers(-5, 99, max_pages - used)   # never read: anything goes
        args["block_table"] = place(table, "contig", rng)
    else:
        args["q"] = place(randn(rng, (tq, hq, d), dtype), draw(st.sampled_from(p.forms)), rng)
        args["k"] = place(randn(rng, (tk, hk, d), dtype), draw(st.sampled_from(p.forms)), rng)
        args["v"] = place(randn(rng, (tk, hk, dv), dtype), draw(st.sampled_from(p.forms)), rng)
    args["cu_seqlens_q"] = place(cq, draw(st.sampled_from(("contig", "padded"))), rng)
    args["cu_seqlens_k"] = place(ck, draw(st.sampled_from(("contig", "padded"))), rng)
    args["max_seqlen_q"] = max(lq, default=0) + draw(st.sampled_from([0, 0, 1]))
    args["max_seqlen_k"] = max(lk, default=0) + draw(st.sampled_from([0, 0, 2]))
    if draw(st.integers(0, 2)) == 0:
        used = np.array([int(rng.integers(0, n + 1)) for n in lk], np.int32)
        args["seqused_k"] = place(used, "contig", rng)
    dims = dict(batch=(n_seq,), hq=hq, hk=hk, sq=max(lq, default=0), sk=max(lk, default=0), d=d, dv=dv)
    args.update(_forward_options(draw, p, dims))
    args.update(_modifiers(draw, rng, p, dtype, (n_seq,), hq, 0, 0, allowed=("softcap", "alibi_slopes")))
    if entry == "attention_varlen":
        if draw(st.booleans()):
            args["return_lse"] = draw(st.booleans())
        if draw(st.integers(0, 2)) == 0:
            args["out"] = place(np.full((tq, hq, dv), np.nan, dtype), draw(st.sampled_from(OUT_FORMS)), rng)
    else:
        out, lse = _varlen_oracle(args, dtype)
        ldt = F64 if dtype == F64 else F32
        args["out"] = place(out.astype(dtype), draw(st.sampled_from(FORMS)), rng)
        args["lse"] = place(lse.astype(ldt), "contig", rng)
        args["dout"] = place(randn(rng, (tq, hq, dv), dtype), draw(st.sampled_from(FORMS)), rng)
        if draw(st.booleans()):
            args["deterministic"] = draw(st.booleans())
    return Call(entry, args, p.backend, meta=dict(dims=dims, dtype=dtype, out_shape=(tq, hq, dv), lse_shape=(hq, tq)))


def _varlen_sequences(args):
    """``(b, query slice, keys, values)`` of each sequence of a (validated) varlen call, NumPy."""
    cq = np.asarray(_value(args["cu_seqlens_q"]), np.int64)
    ck = np.asarray(_value(args["cu_seqlens_k"]), np.int64)
    used = np.diff(ck) if args.get("seqused_k") is None else np.asarray(_value(args["seqused_k"]), np.int64)
    k, v = _value(args["k"]), _value(args["v"])
    table = args.get("block_table")
    for b in range(len(cq) - 1):
        n = int(min(used[b], ck[b + 1] - ck[b]))
        if table is not None:
            t = _value(table)
            kb = ref_kvcache.gather(k, b, 0, n, page_size=k.shape[1], block_table=t)
            vb = ref_kvcache.gather(v, b, 0, n, page_size=v.shape[1], block_table=t)
        else:
            kb, vb = k[ck[b]:ck[b] + n], v[ck[b]:ck[b] + n]
        yield b, slice(int(cq[b]), int(cq[b + 1])), kb, vb


def _seq_kw(args, b):
    kw = _oracle_kw(args)
    s = kw.get("alibi_slopes")
    if s is not None and s.ndim == 2:
        kw["alibi_slopes"] = s[b:b + 1]
    kw["layout"] = "bshd"
    return kw


def _varlen_oracle(args, dtype):
    q = _value(args["q"])
    hq, tq = q.shape[1], q.shape[0]
    dv = _value(args["v"]).shape[-1]
    out = np.zeros((tq, hq, dv))
    lse = np.full((hq, tq), -np.inf)
    for b, rq, kb, vb in _varlen_sequences(args):
        if rq.stop == rq.start:
            continue
        o, l = ref.naive_attention(*(np.ascontiguousarray(x[None], F64) for x in (q[rq], kb, vb)),
                                   return_lse=True, **_kw64(_seq_kw(args, b)))
        out[rq], lse[:, rq] = o[0], l[0]
    return out, lse


@st.composite
def kvcache_calls(draw, p: Profile):
    rng = _rng(draw)
    dtype = draw(st.sampled_from(p.dtypes))
    batch = draw(st.integers(0, 3))
    hk = draw(st.integers(1, 2)) if p.gqa else 1
    hq = hk * (draw(st.integers(1, 3)) if p.gqa else 1)
    d, dv = draw(st.sampled_from(p.head_dims)), draw(st.sampled_from(p.head_dims))
    sq = draw(st.integers(0, 3))
    snew = draw(st.integers(0, 3)) if draw(st.booleans()) else None
    paged = draw(st.booleans())
    s_new = snew or 0
    lengths = [draw(st.integers(0, p.max_len)) for _ in range(batch)]
    args = {"q": place(randn(rng, (batch, sq, hq, d), dtype), draw(st.sampled_from(p.forms)), rng)}
    kw = {}
    if paged:
        page = draw(st.integers(1, 4))
        max_pages = max([-(-(n + s_new) // page) for n in lengths] + [1]) + draw(st.integers(0, 1))
        num_pages = batch * max_pages + draw(st.integers(0, 2))
        shape_k, shape_v = (num_pages, page, hk, d), (num_pages, page, hk, dv)
        perm = rng.permutation(num_pages).astype(np.int32)
        table = np.full((batch, max_pages), -3, np.int32)
        for b in range(batch):
            table[b] = perm[b * max_pages:(b + 1) * max_pages]
            used = -(-(lengths[b] + s_new) // page)
            table[b, used:] = rng.integers(-9, 99, max_pages - used)
        kw["block_table"] = place(table, draw(st.sampled_from(("contig", "padded"))), rng)
    else:
        s_cache = max(lengths + [0]) + s_new + draw(st.integers(0, 2))
        b_cache = batch + draw(st.integers(0, 2))
        shape_k, shape_v = (b_cache, s_cache, hk, d), (b_cache, s_cache, hk, dv)
        if draw(st.booleans()) and batch:
            kw["cache_batch_idx"] = place(rng.permutation(b_cache)[:batch].astype(np.int32), "contig", rng)
    cache_forms = OUT_FORMS if snew is not None else p.forms
    args["k_cache"] = place(randn(rng, shape_k, dtype), draw(st.sampled_from(cache_forms)), rng)
    args["v_cache"] = place(randn(rng, shape_v, dtype), draw(st.sampled_from(cache_forms)), rng)
    if draw(st.integers(0, 3)) == 0 and len(set(lengths)) <= 1 and not (lengths and lengths[0] and False):
        args["cache_seqlens"] = lengths[0] if lengths else draw(st.integers(0, 2))
        if not batch:
            args["cache_seqlens"] = 0
    else:
        args["cache_seqlens"] = place(np.array(lengths, np.int32), draw(st.sampled_from(("contig", "padded"))), rng)
    if snew is not None:
        kw["k"] = place(randn(rng, (batch, snew, hk, d), dtype), draw(st.sampled_from(p.forms)), rng)
        kw["v"] = place(randn(rng, (batch, snew, hk, dv), dtype), draw(st.sampled_from(p.forms)), rng)
        if draw(st.integers(0, 3)) == 0:
            rd = 2 * draw(st.integers(1, max(1, d // 2)))
            if rd <= d:
                seq_ro = max(lengths + [0]) + max(s_new, sq, 1) + draw(st.integers(0, 2))
                rdt = draw(st.sampled_from([dtype, F32]))
                ang = rng.random((seq_ro, rd // 2)) * 6.28
                kw["rotary_cos"] = place(np.cos(ang).astype(rdt), "contig", rng)
                kw["rotary_sin"] = place(np.sin(ang).astype(rdt), "contig", rng)
                if draw(st.booleans()):
                    kw["rotary_interleaved"] = draw(st.booleans())
    if draw(st.integers(0, 3)) == 0 and batch:
        lp = np.array([int(rng.integers(0, n + 1)) for n in lengths], np.int32)
        kw["cache_leftpad"] = place(lp, "contig", rng)
    args["cache_seqlens"] = args["cache_seqlens"]
    args.update(kw)
    dims = dict(batch=(batch,), hq=hq, hk=hk, sq=sq, sk=max(lengths + [0]) + s_new, d=d, dv=dv)
    args.update(_forward_options(draw, p, dims))
    if draw(st.booleans()):
        args["num_splits"] = draw(st.sampled_from([0, 1, 2, 3]))
    if draw(st.booleans()):
        args["return_lse"] = draw(st.booleans())
    args.update(_modifiers(draw, rng, p, dtype, (batch,), hq, 0, 0, allowed=("softcap", "alibi_slopes", "sinks")))
    if draw(st.integers(0, 2)) == 0:
        args["out"] = place(np.full((batch, sq, hq, dv), np.nan, dtype), draw(st.sampled_from(OUT_FORMS)), rng)
    return Call("attention_with_kvcache", args, p.backend,
                meta=dict(dims=dims, dtype=dtype, out_shape=(batch, sq, hq, dv), lse_shape=(batch, hq, sq)))


@st.composite
def merge_calls(draw, p: Profile):
    rng = _rng(draw)
    dtype = draw(st.sampled_from(p.dtypes))
    parts = draw(st.integers(1, 3))
    lead = tuple(draw(st.lists(st.integers(0, 3), min_size=0, max_size=2)))
    sq, dv = draw(st.integers(0, 4)), draw(st.sampled_from(p.head_dims))
    ldt = draw(st.sampled_from([F32, F64]))
    outs, lses = [], []
    for _ in range(parts):
        outs.append(place(randn(rng, lead + (sq, dv), dtype), draw(st.sampled_from(p.forms)), rng))
        lse = randn(rng, lead + (sq,), ldt, 2.0)
        if lse.size and draw(st.booleans()):
            lse[rng.random(lse.shape) < 0.3] = -np.inf
        lses.append(place(lse, draw(st.sampled_from(("contig", "padded", "stepped"))), rng))
    return Call("merge_attention", {"outs": outs, "lses": lses}, p.backend, meta=dict(dtype=dtype))


@st.composite
def softmax_calls(draw, p: Profile):
    rng = _rng(draw)
    dtype = draw(st.sampled_from(p.dtypes))
    shape = tuple(draw(st.lists(st.integers(0 if p.backend == "numpy" else 1, 5), min_size=1, max_size=3)))
    x = randn(rng, shape, dtype, draw(st.sampled_from([1.0, 10.0])))
    if x.size and draw(st.booleans()):
        x[rng.random(shape) < 0.2] = -np.inf
    args = {"x": place(x, draw(st.sampled_from(p.forms)), rng)}
    if draw(st.booleans()):
        args["axis"] = draw(st.integers(-len(shape), len(shape) - 1))
    return Call("softmax", args, p.backend, meta=dict(dtype=dtype))


# --------------------------------------------------------------------------------------------
# mutations: each breaks or bends one argument and names what an error about it may name


BAD_DTYPES = (np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.bool_), np.dtype(np.complex64),
              np.dtype(np.uint16), np.dtype(">f4"), F16, BF16, F32, F64, np.dtype(np.float16).newbyteorder(">"))
FLAGS = ("causal", "return_lse", "deterministic", "return_dbias", "return_dsinks", "rotary_interleaved")
SCALAR_BAD = {
    "softmax_scale": [math.nan, math.inf, -math.inf, "0.5", True, 1j, [0.5], np.float16(0.5), 1e30],
    "window_size": [(-2, 0), (1,), (1, 2, 3), "ab", (1.5, 2), (True, 0), None, (0, -5), np.array([1, 2]),
                    (np.int64(1), np.int32(0)), [3, 3], (2**70, 0)],
    "layout": ["BHSD", "bsdh", None, 3, b"bhsd"],
    "dropout_p": [-0.1, 1.0, math.nan, "0.1", True, 0.5, 2, np.float32(0.3)],
    "dropout_seed": [-1, 2**32, 1.5, True, "7", None, np.uint64(5)],
    "dropout_offset": [-1, 2**32, 1.5, True, None],
    "softcap": [-1.0, math.nan, math.inf, "1", True, None, 1e-30, 1e30, np.float16(2)],
    "num_splits": [-1, 257, 1.5, True, None, np.int8(2), 256],
    "max_seqlen_q": [-1, 0, 1.5, True, None, 2**31, np.int64(3)],
    "max_seqlen_k": [-1, 0, 1.5, True, None, 2**31, np.int64(3)],
    "axis": [5, -6, 1.5, True, None, np.int64(0)],
    "cache_seqlens": [-1, 10**6, 1.5, True, None, "3", np.int32(1), 2**40],
    "arch": ["sm_7x", -1, True, None, "sm_90a", 1.5, 100],
    "backend": ["gpu", None, "Numpy", 0, "cuda"],
}


def _flag_bad():
    return [1, 0, "yes", None, np.bool_(False), 1.0]


def _reshape_arr(rng, a: Arr, shape) -> Arr:
    data = randn(rng, shape, a.view.dtype) if a.view.dtype.kind == "f" or a.view.dtype == BF16 else \
        np.resize(a.view, shape).astype(a.view.dtype) if a.view.size else np.zeros(shape, a.view.dtype)
    return place(data, "contig", rng)


def _array_mutations(draw, rng, call: Call, name: str, a: Arr):
    """One mutation of array argument ``name``: returns (description, new value)."""
    v = a.view
    kinds = ["dtype", "axis", "ndim", "not_array", "last_stride", "negative", "fortran", "empty", "kind"]
    if name in WRITES.get(call.entry, ()):
        kinds += ["zero_stride", "readonly", "overlap"]
    what = draw(st.sampled_from(kinds))
    if what == "dtype":
        dt = draw(st.sampled_from(BAD_DTYPES))
        if dt == v.dtype:
            dt = np.dtype(np.int32)
        if dt.kind in "iub":
            data = (np.nan_to_num(v.astype(F64, copy=False) if v.dtype.kind != "b" else v) > 0) if dt.kind == "b" \
                else np.nan_to_num(v.astype(F64), posinf=7, neginf=-7).astype(dt)
        elif dt.kind == "c":
            data = v.astype(F64).astype(dt)
        else:
            data = v.astype(F64).astype(dt)
        return f"{name} dtype {dt}", place(np.asarray(data, dt), "contig", rng)
    if what == "axis" and v.ndim:
        ax = draw(st.integers(0, v.ndim - 1))
        shape = list(v.shape)
        shape[ax] = max(0, shape[ax] + draw(st.sampled_from([-1, 1, 2])))
        return f"{name}.shape[{ax}] -> {shape[ax]}", _reshape_arr(rng, a, tuple(shape))
    if what == "ndim":
        shape = v.shape[1:] if v.ndim and draw(st.booleans()) else (1,) + v.shape
        return f"{name}.ndim -> {len(shape)}", _reshape_arr(rng, a, tuple(shape))
    if what == "not_array":
        alt = draw(st.sampled_from(["list", "none", "scalar", "string", "matrix", "masked", "tuple"]))
        if alt == "list":
            return f"{name} as a list", Arr(v, a.buffer, kind="list")
        if alt == "none":
            return f"{name}=None", None
        if alt == "scalar":
            return f"{name}=1.5", 1.5
        if alt == "string":
            return f"{name}='q'", "q"
        if alt == "tuple":
            return f"{name}=()", ()
        if alt == "matrix" and v.ndim == 2:
            return f"{name} numpy.matrix", np.asmatrix(np.ascontiguousarray(v))
        return f"{name} masked array", np.ma.masked_array(np.ascontiguousarray(v))
    if what == "last_stride" and v.ndim and v.shape[-1] > 1:
        buf = np.full(v.shape[:-1] + (2 * v.shape[-1],), _poison(v.dtype), v.dtype)
        w = buf[..., ::2]
        w[...] = v
        return f"{name} last-axis stride 2", Arr(w, buf)
    if what == "negative" and v.ndim:
        ax = draw(st.integers(0, v.ndim - 1))
        buf = np.ascontiguousarray(v)
        return f"{name} reversed on axis {ax}", Arr(np.flip(buf, ax), buf)
    if what == "fortran" and v.ndim >= 2:
        buf = np.asfortranarray(v)
        return f"{name} Fortran order", Arr(buf, buf.T)
    if what == "empty":
        return f"{name}=empty array", place(np.zeros((0,), v.dtype), "contig", rng)
    if what == "kind":
        other = draw(st.sampled_from(["torch", "jax"]))
        return f"{name} as {other}", Arr(v, a.buffer, kind=other)
    if what == "zero_stride" and v.ndim >= 1 and v.size:
        ax = draw(st.integers(0, v.ndim - 1))
        shape = list(v.shape)
        small = list(v.shape)
        small[ax] = 1
        buf = np.ascontiguousarray(v[(slice(None),) * ax + (slice(0, 1),)])
        return f"{name} stride 0 on axis {ax}", Arr(np.broadcast_to(buf, shape), buf, readonly=False)
    if what == "readonly":
        return f"{name} read-only", Arr(v, a.buffer, readonly=True)
    if what == "overlap":
        for other in ("q", "k", "v", "k_cache", "v_cache"):
            src = call.args.get(other)
            if isinstance(src, Arr) and src.view.dtype == v.dtype and src.buffer.size >= v.size and v.size:
                flat = src.buffer.reshape(-1)
                w = flat[: v.size].reshape(v.shape)
                return f"{name} overlapping {other}", Arr(w, src.buffer)
    return None


def _index_mutation(draw, rng, call: Call, name: str, a: Arr):
    v = np.array(a.view)
    what = draw(st.sampled_from(["value", "value", "dtype", "shape", "stride", "float"]))
    if what == "value" and v.size:
        i = tuple(int(rng.integers(0, n)) for n in v.shape)
        # cast with wraparound: an earlier mutation may have left an unsigned or narrower index dtype
        v[i] = np.array(draw(st.sampled_from([-1, -100, 1, 2, 2**31 - 1, -(2**31), 7, 1000])), np.int64).astype(v.dtype)
        return f"{name}[{i}] -> {v[i]}", place(v, "contig", rng)
    if what == "dtype":
        dt = draw(st.sampled_from([np.int64, np.uint32, np.int16, np.float32, np.bool_, np.uint8]))
        return f"{name} dtype {np.dtype(dt)}", place(v.astype(dt), "contig", rng)
    if what == "shape":
        shape = (v.shape[0] + draw(st.sampled_from([-1, 1])),) + v.shape[1:] if v.ndim and draw(st.booleans()) \
            else v.shape + (1,)
        shape = tuple(max(0, n) for n in shape)
        return f"{name} shape {shape}", place(np.resize(v, shape).astype(v.dtype) if v.size else
                                               np.zeros(shape, v.dtype), "contig", rng)
    if what == "stride" and v.ndim:
        buf = np.zeros(v.shape[:-1] + (2 * v.shape[-1],), v.dtype)
        w = buf[..., ::2]
        w[...] = v
        return f"{name} stride 2", Arr(w, buf)
    if what == "float":
        return f"{name} as a list", Arr(a.view, a.buffer, kind="list")
    return None


#: arguments whose errors may be reported against a related one (e.g. a shape compared with q's)
RELATED = {
    "cu_seqlens_q": ("q", "max_seqlen_q", "cu_seqlens_k", "seqused_k", "block_table", "alibi_slopes"),
    "cu_seqlens_k": ("k", "v", "max_seqlen_k", "cu_seqlens_q", "seqused_k", "block_table", "alibi_slopes"),
    "seqused_k": ("cu_seqlens_k",),
    "max_seqlen_q": ("cu_seqlens_q",),
    "max_seqlen_k": ("cu_seqlens_k",),
    "block_table": ("k", "k_cache", "cu_seqlens_k", "seqused_k", "cache_seqlens"),
    "cache_seqlens": ("k_cache", "cache_leftpad", "rotary_cos", "k", "block_table"),
    "cache_leftpad": ("cache_seqlens",),
    "dropout_p": ("dropout_seed",),
}


HUGE = 2**44
#: entry points whose float arrays a "huge" mutation broadcasts over a new leading axis
HUGE_ENTRIES = ("attention", "explain", "attention_backward", "softmax", "merge_attention")


def _huge(call: Call) -> None:
    """Every float or bool array gets a new leading axis of ``HUGE`` entries, stride 0 (a view
    that costs nothing, a result no machine can hold): a clear ``MemoryError``, or a ``ValueError``
    where the extra axis breaks a shape rule."""
    def grow(a):
        # (an empty array is left alone: cuflash.reference.online_softmax loops over a long axis of
        # no rows, block by block; reported)
        if not isinstance(a, Arr) or a.view.dtype.kind == "i" or a.kind == "list" or a.view.size == 0:
            return a
        return Arr(np.broadcast_to(a.view, (HUGE,) + a.view.shape), a.buffer, a.kind, a.readonly)

    for n, a in list(call.args.items()):
        if n in ("cu_seqlens_q", "cu_seqlens_k", "seqused_k", "block_table", "cache_seqlens"):
            continue
        call.args[n] = [grow(x) for x in a] if isinstance(a, list) else grow(a)
    names = tuple(n for n, _ in call.arrays()) + ("outs", "lses", "q", "out", "layout")
    call.mutations.append((f"huge: a leading axis of {HUGE}", names))


def mutate(draw, call: Call, count: int) -> Call:
    """``call`` with ``count`` mutations applied (each recorded with the names its error may use)."""
    rng = _rng(draw)
    huge = call.entry in HUGE_ENTRIES and draw(st.integers(0, 15)) == 0
    for _ in range(count - huge):
        names = [n for n in call.args if n in SCALAR_BAD or n in FLAGS or isinstance(call.args[n], (Arr, list))]
        extra = [n for n in ("window_size", "softmax_scale", "layout", "backend", "dropout_p", "softcap",
                             "causal", "out") if _accepts(call.entry, n)]
        name = draw(st.sampled_from(sorted(set(names) | set(extra))))
        value = call.args.get(name)
        result = None
        if name in FLAGS:
            result = (f"{name} bad flag", draw(st.sampled_from(_flag_bad())))
        elif name in SCALAR_BAD:
            result = (f"{name} bad value", draw(st.sampled_from(SCALAR_BAD[name])))
        elif name in ("cu_seqlens_q", "cu_seqlens_k", "seqused_k", "block_table", "cache_batch_idx",
                      "cache_leftpad") or (name == "cache_seqlens" and isinstance(value, Arr)):
            result = _index_mutation(draw, rng, call, name, value)
        elif name in ("outs", "lses") and isinstance(value, list) and value:
            i = draw(st.integers(0, len(value) - 1))
            choice = draw(st.sampled_from(["drop", "entry", "entry", "type"]))
            if choice == "drop":
                new = list(value[:-1]) if len(value) > 1 else []
                result = (f"{name} one part fewer", new)
            elif choice == "type":
                form = draw(st.sampled_from(["array", "dict", "set"]))
                first = value[0].view if isinstance(value[0], Arr) else value[0]
                result = (f"{name} as {form}", first if form == "array" else {0: first} if form == "dict" else {1, 2})
            elif isinstance(value[i], Arr):
                r = _array_mutations(draw, rng, call, f"{name}[{i}]", value[i])
                if r is not None:
                    new = list(value)
                    new[i] = r[1]
                    result = (r[0], new)
        elif name == "out" and value is None:
            shape = call.meta.get("out_shape")
            if shape is not None:
                dt = call.meta["dtype"]
                result = ("out given", place(np.full(shape, np.nan, dt), "contig", rng))
        elif isinstance(value, Arr):
            result = _array_mutations(draw, rng, call, name, value)
        elif value is None and name in ("window_size", "softmax_scale", "layout", "backend", "dropout_p",
                                        "softcap", "causal"):
            pool = SCALAR_BAD.get(name) or _flag_bad()
            result = (f"{name} bad value", draw(st.sampled_from(pool)))
        if result is None:
            continue
        desc, new = result
        if name == "backend":
            call.backend = new
            call.mutations.append((desc + f" {new!r}", ("backend",)))
            continue
        call.args[name] = new
        names = (name,) + RELATED.get(name, ())
        if name == "arch":
            names += ("backend",)
        if name in ("q", "k", "v", "dout", "out", "lse", "k_cache", "v_cache"):
            names += ("q", "k", "v", "out", "dout", "lse", "k_cache", "v_cache", "layout", "attn_bias",
                      "attn_mask", "alibi_slopes", "sinks", "cu_seqlens_q", "cu_seqlens_k", "block_table",
                      "cache_seqlens", "rotary_cos", "x")
        if name in ("outs", "lses"):
            names += ("outs", "lses")
        if name == "x":
            names += ("axis",)
        if name in ("window_size", "causal"):
            names += ("window_size", "causal")
        if name in ("rotary_cos", "rotary_sin"):
            names += ("rotary_cos", "rotary_sin", "k", "q")
        if name in ("attn_bias", "attn_mask", "alibi_slopes", "sinks"):
            names += ("return_dbias", "return_dsinks", "q")
        if name in ("return_dbias", "return_dsinks", "sinks", "attn_bias"):
            names += ("attn_bias", "sinks")
        if name in ("k", "v"):
            names += ("k_cache", "v_cache", "cache_seqlens")
        call.mutations.append((f"{desc}", names))
    if huge:   # last, so that no other mutation copies a huge view
        _huge(call)
    return call


def _accepts(entry: str, name: str) -> bool:
    import inspect

    if name == "backend":
        return entry != "merge_attention"
    fn = getattr(cuflash, entry)
    return name in inspect.signature(fn).parameters


# --------------------------------------------------------------------------------------------
# the contract


def _names(msg: str, name: str) -> bool:
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", msg) is not None


def _snapshot(call: Call):
    snaps = []
    seen = set()
    for n, a in call.arrays():
        if id(a.buffer) in seen:
            continue
        seen.add(id(a.buffer))
        snaps.append((n, a, a.buffer.copy()))
    return snaps


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.tobytes() == b.tobytes()


def run(call: Call):
    """Call the function: ``(result, exception)``."""
    args, kwargs = materialize(call)
    fn = getattr(cuflash, call.entry)
    try:
        return fn(*args, **kwargs), None
    except Exception as exc:   # noqa: BLE001 - the test judges every exception
        return None, exc


#: bugs found and reported but not fixed yet (each with an xfail test in test_bad_input_regressions.py):
#: ``predicate(call, exception) -> bool``; a call they recognise counts as "known" so the search can
#: go past it. Every one found so far is fixed, so none is excused.
KNOWN = ()


def check(call: Call) -> str:
    """Run ``call`` and assert the contract (module docstring); returns "error", "ok" or "known"
    (a reported bug, :data:`KNOWN`)."""
    snaps = _snapshot(call)
    result, exc = run(call)
    if exc is not None:
        if any(known(call, exc) for known in KNOWN):
            return "known"
        _check_error(call, exc)
        for n, a, before in snaps:
            assert _same(a.buffer, before), f"{call.func} raised but changed {n}: {call.describe()}"
        return "error"
    writes = set(WRITES.get(call.entry, ())) if call.entry != "attention_with_kvcache" or call.args.get("k") is not None \
        else {"out"}
    for n, a, before in snaps:
        if n in writes:
            continue
        assert _same(a.buffer, before), f"{call.func} changed its input {n}: {call.describe()}"
    try:
        ORACLES[call.entry](call, result, {id(a.buffer): before for _, a, before in snaps})
    except AssertionError:
        if _huge_scale_on_a_kernel(call):
            return "known"
        raise
    return "ok"


def _huge_scale_on_a_kernel(call: Call) -> bool:
    """A kernel run with ``|softmax_scale| >= 1e10``: the tensor-core forward overflows to inf lse and
    NaN output (test_bad_input_regressions.py::test_tensor_core_forward_with_a_large_softmax_scale_*)."""
    scale = call.args.get("softmax_scale")
    try:
        return call.backend == "sim" and scale is not None and abs(float(scale)) >= 1e10
    except (TypeError, ValueError):
        return False


def _check_error(call: Call, exc: BaseException) -> None:
    func = call.func
    where = f"\n  call: {call.describe()}\n  raised {type(exc).__name__}: {exc}"
    assert isinstance(exc, ALLOWED) and not isinstance(exc, NEVER), f"unexpected exception{where}"
    msg = str(exc)
    assert msg.startswith(func + ": "), f"message does not begin with {func + ': '!r}{where}"
    if call.mutations:
        names = {n for _, ns in call.mutations for n in ns}
    else:
        assert isinstance(exc, NotImplementedError), f"a valid call was refused{where}"
    if isinstance(exc, NotImplementedError):   # a valid call without a kernel: any argument may be the cause
        import inspect

        names = set(inspect.signature(getattr(cuflash, call.entry)).parameters)
    if call.backend != "numpy":
        names.add("backend")
    assert any(_names(msg, n) for n in names), f"message names none of {sorted(names)}{where}"


# --------------------------------------------------------------------------------------------
# oracles: the float64 reference and the project's tolerance rule


def _np(x):
    """A result as NumPy (torch and JAX CPU arrays come back as their kind)."""
    if isinstance(x, np.ndarray):
        return x
    mod = type(x).__module__
    if mod.startswith("torch"):
        import torch

        if x.dtype == torch.bfloat16:
            return x.view(torch.int16).numpy().view(BF16)
        return x.numpy()
    return np.asarray(x)


def _kind_name(x) -> str:
    mod = type(x).__module__
    return "torch" if mod.startswith("torch") else "jax" if "jax" in mod else "numpy"


def _check_type(call: Call, x, what: str):
    kind = call.meta.get("kind", "numpy")
    assert _kind_name(x) == kind, \
        f"{what} is a {type(x).__module__}.{type(x).__name__}, expected the input's kind {kind}: {call.describe()}"


def _orig(call: Call, name: str):
    a = call.args.get(name)
    return a.view if isinstance(a, Arr) else a


def _fwd_kw(call: Call) -> dict:
    kw = _oracle_kw(call.args)
    if "softmax_scale" in kw and kw["softmax_scale"] is not None:
        kw["softmax_scale"] = float(kw["softmax_scale"])
    return kw


def _compare(out, q, k, v, lse, what: str, **kw):
    for x in (q, k, v):   # non-finite input (an overlapping view reaching a buffer's poison) is not this rule's
        if not np.isfinite(np.asarray(x, F64)).all():
            return
    q, k, v = (np.ascontiguousarray(x) for x in (q, k, v))
    ok, msg, _ = tolerance.compare(_np(out), q, k, v, lse=None if lse is None else _np(lse), **kw)
    assert ok, f"{what}: {msg}"


def _oracle_attention(call: Call, result, before):
    q, k, v = (_orig(call, n) for n in ("q", "k", "v"))
    if call.args.get("return_lse"):
        out, lse = result
    else:
        out, lse = result, None
    _check_type(call, out, "out")
    o = _np(out)
    out_shape, lse_shape = _shapes(call)
    assert o.shape == out_shape and o.dtype == q.dtype, f"out {o.shape} {o.dtype}: {call.describe()}"
    if call.args.get("out") is not None:
        given = call.args["out"]
        assert np.shares_memory(o, given.view) or o.size == 0 or given.kind != "numpy", \
            f"the result is not the out= buffer: {call.describe()}"
        o_view = given.view
        assert _same(np.ascontiguousarray(o), np.ascontiguousarray(o_view)), "out= differs from the result"
    if lse is not None:
        l_ = _np(lse)
        assert l_.shape == lse_shape, f"lse shape {l_.shape}: {call.describe()}"
        assert l_.dtype == (F64 if q.dtype == F64 else F32), f"lse dtype {l_.dtype}"
    _compare(o, q, k, v, lse, call.describe(), **_fwd_kw(call))


def _shapes(call: Call):
    """The output's and the lse's shapes for the call's (possibly mutated) q and v."""
    q, v = _orig(call, "q"), _orig(call, "v_cache" if call.entry == "attention_with_kvcache" else "v")
    out_shape = q.shape[:-1] + (v.shape[-1],)
    if call.entry in ("attention_varlen", "attention_varlen_backward"):
        return out_shape, (q.shape[1], q.shape[0])
    if call.entry == "attention_with_kvcache" or call.args.get("layout") == "bshd":
        return out_shape, (q.shape[0], q.shape[2], q.shape[1])
    return out_shape, q.shape[:-1]


def _oracle_explain(call: Call, result, before):
    assert isinstance(result, dict) and "backend" in result and "choice" in result, f"{result!r}: {call.describe()}"


def _grad_ok(name, got, want, dtype, scale_terms: float, what: str):
    got = np.asarray(_np(got), F64)
    assert got.shape == want.shape, f"{name} shape {got.shape} != {want.shape}: {what}"
    fin = np.isfinite(want)
    assert np.array_equal(np.isfinite(got), fin), f"{name}: non-finite pattern differs: {what}"
    u = {F16: 2.0**-11, BF16: 2.0**-8, F32: 2.0**-24, F64: 2.0**-53}[np.dtype(dtype)]
    tol = 64 * u * (1 + np.abs(want[fin]).max(initial=0)) * scale_terms
    err = np.abs(got[fin] - want[fin]).max(initial=0)
    assert err <= tol, f"{name}: error {err:.3g} > {tol:.3g}: {what}"


def _oracle_backward(call: Call, result, before):
    from support.grads import check_grads_close

    q, k, v, dout, out, lse = (_orig(call, n) for n in ("q", "k", "v", "dout", "out", "lse"))
    kw = _fwd_kw(call)
    for g in result:
        _check_type(call, g, "gradient")
    dq, dk, dv = (_np(g) for g in result[:3])
    for g, x in ((dq, q), (dk, k), (dv, v)):
        assert g.shape == x.shape and g.dtype == x.dtype, f"gradient {g.shape} {g.dtype}: {call.describe()}"
    mods = any(n in kw for n in ("softcap", "alibi_slopes", "attn_bias", "attn_mask", "sinks"))
    want = ref.attention_backward(*(np.ascontiguousarray(x, F64) for x in (dout, q, k, v, out, lse)),
                                  return_dbias=bool(call.args.get("return_dbias")),
                                  return_dsinks=bool(call.args.get("return_dsinks")), **_kw64(kw))
    n_extra = int(bool(call.args.get("return_dbias"))) + int(bool(call.args.get("return_dsinks")))
    assert len(result) == 3 + n_extra, f"{len(result)} results: {call.describe()}"
    d = call.meta["dims"]
    terms = math.sqrt(max(d["sq"], d["sk"], 1) * max(d["d"], d["dv"]))
    if mods or "dropout_p" in kw or q.dtype == F64 or call.mutations:   # the formula on the given out and lse
        for name, g, w in zip(("dq", "dk", "dv", "dbias", "dsinks"), result, want):
            _grad_ok(name, g, w, _np(g).dtype if name in ("dbias", "dsinks") else q.dtype, terms * (1 + float(np.abs(lse[np.isfinite(lse)]).max(initial=0))), call.describe())
        return
    dout, q, k, v, out, lse = (np.ascontiguousarray(x) for x in (dout, q, k, v, out, lse))
    try:
        check_grads_close((dq, dk, dv), dout, q, k, v, out, lse, **kw)
    except AssertionError as e:
        if q.dtype != F32:
            raise AssertionError(f"{e}: {call.describe()}") from None
        # float32: the rule's baseline can be luckier than the summation order of a few terms
        # allows (an ulp or two); hold the gradients to the float32 bound of the formula instead
        for name, g, w in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
            _grad_ok(name, g, w, F32, terms, f"{e}: {call.describe()}")


def _oracle_varlen(call: Call, result, before):
    if call.args.get("return_lse"):
        out, lse = result
    else:
        out, lse = result, None
    _check_type(call, out, "out")
    o = _np(out)
    q = _orig(call, "q")
    out_shape, lse_shape = _shapes(call)
    assert o.shape == out_shape and o.dtype == q.dtype, f"out {o.shape}: {call.describe()}"
    if call.args.get("out") is not None and call.args["out"].kind == "numpy" and o.size:
        assert np.shares_memory(o, call.args["out"].view), f"the result is not the out= buffer: {call.describe()}"
    l_ = None if lse is None else _np(lse)
    if l_ is not None:
        assert l_.shape == lse_shape, f"lse shape {l_.shape}: {call.describe()}"
    for b, rq, kb, vb in _varlen_sequences(call.args):
        if rq.stop == rq.start:
            continue
        _compare(o[None, rq], q[None, rq], kb[None], vb[None], None if l_ is None else l_[None, :, rq],
                 call.describe(), **_seq_kw_call(call, b))


def _seq_kw_call(call, b):
    kw = _seq_kw(call.args, b)
    if kw.get("softmax_scale") is not None:
        kw["softmax_scale"] = float(kw["softmax_scale"])
    return kw


def _oracle_varlen_backward(call: Call, result, before):
    q, k, v, dout, out, lse = (_orig(call, n) for n in ("q", "k", "v", "dout", "out", "lse"))
    dq, dk, dv = (_np(g) for g in result)
    for g, x in ((dq, q), (dk, k), (dv, v)):
        assert g.shape == x.shape and g.dtype == x.dtype, f"gradient {g.shape} {g.dtype}: {call.describe()}"
    cq = np.asarray(_orig(call, "cu_seqlens_q"), np.int64)
    ck = np.asarray(_orig(call, "cu_seqlens_k"), np.int64)
    su = call.args.get("seqused_k")
    used = np.diff(ck) if su is None else np.asarray(su.view, np.int64)
    want = [np.zeros(x.shape) for x in (q, k, v)]
    d = call.meta["dims"]
    for b in range(len(cq) - 1):
        rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b] + used[b])
        if rq.stop == rq.start or rk.stop == rk.start:
            continue
        g = ref.attention_backward(*(np.ascontiguousarray(x, F64) for x in (dout[None, rq], q[None, rq], k[None, rk],
                                                                             v[None, rk], out[None, rq])),
                                   np.ascontiguousarray(lse[None, :, rq], F64), **_kw64(_seq_kw_call(call, b)))
        want[0][rq], want[1][rk], want[2][rk] = g[0][0], g[1][0], g[2][0]
    terms = math.sqrt(max(d["sq"], d["sk"], 1) * max(d["d"], d["dv"]))
    lmax = float(np.abs(lse[np.isfinite(lse)]).max(initial=0))
    for name, g, w in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        _grad_ok(name, g, w, q.dtype, terms * (1 + lmax), call.describe())


def _oracle_kvcache(call: Call, result, before):
    from support.kvcache import expected_cache

    if call.args.get("return_lse"):
        out, lse = result
    else:
        out, lse = result, None
    o = _np(out)
    q = _orig(call, "q")
    out_shape, lse_shape = _shapes(call)
    assert o.shape == out_shape and o.dtype == q.dtype, f"out {o.shape}: {call.describe()}"
    if lse is not None:
        assert _np(lse).shape == lse_shape, f"lse shape {_np(lse).shape}: {call.describe()}"
    kc_now, vc_now = _orig(call, "k_cache"), _orig(call, "v_cache")
    # the caches as they were: the snapshots of their buffers viewed as the caches were (JAX
    # arrays are copies, never written)
    kc0, vc0 = (call.args[n].view if call.args[n].kind == "jax" else _view_of(call.args[n], before)
                for n in ("k_cache", "v_cache"))
    seqlens = call.args["cache_seqlens"]
    batch = q.shape[0]
    lengths = (np.full(batch, int(seqlens), np.int64) if not isinstance(seqlens, Arr)
               else np.asarray(seqlens.view, np.int64))
    kw = {n: _orig(call, n) for n in ("k", "v", "rotary_cos", "rotary_sin", "cache_batch_idx", "block_table",
                                      "cache_leftpad") if call.args.get(n) is not None}
    kw["rotary_interleaved"] = call.args.get("rotary_interleaved", True)
    page = kc0.shape[1] if "block_table" in kw else None
    kc, vc = expected_cache(kc0, vc0, lengths, kw, page)
    assert _same(np.ascontiguousarray(kc_now), np.ascontiguousarray(kc)), f"k_cache after the append: {call.describe()}"
    assert _same(np.ascontiguousarray(vc_now), np.ascontiguousarray(vc)), f"v_cache after the append: {call.describe()}"
    causal = bool(call.args.get("causal", False))
    window = call.args.get("window_size", (-1, -1))
    snew = kw["k"].shape[1] if "k" in kw else 0
    q_use = q
    if "rotary_cos" in kw:
        per_row = causal or tuple(int(w) for w in window) != (-1, -1)
        pos = lengths[:, None] + (np.arange(q.shape[1])[None] if per_row else 0)
        q_use = ref_kvcache.apply_rotary(q, kw["rotary_cos"], kw["rotary_sin"], pos,
                                         interleaved=kw["rotary_interleaved"])
    leftpad = kw.get("cache_leftpad", np.zeros(batch, np.int32))
    l_ = None if lse is None else _np(lse)
    for b in range(batch):
        lo, hi = int(leftpad[b]), int(lengths[b]) + snew
        where = dict(page_size=page, block_table=kw.get("block_table"), cache_batch_idx=kw.get("cache_batch_idx"))
        kb = ref_kvcache.gather(kc, b, lo, hi, **where)[None]
        vb = ref_kvcache.gather(vc, b, lo, hi, **where)[None]
        skw = _seq_kw_call(call, b)
        _compare(o[b:b + 1], q_use[b:b + 1], kb, vb, None if l_ is None else l_[b:b + 1], call.describe(), **skw)


def _view_of(a: Arr, before: dict) -> np.ndarray:
    """``a``'s view into the snapshot of its buffer (the array as it was before the call)."""
    snap = before[id(a.buffer)]
    offset = a.view.__array_interface__["data"][0] - a.buffer.__array_interface__["data"][0]
    return np.lib.stride_tricks.as_strided(snap.reshape(-1)[offset // a.view.itemsize:], a.view.shape, a.view.strides)


def _oracle_merge(call: Call, result, before):
    out, lse = result
    outs = [np.asarray(x.view, F64) for x in call.args["outs"]]
    lses = [np.asarray(x.view, F64) for x in call.args["lses"]]
    o, l_ = _np(out), _np(lse)
    dt = call.args["outs"][0].view.dtype
    want_l = np.logaddexp.reduce(np.stack(lses), axis=0) if lses else None
    w = [np.where(np.isneginf(s), 0.0, np.exp(s - np.where(np.isneginf(want_l), 0, want_l))) for s in lses]
    want_o = sum(wi[..., None] * oi for wi, oi in zip(w, outs))
    assert o.shape == want_o.shape and l_.shape == want_l.shape, f"shapes {o.shape} {l_.shape}: {call.describe()}"
    assert o.dtype == dt, f"out dtype {o.dtype}: {call.describe()}"
    assert np.array_equal(np.isneginf(l_), np.isneginf(want_l)), f"lse -inf pattern: {call.describe()}"
    fin = np.isfinite(want_l)
    np.testing.assert_allclose(np.asarray(l_, F64)[fin], want_l[fin], rtol=1e-5, atol=1e-5, err_msg=call.describe())
    u = {F16: 2.0**-11, BF16: 2.0**-8, F32: 2.0**-24, F64: 2.0**-53}[np.dtype(dt)]
    tol = 4 * u * (1 + np.abs(want_o).max(initial=0)) * len(outs)
    err = np.abs(np.asarray(o, F64) - want_o).max(initial=0)
    assert err <= tol, f"merge out error {err:.3g} > {tol:.3g}: {call.describe()}"


def _oracle_softmax(call: Call, result, before):
    _check_type(call, result, "softmax result")
    x = _orig(call, "x")
    axis = int(call.args.get("axis", -1))
    y = _np(result)
    assert y.shape == x.shape and y.dtype == x.dtype, f"softmax {y.shape} {y.dtype}: {call.describe()}"
    x64 = np.asarray(x, F64)
    if x.size == 0:
        return   # cuflash.reference.softmax refuses empty input (tests/api/test_bad_input_regressions.py)
    with np.errstate(invalid="ignore"):
        want = ref.softmax(x64, axis)
        base = ref.softmax(np.asarray(x, F32 if x.dtype != F64 else F64), axis).astype(x.dtype).astype(F64)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(np.asarray(y, F64)), nan), f"softmax NaN pattern: {call.describe()}"
    err = np.abs(np.asarray(y, F64)[~nan] - want[~nan]).max(initial=0)
    tol = 2 * np.abs(base[~nan] - want[~nan]).max(initial=0) + tolerance.floor_for(x.dtype)
    assert err <= tol, f"softmax error {err:.3g} > {tol:.3g}: {call.describe()}"


ORACLES = {"attention": _oracle_attention, "explain": _oracle_explain, "attention_backward": _oracle_backward,
           "attention_varlen": _oracle_varlen, "attention_varlen_backward": _oracle_varlen_backward,
           "attention_with_kvcache": _oracle_kvcache, "merge_attention": _oracle_merge,
           "softmax": _oracle_softmax}


# --------------------------------------------------------------------------------------------
# the strategy of one test


BUILDERS = {
    "attention": lambda p: attention_calls(p, "attention"),
    "explain": lambda p: attention_calls(p, "explain"),
    "attention_backward": lambda p: attention_calls(p, "attention_backward"),
    "attention_varlen": lambda p: varlen_calls(p, "attention_varlen"),
    "attention_varlen_backward": lambda p: varlen_calls(p, "attention_varlen_backward"),
    "attention_with_kvcache": kvcache_calls,
    "merge_attention": merge_calls,
    "softmax": softmax_calls,
}


@st.composite
def calls(draw, entry: str, p: Profile):
    """One call of ``cuflash.<entry>``: valid, then mutated 0-2 times, in one of ``p.kinds``."""
    call = draw(BUILDERS[entry](p))
    count = draw(st.sampled_from(p.mutations))
    if count:
        call = mutate(draw, call, count)
    kind = draw(st.sampled_from(p.kinds))
    if kind != "numpy":
        for _, a in call.arrays():
            if a.kind == "numpy":
                a.kind = kind
    if kind == "jax":
        for name in ("out", "k_cache", "v_cache"):
            if isinstance(call.args.get(name), Arr) and (name == "out" or call.args.get("k") is not None):
                call.mutations.append((f"{name} is a JAX array (immutable)", (name, "k_cache", "v_cache", "out")))
    return call
