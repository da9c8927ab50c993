"""The simulator's Hopper layouts against CuTe's own (NVIDIA's CuTe DSL, ``nvidia-cutlass-dsl``):
a second reader of the PTX ISA, independent of cuflash/sim/cusim_sm90.h and of the kernels.

CuTe lays out each shared-memory tile (tests/support/cute_oracle.py), compiles a kernel of wgmma
on those tiles for sm_90a (no GPU needed) and emits the matrix descriptors it pairs with them. The
simulator then runs wgmma with CuTe's descriptors on shared memory filled as CuTe lays it out, and
each element it reads must be the one CuTe puts at that address; its accumulator registers must be
CuTe's accumulator fragment, the registers it takes A from CuTe's register-A fragment, and each TMA
box it lands in shared memory CuTe's tile. The Hopper kernels' own descriptors (the forward's
desc_k_major / desc_n_major / k_step_offset, hopper_probe's desc_kmajor / desc_nmajor) must equal
CuTe's bit for bit, so what the simulator is checked on here is what the kernels issue.

Element reads are told apart by codes: a tile holds code(row, col) = row * cols + col, in two
launches (code % 256, then code // 256: exact in bf16), and the other operand is one-hot, so that
the accumulator is the code itself.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from support.simtools import P, i32

from cuflash import sim
from cuflash.kernels import attention_fwd_sm90 as fwd
from cuflash.runtime import source
from cuflash.runtime.plan import LaunchPlan, PointerArg, TensorMapArg
from cuflash.sim import launcher

# one worker imports CuTe, compiles its kernels and, once, hopper_layouts.cu (shared with
# test_sim_hopper_layouts.py)
pytestmark = pytest.mark.xdist_group("hopper_layouts")

KERNELS = Path(__file__).parent / "kernels"
BF16 = ml_dtypes.bfloat16
BR, PANEL = fwd.BLOCK_M, fwd.PANEL


@pytest.fixture(scope="module")
def co():
    from support import cute_oracle
    return cute_oracle


@pytest.fixture(scope="module")
def probes():
    text = source.build_text((KERNELS / "hopper_layouts.cu").read_text(), origin="hopper_layouts.cu",
                             search_dirs=[KERNELS])
    with sim.options(arch=90) as o:
        return launcher.load_source(text, origin="hopper_layouts.cu", options=o), o


# ------------------------------------------------------------------------------------ helpers
def _grid(shape):
    return np.meshgrid(np.arange(shape[0]), np.arange(shape[1]), indexing="ij")


def _image(parts, nbytes: int) -> np.ndarray:
    """Shared memory as CuTe lays it out: parts of (byte offset, SmemLayout, values (rows x cols))."""
    img = np.zeros(nbytes // 2, np.uint16)
    seen = np.zeros(nbytes // 2, bool)
    for off, lay, vals in parts:
        r, c = _grid(lay.shape)
        addr = off + lay.byte_address(r, c)
        assert (addr % 2 == 0).all() and addr.max() < nbytes
        assert not seen[addr // 2].any() and np.unique(addr).size == addr.size, "CuTe's tiles overlap"
        seen[addr // 2] = True
        img[addr // 2] = np.asarray(vals, np.float32).astype(BF16).view(np.uint16)
    return img.view(np.uint8)


def _bits(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(BF16).view(np.uint16).astype(np.uint32)


def _a_registers(co, a_vals: np.ndarray) -> np.ndarray:
    """Each thread's four A registers of a 64 x 16 A from registers, by CuTe's register-A fragment:
    value v in register v // 2, the even value in the low half (CuTe packs the bf16 fragment into
    32-bit registers, the lower-indexed value low)."""
    tv = co.tv_layout(16, "A")
    t, v = np.meshgrid(np.arange(128), np.arange(8), indexing="ij")
    idx = tv.index(t, v)
    m, k = idx % 64, idx // 64
    assert np.unique(idx).size == 64 * 16
    half = _bits(a_vals[m, k]) << (16 * (v % 2)).astype(np.uint32)
    regs = np.zeros((128, 4), np.uint32)
    for j in range(8):
        regs[:, j // 2] |= half[:, j]
    return regs


def _run(co, probes, img: np.ndarray, ops, a_regs=None) -> list[np.ndarray]:
    """Run ops (co.Wgmma) on the simulator, each on a zeroed accumulator; their 64 x N results
    read out of the registers by CuTe's accumulator fragment."""
    mod, o = probes
    results = [None] * len(ops)
    for n in sorted({op.n for op in ops}):
        idx = [i for i, op in enumerate(ops) if op.n == n]
        flags = np.array([(ops[i].trans_b & 1) | (2 if ops[i].desc_a is None else 0) | (4 * ops[i].trans_a)
                          for i in idx], np.int32)
        da = np.array([ops[i].desc_a or 0 for i in idx], np.uint64)
        db = np.array([ops[i].desc_b for i in idx], np.uint64)
        regs = np.zeros((len(idx), 128, 4), np.uint32) if a_regs is None else np.stack([a_regs] * len(idx))
        out = np.full(len(idx) * 128 * n // 2, np.nan, np.float32)
        args = (PointerArg.of("img", img), i32(img.size), PointerArg.of("desc_a", da), PointerArg.of("desc_b", db),
                PointerArg.of("a_regs", regs.ravel()), PointerArg.of("flags", flags), i32(len(idx)), P(out))
        mod.launch(LaunchPlan(None, f"wgmma_each_n{n}", 1, 128, img.size + 1024, args), o)
        tv = co.tv_layout(n, "C")
        t, v = np.meshgrid(np.arange(128), np.arange(n // 2), indexing="ij")
        flat = tv.index(t, v)
        assert np.unique(flat).size == 64 * n
        for j, i in enumerate(idx):
            d = np.full((64, n), np.nan, np.float32)
            d[flat % 64, flat // 64] = out.reshape(len(idx), 128, n // 2)[j]
            results[i] = d
    return results


def _code(shape):
    r, c = _grid(shape)
    return r * shape[1] + c


def _check_reads(co, probes, tiles: dict, gemms, ops):
    """Every element each op reads is the one CuTe puts there. ``tiles`` names each operand tile:
    {name: (byte offset, SmemLayout)}; ``gemms`` is a list of (description, (A tile, B tile, m0,
    k)) (A None: from registers), whose k / 16 steps are ``ops`` in order."""
    nbytes = max(off + int(lay.byte_address(*_grid(lay.shape)).max()) + 2 for off, lay in tiles.values())
    nbytes = -(-nbytes // 16) * 16
    steps = []   # per op: (description, A tile, B tile, m0, k step)
    for g, (a_name, b_name, m0, k) in gemms:
        steps += [(g, a_name, b_name, m0, kb) for kb in range(k // 16)]
    assert len(steps) == len(ops)

    def onehot(shape, modulo_rows):
        r, c = _grid(shape)
        return ((r % modulo_rows) == (c % 16)).astype(np.float32)

    for role in ("A", "B"):
        got = []
        for part in (0, 1):
            parts = []
            for name, (off, lay) in tiles.items():
                reading = any((a if role == "A" else b) == name for _, a, b, _, _ in steps)
                code = _code(lay.shape)
                if reading:
                    vals = code % 256 if part == 0 else code // 256
                else:   # the other operand one-hot: A[m][k] = [m % 64 == k % 16], B[n][k] = [n == k % 16]
                    vals = onehot(lay.shape, 64 if role == "B" else 1 << 30)
                parts.append((off, lay, vals))
            regs = _a_registers(co, onehot((64, 16), 64)) if role == "B" else None
            got.append(_run(co, probes, _image(parts, nbytes), ops, regs))
        for i, (g, a, b, m0, kb) in enumerate(steps):
            if role == "A" and a is None:
                continue   # A from registers: test_register_a_fragment
            d = got[0][i] + 256.0 * got[1][i]
            name = a if role == "A" else b
            cols = tiles[name][1].shape[1]
            if role == "A":   # D[m][j] = A[m0 + m][16 kb + j] for j < 16 (B one-hot)
                m, j = _grid((64, 16))
                want = (m0 + m) * cols + 16 * kb + j
                read = d[:, :16]
                rest = d[:, 16:]
            else:             # D[j][n] = B[n][16 kb + j] for j < 16 (A one-hot)
                j, n = _grid((16, ops[i].n))
                want = n * cols + 16 * kb + j
                read = d[:16]
                rest = d[16:]
            bad = np.argwhere(read != want)
            assert bad.size == 0, (f"{role} of wgmma {i} ({g}, k step {kb}): at {bad[0].tolist()} the simulator "
                                   f"read code {read[tuple(bad[0])]}, CuTe puts code {want[tuple(bad[0])]} there "
                                   f"({len(bad)} elements differ)")
            assert (rest == 0).all()


def _desc(start: int, lbo: int, sbo: int, swizzle: int) -> int:
    """ptx_wgmma_desc (kernels_cu/ptx.cuh)."""
    mode = {0: 0, 128: 1, 64: 2, 32: 3}[swizzle]
    return ((start & 0x3FFFF) >> 4) | (((lbo & 0x3FFFF) >> 4) << 16) | (((sbo & 0x3FFFF) >> 4) << 32) | (mode << 62)


# ------------------------------------------------------------------------------------ the forward
def _forward_case(co, d: int, bc: int):
    """CuTe's version of the forward's shared memory for head dim bucket d and Bc keys: Q (128 rows,
    64-column panels), one stage of K (Bc rows) and of V (Bc keys, N-major panels of 64 columns),
    128-byte swizzle; S = Q K^T for each consumer's 64 rows, O = P V (P from registers) for every
    Dv <= d.

    A head dim that is not a whole number of panels (96) is read as the first d / 16 k steps of the
    padded tile (S), or as the first Dv columns of CuTe's descriptors for the padded width (O = P V):
    CuTe's layout algebra cannot cut 96 columns out of two 64-column swizzle panels (its own choice
    for 96 would be a 64-byte swizzle), and wgmma's N only bounds how far along N it reads."""
    npanel = -(-d // PANEL)
    q0, k0 = 0, 0 + npanel * BR * 128
    v0 = k0 + npanel * bc * 128
    G = co.Gemm
    gemms, names = [], []
    for c in (0, 1):
        gemms.append(G(bc, npanel * PANEL, "K", 128, (BR, npanel * PANEL), (0, 1), 64 * c, q0, "K", 128,
                       (bc, npanel * PANEL), (0, 1), k0, k_steps=d // 16))
        names.append((f"S = Q K^T, consumer {c}", ("Q", "K", 64 * c, d)))
    dvs = [dv for dv in fwd.HEAD_DIM_BUCKETS if dv <= d]
    for dv in dvs:
        gemms.append(G(-(-dv // PANEL) * PANEL, bc, "K", 128, (64, bc), (0, 1), 0, 0, "MN", 128,
                       (npanel * PANEL, bc), (1, 0), v0, a_regs=True))
        names.append((f"O = P V, Dv {dv}", (None, "V", 0, bc)))
    ops = co.wgmma_descriptors(tuple(gemms))
    n_of = [g.n for g in gemms for _ in range(g.steps)]
    assert [op.n for op in ops] == n_of
    dv_of = [bc] * (2 * (d // 16)) + [dv for dv in dvs for _ in range(bc // 16)]
    ops = [dataclasses.replace(op, n=n) for op, n in zip(ops, dv_of)]
    tiles = {"Q": (q0, co.smem_layout("K", 128, (BR, npanel * PANEL), (0, 1))),
             "K": (k0, co.smem_layout("K", 128, (bc, npanel * PANEL), (0, 1))),
             "V": (v0, co.smem_layout("MN", 128, (npanel * PANEL, bc), (1, 0)))}

    # the forward's descriptors (attention_fwd_sm90.cu): desc_k_major = (tile, 16, 1024, 128),
    # desc_n_major = (tile, PANEL_KV, 1024, 128), k step kk at k_step_offset(kk, rows), V's 16 keys
    # a step at 16 * 128 bytes
    def k_step_offset(kk, rows):
        return (kk * 16) // PANEL * rows * 128 + (kk * 16) % PANEL * 2

    want = []
    for c in (0, 1):
        for kk in range(d // 16):
            want.append((_desc(q0 + 64 * c * 128 + k_step_offset(kk, BR), 16, 1024, 128),
                         _desc(k0 + k_step_offset(kk, bc), 16, 1024, 128), 0, 0))
    for dv in dvs:
        for kb in range(bc // 16):
            want.append((None, _desc(v0 + kb * 16 * 128, bc * 128, 1024, 128), 0, 1))
    return gemms, names, ops, tiles, want


FORWARD_TILES = sorted({(d, fwd.BLOCK_N[d]) for d in fwd.HEAD_DIM_BUCKETS} |
                       {(d, bc) for (d, _), bc in fwd.BLOCK_N_MODS.items()})
DEFAULT_FORWARD = (128, 128)


@pytest.mark.parametrize("d,bc", [pytest.param(*t, marks=() if t == DEFAULT_FORWARD else pytest.mark.slow)
                                  for t in FORWARD_TILES], ids=[f"d{d}-bc{bc}" for d, bc in FORWARD_TILES])
def test_forward_descriptors_are_cutes_and_the_simulator_reads_cutes_layout(co, probes, d, bc):
    gemms, names, ops, tiles, want = _forward_case(co, d, bc)
    for i, (op, w) in enumerate(zip(ops, want)):
        # (with Dv = 64, V has one swizzle panel along N: CuTe leaves the leading byte offset 0)
        g = (op.desc_a, _unused_lbo(op.desc_b, op.desc_a is not None, 128, -(-op.n // PANEL)), op.trans_a, op.trans_b)
        w = (w[0], _unused_lbo(w[1], w[0] is not None, 128, -(-op.n // PANEL)), *w[2:])
        assert g == w, (f"wgmma {i}: CuTe emits A {g[0] and co.decode(g[0])}, B {co.decode(g[1])}, trans {g[2:]}; "
                        f"the forward builds A {w[0] and co.decode(w[0])}, B {co.decode(w[1])}, trans {w[2:]}")
    _check_reads(co, probes, tiles, names, ops)


# ------------------------------------------------------------------------------------ the backward
def _backward_cases(co, d: int):
    """CuTe's version of the Hopper backward's operands (kernels_cu/attention_bwd_sm90.cu) at head
    dim d, in three groups, each a set of tiles that do not overlap (the kernel reads Q, dO and K
    both K-major and MN-major): (1) S^T = K Q^T and dP^T = V dO^T of each consumer's 64 keys,
    K-major, over d columns of 64-column panels; (2) dV += P^T dO and dK += dS^T Q, A from
    registers, dO and Q MN-major B of N = d; (3) dQ = dS K, dS an M-major A (the [key][query]
    dS^T buffer), K an MN-major B, each consumer's DQN columns. Returns a list of (gemms, names,
    ops, tiles, want) with ``want`` the kernel's descriptors (its desc_k_major / desc_mn_major /
    k_step_offset). Consumer 1's dQ window at d = 64 starts 64 bytes into a swizzle row, which
    CuTe's tile algebra cannot cut; only consumer 0's is checked there."""
    from cuflash.kernels import attention_bwd_sm90 as bwd

    G = co.Gemm
    bm, bc, dp = bwd.BLOCK_M, bwd.BLOCK_N, -(-d // PANEL) * PANEL
    q0 = 0
    do0 = q0 + bm * dp * 2
    k0 = do0 + bm * dp * 2
    v0 = k0 + bc * dp * 2

    def k_step_offset(kk, rows):
        return (kk * 16) // PANEL * rows * 128 + (kk * 16) % PANEL * 2

    cases = []
    # (1) S^T, dP^T
    gemms, names, want = [], [], []
    for a_name, a0, b_name, b0 in (("K", k0, "Q", q0), ("V", v0, "dO", do0)):
        for c in (0, 1):
            gemms.append(G(bm, dp, "K", 128, (bc, dp), (0, 1), 64 * c, a0, "K", 128, (bm, dp), (0, 1), b0,
                           k_steps=d // 16))
            names.append((f"{a_name} {b_name}^T, consumer {c}", (a_name, b_name, 64 * c, d)))
            want += [(_desc(a0 + 64 * c * 128 + k_step_offset(kk, bc), 16, 1024, 128),
                      _desc(b0 + k_step_offset(kk, bm), 16, 1024, 128), 0, 0) for kk in range(d // 16)]
    tiles = {"Q": (q0, co.smem_layout("K", 128, (bm, dp), (0, 1))), "dO": (do0, co.smem_layout("K", 128, (bm, dp), (0, 1))),
             "K": (k0, co.smem_layout("K", 128, (bc, dp), (0, 1))), "V": (v0, co.smem_layout("K", 128, (bc, dp), (0, 1)))}
    cases.append((gemms, names, [bm] * len(want), tiles, want))
    # (2) dV, dK: N = d (CuTe builds N = dp; the simulator runs N = d, which bounds how far it reads)
    gemms, names, want = [], [], []
    for b_name, b0 in (("dO", do0), ("Q", q0)):
        gemms.append(G(dp, bm, "K", 128, (64, bm), (0, 1), 0, 0, "MN", 128, (dp, bm), (1, 0), b0, a_regs=True))
        names.append((f"{'dV' if b_name == 'dO' else 'dK'} += A {b_name}", (None, b_name, 0, bm)))
        want += [(None, _desc(b0 + kb * 16 * 128, bm * 128, 1024, 128), 0, 1) for kb in range(bm // 16)]
    tiles = {"Q": (q0, co.smem_layout("MN", 128, (dp, bm), (1, 0))), "dO": (do0, co.smem_layout("MN", 128, (dp, bm), (1, 0)))}
    cases.append((gemms, names, [d] * len(want), tiles, want))
    # (3) dQ = dS K: dS^T buffer after K (its own offset), K's column windows as tiles of their own
    dqn = dp // 2
    ds0 = v0 + bc * dp * 2
    gemms, names, want, tiles = [], [], [], {"dS": (ds0, co.smem_layout("MN", 128, (bm, bc), (1, 0)))}
    for c in (0, 1) if dqn % PANEL == 0 else (0,):
        w0 = k0 + (c * dqn) // PANEL * bc * 128
        tiles[f"K{c}"] = (w0, co.smem_layout("MN", 128, (max(dqn, PANEL), bc), (1, 0)))
        gemms.append(G(dqn, bc, "MN", 128, (bm, bc), (1, 0), 0, ds0, "MN", 128, (max(dqn, PANEL), bc), (1, 0), w0))
        names.append((f"dQ = dS K, consumer {c}", ("dS", f"K{c}", 0, bc)))
        want += [(_desc(ds0 + kb * 16 * 128, bc * bm * 2, 1024, 128), _desc(w0 + kb * 16 * 128, bc * 128, 1024, 128),
                  1, 1) for kb in range(bc // 16)]
    cases.append((gemms, names, [dqn] * len(want), tiles, want))
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("d", [64, 96, 128])
def test_backward_descriptors_are_cutes_and_the_simulator_reads_cutes_layout(co, probes, d):
    for gemms, names, n_run, tiles, want in _backward_cases(co, d):
        ops = co.wgmma_descriptors(tuple(gemms))
        of_op = [g for g in gemms for _ in range(g.steps)]
        assert len(ops) == len(want) == len(of_op)
        for i, (op, w) in enumerate(zip(ops, want)):
            ga, gb = of_op[i].a_major, of_op[i].b_major
            panels_b = -(-op.n // PANEL)
            g = (op.desc_a if op.desc_a is None else _unused_lbo(op.desc_a, ga == "K", 128, 1),
                 _unused_lbo(op.desc_b, gb == "K", 128, panels_b), op.trans_a, op.trans_b)
            w = (w[0] if w[0] is None else _unused_lbo(w[0], ga == "K", 128, 1),
                 _unused_lbo(w[1], gb == "K", 128, panels_b), *w[2:])
            assert g == w, (f"{names[0][0]}.., wgmma {i}: CuTe emits A {g[0] and co.decode(g[0])}, B {co.decode(g[1])}, "
                            f"trans {g[2:]}; the backward builds A {w[0] and co.decode(w[0])}, B {co.decode(w[1])}, "
                            f"trans {w[2:]}")
        _check_reads(co, probes, tiles, names, [dataclasses.replace(op, n=n) for op, n in zip(ops, n_run)])


# ------------------------------------------------------------------ every swizzle, both majors
SWIZZLES = (0, 32, 64, 128)
PROBE_K = 64   # hopper_probe's K (a multiple of 64), its N (BN) = 64


def _generic_case(co):
    """hopper_probe.cu's operands at each swizzle (A K-major 64 x K in panels of the swizzle span
    along K; B K-major 64 x K alike, or N-major K x 64 in panels along N) and an M-major A (as a
    transposed P^T or dS^T would be), laid out and described by CuTe."""
    G = co.Gemm
    gemms, names, tiles, want = [], [], {}, []
    off = 0

    def tile(name, major, sw, shape, order):
        nonlocal off
        tiles[name] = (off, co.smem_layout(major, sw, shape, order))
        off += shape[0] * shape[1] * 2
        return tiles[name][0]

    for sw in SWIZZLES:
        w = sw // 2 if sw else 8
        a = tile(f"A{sw}", "K", sw, (64, PROBE_K), (0, 1))
        bk = tile(f"Bk{sw}", "K", sw, (64, PROBE_K), (0, 1))
        bn = tile(f"Bn{sw}", "MN", sw, (64, PROBE_K), (1, 0))
        am = tile(f"Am{sw}", "MN", sw, (64, PROBE_K), (1, 0))
        gemms += [G(64, PROBE_K, "K", sw, (64, PROBE_K), (0, 1), 0, a, "K", sw, (64, PROBE_K), (0, 1), bk),
                  G(64, PROBE_K, "K", sw, (64, PROBE_K), (0, 1), 0, a, "MN", sw, (64, PROBE_K), (1, 0), bn),
                  G(64, PROBE_K, "MN", sw, (64, PROBE_K), (1, 0), 0, am, "MN", sw, (64, PROBE_K), (1, 0), bn)]
        names += [(f"sw{sw} A K-major, B K-major", (f"A{sw}", f"Bk{sw}", 0, PROBE_K)),
                  (f"sw{sw} A K-major, B N-major", (f"A{sw}", f"Bn{sw}", 0, PROBE_K)),
                  (f"sw{sw} A M-major, B N-major", (f"Am{sw}", f"Bn{sw}", 0, PROBE_K))]

        # hopper_probe.cu: desc_kmajor<SW>(base, rows, kk), desc_nmajor<SW>(base, K, kk)
        def kmajor(base, rows, kk, sw=sw, w=w):
            start = base + (16 * kk // w) * rows * w * 2 + (16 * kk % w) * 2
            return _desc(start, 16, 8 * sw, sw) if sw else _desc(start, rows * 16, 128, 0)

        def nmajor(base, k, kk, sw=sw):
            return _desc(base + 16 * kk * sw, k * sw, 8 * sw, sw) if sw else _desc(base + 16 * kk * 16, 128, k * 16, 0)

        for kk in range(PROBE_K // 16):
            want.append((kmajor(a, 64, kk), kmajor(bk, 64, kk), 0, 0))
        for kk in range(PROBE_K // 16):
            want.append((kmajor(a, 64, kk), nmajor(bn, PROBE_K, kk), 0, 1))
        for kk in range(PROBE_K // 16):
            want.append((nmajor(am, PROBE_K, kk), nmajor(bn, PROBE_K, kk), 1, 1))
    return gemms, names, co.wgmma_descriptors(tuple(gemms)), tiles, want


@pytest.fixture(scope="module")
def generic(co):
    return _generic_case(co)


def _unused_lbo(desc: int, major_k: bool, sw: int, panels_along_mn: int) -> int:
    """The descriptor with its leading-byte-offset field cleared where the layout never reaches it
    (PTX ISA: a swizzled K-major operand's k16 slice lies within one swizzle row; an M/N-major one
    with a single swizzle panel along M/N never steps to the next)."""
    if sw and (major_k or panels_along_mn == 1):
        return desc & ~(0x3FFF << 16)
    return desc


def test_hopper_probe_descriptors_are_cutes(co, generic):
    gemms, names, ops, tiles, want = generic
    i = 0
    for g, (name, _) in zip(gemms, names):
        for _kk in range(g.steps):
            op, w = ops[i], want[i]
            panels_a = 64 // (g.a_swizzle // 2) if g.a_swizzle else 8
            panels_b = 64 // (g.b_swizzle // 2) if g.b_swizzle else 8
            a_cute = _unused_lbo(op.desc_a, g.a_major == "K", g.a_swizzle, panels_a)
            a_probe = _unused_lbo(w[0], g.a_major == "K", g.a_swizzle, panels_a)
            b_cute = _unused_lbo(op.desc_b, g.b_major == "K", g.b_swizzle, panels_b)
            b_probe = _unused_lbo(w[1], g.b_major == "K", g.b_swizzle, panels_b)
            assert (a_cute, b_cute, op.trans_a, op.trans_b) == (a_probe, b_probe, w[2], w[3]), (
                f"{name}, wgmma {i}: CuTe A {co.decode(op.desc_a)} B {co.decode(op.desc_b)}; hopper_probe A "
                f"{co.decode(w[0])} B {co.decode(w[1])}")
            i += 1


def test_simulator_reads_cutes_layout_at_every_swizzle_and_major(co, probes, generic):
    gemms, names, ops, tiles, _ = generic
    _check_reads(co, probes, tiles, names, ops)


# ------------------------------------------------------------------------------------ fragments
N_USED = sorted({64} | {fwd.BLOCK_N[d] for d in fwd.HEAD_DIM_BUCKETS} | set(fwd.BLOCK_N_MODS.values())
                | set(fwd.HEAD_DIM_BUCKETS))


def test_accumulator_fragment_is_cutes(co, probes):
    """D = A B with D[m][n] = m + 64 n (A[m][0] = m, A[m][1] = 1, B[n][0] = 1, B[n][1] = 64 n): thread
    t's register i holds D at CuTe's accumulator index tv_layout_C(t, i) = m + 64 n, for every N the
    Hopper kernels issue (Bc and Dv of the forward, the probes' 64)."""
    G = co.Gemm
    nmax = max(N_USED)
    gemms = tuple(G(n, 16, "K", 128, (64, 64), (0, 1), 0, 0, "K", 128, (nmax, 64), (0, 1), 8192) for n in N_USED)
    ops = co.wgmma_descriptors(gemms)
    la, lb = co.smem_layout("K", 128, (64, 64)), co.smem_layout("K", 128, (nmax, 64))
    a = np.zeros((64, 64), np.float32)
    a[:, 0], a[:, 1] = np.arange(64), 1
    b = np.zeros((nmax, 64), np.float32)
    b[:, 0], b[:, 1] = 1, 64 * np.arange(nmax)
    mod, o = probes
    img = _image([(0, la, a), (8192, lb, b)], 8192 + nmax * 128)
    for op in ops:
        flags = np.zeros(1, np.int32)
        out = np.full(128 * op.n // 2, np.nan, np.float32)
        args = (PointerArg.of("img", img), i32(img.size), PointerArg.of("desc_a", np.array([op.desc_a], np.uint64)),
                PointerArg.of("desc_b", np.array([op.desc_b], np.uint64)),
                PointerArg.of("a_regs", np.zeros(512, np.uint32)), PointerArg.of("flags", flags), i32(1), P(out))
        mod.launch(LaunchPlan(None, f"wgmma_each_n{op.n}", 1, 128, img.size + 1024, args), o)
        t, i = np.meshgrid(np.arange(128), np.arange(op.n // 2), indexing="ij")
        np.testing.assert_array_equal(out.reshape(128, op.n // 2), co.tv_layout(op.n, "C").index(t, i),
                                      err_msg=f"N = {op.n}")


def test_register_a_fragment_is_cutes(co, probes):
    """A from registers placed by CuTe's register-A fragment, B one-hot (B[n][k] = [n == k]): the
    simulator's D[m][n] for n < 16 is the A element CuTe says those registers hold."""
    G = co.Gemm
    (op,) = co.wgmma_descriptors((G(16, 16, "K", 128, (64, 64), (0, 1), 0, 0, "K", 128, (16, 64), (0, 1), 0,
                                    a_regs=True),))
    lb = co.smem_layout("K", 128, (16, 64))
    r, c = _grid((16, 64))
    img = _image([(0, lb, (r == c).astype(np.float32))], 16 * 128)
    m, k = _grid((64, 16))
    for vals in (m, k + 1):   # the row, then the column, of each element
        (d,) = _run(co, probes, img, [op], _a_registers(co, vals.astype(np.float32)))
        np.testing.assert_array_equal(d, vals)


# ------------------------------------------------------------------------------------ TMA boxes
# (rows, swizzle): the forward's Q (128 rows), K and V (Bc rows) and O (64 rows) boxes of 64
# columns, 128-byte swizzle; hopper_probe's A / B boxes of the swizzle span (8 columns unswizzled)
TMA_BOXES = sorted({(BR, 128), (64, 128)} | {(bc, 128) for bc in {*fwd.BLOCK_N.values(), *fwd.BLOCK_N_MODS.values()}}
                   | {(64, sw) for sw in SWIZZLES} | {(PROBE_K, sw) for sw in SWIZZLES})


@pytest.mark.parametrize("rows,swizzle", TMA_BOXES, ids=[f"{r}x-sw{s}" for r, s in TMA_BOXES])
def test_tma_box_lands_as_cutes_tile(co, probes, rows, swizzle):
    """A TMA load of a (rows, W) box (W the swizzle span in bf16, 8 without one) with the swizzle
    leaves each element where CuTe's K-major tile of that shape and swizzle has it; a panel of the
    forward's tiles (p * rows * 128 bytes on) is that tile too."""
    w = swizzle // 2 if swizzle else 8
    codes = np.arange(170 * 192, dtype=np.uint16).reshape(170, 192)   # distinct finite bf16 bit patterns
    x = codes.view(BF16)
    c0, c1 = w, 40
    nbytes = rows * w * 2
    out = np.zeros(nbytes, np.uint8)
    mod, o = probes
    args = (TensorMapArg.of("map", x, (rows, w), swizzle=swizzle), P(out), i32(nbytes), i32(c0), i32(c1))
    mod.launch(LaunchPlan(None, "tma_raw_load", 1, 128, nbytes + 1024, args), o)
    lay = co.smem_layout("K", swizzle, (rows, w))
    r, c = _grid((rows, w))
    addr = lay.byte_address(r, c)
    np.testing.assert_array_equal(out.view(np.uint16)[addr // 2], codes[c1 + r, c0 + c])
    if swizzle == 128:   # the forward's tiles: 64-column panels of this box, one after another
        full = co.smem_layout("K", 128, (rows, 4 * PANEL))
        for p in range(4):
            np.testing.assert_array_equal(full.byte_address(r, c + PANEL * p), p * rows * 128 + addr)


def test_tma_store_takes_cutes_tile(co, probes):
    """The forward's O store: a (64, 64) box, 128-byte swizzle, from shared memory laid out as CuTe's tile."""
    mod, o = probes
    lay = co.smem_layout("K", 128, (64, PANEL))
    codes = (np.arange(64 * PANEL, dtype=np.uint16).reshape(64, PANEL) * 5 + 7)
    img = np.zeros(64 * PANEL, np.uint16)
    r, c = _grid((64, PANEL))
    img[lay.byte_address(r, c) // 2] = codes
    y = np.zeros((70, 72), np.uint16)
    args = (TensorMapArg.of("map", y.view(BF16), (64, PANEL), swizzle=128, writable=True),
            PointerArg.of("image", img.view(np.uint8)), i32(img.nbytes), i32(8), i32(3))
    mod.launch(LaunchPlan(None, "tma_raw_store", 1, 128, img.nbytes + 1024, args), o)
    np.testing.assert_array_equal(y[3:67, 8:72], codes)


def test_cute_evaluation_here_matches_cutes_own(co, generic):
    """The shapes and strides CuTe returned, evaluated by cute_oracle's arithmetic, agree with CuTe's
    own evaluation at sampled coordinates (layouts, swizzles, thread/value layouts)."""
    reqs = co.requests_so_far()
    assert len(reqs) >= 8
    assert co.check_evaluator(reqs) > 1000


# --------------------------------------------------------------------------- ldmatrix / stmatrix
FORMS = [(1, False), (2, False), (4, False), (1, True), (2, True), (4, True)]   # ldsm_each / stsm_each order


def _rows(seed: int) -> np.ndarray:
    """Each lane's row: 32 distinct 16-byte rows of a 64-row image, in a shuffled order."""
    return (np.random.default_rng(seed).permutation(64)[:32] * 16).astype(np.int32)


def test_ldmatrix_fragments_are_cutes(co, probes):
    """ldmatrix x1/x2/x4 (+ .trans) from rows at scattered addresses: each lane's register halves are
    the elements CuTe's copy atom (LdMatrix8x8x16bOp) gives that thread, read from the row CuTe
    says which lane addresses."""
    mod, o = probes
    rows = _rows(1)
    img = (np.arange(64 * 8, dtype=np.uint16) + 1)   # row r, element e: 8 r + e + 1
    out = np.zeros(32 * 14, np.uint32)
    args = (PointerArg.of("img", img.view(np.uint8)), i32(img.nbytes), PointerArg.of("rows", rows), P(out))
    mod.launch(LaunchPlan(None, "ldsm_each", 1, 32, img.nbytes, args), o)
    out = out.reshape(32, 14)
    col = 0
    for x, trans in FORMS:
        src, dst = co.copy_layouts("ldmatrix", x, trans)
        t, v = np.meshgrid(np.arange(8 * x), np.arange(8), indexing="ij")   # the lanes whose rows are read
        table = np.zeros(64 * x, np.int64)
        table[src.index(t, v)] = img[rows[t] // 2 + v]
        assert np.unique(src.index(t, v)).size == 64 * x
        t, v = np.meshgrid(np.arange(32), np.arange(2 * x), indexing="ij")
        want = table[dst.index(t, v)]
        regs = out[:, col:col + x]
        got = np.stack([regs[:, v // 2] >> (16 * (v % 2)) & 0xFFFF for v in range(2 * x)], axis=1)
        np.testing.assert_array_equal(got, want, err_msg=f"ldmatrix.x{x}{'.trans' if trans else ''}")
        col += x


@pytest.mark.parametrize("form", range(len(FORMS)), ids=[f"x{x}{'-trans' if t else ''}" for x, t in FORMS])
def test_stmatrix_fragments_are_cutes(co, probes, form):
    """stmatrix x1/x2/x4 (+ .trans) to rows at scattered addresses: each row holds the register
    halves CuTe's copy atom (StMatrix8x8x16bOp) takes from each thread for it; no other byte changes."""
    mod, o = probes
    x, trans = FORMS[form]
    rows = _rows(2 + form)
    regs = np.random.default_rng(form).permutation(np.arange(1, 32 * 4 * 2 + 1, dtype=np.uint32))
    regs = (regs[0::2] | (regs[1::2] << 16)).reshape(32, 4)   # distinct nonzero halves
    img = np.zeros(64 * 8, np.uint16)
    args = (PointerArg.of("img", img.view(np.uint8), writable=True), i32(img.nbytes), PointerArg.of("rows", rows),
            PointerArg.of("regs", regs.ravel()), i32(form))
    mod.launch(LaunchPlan(None, "stsm_each", 1, 32, img.nbytes, args), o)
    src, dst = co.copy_layouts("stmatrix", x, trans)
    t, v = np.meshgrid(np.arange(32), np.arange(2 * x), indexing="ij")
    table = np.zeros(64 * x, np.int64)
    table[src.index(t, v)] = regs[t, v // 2] >> (16 * (v % 2)) & 0xFFFF
    assert np.unique(src.index(t, v)).size == 64 * x
    want = np.zeros(64 * 8, np.int64)
    t, e = np.meshgrid(np.arange(8 * x), np.arange(8), indexing="ij")   # the lanes whose rows are written
    want[rows[t] // 2 + e] = table[dst.index(t, e)]
    np.testing.assert_array_equal(img, want)


# ------------------------------------------------------------------ fp8 (wgmma m64nNk32 .e4m3)


def test_e4m3_register_a_and_accumulator_fragments_are_cutes(co):
    """The fragments the simulator's e4m3 wgmma reads and writes (cuflash/sim/cusim_sm90.h,
    wgmma_compute; the layouts kernels_cu/ptx.cuh states): A from registers, 64 x 32, four e4m3 per
    register, the lowest value in the low byte, register r of thread 4g + t of warp j holding row
    16j + g + 8 (r % 2), columns 4t + 16 (r // 2) .. + 3; the accumulator as for k16. CuTe's
    thread/value layouts of its fp8 tiled MMA (K-major operands) give the same elements, value v
    being byte v % 4 of register v // 4 (tests/sim/test_sim_hopper.py runs the probe GEMMs that load
    A by this formula, exactly against NumPy)."""
    a = co.tv_layout_e4m3(64, "A")
    t, v = np.meshgrid(np.arange(128), np.arange(16), indexing="ij")
    idx = a.index(t, v)
    assert np.unique(idx).size == 64 * 32
    j, g, tt, r = t // 32, (t % 32) // 4, t % 4, v // 4
    np.testing.assert_array_equal(idx % 64, 16 * j + g + 8 * (r % 2))
    np.testing.assert_array_equal(idx // 64, 4 * tt + 16 * (r // 2) + v % 4)
    for n in (64, 256):
        c = co.tv_layout_e4m3(n, "C")
        t, v = np.meshgrid(np.arange(128), np.arange(n // 2), indexing="ij")
        idx = c.index(t, v)
        j, g, tt = t // 32, (t % 32) // 4, t % 4
        np.testing.assert_array_equal(idx % 64, 16 * j + g + 8 * ((v % 4) // 2))
        np.testing.assert_array_equal(idx // 64, 8 * (v // 4) + 2 * tt + v % 2)
    # (this module's layout arithmetic, held to CuTe's own evaluation of these layouts)
    assert co.check_evaluator([("tv8", 64, True), ("tv8", 256, False)]) > 50
