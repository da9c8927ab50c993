"""CuTe's own definitions of the Hopper layouts, from NVIDIA's CuTe DSL (the ``nvidia-cutlass-dsl``
package), as plain numbers: a second reader of the PTX ISA beside cuflash's simulator.

* :func:`smem_layout`: a shared-memory tile built as CuTe builds wgmma operands and TMA boxes, its
  GMMA layout atom (``warpgroup.make_smem_layout_atom``) tiled to the tile's shape
  (``cute.tile_to_shape``), as the byte address of every element. The atom's swizzle acts on byte
  addresses (CuTe puts it on the shared-memory pointer; the same ``S<B,4,3>`` for every element
  type, 16-byte chunks), the rest of the layout maps coordinates to element offsets.
* :func:`tv_layout`: which (row, column) of a wgmma m64nNk16 operand each thread's value i holds
  (``TiledMma.tv_layout_A`` / ``tv_layout_C``), for the accumulator and for A from registers.
* :func:`wgmma_descriptors`: the matrix descriptors CuTe itself emits for a list of GEMMs on such
  tiles: a small CuTe kernel is compiled for ``sm_90a`` (no GPU or driver is needed for that) and
  each ``wgmma.mma_async`` of its PTX is read back with its descriptors' constant parts, its shape
  and its transpose flags.

CuTe's layouts are evaluated by CuTe inside a traced function; the bulk of the numbers is then
computed here from the shapes and strides CuTe returns (``layout_offsets``), and
:func:`check_evaluator` holds that arithmetic to CuTe's own evaluation on sampled coordinates.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass

import numpy as np

# the default arch refuses warpgroup operations; the DSL's file cache would skip the PTX we read
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
os.environ.setdefault("CUTE_DSL_DISABLE_FILE_CACHING", "1")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import cutlass.utils.hopper_helpers as sm90_helpers  # noqa: E402
from cutlass.cute.nvgpu import OperandMajorMode, warp, warpgroup  # noqa: E402

VERSION = "4.8.1"   # the pinned nvidia-cutlass-dsl (setup.cfg's test extra)

_ATOMS = {("K", 0): "K_INTER", ("K", 32): "K_SW32", ("K", 64): "K_SW64", ("K", 128): "K_SW128",
          ("MN", 0): "MN_INTER", ("MN", 32): "MN_SW32", ("MN", 64): "MN_SW64", ("MN", 128): "MN_SW128"}


def _tile(major: str, swizzle: int, shape: tuple, order: tuple, dtype=cutlass.BFloat16):
    atom = warpgroup.make_smem_layout_atom(getattr(warpgroup.SmemLayoutAtomKind, _ATOMS[major, swizzle]), dtype)
    return cute.tile_to_shape(atom, shape, order)


def _static(x):
    """A CuTe IntTuple as nested Python tuples of int (the layouts here are all static)."""
    if isinstance(x, tuple):
        return tuple(_static(e) for e in x)
    return int(x)


def _flat(shape, stride):
    if isinstance(shape, tuple):
        out = []
        for s, d in zip(shape, stride):
            out += _flat(s, d)
        return out
    return [(shape, stride)]


def layout_offsets(shape, stride, coords: np.ndarray) -> np.ndarray:
    """A layout (shape, stride) evaluated at 1-d coordinates (one per top-level mode, each
    decomposed colexicographically over its sub-modes), as CuTe's ``layout(coord)`` does."""
    coords = np.asarray(coords, np.int64)
    modes = shape if isinstance(shape, tuple) else (shape,)
    strides = stride if isinstance(stride, tuple) else (stride,)
    out = np.zeros(coords.shape[:-1], np.int64)
    for m, (s, d) in enumerate(zip(modes, strides)):
        c = coords[..., m].copy()
        for ext, st in _flat(s, d):
            out += (c % ext) * st
            c //= ext
    return out


def swizzle_bytes(off: np.ndarray, bits: int, base: int, shift: int) -> np.ndarray:
    """CuTe's ``Swizzle<B, M, S>`` on (byte) offsets: the B bits from M + S up are XORed into the B
    bits from M up."""
    off = np.asarray(off, np.int64)
    mask = ((1 << bits) - 1) << (base + shift)
    return off ^ ((off & mask) >> shift)


@dataclass(frozen=True)
class SmemLayout:
    """A shared-memory tile as CuTe lays it out: ``outer`` maps (row, col) to a bf16 element
    offset, ``swizzle`` (B, M, S) then acts on the byte address."""
    shape: tuple
    outer_shape: tuple
    outer_stride: tuple
    swizzle: tuple

    def byte_address(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """Byte offset from a base aligned to the swizzle pattern (1024 bytes) of element (row, col)."""
        coords = np.stack(np.broadcast_arrays(rows, cols), axis=-1)
        return swizzle_bytes(2 * layout_offsets(self.outer_shape, self.outer_stride, coords), *self.swizzle)


@dataclass(frozen=True)
class TvLayout:
    """Thread/value layout of an m64nNk16 operand: ``(thread, value)`` -> the column-major index
    ``row + rows * col`` of the operand tile (CuTe's convention)."""
    shape: tuple
    stride: tuple
    rows: int

    def index(self, thread: np.ndarray, value: np.ndarray) -> np.ndarray:
        coords = np.stack(np.broadcast_arrays(thread, value), axis=-1)
        return layout_offsets(self.shape, self.stride, coords)


_ORACLE: dict = {}


def _swizzle_params(sw) -> tuple:
    m = re.fullmatch(r"S<(\d+),(\d+),(\d+)>", str(sw))
    if not m:
        raise ValueError(f"cute_oracle: unexpected swizzle {sw}")
    return tuple(int(g) for g in m.groups())


@cute.jit
def _trace(requests: cutlass.Constexpr):
    """Evaluate each request with CuTe; results into _ORACLE (Python values at trace time)."""
    for req in requests:
        if cutlass.const_expr(req[0] == "smem"):
            _, major, swz, shape, order = req
            lay = _tile(major, swz, shape, order)
            outer = cute.get_nonswizzle_portion(lay)
            sw = cute.get_swizzle_portion(lay)
            # CuTe's own evaluation at a few coordinates, for check_evaluator
            pts = [(r, c) for r in range(0, shape[0], max(1, shape[0] // 7))
                   for c in range(0, shape[1], max(1, shape[1] // 9))]
            pts.append((shape[0] - 1, shape[1] - 1))
            ident = cute.make_composed_layout(sw, 0, cute.make_layout(1 << 20))
            probes = [0, 16, 128, 144, 400, 1040, 4096 + 272, 65536 + 1008]
            # the same tile of bytes (twice as many 8-bit elements along the contiguous mode), whose
            # composed layout CuTe evaluates swizzle included: element offsets are byte offsets there
            bshape = (shape[0], 2 * shape[1]) if major == "K" else (2 * shape[0], shape[1])
            lay8 = _tile(major, swz, bshape, order, cutlass.Uint8)
            _ORACLE[req] = dict(shape=_static(outer.shape), stride=_static(outer.stride), swizzle=_swizzle_params(sw),
                                samples=[(p, int(outer(p))) for p in pts],
                                swizzle_samples=[(b, int(ident(b))) for b in probes],
                                byte_samples=[(p, int(lay8((p[0], 2 * p[1]) if major == "K" else (2 * p[0], p[1]))))
                                              for p in pts])
        elif cutlass.const_expr(req[0] == "copy"):
            _, kind, x, trans = req
            op = (warp.LdMatrix8x8x16bOp if kind == "ldmatrix" else warp.StMatrix8x8x16bOp)(trans, x)
            atom = cute.make_copy_atom(op, cutlass.BFloat16)
            res = {}
            for name, lay in (("src", atom.layout_src_tv), ("dst", atom.layout_dst_tv)):
                nvals = int(np.prod(_static(lay.shape)[1]))
                pts = [(t, v) for t in (0, 3, 9, 31) for v in range(nvals)]
                res[name] = dict(shape=_static(lay.shape), stride=_static(lay.stride),
                                 samples=[(p, int(lay(p))) for p in pts])
            _ORACLE[req] = res
        else:
            kind, n, a_regs = req
            el = cutlass.Float8E4M3FN if kind == "tv8" else cutlass.BFloat16   # ("tv8": wgmma k32 .e4m3)
            tm = sm90_helpers.make_trivial_tiled_mma(
                el, el, OperandMajorMode.K, OperandMajorMode.K, cutlass.Float32,
                (1, 1, 1), (64, n), a_source=warpgroup.OperandSource.RMEM if a_regs else warpgroup.OperandSource.SMEM)
            res = {}
            for name, lay in (("C", tm.tv_layout_C), ("A", tm.tv_layout_A)):
                nvals = int(np.prod(_static(lay.shape)[1]))
                pts = [(t, v) for t in (0, 1, 5, 31, 32, 77, 127)
                       for v in sorted({0, 1, 2, 3, 5, nvals // 2, nvals - 1})]
                res[name] = dict(shape=_static(lay.shape), stride=_static(lay.stride),
                                 samples=[(p, int(lay(p))) for p in pts])
            _ORACLE[req] = res


def evaluate(requests) -> dict:
    """CuTe's numbers for ``("smem", major, swizzle, shape, order)`` and ``("tv", n, a_regs)``
    requests (each evaluated once per process)."""
    todo = tuple(r for r in requests if r not in _ORACLE)
    if todo:
        _trace(todo)
    return {r: _ORACLE[r] for r in requests}


def smem_layout(major: str, swizzle: int, shape: tuple, order: tuple = (0, 1)) -> SmemLayout:
    """The tile ``shape`` (M/N rows, K columns) of bf16 built from CuTe's GMMA atom for ``major``
    ("K" or "MN") and ``swizzle`` (0, 32, 64, 128 bytes), tiled in ``order`` (``(0, 1)``: along the
    rows first, then K; ``(1, 0)``: along K first)."""
    key = ("smem", major, swizzle, tuple(shape), tuple(order))
    r = evaluate([key])[key]
    return SmemLayout(tuple(shape), r["shape"], r["stride"], r["swizzle"])


def tv_layout(n: int, operand: str) -> TvLayout:
    """CuTe's thread/value layout of wgmma m64nNk16's accumulator (``operand="C"``, 64 x n) or of A
    from registers (``"A"``, 64 x 16)."""
    key = ("tv", n, operand == "A")
    r = evaluate([key])[key][operand]
    return TvLayout(r["shape"], r["stride"], 64)


def tv_layout_e4m3(n: int, operand: str) -> TvLayout:
    """CuTe's thread/value layout of wgmma m64nNk32 .e4m3's accumulator (``"C"``, 64 x n) or of A
    from registers (``"A"``, 64 x 32, K-major: the only fp8 layout)."""
    key = ("tv8", n, operand == "A")
    r = evaluate([key])[key][operand]
    return TvLayout(r["shape"], r["stride"], 64)


def requests_so_far() -> list:
    """The requests evaluated so far in this process."""
    return list(_ORACLE)


def copy_layouts(kind: str, x: int, trans: bool) -> tuple:
    """CuTe's (source, destination) thread/value layouts of ``ldmatrix`` or ``stmatrix`` (``kind``)
    .m8n8.x{1,2,4}{.trans} on 16-bit elements: (thread, value) -> the index of the element in the
    8 x-matrix block (64 per matrix, row-major 8 x 8); for the shared-memory side each thread's 8
    values are the row it gives the address of."""
    key = ("copy", kind, x, bool(trans))
    r = evaluate([key])[key]
    return TvLayout(r["src"]["shape"], r["src"]["stride"], 0), TvLayout(r["dst"]["shape"], r["dst"]["stride"], 0)


def check_evaluator(requests) -> int:
    """Hold this module's arithmetic (layout_offsets, swizzle_bytes) to CuTe's own evaluation on
    the sampled coordinates of each request; returns the number of points compared. A 16-bit
    tile's byte addresses are also held to CuTe's 8-bit tile of the same atom kind (element
    offsets there are byte offsets, swizzle included): CuTe's swizzle acts on bytes."""
    count = 0
    for req, r in evaluate(requests).items():
        parts = {"smem": lambda: [r], "copy": lambda: [r["src"], r["dst"]], "tv": lambda: [r["C"], r["A"]],
                 "tv8": lambda: [r["C"], r["A"]]}[req[0]]()
        for part in parts:
            for coord, want in part["samples"]:
                got = int(layout_offsets(part["shape"], part["stride"], np.array([coord]))[0])
                assert got == want, f"cute_oracle: {req} at {coord}: CuTe {want}, evaluated here {got}"
                count += 1
        if req[0] == "smem":
            lay = SmemLayout(req[3], r["shape"], r["stride"], r["swizzle"])
            for (row, col), want in r["byte_samples"]:
                got = int(lay.byte_address(np.array(row), np.array(col)))
                assert got == want, (f"cute_oracle: {req} at ({row}, {col}): byte {got} here, CuTe's 8-bit tile of the "
                                     f"same bytes has {want}")
                count += 1
            for b, want in r["swizzle_samples"]:
                got = int(swizzle_bytes(np.array([b]), *r["swizzle"])[0])
                assert got == want, f"cute_oracle: swizzle {r['swizzle']} at {b}: CuTe {want}, here {got}"
                count += 1
    return count


# ----------------------------------------------------------------------------------- descriptors
@dataclass(frozen=True)
class Gemm:
    """One GEMM of the traced kernel, 64 x ``n`` x ``k``: A is rows ``m0``.. and columns 0..k of an
    ``a_shape`` tile at byte ``a_off`` of shared memory (or registers when ``a_regs``), B rows
    0..n and columns 0..k of a ``b_shape`` tile (N/M rows, K columns) at ``b_off``; k / 16
    wgmma.mma_async m64nNk16 in a row."""
    n: int
    k: int
    a_major: str
    a_swizzle: int
    a_shape: tuple
    a_order: tuple
    m0: int
    a_off: int
    b_major: str
    b_swizzle: int
    b_shape: tuple
    b_order: tuple
    b_off: int
    a_regs: bool = False
    k_steps: int = 0   # wgmma issued: the first k_steps of the k / 16 (0: all)

    @property
    def steps(self) -> int:
        return self.k_steps or self.k // 16


@dataclass(frozen=True)
class Wgmma:
    """One wgmma.mma_async of CuTe's PTX: N, A's and B's 64-bit descriptors as if the dynamic shared
    memory began at address 0 (``desc_a`` None with A from registers), the transpose flags."""
    n: int
    desc_a: int | None
    desc_b: int
    trans_a: int
    trans_b: int


@cute.kernel
def _gemm_kernel(gemms: cutlass.Constexpr, out: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    base = cute.arch.get_dyn_smem(cutlass.BFloat16, alignment=1024)
    total = cutlass.Float32(0.0)
    for g in gemms:
        n, k = g.n, g.k
        tm = sm90_helpers.make_trivial_tiled_mma(
            cutlass.BFloat16, cutlass.BFloat16, OperandMajorMode.K if g.a_major == "K" else OperandMajorMode.MN,
            OperandMajorMode.K if g.b_major == "K" else OperandMajorMode.MN, cutlass.Float32, (1, 1, 1), (64, n),
            a_source=warpgroup.OperandSource.RMEM if g.a_regs else warpgroup.OperandSource.SMEM)
        thr = tm.get_slice(tidx)
        lb = _tile(g.b_major, g.b_swizzle, g.b_shape, g.b_order)
        s_b = cute.make_tensor(cute.recast_ptr(base + g.b_off // 2, swizzle_=lb.inner), lb.outer)
        frag_b = tm.make_fragment_B(thr.partition_B(cute.local_tile(s_b, (n, k), (0, 0))))
        acc = tm.make_fragment_C(thr.partition_shape_C((64, n)))
        acc.fill(0.0)
        if cutlass.const_expr(g.a_regs):
            frag_a = tm.make_fragment_A(thr.partition_shape_A((64, k)))
            frag_a.fill(1.0)
        else:
            la = _tile(g.a_major, g.a_swizzle, g.a_shape, g.a_order)
            s_a = cute.make_tensor(cute.recast_ptr(base + g.a_off // 2, swizzle_=la.inner), la.outer)
            frag_a = tm.make_fragment_A(thr.partition_A(cute.local_tile(s_a, (64, k), (g.m0 // 64, 0))))
        warpgroup.fence()
        for kb in cutlass.range_constexpr(g.steps):
            cute.gemm(tm, acc, frag_a[None, None, kb], frag_b[None, None, kb], acc)
        warpgroup.commit_group()
        warpgroup.wait_group(0)
        total = total + acc[0]
    out[tidx] = total


@cute.jit
def _gemm_host(gemms: cutlass.Constexpr, out: cute.Tensor):
    _gemm_kernel(gemms, out).launch(grid=[1, 1, 1], block=[128, 1, 1], smem=1024)


def compile_ptx(gemms: tuple) -> str:
    """The PTX CuTe compiles for ``gemms`` (a tuple of :class:`Gemm`) on sm_90a."""
    from cutlass.cute.runtime import from_dlpack

    out = np.zeros(128, np.float32)
    with tempfile.TemporaryDirectory() as d:
        compiled = cute.compile(_gemm_host, tuple(gemms), from_dlpack(out), options=f"--keep-ptx --dump-dir={d}")
        ptx = compiled.__ptx__
        if not ptx.lstrip().startswith("//") and os.path.exists(ptx):
            with open(ptx) as f:
                ptx = f.read()
    if "wgmma.mma_async" not in ptx:
        raise RuntimeError("cute_oracle: CuTe's PTX has no wgmma.mma_async (was it served from a cache?)")
    return ptx


_WGMMA = re.compile(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.f32\.bf16\.bf16\s*\{[^}]*\},\s*"
                    r"(\{[^}]*\}|%rd\d+),\s*(%rd\d+),\s*p,\s*([-\d,\s]+);")


def parse_wgmmas(ptx: str) -> list[Wgmma]:
    """Every wgmma.mma_async of ``ptx`` in program order, its descriptors evaluated symbolically from
    the dynamic shared memory's address (taken as 0): ``mov`` of the shared base, ``add`` of
    constants, the ``>> 4`` and 14-bit mask of the start field, and ``or`` / ``add`` of the
    descriptor constants. Anything else feeding a descriptor raises ValueError."""
    val: dict[str, tuple[str, int]] = {}
    out = []
    for raw in ptx.splitlines():
        line = raw.strip().rstrip(";")
        m = _WGMMA.search(raw)
        if m:
            n, a, b = int(m.group(1)), m.group(2), m.group(3)
            imm = [int(x) for x in m.group(4).replace(" ", "").split(",")]

            def desc(reg):
                kind, v = val.get(reg, ("?", 0))
                if kind != "desc":
                    raise ValueError(f"cute_oracle: descriptor {reg} is not a recognised expression ({kind})")
                return v

            if a.startswith("{"):   # A from registers: scale-a, scale-b, tnsp-b
                out.append(Wgmma(n, None, desc(b), 0, imm[2]))
            else:                   # scale-a, scale-b, tnsp-a, tnsp-b
                out.append(Wgmma(n, desc(a), desc(b), imm[2], imm[3]))
            continue
        parts = re.split(r"[\s,]+", line)
        if len(parts) < 3 or not parts[1].startswith("%"):
            continue
        op, dst, srcs = parts[0], parts[1], parts[2:]

        def get(s):
            return val.get(s, ("?", 0))

        if op.startswith("mov") and srcs[0] == "__dynamic_shmem__0":
            val[dst] = ("smem", 0)
        elif op.startswith("mov") and srcs[0].startswith("%"):
            val[dst] = get(srcs[0])
        elif op.startswith("shfl.sync.idx") and get(srcs[0])[0] == "smem":
            val[dst] = get(srcs[0])
        elif op == "add.s32" and get(srcs[0])[0] == "smem" and re.fullmatch(r"-?\d+", srcs[1]):
            val[dst] = ("smem", get(srcs[0])[1] + int(srcs[1]))
        elif op == "shr.u32" and get(srcs[0])[0] == "smem" and srcs[1] == "4":
            val[dst] = ("start", get(srcs[0])[1] >> 4)
        elif op == "and.b32" and get(srcs[0])[0] == "start":
            v = get(srcs[0])[1]
            val[dst] = ("start", v & int(srcs[1]))
            if v & int(srcs[1]) != v & 0x3FFF:
                raise ValueError(f"cute_oracle: mask {srcs[1]} drops bits of the start field {v}")
        elif op == "cvt.u64.u32" and get(srcs[0])[0] == "start":
            val[dst] = ("desc", get(srcs[0])[1])
        elif op in ("or.b64", "add.s64") and get(srcs[0])[0] == "desc" and re.fullmatch(r"-?\d+", srcs[1]):
            v, c = get(srcs[0])[1], int(srcs[1]) % 2**64   # (PTX prints the swizzle's top bit as a negative immediate)
            val[dst] = ("desc", (v | c) if op == "or.b64" else (v + c) & (2**64 - 1))
            if op == "or.b64" and v & c:
                raise ValueError("cute_oracle: or of overlapping descriptor bits")
        else:
            val.pop(dst, None)
    return out


def wgmma_descriptors(gemms: tuple) -> list[Wgmma]:
    """CuTe's wgmma.mma_async for ``gemms``, in order: ``steps`` per GEMM."""
    got = parse_wgmmas(compile_ptx(gemms))
    want = sum(g.steps for g in gemms)
    if len(got) != want:
        raise ValueError(f"cute_oracle: {len(got)} wgmma.mma_async in CuTe's PTX, expected {want}")
    return got


def decode(desc: int) -> dict:
    """A descriptor's fields (PTX ISA "Matrix Descriptor Format"), in bytes."""
    return dict(start=(desc & 0x3FFF) << 4, lbo=((desc >> 16) & 0x3FFF) << 4, sbo=((desc >> 32) & 0x3FFF) << 4,
                base_offset=(desc >> 49) & 7, swizzle={0: 0, 1: 128, 2: 64, 3: 32}[desc >> 62])
