"""The simulator's TMA and wgmma layouts against shared-memory images built here, independently of
cuflash/sim/cusim_sm90.h, from the PTX ISA's definitions:

* swizzling ("Tensor-map swizzling modes", "Shared Memory Matrix Layout"): the 16-byte chunk c of
  an S-byte row (S = 32, 64, 128) that lies in 128-byte line l of its pattern (8 S bytes, aligned to
  its size) is stored at chunk c XOR (l mod S/16): for 128 B each row is a line, for 64 B two rows
  share a line (the ISA's figure repeats each 64 B row pattern twice), for 32 B four;
* the matrix descriptor ("Matrix Descriptor Format"): start, leading- and stride-dimension byte
  offsets >> 4 in bits 0-13, 16-29, 32-45, the swizzle in 62-63 (1: 128 B, 2: 64 B, 3: 32 B);
* the canonical layouts, in 16-byte chunks of 8 bf16: K-major without swizzle, 8 x 16-byte core
  matrices, the next along K at LBO and along M/N at SBO; K-major with an S-byte swizzle, S-byte
  rows of K, 8 per pattern, the next 8 rows at SBO; M/N-major without swizzle, core matrices of 8
  K-rows x 16 bytes of M/N, the next along M/N at SBO and along K at LBO; M/N-major with a swizzle,
  S-byte K-rows of M/N, the next S bytes of M/N at LBO, the next 8 K-rows at SBO.

The images use strides a dense TMA box would not (gaps between 8-row groups and between panels),
so a descriptor field decoded wrong, or swapped, reads the wrong element.
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from support.simtools import P, i32

from cuflash import sim
from cuflash.runtime import source
from cuflash.runtime.plan import LaunchPlan, PointerArg, TensorMapArg
from cuflash.sim import launcher

# hopper_layouts.cu compiled once per run: test_sim_cute_layouts.py shares it on the same worker
pytestmark = pytest.mark.xdist_group("hopper_layouts")

KERNELS = Path(__file__).parent / "kernels"
BF16 = ml_dtypes.bfloat16
MODE = {0: 0, 128: 1, 64: 2, 32: 3}


def _swizzled(off: np.ndarray, span: int) -> np.ndarray:
    """Byte offset (from a pattern-aligned base) where logical offset ``off`` is stored."""
    if span == 0:
        return off
    line, chunk = off // 128, (off % span) // 16   # the 128-byte line, the chunk within the S-byte row
    return off - chunk * 16 + ((chunk ^ (line % (span // 16))) * 16)


def _desc(start: int, lbo: int, sbo: int, swizzle: int) -> int:
    return ((start >> 4) & 0x3FFF) | (((lbo >> 4) & 0x3FFF) << 16) | (((sbo >> 4) & 0x3FFF) << 32) | (MODE[swizzle] << 62)


def _image(offsets: np.ndarray, values: np.ndarray, swizzle: int) -> np.ndarray:
    """The byte image with each bf16 value at its (swizzled) offset."""
    offsets = _swizzled(offsets.ravel(), swizzle)
    img = np.zeros(int(offsets.max()) + 2, np.uint8)
    raw = values.astype(BF16).ravel().view(np.uint8).reshape(-1, 2)
    img[offsets], img[offsets + 1] = raw[:, 0], raw[:, 1]
    return img


def kmajor(mat: np.ndarray, swizzle: int):
    """(image, descriptors per k16 step) of ``mat`` (rows x K) as a K-major operand."""
    rows, k = mat.shape
    r, c = np.meshgrid(np.arange(rows), np.arange(k), indexing="ij")
    if swizzle:
        w, sbo = swizzle // 2, 16 * swizzle                # a gap of one pattern after each 8-row group
        panel = (rows // 8) * sbo
        off = (c // w) * panel + (r // 8) * sbo + (r % 8) * swizzle + (c % w) * 2
        descs = [_desc((16 * kk // w) * panel + (16 * kk % w) * 2, 16, sbo, swizzle) for kk in range(k // 16)]
    else:
        lbo, sbo = 128, (k // 8) * 128 + 256               # K chunks adjacent, then a gap, then the next 8 rows
        off = (r // 8) * sbo + (c // 8) * lbo + (r % 8) * 16 + (c % 8) * 2
        descs = [_desc(2 * kk * lbo, lbo, sbo, 0) for kk in range(k // 16)]
    return _image(off, mat, swizzle), descs


def nmajor(mat: np.ndarray, swizzle: int):
    """(image, descriptors per k16 step) of ``mat`` (K x N, element [k][n]) as an N-major operand."""
    k, n = mat.shape
    kk_, nn = np.meshgrid(np.arange(k), np.arange(n), indexing="ij")
    if swizzle:
        w, sbo = swizzle // 2, 8 * swizzle
        lbo = (k // 8) * sbo + 8 * swizzle                 # the next W columns one pattern further on
        off = (nn // w) * lbo + (kk_ // 8) * sbo + (kk_ % 8) * swizzle + (nn % w) * 2
        descs = [_desc(2 * kk * sbo, lbo, sbo, swizzle) for kk in range(k // 16)]
    else:
        lbo, sbo = 128, (k // 8) * 128 + 256
        off = (nn // 8) * sbo + (kk_ // 8) * lbo + (kk_ % 8) * 16 + (nn % 8) * 2
        descs = [_desc(2 * kk * lbo, lbo, sbo, 0) for kk in range(k // 16)]
    return _image(off, mat, swizzle), descs


@pytest.fixture(scope="module")
def layouts():
    text = source.build_text((KERNELS / "hopper_layouts.cu").read_text(), origin="hopper_layouts.cu",
                             search_dirs=[KERNELS])
    mods = {}
    for checked in (False, True):
        with sim.options(arch=90, checked=checked) as o:
            mods[checked] = (launcher.load_source(text, origin="hopper_layouts.cu", options=o), o)
    return mods


def _fragment(out: np.ndarray, n: int = 64) -> np.ndarray:
    """The 64 x n D from the per-thread accumulators (PTX ISA, wgmma .m64nNk16 D fragment)."""
    d = np.full((64, n), np.nan, np.float32)
    r = n // 2
    for tid in range(128):
        j, g, t = tid // 32, (tid % 32) // 4, tid % 4
        for i in range(r):
            d[16 * j + g + 8 * ((i % 4) // 2), 8 * (i // 4) + 2 * t + i % 2] = out[tid * r + i]
    return d


@pytest.mark.parametrize("checked", [False, True], ids=["normal", "checked"])
@pytest.mark.parametrize("trans_b", [0, 1], ids=["b-kmajor", "b-nmajor"])
@pytest.mark.parametrize("swizzle", [0, 32, 64, 128])
def test_wgmma_reads_the_canonical_layouts(layouts, swizzle, trans_b, checked):
    rng = np.random.default_rng(swizzle + trans_b)
    a = rng.integers(-4, 5, (64, 64)).astype(np.float32)
    b = rng.integers(-4, 5, (64, 64)).astype(np.float32)   # B[k][n]
    img_a, da = kmajor(a, swizzle)
    img_b, db = nmajor(b, swizzle) if trans_b else kmajor(b.T.copy(), swizzle)
    assert img_a.size <= 64 * 1024 and img_b.size <= 64 * 1024
    out = np.full(128 * 32, np.nan, np.float32)
    args = (PointerArg.of("img_a", img_a), PointerArg.of("img_b", img_b), i32(img_a.size), i32(img_b.size),
            PointerArg.of("desc_a", np.array(da, np.uint64)), PointerArg.of("desc_b", np.array(db, np.uint64)),
            i32(len(da)), i32(trans_b), P(out))
    mod, o = layouts[checked]
    mod.launch(LaunchPlan(None, "wgmma_raw", 1, 128, 128 * 1024, args), o)
    np.testing.assert_array_equal(_fragment(out), a @ b)


@pytest.mark.parametrize("swizzle,box", [(0, (16, 24)), (32, (8, 16)), (64, (16, 32)), (128, (8, 64))])
@pytest.mark.parametrize("corner", [(0, 0), (30, 90)], ids=["inside", "past-the-end"])
def test_tma_load_image_and_zero_fill(layouts, swizzle, box, corner):
    x = (np.arange(37 * 104) % 251 + 1).reshape(37, 104).astype(BF16)   # no element is 0
    c1, c0 = corner
    nbytes = box[0] * box[1] * 2
    out = np.zeros(nbytes, np.uint8)
    args = (TensorMapArg.of("map", x, box, swizzle=swizzle), P(out), i32(nbytes), i32(c0), i32(c1))
    mod, o = layouts[False]
    mod.launch(LaunchPlan(None, "tma_raw_load", 1, 128, nbytes + 1024, args), o)
    i, j = np.meshgrid(np.arange(box[0]), np.arange(box[1]), indexing="ij")
    rows, cols = c1 + i, c0 + j
    inside = (rows < x.shape[0]) & (cols < x.shape[1])
    vals = np.where(inside, x.astype(np.float32)[np.minimum(rows, 36), np.minimum(cols, 103)], 0.0)
    want = _image((i * box[1] + j) * 2, vals, swizzle)
    np.testing.assert_array_equal(out, want[:nbytes])
    assert (~inside).any() == (corner != (0, 0))


@pytest.mark.parametrize("swizzle,box", [(0, (16, 24)), (128, (8, 64))])
@pytest.mark.parametrize("checked", [False, True], ids=["normal", "checked"])
def test_tma_store_takes_the_image_and_drops_out_of_bounds(layouts, swizzle, box, checked):
    rng = np.random.default_rng(4)
    vals = rng.integers(1, 200, box).astype(np.float32)
    i, j = np.meshgrid(np.arange(box[0]), np.arange(box[1]), indexing="ij")
    img = _image((i * box[1] + j) * 2, vals, swizzle)
    nbytes = box[0] * box[1] * 2
    y = np.full((37, 104), -1, BF16)
    c1, c0 = 30, 90
    args = (TensorMapArg.of("map", y, box, swizzle=swizzle, writable=True), PointerArg.of("image", img[:nbytes]),
            i32(nbytes), i32(c0), i32(c1))
    mod, o = layouts[checked]
    mod.launch(LaunchPlan(None, "tma_raw_store", 1, 128, nbytes + 1024, args), o)
    want = np.full((37, 104), -1, np.float32)
    r, c = c1 + i, c0 + j
    keep = (r < 37) & (c < 104)
    want[r[keep], c[keep]] = vals[keep]
    np.testing.assert_array_equal(y.astype(np.float32), want)


# (an N-major swizzled B holds whole swizzle panels: N = 96 has no 128 B N-major case)
WIDTHS = [(n, tb, sw) for n in (16, 96, 128, 192, 256) for tb, sw in ((0, 128), (1, 128), (1, 0), (0, 32))
          if not (tb and sw and n % (sw // 2))]


@pytest.mark.parametrize("n,trans_b,swizzle", WIDTHS, ids=[f"n{n}-{'nmajor' if t else 'kmajor'}-sw{s}" for n, t, s in WIDTHS])
def test_wgmma_widths(layouts, n, trans_b, swizzle):
    """The other N of m64nNk16 the attention kernels use (Bc for S = Q K^T, the head dim for
    O = P V): the fragment's N / 2 registers per thread, B's panels along N at LBO (N-major) or its
    8-row groups at SBO (K-major)."""
    rng = np.random.default_rng(n + trans_b)
    k = 32
    a = rng.integers(-4, 5, (64, k)).astype(np.float32)
    b = rng.integers(-4, 5, (k, n)).astype(np.float32)
    img_a, da = kmajor(a, 128)
    img_b, db = nmajor(b, swizzle) if trans_b else kmajor(b.T.copy(), swizzle)
    assert img_a.size <= 64 * 1024 and img_b.size <= 64 * 1024
    out = np.full(128 * n // 2, np.nan, np.float32)
    args = (PointerArg.of("img_a", img_a), PointerArg.of("img_b", img_b), i32(img_a.size), i32(img_b.size),
            PointerArg.of("desc_a", np.array(da, np.uint64)), PointerArg.of("desc_b", np.array(db, np.uint64)),
            i32(len(da)), i32(trans_b), P(out))
    mod, o = layouts[False]
    mod.launch(LaunchPlan(None, f"wgmma_raw_n{n}", 1, 128, 128 * 1024, args), o)
    np.testing.assert_array_equal(_fragment(out, n), a @ b)


@pytest.mark.skipif(launcher.platform.machine().lower() not in ("x86_64", "amd64"), reason="needs x86-64")
def test_wgmma_gpu_numerics_truncates_as_tensor_cores_do():
    """gpu_numerics (cuflash.sim.options) rounds wgmma's sums as mma.sync's (Fasi et al. 2021: terms
    aligned to the largest exponent, truncated to 24 bits, the sum truncated): 1 + 2^-24 + 2^-25 is
    1 + 2^-23 rounded to nearest, 1 on a tensor core."""
    a = np.zeros((64, 16), np.float32)
    a[:, :3] = [1.0, 2.0**-24, 2.0**-25]
    b = np.zeros((16, 64), np.float32)
    b[:3] = 1.0
    img_a, da = kmajor(a, 128)
    img_b, db = kmajor(b.T.copy(), 128)
    text = source.build_text((KERNELS / "hopper_layouts.cu").read_text(), origin="hopper_layouts.cu",
                             search_dirs=[KERNELS])
    got = {}
    for gpu in (False, True):
        out = np.full(128 * 32, np.nan, np.float32)
        args = (PointerArg.of("img_a", img_a), PointerArg.of("img_b", img_b), i32(img_a.size), i32(img_b.size),
                PointerArg.of("desc_a", np.array(da, np.uint64)), PointerArg.of("desc_b", np.array(db, np.uint64)),
                i32(1), i32(0), P(out))
        with sim.options(arch=90, gpu_numerics=gpu) as o:
            mod = launcher.load_source(text, origin="hopper_layouts.cu", options=o)
            mod.launch(LaunchPlan(None, "wgmma_raw", 1, 128, 128 * 1024, args), o)
        got[gpu] = _fragment(out)
    assert (got[False] == np.float32(1 + 2.0**-23)).all()
    assert (got[True] == np.float32(1.0)).all()
