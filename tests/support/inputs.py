"""Input builders of the kernel grids: the masks, the input forms (contiguous, transposed,
strided views inside NaN-filled buffers, stride-0 broadcasts, misaligned views), and packed
batches of variable-length sequences with their per-sequence slices."""

from __future__ import annotations

import numpy as np

#: name -> (causal, window_size)
MASKS = {
    "none": (False, (-1, -1)),
    "causal": (True, (-1, -1)),
    "causal_win": (True, (16, -1)),
    "win_lr": (False, (7, 9)),
    "win_r": (False, (-1, 5)),
    "win_2_31": (False, (2**31 - 1, 2**33)),  # flash-attn's "unbounded" and past it: normalised on the host
}
#: the input forms that misalign rows or their start (a tier that needs 16-byte rows refuses them)
MISALIGNED_FORMS = {"strided3", "offset"}


def nan_padded(rng, shape, dtype, scale, pad_axes, pad=3):
    """A view of ``shape`` inside a larger NaN-filled buffer (``pad`` more on ``pad_axes``), so a
    read past the view shows."""
    big = list(shape)
    for ax in pad_axes:
        big[ax] += pad
    buf = np.full(big, np.nan, dtype=dtype)
    view = buf[tuple(slice(0, n) for n in shape)]
    view[...] = (rng.standard_normal(shape) * scale).astype(dtype)
    return view


def make_inputs(rng, form, dtype, shape, scale):
    """``(q, k, v, layout)`` of one input form; ``shape`` is ``(B, Hq, Hk, Sq, Sk, D, Dv)`` and
    ``scale`` multiplies q and k.

    Forms: ``bhsd``/``bshd`` (contiguous), ``strided`` (views in buffers padded by 3 on the row,
    head and sequence axes: K/V are views of a longer cache whose tail is NaN), ``strided8``
    (padded by 8: strides stay multiples of 8 elements), ``strided3`` (padded by 3, rows not
    16-byte aligned), ``offset`` (one element into the buffers: aligned strides, misaligned start),
    ``transposed`` (bhsd views of bshd storage), ``broadcast`` (K/V of stride 0 over the batch).
    """
    b, hq, hk, sq, sk, d, dv = shape
    if form == "bshd":
        shapes = ((b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, dv))
        return (*(np.asarray(rng.standard_normal(s) * scale).astype(dtype) for s in shapes[:2]),
                rng.standard_normal(shapes[2]).astype(dtype), "bshd")
    shapes = ((b, hq, sq, d), (b, hk, sk, d), (b, hk, sk, dv))
    scales = (scale, scale, 1.0)
    if form == "bhsd":
        return (*(np.asarray(rng.standard_normal(s) * sc).astype(dtype) for s, sc in zip(shapes, scales)), "bhsd")
    if form in ("strided", "strided3", "strided8"):
        pad = 8 if form == "strided8" else 3
        return (*(nan_padded(rng, s, dtype, sc, (1, 2, 3), pad) for s, sc in zip(shapes, scales)), "bhsd")
    if form == "offset":
        def shifted(s, sc):
            buf = np.full((int(np.prod(s)) + 1,), np.nan, dtype=dtype)
            view = buf[1:].reshape(s)
            view[...] = (rng.standard_normal(s) * sc).astype(dtype)
            return view
        return (*(shifted(s, sc) for s, sc in zip(shapes, scales)), "bhsd")
    if form == "transposed":
        return (*(np.asarray(rng.standard_normal((s[0], s[2], s[1], s[3])) * sc).astype(dtype).swapaxes(1, 2)
                  for s, sc in zip(shapes, scales)), "bhsd")
    if form == "broadcast":
        q = np.asarray(rng.standard_normal(shapes[0]) * scale).astype(dtype)
        k, v = (np.broadcast_to(np.asarray(rng.standard_normal((1,) + s[1:]) * sc).astype(dtype), s)
                for s, sc in zip(shapes[1:], scales[1:]))
        return q, k, v, "bhsd"
    raise ValueError(form)


def aligned(arrays) -> bool:
    """Whether every array starts 16-byte aligned with every stride of an axis longer than 1 a
    multiple of 16 bytes (what the tensor-core and Hopper tiers need)."""
    return all(x.ctypes.data % 16 == 0 and all(st % 16 == 0 for st, n in zip(x.strides[:-1], x.shape[:-1]) if n > 1)
               for x in arrays)


# --------------------------------------------------------------------------------------------
# packed batches


def make_batch(rng, lengths, hq, hk, d, dv, dtype, used="all"):
    """A packed batch of sequences of ``lengths`` ((query, key) pairs): ``(q, k, v, cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k)``; ``used="some"`` has every other
    sequence use about half of its keys."""
    lq = np.array([a for a, _ in lengths], np.int64)
    lk = np.array([b for _, b in lengths], np.int64)
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    q = rng.standard_normal((int(cq[-1]), hq, d)).astype(dtype)
    k = rng.standard_normal((int(ck[-1]), hk, d)).astype(dtype)
    v = rng.standard_normal((int(ck[-1]), hk, dv)).astype(dtype)
    seqused = None
    if used == "some":
        seqused = np.array([n // 2 if b % 2 == 0 else n for b, n in enumerate(lk)], np.int32)
    return q, k, v, cq, ck, int(lq.max(initial=0)), int(lk.max(initial=0)), seqused


def sequences(cq, ck, seqused):
    """``(query rows, key rows used, key rows)`` slices of each sequence."""
    for b in range(len(cq) - 1):
        n_used = (ck[b + 1] - ck[b]) if seqused is None else seqused[b]
        yield slice(cq[b], cq[b + 1]), slice(ck[b], ck[b] + n_used), slice(ck[b], ck[b + 1])
