"""Block-sparse masks: which (query block, key block) pairs a ``mask_mod`` keeps whole, in part or not at all.

A :class:`BlockMask` describes a ``mask_mod`` over ``(Sq, Sk)`` in blocks of ``Q_BLOCK`` query rows
by ``KV_BLOCK`` keys (FlexAttention's ``BlockMask``, Guessous et al., "FlexAttention", 2024, and
the ``torch.nn.attention.flex_attention`` documentation; the field names are theirs):

* a **full** block: the function keeps every pair of it, so attention runs it without calling
  the function;
* a **partial** block: it keeps some pairs; the function is evaluated pair by pair there;
* an **empty** block: it keeps none, and is never visited.

Per (batch, head, query block) the key blocks that are partial (``kv_num_blocks``,
``kv_indices``) and full (``full_kv_num_blocks``, ``full_kv_indices``) are listed in ascending
order; the transposed index, per (batch, head, key block), lists the query blocks that see it
(``q_num_blocks``/``q_indices``, ``full_q_num_blocks``/``full_q_indices``), for the backward,
which walks keys. :func:`cuflash.create_block_mask` builds one; :func:`check_block_mask`
validates one against a call. Nothing here reads array data except :meth:`BlockMask.to_dense`
and :meth:`BlockMask.sparsity`.

Imports: :mod:`cuflash.runtime.score_mod` only.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from cuflash.runtime import score_mod as tracing

__all__ = ["BlockMask", "BLOCK_MULTIPLE", "DEFAULT_BLOCK_SIZE", "block_sizes", "check_block_mask", "own_mask_mod"]

#: a block size must be a multiple of this: the tensor-core forward's and backward's tiles of the
#: score-modifier forms (64 query rows by 64 keys, 32 keys at head dim 256) divide it, so every
#: kernel tile lies inside one block
BLOCK_MULTIPLE = 64
#: FlexAttention's default block size (both sides)
DEFAULT_BLOCK_SIZE = 128


def block_sizes(block_size, func: str) -> tuple[int, int]:
    """``(Q_BLOCK, KV_BLOCK)`` from ``BLOCK_SIZE`` (an int for both sides, or a pair).

    Raises
    ------
    TypeError
        Not an int or a pair of ints.
    ValueError
        A size that is not a positive multiple of :data:`BLOCK_MULTIPLE`.
    """
    pair = (block_size, block_size) if isinstance(block_size, (int, np.integer)) else block_size
    if (not isinstance(pair, (tuple, list)) or len(pair) != 2
            or not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in pair)):
        raise TypeError(f"{func}: BLOCK_SIZE must be an int or a pair of ints (Q_BLOCK, KV_BLOCK), got {block_size!r}")
    bq, bk = (int(x) for x in pair)
    if bq <= 0 or bk <= 0 or bq % BLOCK_MULTIPLE or bk % BLOCK_MULTIPLE:
        raise ValueError(f"{func}: BLOCK_SIZE must be positive multiples of {BLOCK_MULTIPLE} (the kernels' tiles divide "
                         f"them), got (Q_BLOCK, KV_BLOCK) = {(bq, bk)}")
    return bq, bk


@dataclasses.dataclass(frozen=True, eq=False)
class BlockMask:
    """A ``mask_mod`` over ``(Sq, Sk)`` summarised by blocks (see the module docstring).

    Attributes
    ----------
    kv_num_blocks, full_kv_num_blocks : int32 array ``(B, H, ceil(Sq / Q_BLOCK))``
        Per query block, how many key blocks are partial (full).
    kv_indices, full_kv_indices : int32 array ``(B, H, ceil(Sq / Q_BLOCK), ceil(Sk / KV_BLOCK))``
        Their key-block indices, ascending, in the first ``kv_num_blocks`` (``full_kv_num_blocks``)
        entries of the last axis; the entries after them are the other blocks (unspecified use).
    q_num_blocks, full_q_num_blocks : int32 array ``(B, H, ceil(Sk / KV_BLOCK))``
    q_indices, full_q_indices : int32 array ``(B, H, ceil(Sk / KV_BLOCK), ceil(Sq / Q_BLOCK))``
        The transposed index: per key block, the query blocks for which it is partial (full).
    BLOCK_SIZE : tuple of int
        ``(Q_BLOCK, KV_BLOCK)``.
    seq_lengths : tuple of int
        ``(Sq, Sk)`` it was built for.
    mask_mod : TracedMod
        The traced function it was built from (``mask_mod.fn`` is the Python function).
        ``B`` or ``H`` is 1 when it was built with ``B=None``/``H=None`` (the same for every
        batch entry / head: ``mask_mod`` was evaluated at ``b = 0`` / ``h = 0``).

    Notes
    -----
    The arrays are of one kind (NumPy, or CuPy for a mask built on the device). The block mask
    holds the captured arrays' values as they were when it was built: after changing them (new
    document ids), build it again.
    """

    kv_num_blocks: object
    kv_indices: object
    full_kv_num_blocks: object
    full_kv_indices: object
    q_num_blocks: object
    q_indices: object
    full_q_num_blocks: object
    full_q_indices: object
    BLOCK_SIZE: tuple
    seq_lengths: tuple
    mask_mod: tracing.TracedMod

    @property
    def shape(self) -> tuple:
        """``(B, H, Sq, Sk)``, with ``B``/``H`` 1 where it holds for every batch entry / head."""
        return tuple(self.kv_num_blocks.shape[:2]) + tuple(self.seq_lengths)

    @property
    def num_blocks(self) -> tuple:
        """``(query blocks, key blocks)``."""
        return tuple(self.kv_indices.shape[2:])

    def arrays(self) -> tuple:
        """The eight index arrays, in field order."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self)[:8])

    def with_arrays(self, convert) -> "BlockMask":
        """A copy whose index arrays are ``convert(array)`` (the device import)."""
        names = [f.name for f in dataclasses.fields(self)[:8]]
        return dataclasses.replace(self, **{n: convert(getattr(self, n)) for n in names})

    def to_dense(self) -> np.ndarray:
        """NumPy int8 ``(B, H, query blocks, key blocks)``: 0 empty, 1 partial, 2 full."""
        out = np.zeros(self.kv_num_blocks.shape + (self.kv_indices.shape[-1],), np.int8)
        for code, num, idx in ((1, self.kv_num_blocks, self.kv_indices), (2, self.full_kv_num_blocks, self.full_kv_indices)):
            num, idx = _host(num), _host(idx).astype(np.int64)
            listed = np.zeros(out.shape, bool)   # each row of idx is a permutation of the key blocks
            np.put_along_axis(listed, idx, np.arange(idx.shape[-1]) < num[..., None], -1)
            out[listed] = code
        return out

    def sparsity(self) -> float:
        """The percentage of blocks that are empty (never visited), over ``(B, H)`` as stored."""
        dense = self.to_dense()
        return 100.0 * float((dense == 0).mean()) if dense.size else 0.0

    def __repr__(self) -> str:
        return (f"BlockMask(shape={self.shape}, BLOCK_SIZE={self.BLOCK_SIZE}, blocks={self.num_blocks}, "
                f"sparsity={self.sparsity():.1f}%)")


def _host(a) -> np.ndarray:
    get = getattr(a, "get", None)
    return np.asarray(get() if callable(get) and not isinstance(a, np.ndarray) else a)


def check_block_mask(block_mask, mask_mod, func: str, batch: int, num_heads_q: int, seqlen_q: int, seqlen_k: int,
                     q_kind: str) -> tracing.TracedMod:
    """Validate ``block_mask`` against a call and return the ``mask_mod`` the call uses: the block
    mask's own when ``mask_mod`` is None, else ``mask_mod`` (traced), which must be the function
    the block mask was built from (the same traced expression over the same captured arrays).

    Raises
    ------
    TypeError
        ``block_mask`` not a :class:`BlockMask`; its arrays NumPy while q is not, or the other way.
    ValueError
        Built for other lengths (``seq_lengths`` != ``(Sq, Sk)``), another batch or head count
        (``B`` not 1 or the call's flattened batch, ``H`` not 1 or ``Hq``), or from another
        ``mask_mod``; index arrays not int32 of the block counts' shapes with a unit last-axis
        stride.
    """
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"{func}: block_mask must be a BlockMask (cuflash.create_block_mask), got "
                        f"{type(block_mask).__name__}")
    bm = block_mask
    if tuple(bm.seq_lengths) != (seqlen_q, seqlen_k):
        raise ValueError(f"{func}: block_mask was built for (Q_LEN, KV_LEN) = {tuple(bm.seq_lengths)}, the call has "
                         f"(Sq, Sk) = {(seqlen_q, seqlen_k)}")
    b, h = bm.shape[:2]
    if b not in (1, batch) or h not in (1, num_heads_q):
        raise ValueError(f"{func}: block_mask was built for (B, H) = {(b, h)}; the call needs B of 1 or {batch} and H "
                         f"of 1 or Hq = {num_heads_q}")
    nq, nk = -(-seqlen_q // bm.BLOCK_SIZE[0]), -(-seqlen_k // bm.BLOCK_SIZE[1])
    shapes = ((b, h, nq), (b, h, nq, nk), (b, h, nq), (b, h, nq, nk), (b, h, nk), (b, h, nk, nq), (b, h, nk), (b, h, nk, nq))
    for f, a, shape in zip(dataclasses.fields(bm), bm.arrays(), shapes):
        if str(getattr(a, "dtype", "")) != "int32" or tuple(a.shape) != shape or a.strides[-1] != 4:
            raise ValueError(f"{func}: block_mask.{f.name} must be int32 of shape {shape} with unit last-axis stride "
                             f"(as create_block_mask builds it), got {getattr(a, 'dtype', type(a).__name__)} "
                             f"{tuple(getattr(a, 'shape', ()))}")
    numpy_mask = isinstance(bm.kv_num_blocks, np.ndarray)
    if numpy_mask != (q_kind == "numpy"):
        where = "NumPy" if numpy_mask else "device"
        raise TypeError(f"{func}: block_mask holds {where} arrays, q is {'NumPy' if q_kind == 'numpy' else 'a device array'}"
                        f"; build it with create_block_mask(..., device=) for q's kind")
    return own_mask_mod(bm, mask_mod, func)


def own_mask_mod(block_mask: BlockMask, mask_mod, func: str) -> tracing.TracedMod:
    """The ``mask_mod`` a call with ``block_mask`` uses: ``block_mask.mask_mod`` when ``mask_mod``
    is None, else ``mask_mod`` traced, which must be the function the block mask was built from
    (the same traced expression over the same captured array objects). The framework adapters
    call it before they detach or replace captured arrays.

    Raises
    ------
    TypeError
        ``block_mask`` not a :class:`BlockMask`; ``mask_mod`` not traceable.
    ValueError
        ``mask_mod`` another function, or the same code over other arrays.
    """
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"{func}: block_mask must be a BlockMask (cuflash.create_block_mask), got "
                        f"{type(block_mask).__name__}")
    bm = block_mask
    if mask_mod is None:
        return bm.mask_mod
    traced = tracing.trace(mask_mod, "mask_mod", func)
    same = (traced.key == bm.mask_mod.key and len(traced.arrays) == len(bm.mask_mod.arrays)
            and all(a is c for a, c in zip(traced.arrays, bm.mask_mod.arrays)))
    if not same:
        raise ValueError(f"{func}: mask_mod must be the function block_mask was built from (or None, to use "
                         f"block_mask.mask_mod): got {traced.key}, block_mask has {bm.mask_mod.key}")
    return traced
