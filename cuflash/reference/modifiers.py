"""The score modifiers on the NumPy paths: softcap, ALiBi, attn_bias, attn_mask, sinks, score_mod, mask_mod.

The convention is :mod:`cuflash.runtime.validation_modifiers`'s (docs/conventions.md, "Score modifiers"): scale, softcap,
ALiBi and bias, score_mod, mask (causal/window, attn_mask, mask_mod), softmax with the sink in the denominator. :class:`HeadTerms` gives the
modifiers of one kv head (its ``G`` query heads) or of the whole problem, block by block: a
broadcast bias or mask is a stride-0 view of the argument, and only the block a tile needs is
ever read (and converted to the accumulation type). :class:`BiasGrad` sums ``dS`` blocks over
the bias's broadcast axes into a buffer of the bias's own shape.

Gradients (``s`` the scaled score, ``t = tanh(s / softcap)``, ``dS = P * (dP - D)`` the
gradient of the final score, ``D = rowsum(dO * O)``)::

    dS'         = dS * score_mod'(s')                   (s' the score score_mod received; the
                                                          symbolic derivative, cuflash.runtime.score_mod)
    d attn_bias = dS', summed over the axes the bias broadcasts over
    d s         = dS' * (1 - t**2)                      (softcap; dS' itself without it)
    d sinks[h]  = -sum over batch and rows of exp(sinks[h] - lse) * D

(the last because ``lse`` is the only place a sink enters: ``d lse / d sink = exp(sink - lse)``,
``d out / d lse = -out``, so ``d loss / d sink = -exp(sink - lse) * (dO . O)`` per row).
"""

from __future__ import annotations

import numpy as np

from cuflash.reference.score_mods import ModTerms
from cuflash.reference.views import split_heads
from cuflash.runtime.validation import AttentionProblem
from cuflash.runtime.validation_modifiers import BroadcastArray

__all__ = ["broadcast_view", "HeadTerms", "ScoreGrad", "BiasGrad", "stack_rows", "sink_grad", "scale_grad"]


def broadcast_view(b: BroadcastArray) -> np.ndarray:
    """The NumPy argument of ``b`` viewed in ``b.shape`` (stride 0 on broadcast axes; no copy)."""
    a = np.asarray(b.array)
    return np.lib.stride_tricks.as_strided(a, shape=b.shape, strides=tuple(s * a.itemsize for s in b.strides),
                                           writeable=False)


def _index(idx) -> object:
    """A contiguous ascending index array as a slice (a view), anything else as it is."""
    idx = np.asarray(idx)
    if idx.size and idx[-1] - idx[0] == idx.size - 1 and (idx.size < 2 or (np.diff(idx) == 1).all()):
        return slice(int(idx[0]), int(idx[-1]) + 1)
    return idx


def stack_rows(x: np.ndarray) -> np.ndarray:
    """``(G, R, n)`` as the tiled paths' stacked ``(R * G, n)`` (row ``r * G + g``)."""
    g, r, n = x.shape
    return x.transpose(1, 0, 2).reshape(r * g, n)


class HeadTerms:
    """The modifiers of kv head ``h`` (a tuple ``(*batch index, kv head)``: blocks of shape
    ``(G, R, n)``), or of every head (``h=None``: blocks ``(*batch, Hk, G, R, n)``)."""

    def __init__(self, p: AttentionProblem, h=None, acc_t=np.float64):
        m = p.modifiers
        self.p, self.acc_t, self.h = p, np.dtype(acc_t), h
        self.softcap = m.softcap
        self.mods = None if m.score_mod is None and m.mask_mod is None else ModTerms(m.score_mod, m.mask_mod)
        hk, g = p.num_heads_k, p.group_size
        lead = (...,) if h is None else tuple(h)
        self.slopes = self.bias = self.mask = self.sinks = None
        if m.alibi_slopes is not None:
            s = broadcast_view(m.alibi_slopes).astype(self.acc_t)
            self.slopes = s.reshape(s.shape[:-1] + (hk, g))[lead]
        if m.attn_bias is not None:
            self.bias = split_heads(broadcast_view(m.attn_bias), hk)[lead]
        if m.attn_mask is not None:
            self.mask = split_heads(broadcast_view(m.attn_mask), hk)[lead]
        if m.sinks is not None:
            s = broadcast_view(m.sinks).astype(self.acc_t).reshape(hk, g)
            self.sinks = s[h[-1]] if h is not None else np.broadcast_to(s, p.batch_shape + (hk, g))
        self.blocks = None   # the block mask's codes (0 empty, 1 partial, 2 full) of this kv head's G query heads
        if m.block_mask is not None and h is not None:
            dense = m.block_mask.to_dense()
            *bidx, hk_i = h
            b = int(np.ravel_multi_index(tuple(bidx), p.batch_shape)) if bidx and dense.shape[0] > 1 else 0
            heads = slice(hk_i * g, hk_i * g + g) if dense.shape[1] > 1 else slice(0, 1)
            self.blocks = dense[b, heads]
            self.block_size = tuple(m.block_mask.BLOCK_SIZE)

    def key_blocks(self, qb: int, lo: int, hi: int) -> list:
        """The block mask's key blocks of query block ``qb`` for the G heads, clipped to keys
        ``[lo, hi)``: ``(c0, c1, full)`` in key order, a block every head finds empty left out;
        ``full`` when every head keeps all of it (mask_mod is then not evaluated)."""
        return self._listed(self.blocks[:, qb, :], self.block_size[1], lo, hi)

    def query_blocks(self, kb: int, lo: int, hi: int) -> list:
        """The transposed index: the query blocks that see key block ``kb``, clipped to rows
        ``[lo, hi)``, as :meth:`key_blocks` lists them."""
        return self._listed(self.blocks[:, :, kb], self.block_size[0], lo, hi)

    @staticmethod
    def _listed(codes, size: int, lo: int, hi: int) -> list:
        seen, full = (codes > 0).any(axis=0), (codes == 2).all(axis=0)
        out = []
        for i in np.flatnonzero(seen):
            c0, c1 = max(int(i) * size, lo), min((int(i) + 1) * size, hi)
            if c0 < c1:
                out.append((c0, c1, bool(full[i])))
        return out

    def _block(self, x, rows, cols):
        r, c = _index(rows), _index(cols)
        if isinstance(r, slice) or isinstance(c, slice):
            return x[..., r, :][..., c]
        return x[..., r[:, None], c[None, :]]

    def modify(self, s: np.ndarray, rows, cols, stacked: bool = False, grad: bool = False, arrays: bool = False):
        """Softcap, ALiBi, bias and score_mod applied to the scaled scores ``s`` in place
        (``(G, R, n)`` or, with ``stacked``, ``(R * G, n)``; ``(*batch, Hk, G, R, n)`` for every
        head); with ``grad``, returns the :class:`ScoreGrad` of the block for the backward (with
        ``arrays`` too, its ``arrays`` terms for the captured float arrays' gradients)."""
        cap = None
        if self.softcap > 0:
            s /= self.softcap
            np.tanh(s, out=s)
            if grad:   # d (softcap * tanh(s / softcap)) / d s = 1 - tanh**2
                cap = 1 - s * s
            s *= self.softcap
        add = self.additive(rows, cols)
        if add is not None:
            s += stack_rows(add) if stacked else add
        mod, terms = None, []
        if self.mods is not None and self.mods.score_mod is not None:
            mod = self.mods.modify(s, self.mod_index(rows, cols, stacked), want_grad=grad, want_arrays=grad and arrays)
            if grad and arrays:
                mod, terms = mod
        return ScoreGrad(mod, cap, terms) if grad else None

    def mod_index(self, rows, cols, stacked: bool = False) -> dict:
        """The ``b``, ``h``, ``q_idx``, ``kv_idx`` arguments of score_mod/mask_mod for a block
        (int64 arrays broadcastable to it); ``b`` is the row-major linear batch index, ``h``
        the query head."""
        p, g = self.p, self.p.group_size
        rows, cols = np.asarray(rows, np.int64), np.asarray(cols, np.int64)
        if self.h is None:   # (*batch, Hk, G, R, n)
            b = np.arange(int(np.prod(p.batch_shape, dtype=np.int64)), dtype=np.int64).reshape(
                tuple(p.batch_shape) + (1, 1, 1, 1))
            h = np.arange(p.num_heads_q, dtype=np.int64).reshape(p.num_heads_k, g, 1, 1)
            return {"b": b, "h": h, "q_idx": rows[:, None], "kv_idx": cols[None, :]}
        *bidx, hk = self.h
        b = np.int64(np.ravel_multi_index(tuple(bidx), p.batch_shape)) if bidx else np.int64(0)
        heads = hk * g + np.arange(g, dtype=np.int64)
        if stacked:   # row r * G + g
            return {"b": b, "h": np.tile(heads, len(rows))[:, None], "q_idx": np.repeat(rows, g)[:, None],
                    "kv_idx": cols[None, :]}
        return {"b": b, "h": heads[:, None, None], "q_idx": rows[None, :, None], "kv_idx": cols[None, None, :]}

    def additive(self, rows, cols):
        """ALiBi plus bias for the block, in the accumulation type, or None."""
        add = None
        if self.slopes is not None:
            p = self.p
            dist = np.abs(np.asarray(rows)[:, None] + (p.seqlen_k - p.seqlen_q) - np.asarray(cols)[None, :])
            add = -self.slopes[..., None, None] * dist.astype(self.acc_t)
        if self.bias is not None:
            b = self._block(self.bias, rows, cols).astype(self.acc_t)
            add = b if add is None else add + b
        return add

    def keep(self, rows, cols, stacked: bool = False, user: bool = True):
        """attn_mask's block and mask_mod's (True = attend), or None without either; ``user``
        False leaves mask_mod out (a block the block mask lists as full)."""
        k = None
        if self.mask is not None:
            k = self._block(self.mask, rows, cols)
            k = stack_rows(k) if stacked else k
        if user and self.mods is not None and self.mods.mask_mod is not None:
            shape = self._shape(len(rows), len(cols), stacked)
            user = self.mods.keep(self.mod_index(rows, cols, stacked), shape)
            k = user if k is None else k & user
        return k

    def _shape(self, r: int, n: int, stacked: bool) -> tuple:
        p, g = self.p, self.p.group_size
        if self.h is None:
            return tuple(p.batch_shape) + (p.num_heads_k, g, r, n)
        return (r * g, n) if stacked else (g, r, n)

    def stacked_sinks(self, rows: int):
        """The sinks of the stacked ``(rows * G,)`` rows, or None."""
        return None if self.sinks is None else np.tile(self.sinks, rows)


class ScoreGrad:
    """The chain factors of one block's modified scores, for the backward.

    Attributes
    ----------
    mod : array or None
        ``d score_mod / d score`` at the score score_mod received (None: 1, or no score_mod).
    cap : array or None
        ``1 - tanh(s / softcap)**2`` (None: no softcap).
    arrays : list
        ``(slot, index, d score_mod / d read)`` per read of a captured float array
        (:meth:`cuflash.reference.score_mods.ModTerms.modify`); empty unless asked for.
    """

    def __init__(self, mod, cap, arrays=()):
        self.mod, self.cap, self.arrays = mod, cap, list(arrays)


def scale_grad(ds: np.ndarray, factor) -> np.ndarray:
    """``ds * factor`` in place where ``ds != 0`` (a pair with no gradient keeps 0 even where the
    factor is not finite, e.g. a masked pair's); ``factor`` None is 1."""
    if factor is not None:
        np.multiply(ds, factor, out=ds, where=ds != 0)
    return ds


def join_sinks(m, l, acc, sinks):
    """Fold the sink logits into a finished online softmax (in place): running max ``m``, sum
    ``l`` and accumulator ``acc`` per row become those of the softmax whose denominator also
    holds ``exp(sink)`` (the sink's value is 0, so ``acc`` is only rescaled)."""
    m_new = np.maximum(m, sinks)
    shift = np.where(np.isneginf(m_new), 0, m_new)
    with np.errstate(invalid="ignore", over="ignore"):
        alpha = np.exp(m - shift)
        l *= alpha
        l += np.exp(sinks - shift)
        acc *= alpha[:, None]
    m[...] = m_new


def sink_grad(sinks, lse, d_row):
    """``-sum_i exp(sink - lse_i) * D_i`` over the rows (axis 0 of ``lse`` and ``d_row``,
    ``(Sq, G)``): the gradient of one kv head's ``G`` sinks; a row with ``lse = -inf`` (no key
    and a ``-inf`` sink) adds nothing."""
    with np.errstate(invalid="ignore", over="ignore"):
        w = np.where(np.isneginf(lse), 0, np.exp(sinks[None, :] - np.where(np.isneginf(lse), 0, lse)))
        return -(w * d_row).sum(axis=0)


class BiasGrad:
    """``d attn_bias`` of the tiled backward: each work item (kv head ``h``, key columns
    ``[c0, c1)``) sums its ``dS`` blocks over the broadcast axes into a small partial
    (:meth:`partial`, :meth:`add`), and the partials are added into the result in item order
    (:meth:`commit`): the same bits whatever the thread count."""

    def __init__(self, p: AttentionProblem, acc_t):
        b = p.modifiers.attn_bias
        self.p, self.acc_t, self.bias = p, acc_t, b
        nd = len(b.shape)
        own = b.own_shape[-nd:] if len(b.own_shape) >= nd else b.own_shape
        self.aligned = (1,) * (nd - len(own)) + tuple(own)
        self.bcast = set(b.broadcast_axes)
        self.buf = np.zeros(self.aligned, acc_t)

    def partial(self, c0: int, c1: int) -> np.ndarray:
        """Zeros for one item: ``(G or 1, Sq or 1, c1 - c0 or 1)``."""
        nd = len(self.aligned)
        return np.zeros((self.aligned[nd - 3] if nd - 3 in self.bcast else self.p.group_size,
                         1 if nd - 2 in self.bcast else self.p.seqlen_q,
                         1 if nd - 1 in self.bcast else c1 - c0), self.acc_t)

    def add(self, part: np.ndarray, ds: np.ndarray, r0: int, r1: int, c0: int, c1: int) -> None:
        """Add the stacked ``(R * G, n)`` block ``ds`` of rows ``[r0, r1)`` and columns
        ``[c0, c1)`` (relative to the item's first column) into ``part``."""
        nd = len(self.aligned)
        x = ds.reshape(r1 - r0, -1, c1 - c0).transpose(1, 0, 2)
        axes = tuple(i for i, ax in enumerate((nd - 3, nd - 2, nd - 1)) if ax in self.bcast)
        if axes:
            x = x.sum(axis=axes, keepdims=True)
        part[:, slice(None) if nd - 2 in self.bcast else slice(r0, r1),
             slice(None) if nd - 1 in self.bcast else slice(c0, c1)] += x

    def commit(self, part: np.ndarray, h: tuple, c0: int, c1: int) -> None:
        nd = len(self.aligned)
        g = self.p.group_size
        idx = [slice(0, 1) if ax in self.bcast else slice(i, i + 1) for ax, i in enumerate(h[:-1])]
        hk = h[-1]
        idx.append(slice(0, 1) if nd - 3 in self.bcast else slice(hk * g, hk * g + g))
        idx.append(slice(None))
        idx.append(slice(0, 1) if nd - 1 in self.bcast else slice(c0, c1))
        self.buf[tuple(idx)] += part

    def result(self, dtype) -> np.ndarray:
        """The gradient in the bias's own shape, cast to ``dtype``."""
        return self.buf.reshape(self.bias.own_shape).astype(dtype)


def reduce_bias_grad(b: BroadcastArray, ds_full: np.ndarray) -> np.ndarray:
    """The dense ``dS`` of shape ``b.shape`` summed over ``b``'s broadcast axes, in its own shape
    (the float64 oracle's ``d attn_bias``)."""
    axes = b.broadcast_axes
    red = ds_full.sum(axis=axes, keepdims=True) if axes else ds_full
    return red.reshape(b.own_shape)
