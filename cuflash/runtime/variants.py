"""Kernel variants: the compile-time choices of one kernel, as a frozen, hashable value.

A variant does two jobs with one object (docs/kernels.md): its :attr:`~Variant.name` encodes every
compile-time axis and is the suffix of the kernel's ``extern "C"`` entry name, and its
:meth:`~Variant.defines` give the ``#define`` prelude that selects those axes in the
``kernels_cu/`` source. Run-time values (lengths, strides, flags) are kernel arguments, never
variant axes. A kernel's own variant class lives in its host module (``cuflash/kernels/<stem>.py``,
beside ``kernels_cu/<stem>.cu``); the bases here carry what the kernels share:
:class:`Variant` (name, entry, prelude), :class:`AttentionVariant` (dtype and head-dim bucket
checks, the tile's axes and defines), :class:`TileVariant` (the tile as an axis: the forward
kernels) and :class:`BucketTiledVariant` (the tile fixed by the bucket: the backward kernels).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

try:  # bfloat16 as NumPy (>= 2.1) and CuPy 14 use it
    from ml_dtypes import bfloat16 as _bfloat16
except ImportError:  # pragma: no cover - ml_dtypes is a dependency
    _bfloat16 = None

#: dtype key -> (CUDA element type, NumPy dtype)
DTYPES: dict[str, tuple[str, np.dtype]] = {
    "f16": ("__half", np.dtype(np.float16)),
    "f32": ("float", np.dtype(np.float32)),
}
if _bfloat16 is not None:
    DTYPES["bf16"] = ("__nv_bfloat16", np.dtype(_bfloat16))


def dtype_key(dtype) -> str:
    """Return the variant dtype key (``"f16"``, ``"bf16"``, ``"f32"``) of a NumPy/CuPy dtype.

    Raises
    ------
    KeyError
        If no kernel handles ``dtype``.
    """
    dt = np.dtype(dtype)
    for key, (_, npdt) in DTYPES.items():
        if npdt == dt:
            return key
    raise KeyError(str(dt))


@dataclasses.dataclass(frozen=True)
class Variant:
    """Base class of kernel variants.

    Subclasses set :attr:`family` (the kernel family, also the entry name's prefix) and
    :attr:`source` (the ``kernels_cu/`` file), declare their axes as dataclass fields and extend
    :meth:`defines`.
    """

    family: ClassVar[str] = ""
    source: ClassVar[str] = ""
    #: the arch the kernel is compiled for: None for the device's own compute capability (the
    #: tensor-core and SIMT tiers), ``"90a"`` for ``sm_90a`` (the Hopper tier: ``wgmma``,
    #: ``setmaxnreg``), whose cubin runs on compute capability 9.0 only (docs/kernels.md)
    target_arch: ClassVar[str | None] = None
    #: the oldest NVRTC major that compiles the kernel; 13 marks a CUDA-13-only variant (one the
    #: compile gate found NVRTC 12.x cannot compile)
    min_nvrtc_major: ClassVar[int] = 12

    def spilling_nvrtc_majors(self, arch: int) -> tuple[int, ...]:
        """The NVRTC majors whose ptxas spills this variant on ``sm_<arch>`` (measured; the compile
        gate's ``KNOWN_SPILLS`` holds each): :func:`cuflash.runtime.cuda_runner.nvrtc_for` compiles
        it with another installed major where one is. None by default."""
        return ()

    def unsupported_device_reason(self, cc: int) -> str | None:
        """Why this variant's cubin cannot run on a device of compute capability ``cc`` (``90``
        for 9.0), or None: only a :attr:`target_arch` restricts it (``"90a"``: 9.0 only)."""
        if self.target_arch is None:
            return None
        from cuflash.runtime.cubin import arch_reason

        return arch_reason(self.target_arch, cc)

    def axes(self) -> tuple[str, ...]:
        """The axis values in field order, as they appear in :attr:`name`."""
        return tuple(str(getattr(self, f.name)) for f in dataclasses.fields(self))

    @property
    def name(self) -> str:
        """Unique, C-identifier-safe name of this variant, e.g. ``"f16_warp"``."""
        return "_".join(self.axes())

    @property
    def entry(self) -> str:
        """The ``extern "C"`` entry name: ``cuflash_<family>_<name>``."""
        return f"cuflash_{self.family}_{self.name}"

    def defines(self) -> tuple[tuple[str, str], ...]:
        """The ``#define`` prelude as ``(macro, value)`` pairs (the base gives the entry name)."""
        return (("CUFLASH_ENTRY", self.entry), ("CUFLASH_VARIANT", f'"{self.name}"'))


@dataclasses.dataclass(frozen=True)
class AttentionVariant(Variant):
    """Base of the attention kernels' variants: a dtype, a head-dim bucket and a tile.

    What every attention kernel shares is done here once: checking the dtype and bucket against
    the values the subclass takes, the entry-name axes ``<dtype>_d<bucket>_m<Br>_n<Bc>``, the
    thread-block shape, and the ``#define`` lines every attention kernel reads (``CUFLASH_T``,
    ``CUFLASH_HEAD_DIM_MAX``, ``CUFLASH_BLOCK_M``, ``CUFLASH_BLOCK_N``, ``CUFLASH_THREADS``,
    ``CUFLASH_SMEM_BYTES``).

    A subclass declares its dataclass fields (at least ``dtype`` and ``head_dim_max``), sets
    :attr:`dtypes` and :attr:`head_dim_buckets`, provides ``block_m``, ``block_n``, ``threads``
    and ``smem_bytes`` (fields or properties), and adds its own axes and defines.
    """

    #: dtype keys the kernel takes
    dtypes: ClassVar[tuple[str, ...]] = ("f16", "bf16", "f32")
    #: head-dim buckets: a variant serves every ``max(D, Dv)`` up to its bucket
    head_dim_buckets: ClassVar[tuple[int, ...]] = ()
    #: the packed variable-length form (``cuflash.attention_varlen``: ``CUFLASH_VARLEN`` 1, entry
    #: name suffix ``_varlen``); a compile-time axis, so the fixed-shape code is unchanged by it
    varlen: bool = dataclasses.field(default=False, kw_only=True)
    #: the dropout form (``CUFLASH_DROPOUT`` 1, entry suffix ``_dropout``: Philox keep mask on P);
    #: a compile-time axis, so ``dropout_p = 0`` runs the kernel without it
    dropout: bool = dataclasses.field(default=False, kw_only=True)
    #: the score-modifier form (``CUFLASH_MODS`` 1, entry suffix ``_mods``: softcap, ALiBi, bias,
    #: boolean mask and sinks as run-time arguments, ``kernels_cu/score_mods.cuh``); a compile-time
    #: axis, so a call without modifiers runs the kernel without them
    mods: bool = dataclasses.field(default=False, kw_only=True)
    #: a traced score_mod / mask_mod, and the score_mod's derivative (the backward's), as CUDA C
    #: expressions (:func:`cuflash.runtime.score_mod.kernel_texts`; "" for none): an axis of the
    #: ``mods`` forms (``CUFLASH_USER_MOD``, kernels_cu/score_mods.cuh), named by a hash of the three
    score_c: str = dataclasses.field(default="", kw_only=True)
    mask_c: str = dataclasses.field(default="", kw_only=True)
    grad_c: str = dataclasses.field(default="", kw_only=True)
    #: the backward's captured-array gradients of the traced score_mod, per pair and per warp
    #: (:func:`cuflash.runtime.score_mod.array_grad_c`; "" for none): ``CUFLASH_USER_MOD`` bit 4
    agrad_c: str = dataclasses.field(default="", kw_only=True)
    agrad_warp_c: str = dataclasses.field(default="", kw_only=True)
    #: the block-sparse form of a traced mask_mod's variant (``CUFLASH_BLOCK_SPARSE`` 1, suffix
    #: ``_bs``: the tile loop walks a block mask's lists, kernels_cu/score_mods.cuh)
    block_sparse: bool = dataclasses.field(default=False, kw_only=True)

    def __post_init__(self):
        name = type(self).__name__
        allowed = tuple(d for d in self.dtypes if d in DTYPES)
        if self.dtype not in allowed:
            raise ValueError(f"{name}: dtype={self.dtype!r} must be one of {allowed}")
        if self.head_dim_max not in self.head_dim_buckets:
            raise ValueError(f"{name}: head_dim_max={self.head_dim_max} must be one of {self.head_dim_buckets}")

    def axes(self) -> tuple[str, ...]:
        return (self.dtype, f"d{self.head_dim_max}", f"m{self.block_m}", f"n{self.block_n}")

    @property
    def name(self) -> str:
        return ("_".join(self.axes()) + ("_varlen" if self.varlen else "") + ("_dropout" if self.dropout else "")
                + ("_mods" if self.mods else "") + self._user_suffix() + ("_bs" if self.block_sparse else ""))

    @property
    def user_mod(self) -> int:
        """``CUFLASH_USER_MOD``: bit 1 a traced score_mod, bit 2 a traced mask_mod, bit 4 the
        score_mod's captured-array gradients (the backward's)."""
        return (1 if self.score_c else 0) | (2 if self.mask_c else 0) | (4 if self.agrad_c else 0)

    def _user_suffix(self) -> str:
        """``_um`` and 16 hex digits of a hash of the traced functions' C (none without them)."""
        if not self.user_mod:
            return ""
        import hashlib

        text = "\n".join((self.score_c, self.mask_c, self.grad_c)
                         + ((self.agrad_c, self.agrad_warp_c) if self.agrad_c else ()))
        return "_um" + hashlib.sha256(text.encode()).hexdigest()[:16]

    def user_defines(self) -> tuple[tuple[str, str], ...]:
        """The traced functions' ``#define`` lines (none without them)."""
        if not self.user_mod:
            return ()
        out = (("CUFLASH_USER_MOD", str(self.user_mod)),)
        for macro, text in (("CUFLASH_SCORE_MOD(score, b, h, q_idx, kv_idx, A)", self.score_c),
                            ("CUFLASH_SCORE_MOD_GRAD(score, b, h, q_idx, kv_idx, A)", self.grad_c),
                            ("CUFLASH_MASK_MOD(b, h, q_idx, kv_idx, A)", self.mask_c),
                            ("CUFLASH_SCORE_MOD_ARRAY_GRAD(score, b, h, q_idx, kv_idx, A, G, ds, U)", self.agrad_c),
                            ("CUFLASH_SCORE_MOD_ARRAY_GRAD_WARP(b, h, A, G, U)", self.agrad_warp_c)):
            if text:
                out += ((macro, text),)
        return out + ((("CUFLASH_BLOCK_SPARSE", "1"),) if self.block_sparse else ())

    @property
    def block(self) -> tuple[int, int, int]:
        """Thread-block shape (1-D)."""
        return (self.threads, 1, 1)

    def defines(self) -> tuple[tuple[str, str], ...]:
        return super().defines() + (
            ("CUFLASH_T", DTYPES[self.dtype][0]),
            ("CUFLASH_HEAD_DIM_MAX", str(self.head_dim_max)),
            ("CUFLASH_BLOCK_M", str(self.block_m)),
            ("CUFLASH_BLOCK_N", str(self.block_n)),
            ("CUFLASH_THREADS", str(self.threads)),
            ("CUFLASH_SMEM_BYTES", str(self.smem_bytes)),
            ("CUFLASH_VARLEN", "1" if self.varlen else "0"),
            ("CUFLASH_DROPOUT", "1" if self.dropout else "0"),
            ("CUFLASH_MODS", "1" if self.mods else "0"),
        ) + self.user_defines()

    @classmethod
    def bucket(cls, head_dim: int, head_dim_v: int) -> int:
        """The smallest of :attr:`head_dim_buckets` holding both head dims.

        Raises
        ------
        NotImplementedError
            If ``max(head_dim, head_dim_v)`` exceeds the largest bucket.
        """
        need = max(head_dim, head_dim_v)
        for b in cls.head_dim_buckets:
            if need <= b:
                return b
        raise NotImplementedError(
            f"cuflash: head dim {need} exceeds the largest bucket {cls.head_dim_buckets[-1]} of {cls.family}")

    @classmethod
    def first_fitting(cls, candidates, smem_limit: int):
        """The first variant of ``candidates`` (an iterable of them, in order of preference)
        whose dynamic shared memory fits ``smem_limit`` bytes, or None."""
        return next((v for v in candidates if v.smem_bytes <= smem_limit), None)


@dataclasses.dataclass(frozen=True)
class BucketTiledVariant(AttentionVariant):
    """An attention variant whose tile ``(block_m, block_n)`` is fixed by its head-dim bucket,
    through the subclass's :attr:`tiles` table (the backward kernels)."""

    #: head-dim bucket -> (block_m, block_n)
    tiles: ClassVar[dict[int, tuple[int, int]]] = {}

    @property
    def tile(self) -> tuple[int, int]:
        return self.tiles[self.head_dim_max]

    @property
    def block_m(self) -> int:
        return self.tile[0]

    @property
    def block_n(self) -> int:
        return self.tile[1]


@dataclasses.dataclass(frozen=True)
class TileVariant(AttentionVariant):
    """An attention variant whose tile is one of its axes (the forward kernels, whose tile is
    chosen per device from a list of candidates).

    Parameters
    ----------
    dtype : str
        Element type key of q, k, v and out (``"f16"``, ``"bf16"``, ``"f32"``).
    head_dim_max : int
        Head-dim bucket: the variant serves every ``max(D, Dv)`` up to it.
    block_m, block_n : int
        Query rows (Br) and key rows (Bc) per tile.
    """

    dtype: str
    head_dim_max: int
    block_m: int
    block_n: int
