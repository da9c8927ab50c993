"""Host side of ``kernels_cu/attention_bwd_sm90.cu``: the Hopper tier of the backward's main stage.

FA3's design (Shah et al., "FlashAttention-3", 2024, §3 and its backward): one block per 128 keys
of one kv head; a producer warp feeds Q, dO, lse and Dd per 64-row query tile through TMA and a
2-stage mbarrier ring; two consumer warpgroups (64 keys each) keep dK and dV in registers and run
the five GEMMs on wgmma; dQ leaves each tile through shared memory, added to the float32 workspace
by one warp's bulk reduce-add (``cp.reduce.async.bulk .add.f32``), no atomics. The dot stage
(``Dd = rowsum(dO * O)``), the workspace and the convert stage are
:mod:`cuflash.kernels.backward_run`'s, shared with the other tiers.

The kernel is compiled for ``sm_90a`` and runs on compute capability 9.0 only. Calls it takes:
float16/bfloat16, D = Dv = 64, 96 or 128 exactly, causal and windows (bottom-right), GQA, rows without
keys, one batch dim or a packed batch (``cu_seqlens_q/k`` and ``seqused_k`` read on the device; Q,
dO, K and V through ragged tensor maps, as the Hopper forward's, so no tile reads another
sequence's rows), any strides a tensor map can describe (the head dim contiguous, every other
stride and each base 16-byte aligned), and deterministic mode. At fixed shapes it also takes a traced
``score_mod`` / ``mask_mod`` and a block mask (the ``_um`` / ``_bs`` forms, :func:`traced_reason`;
``return_dscore_mod`` by atomics, so not with ``deterministic=True``). The rest goes to the
tensor-core backward, and ``explain`` says why: other head dims, Dv != D, dropout, the built-in score
modifiers, traced functions on a packed batch, a block mask of 64-key blocks or with deterministic mode.

Deterministic mode (``deterministic=True``): the key tiles that add to one (query head, query
tile) of the dQ workspace add in key-tile order, ordered by an int32 counter per (batch, query
head, query tile) in a zeroed array the call allocates (a wait with acquire loads, then the bulk
reduce-add, its completion and a release increment; FA3's scheme). The sums are then the same
bits on every run; dK and dV have one writer per element anyway. It is a run-time flag of the dQ
warp, not a variant: the consumers' code is the same in both modes.

Tiles: Br = 64 query rows, Bc = 128 keys; shared memory = K, V, two stages of Q and dO, two dS^T
buffers, the dQ buffer and the stages' lse and Dd, plus 1 KB of alignment.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from cuflash.kernels import attention_fwd_sm90
from cuflash.kernels import launch_args as la
from cuflash.runtime import plan, score_mod, variants
from cuflash.runtime.plan import LaunchPlan, PointerArg, ScalarArg, TensorMapArg
from cuflash.runtime.tensor_map import TensorMap
from cuflash.runtime.validation_modifiers import refuse_modifiers

#: this module's tier, in the dispatcher's words
TARGET_ARCH = attention_fwd_sm90.TARGET_ARCH
HEAD_DIMS = (64, 96, 128)
DTYPES = attention_fwd_sm90.DTYPES
BLOCK_M = 64
BLOCK_N = 128
STAGES = 2
PANEL = attention_fwd_sm90.PANEL
#: the roofline model (``python -m cuflash roofline``) does not read this kernel's loop nest (a loop
#: per mask kind inside the walk over query heads) yet: it models the next backward tier, and
#: ``--sass-of`` counts this kernel's loops
ROOFLINE_MODEL = False


@dataclasses.dataclass(frozen=True)
class Sm90BackwardVariant(attention_fwd_sm90.ThreeWarpgroups, variants.Variant):
    # (three warpgroups: the producer's, a TMA warp and the dQ warp, and two consumers)
    """The Hopper main stage of the backward for one dtype and head dim.

    Parameters
    ----------
    dtype : {"f16", "bf16"}
    head_dim : {64, 96, 128}
        D = Dv, exactly (96: the tiles hold two 64-column panels, the last 32 columns zero).
    """

    family: ClassVar[str] = "attn_bwd_sm90"
    source: ClassVar[str] = "attention_bwd_sm90.cu"
    target_arch: ClassVar[str | None] = TARGET_ARCH

    dtype: str
    head_dim: int
    # the forms the shared backward driver asks about (:func:`cuflash.kernels.backward_run.backward`);
    # a packed batch is a run-time form of the same code (the index arrays and ragged tensor maps),
    # dropout and the built-in score modifiers are not in this kernel
    varlen: bool = dataclasses.field(default=False, kw_only=True)
    dropout: bool = dataclasses.field(default=False, kw_only=True)
    mods: bool = dataclasses.field(default=False, kw_only=True)
    #: a traced score_mod / mask_mod, the score_mod's derivative and its captured-array gradients as
    #: CUDA C (:func:`cuflash.runtime.score_mod.kernel_texts`, :func:`~cuflash.runtime.score_mod.array_grad_c`;
    #: "" for none): ``CUFLASH_USER_MOD``, entry suffix ``_um`` and a hash, as the tensor-core forms'
    score_c: str = dataclasses.field(default="", kw_only=True)
    mask_c: str = dataclasses.field(default="", kw_only=True)
    grad_c: str = dataclasses.field(default="", kw_only=True)
    agrad_c: str = dataclasses.field(default="", kw_only=True)
    agrad_warp_c: str = dataclasses.field(default="", kw_only=True)
    #: the form that walks a block mask's transposed index (``CUFLASH_BLOCK_SPARSE`` 1, suffix ``_bs``)
    block_sparse: bool = dataclasses.field(default=False, kw_only=True)

    user_mod = variants.AttentionVariant.user_mod
    _user_suffix = variants.AttentionVariant._user_suffix
    user_defines = variants.AttentionVariant.user_defines

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"Sm90BackwardVariant: dtype={self.dtype!r} must be one of {DTYPES}")
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"Sm90BackwardVariant: head_dim={self.head_dim} must be one of {HEAD_DIMS}")
        if self.dropout or self.mods:
            raise ValueError("Sm90BackwardVariant: no dropout or built-in score-modifier form exists")
        if self.user_mod and self.varlen:
            raise ValueError("Sm90BackwardVariant: the traced score_mod / mask_mod forms take fixed shapes only")
        if self.block_sparse and not self.mask_c:
            raise ValueError("Sm90BackwardVariant: a block-sparse form has a traced mask_mod (mask_c)")

    def axes(self) -> tuple[str, ...]:
        return ("main", self.dtype, f"d{self.head_dim}")

    @property
    def name(self) -> str:
        return "_".join(self.axes()) + self._user_suffix() + ("_bs" if self.block_sparse else "")

    @property
    def stage(self) -> str:
        return "main"

    @property
    def block_m(self) -> int:
        return BLOCK_M

    @property
    def block_n(self) -> int:
        return BLOCK_N

    @property
    def head_dim_v_max(self) -> int:
        return self.head_dim

    @property
    def smem_bytes(self) -> int:
        """K, V, 2 stages of Q and dO (whole 64-column panels), 2 dS^T buffers (Bc x Br 16-bit), the
        dQ buffer (Br x D float32), 2 stages of lse and Dd, 1 KB for alignment (the kernel's layout
        comment; :func:`head_dim_budget`)."""
        return head_dim_budget(self.head_dim, self.head_dim)[1]

    def defines(self) -> tuple[tuple[str, str], ...]:
        return super().defines() + (("CUFLASH_BF16", "1" if self.dtype == "bf16" else "0"),
                                    ("CUFLASH_D", str(self.head_dim))) + self.user_defines()

    def describe(self) -> str:
        traced = ("; traced " + " and ".join(n for n, c in (("score_mod", self.score_c), ("mask_mod", self.mask_c)) if c)
                  + (" with captured-array gradients (atomics)" if self.agrad_c else "")
                  + (", walking the block mask's transposed index" if self.block_sparse else "")) if self.user_mod else ""
        return (f"{self.entry}: a producer warp (TMA, 2-stage Q/dO ring) and a dQ warp (bulk reduce-add into the "
                f"float32 workspace), 2 consumer warpgroups of 64 keys (wgmma; dK, dV in registers), Br={BLOCK_M}, "
                f"Bc={BLOCK_N}, {self.smem_bytes} B of shared memory{traced}")

    def plan_main(self, problem, views, lse, dd, acc, call, darrays=None) -> LaunchPlan:
        """The main stage's launch for :func:`cuflash.kernels.backward_run.backward`: ``views`` are
        its ``(q, k, v, out, dout, dq, dk, dv)`` in (B, H, S, D) order, ``lse`` and ``dd`` (B, Hq,
        Sq) float32 contiguous, ``acc`` the float32 dQ workspace ``(splits, B, Hq, Sq, D)`` (this
        kernel adds into split 0); ``darrays`` the captured arrays' gradient workspaces by slot
        (``return_dscore_mod``; the form with ``agrad_c`` adds into them)."""
        q, k, v, _, dout, _, dk, dv = views
        vl = problem.varlen
        packed = None if vl is None else (la.varlen_args(problem, call), vl.batch, vl.max_seqlen_q, vl.max_seqlen_k)
        traced = None
        if self.user_mod:
            grid = -(-k.shape[2] // BLOCK_N) * k.shape[1] * k.shape[0]   # (key tiles, Hk, B) blocks
            traced = (la.user_args(problem, call, 0)
                      + (la.block_sparse_args(problem, call, True, grid) if self.block_sparse else ())
                      + (la.array_grad_args(darrays or {}, call) if self.agrad_c else ()))
        # deterministic mode: the shared driver allocates one partial buffer per split of the
        # tensor-core tier's scheme; this kernel adds in order into the first, the rest stay zero
        return plan_main((q, k, v, dout, dk, dv), lse, dd, acc[:1], call, softmax_scale=problem.softmax_scale,
                         window_left=problem.window_left, window_right=problem.window_right, dtype=self.dtype,
                         deterministic=problem.options.deterministic, packed=packed,
                         traced=None if traced is None else (self, traced))


def all_variants(arch: int = 90) -> tuple[Sm90BackwardVariant, ...]:
    """Every variant (the compile gate's list); none below sm_90."""
    if arch != 90:
        return ()
    return tuple(Sm90BackwardVariant(dt, d) for dt in DTYPES for d in HEAD_DIMS)


def plan_main(arrays, lse, dd, acc, call, *, softmax_scale: float, window_left: int = -1, window_right: int = -1,
              dtype: str, deterministic: bool = False, packed: tuple | None = None,
              traced: tuple | None = None) -> LaunchPlan:
    """The main stage's launch for arrays in (B, H, S, D) order.

    Parameters
    ----------
    arrays : tuple ``(q, k, v, dout, dk, dv)``
        q, dout (B, Hq, Sq, D); k, v (B, Hk, Sk, D): float16 or bfloat16, any strides a tensor map
        can describe, Hq a multiple of Hk; dk, dv (B, Hk, Sk, D), q's dtype, written (dk times
        ``softmax_scale``).
    lse, dd : arrays (B, Hq, Sq) float32, C-contiguous
        The forward's natural-log LSE and ``rowsum(dO * O)``.
    acc : array (1, B, Hq, Sq, D) float32, C-contiguous
        The dQ workspace, added to (unscaled).
    call : DeviceCall
    softmax_scale, window_left, window_right : as the forward's (-1 unbounded; causal: right 0)
    dtype : {"f16", "bf16"}
    deterministic : bool
        Add dQ in key-tile order per (query head, query tile): the same bits on every run (a zeroed
        int32 counter array of ``B * Hq * ceil(Sq / 64)`` is allocated on ``call``; a packed batch:
        ``batch * Hq * ceil(max_seqlen_q / 64)``).
    packed : tuple ``(index_args, batch, max_seqlen_q, max_seqlen_k)``, optional
        A packed batch: ``arrays`` are then ``(1, H, total, D)`` views of the packed rows (B = 1, S
        the total), ``lse``, ``dd`` ``(1, Hq, total_q)`` and ``acc`` ``(1, 1, Hq, total_q, D)``;
        ``index_args`` the plan arguments ``cu_seqlens_q, cu_seqlens_k, seqused_k, varlen``
        (:func:`cuflash.kernels.launch_args.varlen_args`), then the sequences and the longest's
        query and key rows (the grid's extents). Q, dO, K and V go through ragged tensor maps, so a
        tile never reads another sequence's rows; dK and dV rows of keys past ``seqused_k`` are 0.
    traced : tuple ``(variant, args)``, optional
        A traced score_mod / mask_mod form (fixed shapes): its :class:`Sm90BackwardVariant` and its
        trailing arguments (:func:`cuflash.kernels.launch_args.user_args`, then the block mask's and
        the captured-array gradients' where the form has them).

    Raises
    ------
    ValueError
        For shapes or layouts the kernel cannot take, naming the arrays.
    """
    q, k, v, dout, dk, dv = arrays
    b, hq, sq, d = q.shape
    bk, hk, sk, dk_ = k.shape
    if (tuple(v.shape) != (b, hk, sk, d) or bk != b or dk_ != d or tuple(dout.shape) != (b, hq, sq, d)
            or tuple(dk.shape) != (b, hk, sk, d) or tuple(dv.shape) != (b, hk, sk, d) or hk == 0 or hq % hk):
        raise ValueError(f"attention_bwd_sm90: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, dout "
                         f"{tuple(dout.shape)}, dk {tuple(dk.shape)}, dv {tuple(dv.shape)} must be (B, Hq, Sq, D), "
                         "(B, Hk, Sk, D) x 3, (B, Hq, Sq, D) with Hq a multiple of Hk")
    for name, a, shape in (("lse", lse, (b, hq, sq)), ("dd", dd, (b, hq, sq)), ("acc", acc, (1, b, hq, sq, d))):
        if tuple(a.shape) != shape or np.dtype(a.dtype) != np.float32 or not a.flags.c_contiguous:
            raise ValueError(f"attention_bwd_sm90: {name} must be a C-contiguous float32 {shape}, got "
                             f"{tuple(a.shape)} {a.dtype}")
    if sq < 1 or sk < 1:
        raise ValueError(f"attention_bwd_sm90: Sq={sq} and Sk={sk} must be at least 1")
    if packed is not None and b != 1:
        raise ValueError(f"attention_bwd_sm90: a packed batch's arrays must be (1, H, total, D) views, got q {tuple(q.shape)}")
    variant = Sm90BackwardVariant(dtype, d, varlen=packed is not None) if traced is None else traced[0]
    bits = (lambda a: a.view(np.uint16)) if dtype == "bf16" else (lambda a: a)
    if packed is None:
        index_args = tuple(PointerArg.of(n, call.empty_index) for n in ("cu_seqlens_q", "cu_seqlens_k", "seqused_k"))
        index_args, batch, q_tiles, k_tiles = index_args + (la.i32("varlen", 0),), b, -(-sq // BLOCK_M), -(-sk // BLOCK_N)

        def tile_map(name, a, rows):
            return TensorMapArg.of(name, bits(a), (1, 1, rows, PANEL), swizzle=128)
    else:
        index_args, batch, max_q, max_k = packed
        q_tiles, k_tiles = -(-max_q // BLOCK_M), -(-max_k // BLOCK_N)

        def tile_map(name, a, rows):   # the (total, H, D) rows, ragged: a box never leaves its sequence
            rows_hd = bits(a)[0].transpose(1, 0, 2)
            return TensorMapArg(name, PointerArg.of(name, rows_hd), TensorMap.ragged(rows_hd, rows, PANEL, swizzle=128))
    dks, dvs = la.element_strides(dk)[:3], la.element_strides(dv)[:3]
    args = (tile_map("map_q", q, BLOCK_M), tile_map("map_k", k, BLOCK_N), tile_map("map_v", v, BLOCK_N),
            tile_map("map_do", dout, BLOCK_M),
            TensorMapArg.of("map_lse", lse.reshape(1, -1), (1, BLOCK_M)), TensorMapArg.of("map_dd", dd.reshape(1, -1), (1, BLOCK_M)),
            call.pointer("dq_accum", acc, writable=True),
            call.pointer("dk", dk, writable=True), call.pointer("dv", dv, writable=True),
            la.i64("dk_batch_stride", dks[0]), la.i64("dk_head_stride", dks[1]), la.i64("dk_row_stride", dks[2]),
            la.i64("dv_batch_stride", dvs[0]), la.i64("dv_head_stride", dvs[1]), la.i64("dv_row_stride", dvs[2]),
            la.i32("Sq", sq), la.i32("Sk", sk), la.i32("Hq", hq), la.i32("group", hq // hk),
            ScalarArg("softmax_scale", np.float32(softmax_scale)),
            la.i32("window_left", window_left), la.i32("window_right", window_right),
            call.pointer("dq_sem", call.xp.zeros((batch, hq, q_tiles), dtype=np.int32) if deterministic
                         else call.empty_index, writable=True),
            la.i32("deterministic", int(bool(deterministic))), la.i32("q_tiles", q_tiles), *index_args,
            *(traced[1] if traced is not None else ()))
    return LaunchPlan(variant, variant.entry, (k_tiles, hk, batch), (384, 1, 1), variant.smem_bytes, args)


def unsupported_reason(problem, arch: int, arrays=None) -> str | None:
    """Why the backward of ``problem`` cannot run on this tier (None if it can). ``arrays`` is
    ``(q, k, v, out, dout)``; each must be a view a TMA tensor map can describe. The arch rule
    (``sm_90a``: compute capability 9.0 only) is the dispatcher's (:data:`TARGET_ARCH`)."""
    p = problem
    why = attention_fwd_sm90.dtype_reason(p)
    if why is not None:
        return why
    why = traced_reason(p)
    if why is not None:
        return why
    if p.dropout is not None:
        return "dropout is not in the Hopper backward yet"
    if p.head_dim != p.head_dim_v or p.head_dim not in HEAD_DIMS:
        return head_dim_reason(p.head_dim, p.head_dim_v)
    vl = p.varlen
    if vl is not None:
        if vl.total_k == 0 or vl.total_q == 0:
            return "no key or no query row in the whole packed batch (a tensor map has no empty dimension)"
        if vl.batch > plan.MAX_GRID_DIMS[2]:
            return f"{vl.batch} packed sequences exceed the grid's {plan.MAX_GRID_DIMS[2]} (gridDim.z)"
    elif p.seqlen_k == 0 or p.seqlen_q == 0:
        return "an empty sequence (a tensor map has no empty dimension)"
    elif len(p.batch_shape) != 1 or (p.layout == "bhsd" and len(p.q.shape) != 4):
        return f"batch dims {p.batch_shape}: the Hopper backward's tensor maps take one batch dim"
    for a, name in zip(arrays or (), ("q", "k", "v", "out", "dout")):
        if a is None or name == "out":
            continue
        why = attention_fwd_sm90._tma_reason(a if vl is not None else attention_fwd_sm90._bhsd(a, p.layout), name)
        if why:
            return why
    return None


#: the modifiers this tier's traced forms take (the built-in ones are the tensor-core backward's)
USER_MODIFIERS = ("score_mod", "mask_mod", "block_mask")


def traced_reason(problem) -> str | None:
    """Why the traced score_mod / mask_mod / block_mask of ``problem`` cannot run on this tier's
    traced forms (None if they can, or if the call has none)."""
    p = problem
    m = p.modifiers
    if m is None:
        return None
    why = refuse_modifiers(p, "the Hopper backward", USER_MODIFIERS)
    if why is not None:
        return why
    for traced in (m.score_mod, m.mask_mod):
        why = score_mod.kernel_refusal(traced) if traced is not None else None
        if why is not None:
            return why + " in the Hopper backward"
    if p.varlen is not None:
        return "score_mod / mask_mod on a packed batch is not in the Hopper backward yet (fixed shapes only)"
    if p.options.return_dscore_mod and p.options.deterministic:
        # (each pair adds its share with a float32 atomicAdd, in an order that varies from run to run)
        return ("return_dscore_mod with deterministic=True is not in the Hopper backward: it adds the captured "
                "arrays' gradients with atomics, in an order that varies from run to run")
    bm = m.block_mask
    if bm is not None:
        q_block, kv_block = bm.BLOCK_SIZE
        if kv_block % BLOCK_N:
            return (f"block_mask with key blocks of {kv_block}: the Hopper backward's key tile is {BLOCK_N} keys, "
                    f"so it takes key blocks of a multiple of {BLOCK_N}")
        if p.options.deterministic:
            return ("block_mask with deterministic=True is not in the Hopper backward: its ordered dQ adds count "
                    "the key tiles of a causal / window band, which a block mask's key tiles need not be")
    return None


#: the registers a consumer thread may hold (``setmaxnreg``) and the shared memory of one block (H100, H200)
CONSUMER_REGISTERS = 240
SMEM_LIMIT = 227 * 1024


def head_dim_budget(d: int, dv: int) -> tuple[int, int]:
    """``(float32 registers a consumer thread, bytes of shared memory)`` that this kernel's design
    would take at head dims (D, Dv): dK and dV of its 64 keys ((D + Dv) / 2), S^T and dP^T of a
    64-row query tile (64) and its half of the dQ tile (a quarter of the panel-rounded D); K, V, two
    stages of Q and dO in 64-column panels, two dS^T buffers, the dQ buffer (64 x D float32), the
    stages' lse and Dd and 1 KB of alignment. Addresses, descriptors and loop state come on top."""
    dp, dvp = -(-d // PANEL) * PANEL, -(-dv // PANEL) * PANEL
    regs = (d + dv) // 2 + BLOCK_M + dp // 4
    smem = (1024 + BLOCK_N * (dp + dvp) * 2 + STAGES * BLOCK_M * (dp + dvp) * 2 + 2 * BLOCK_N * BLOCK_M * 2
            + BLOCK_M * d * 4 + 2 * STAGES * BLOCK_M * 4)
    return regs, smem


def head_dim_reason(d: int, dv: int) -> str:
    """Why head dims (D, Dv) are not on this tier: its registers or shared memory where they would
    not fit (:func:`head_dim_budget`), else the head dims it was built for."""
    regs, smem = head_dim_budget(d, dv)
    why = f"(D, Dv) = ({d}, {dv}): the Hopper backward takes D = Dv in {HEAD_DIMS} exactly"
    over = []
    if regs > CONSUMER_REGISTERS:
        over.append(f"a consumer thread would hold {regs} float32 accumulator registers (dK, dV of its 64 keys, "
                    f"S^T, dP^T, its dQ half; setmaxnreg gives {CONSUMER_REGISTERS})")
    if smem > SMEM_LIMIT:
        over.append(f"the tiles would take {smem} B of shared memory ({SMEM_LIMIT} B per block)")
    return why + ("; at these head dims " + " and ".join(over) if over else " so far")


def main_variant(problem, arch: int = 90) -> Sm90BackwardVariant:
    """The main stage that runs the backward of ``problem`` (:func:`cuflash.kernels.backward_run.backward`
    runs it between the portable dot and convert stages)."""
    m = problem.modifiers
    if m is None:
        return Sm90BackwardVariant(variants.dtype_key(problem.dtype), problem.head_dim)
    sc, mc, gc = score_mod.kernel_texts(m.score_mod, m.mask_mod, True)
    agrad = (score_mod.array_grad_c(m.score_mod)
             if problem.options.return_dscore_mod and m.score_mod is not None else ("", ""))
    return Sm90BackwardVariant(variants.dtype_key(problem.dtype), problem.head_dim, score_c=sc, mask_c=mc, grad_c=gc,
                               agrad_c=agrad[0], agrad_warp_c=agrad[1], block_sparse=m.block_mask is not None)


def variant_for(problem, arch: int = 90) -> Sm90BackwardVariant:
    """The variant that runs ``problem`` (the signature every tier shares)."""
    return main_variant(problem, arch)


def choose_variant(dtype, head_dim: int, head_dim_v: int, arch: int = 90) -> Sm90BackwardVariant:
    """The variant of a dtype and head dims (the signature every tier shares; D = Dv in
    :data:`HEAD_DIMS`, else ValueError)."""
    if head_dim != head_dim_v:
        raise ValueError(f"attention_bwd_sm90: D={head_dim} and Dv={head_dim_v} must be equal")
    return Sm90BackwardVariant(variants.dtype_key(dtype), head_dim)
