"""Tests of cuflash.intensity: the FLOP/byte model of naive vs. fused attention.

Expected values are written out as arithmetic from the formulas (FlashAttention §3.2, DESIGN
§6), and mask-dependent counts are checked against brute-force NumPy masks.
"""

import dataclasses
import math

import numpy as np
import pytest

from cuflash import intensity as it


def mask(sq, sk, causal=False, window=(-1, -1)):
    """Brute-force visibility mask: query i sees key j iff i+off-left <= j <= i+off+right."""
    left, right = window
    if causal:
        right = 0
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    off = sk - sq
    m = np.ones((sq, sk), dtype=bool)
    if right >= 0:
        m &= j <= i + off + right
    if left >= 0:
        m &= j >= i + off - left
    return m


SIZES = [(1, 1), (1, 7), (7, 1), (5, 5), (5, 9), (9, 5), (16, 16), (13, 40), (40, 13)]
WINDOWS = [(-1, -1), (0, 0), (3, -1), (-1, 2), (2, 4), (0, -1), (6, 1)]


# ---------------------------------------------------------------------------------- pairs


@pytest.mark.parametrize("sq,sk", SIZES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS)
def test_visible_pairs_match_brute_force_mask(sq, sk, causal, window):
    expected = int(mask(sq, sk, causal, window).sum())
    assert it.visible_pairs(sq, sk, causal=causal, window_size=window) == expected


def test_visible_pairs_causal_by_hand():
    # Square causal: N(N+1)/2. Sq < Sk (bottom-right): row i sees Sk - Sq + i + 1 keys.
    assert it.visible_pairs(2048, causal=True) == 2048 * 2049 // 2
    assert it.visible_pairs(3, 10, causal=True) == 8 + 9 + 10
    # Sq > Sk: the first Sq - Sk rows see nothing, the rest see 1..Sk keys.
    assert it.visible_pairs(10, 3, causal=True) == 1 + 2 + 3
    assert it.visible_pairs(4, 6) == 24
    # A (left, 0) window on a long square sequence: row i sees min(i, left) + 1 keys.
    assert it.visible_pairs(100, causal=True, window_size=(4, -1)) == sum(
        min(i, 4) + 1 for i in range(100))


@pytest.mark.parametrize("sq,sk", SIZES)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block", [1, 4, 128])
def test_no_l2_kv_reads_match_brute_force_tiles(sq, sk, window, causal, block):
    """Forward without L2: each query tile reads the keys any of its rows sees."""
    m = mask(sq, sk, causal, window)
    q_seen = int(m.any(axis=1).sum())
    tile_keys = sum(int(m[t:t + block].any(axis=0).sum()) for t in range(0, sq, block))
    # fp32, D = 2, Dv = 3, B = H = 1: Q read 4*q_seen*2, K 4*keys*2, V 4*keys*3, O 4*sq*3,
    # LSE 4*sq.
    c = it.fused_attention_cost(sq, 2, seqlen_k=sk, headdim_v=3, causal=causal,
                                window_size=window, l2_reuse=False, block_m=block)
    t = dict(c.traffic)
    assert t["Q read"] == 4 * q_seen * 2
    assert t["K read"] == 4 * tile_keys * 2
    assert t["V read"] == 4 * tile_keys * 3
    assert t["O write"] == 4 * sq * 3
    assert t["LSE write"] == 4 * sq
    # With L2 reuse the keys are read once: those seen by at least one query.
    c2 = it.fused_attention_cost(sq, 2, seqlen_k=sk, headdim_v=3, causal=causal,
                                 window_size=window)
    assert dict(c2.traffic)["K read"] == 4 * int(m.any(axis=0).sum()) * 2
    assert c2.bytes <= c.bytes


@pytest.mark.parametrize("sq,sk", SIZES)
@pytest.mark.parametrize("window", [(-1, -1), (2, 4), (3, -1)])
@pytest.mark.parametrize("causal", [False, True])
def test_no_l2_backward_q_reads_match_brute_force_key_tiles(sq, sk, window, causal):
    m = mask(sq, sk, causal, window)
    block = 4
    q_rows = sum(int(m[:, t:t + block].any(axis=1).sum()) for t in range(0, sk, block))
    c = it.fused_attention_cost(sq, 8, seqlen_k=sk, dtype="float16", causal=causal,
                                window_size=window, backward=True, l2_reuse=False, block_n=block)
    t = dict(c.traffic)
    assert t["Q read"] == 2 * q_rows * 8
    assert t["dO read"] == 2 * q_rows * 8
    assert t["LSE read"] == 4 * q_rows
    assert t["dQacc read+write"] == 2 * 4 * q_rows * 8
    assert t["dQacc read"] == 4 * sq * 8


# ---------------------------------------------------------------------------------- FLOPs


def test_flops_dense_by_hand():
    # 2*B*H*(D+Dv)*Sq*Sk = 4*N^2*d for B = H = 1, D = Dv = d.
    assert it.attention_flops(2048, 64) == 4 * 2048 * 2048 * 64
    assert it.attention_flops(100, 64, seqlen_k=300, headdim_v=32, batch=2, heads=3) == (
        2 * 2 * 3 * (64 + 32) * 100 * 300)
    # Backward: 2.5x (FA2).
    assert it.attention_flops(2048, 64, backward=True) == 10 * 2048 * 2048 * 64


def test_flops_causal_counts_exact_pairs():
    assert it.attention_flops(1024, 128, causal=True, batch=2, heads=4) == (
        2 * 2 * 4 * 256 * (1024 * 1025 // 2))
    # Sq=3, Sk=10 bottom-right: 8 + 9 + 10 pairs.
    assert it.attention_flops(3, 16, seqlen_k=10, causal=True) == 2 * 32 * 27


def test_flash_attn_convention():
    assert it.flash_attn_flops(2048, 64, batch=8, heads=16) == 4 * 8 * 16 * 2048 * 2048 * 64
    assert it.flash_attn_flops(2048, 64, causal=True) == 4 * 2048 * 2048 * 64 // 2
    assert it.flash_attn_flops(512, 128, seqlen_k=1024, backward=True) == (
        25 * 512 * 1024 * 128 // 10 * 4)
    # Differs from the exact pair count for causal: N^2/2 vs N(N+1)/2 pairs.
    exact = it.attention_flops(2048, 64, causal=True)
    assert exact - it.flash_attn_flops(2048, 64, causal=True) == 4 * 64 * 2048 // 2


# ---------------------------------------------------------------------------------- bytes


def test_naive_forward_bytes_match_the_closed_form():
    n, d = 2048, 64
    c = it.naive_attention_cost(n, d, dtype="float32")
    # Read Q,K (2Nd), write S, read S, write P, read P (4N^2), read V (Nd), write O (Nd).
    assert c.bytes == 4 * (4 * n * d + 4 * n * n)
    assert c.flops == 4 * n * n * d
    # The closed form N*d / (4*(N + d)).
    assert c.intensity == pytest.approx(n * d / (4 * (n + d)))
    assert 15 < c.intensity < 16


def test_naive_bytes_general_and_gqa():
    b, h, hk, sq, sk, d, dv, e = 2, 8, 2, 128, 256, 64, 32, 2
    c = it.naive_attention_cost(sq, d, seqlen_k=sk, headdim_v=dv, batch=b, heads=h,
                                heads_k=hk, dtype="bfloat16")
    expected = (e * b * h * sq * d          # Q read
                + e * b * hk * sk * d       # K read (KV heads)
                + 4 * e * b * h * sq * sk   # S write/read, P write/read
                + e * b * hk * sk * dv      # V read
                + e * b * h * sq * dv)      # O write
    assert c.bytes == expected
    assert c.flops == 2 * b * h * sq * sk * (d + dv)
    assert (c.algorithm, c.pass_, c.element_bytes, c.dtype) == ("naive", "forward", 2,
                                                                "bfloat16")
    # Causal changes nothing for the dense naive version.
    assert it.naive_attention_cost(sq, d, seqlen_k=sk, headdim_v=dv, batch=b, heads=h,
                                   heads_k=hk, dtype="bfloat16", causal=True) == c


def test_naive_backward_bytes():
    n, d, e = 256, 64, 4
    c = it.naive_attention_cost(n, d, backward=True)
    # FlashAttention Algorithm 3: P read twice, dP write+read, dS write + 2 reads (7 N^2);
    # dO read twice, V, K, Q read, dV, dQ, dK written (8 N d).
    assert c.bytes == e * (7 * n * n + 8 * n * d)
    assert c.flops == 4 * n * n * (d + d)


def test_fused_forward_bytes_and_the_dense_512():
    n, d = 2048, 64
    c = it.fused_attention_cost(n, d, dtype="float32")
    # Q, K, V read, O written: 4 bytes * 4Nd; LSE (float32): 4N.
    assert c.bytes == 4 * 4 * n * d + 4 * n
    assert c.flops == 4 * n * n * d
    assert c.intensity == pytest.approx(n * d / (4 * d + 1))
    # Dense fp32: ~N/4 = 512 (the LSE write costs 0.4%).
    assert c.intensity == pytest.approx(512, rel=0.005)
    law = 4 * n * n * d / (4 * (3 * n * d + n * d))
    assert law == 512
    assert c.intensity == pytest.approx(law * (16 * n * d) / (16 * n * d + 4 * n))


@pytest.mark.parametrize("n", [512, 1024, 4096, 16384])
def test_fused_intensity_grows_like_n_over_4_for_fp32(n):
    c = it.fused_attention_cost(n, 128, dtype="float32")
    assert c.intensity == pytest.approx(n / 4, rel=0.01)
    # fp16: N/2.
    assert it.fused_attention_cost(n, 128, dtype="float16").intensity == pytest.approx(
        n / 2, rel=0.01)
    # Doubling N doubles the fused intensity; the naive one saturates near d/4.
    c2 = it.fused_attention_cost(2 * n, 128, dtype="float32")
    assert c2.intensity / c.intensity == pytest.approx(2.0, rel=1e-3)
    assert it.naive_attention_cost(n, 128).intensity < 128 / 4


def test_fused_gqa_bytes_use_kv_heads():
    b, h, hk, n, d, e = 3, 32, 8, 1024, 128, 2
    c = it.fused_attention_cost(n, d, batch=b, heads=h, heads_k=hk, dtype="float16")
    t = dict(c.traffic)
    assert t["K read"] == e * b * hk * n * d
    assert t["V read"] == e * b * hk * n * d
    assert t["Q read"] == e * b * h * n * d
    assert c.bytes == e * b * (2 * h + 2 * hk) * n * d + 4 * b * h * n
    mha = it.fused_attention_cost(n, d, batch=b, heads=h, dtype="float16")
    assert mha.bytes - c.bytes == 2 * e * b * (h - hk) * n * d
    assert mha.flops == c.flops


def test_fused_no_l2_dense_is_ceil_passes():
    sq, sk, d, br = 1000, 512, 64, 128
    c = it.fused_attention_cost(sq, d, seqlen_k=sk, l2_reuse=False, block_m=br)
    passes = math.ceil(sq / br)
    assert passes == 8
    t = dict(c.traffic)
    assert t["K read"] == 4 * passes * sk * d
    assert t["V read"] == 4 * passes * sk * d
    assert c.bytes == 4 * (sq * d + 2 * passes * sk * d + sq * d) + 4 * sq


def test_fused_backward_bytes():
    b, h, hk, n, d, e = 2, 4, 2, 512, 64, 2
    c = it.fused_attention_cost(n, d, batch=b, heads=h, heads_k=hk, dtype="bfloat16",
                                backward=True)
    # Reads Q, K, V, O, dO, LSE; writes dQ, dK, dV.
    expected = (e * b * h * n * d * 4      # Q, O, dO read; dQ written (query heads)
                + e * b * hk * n * d * 4   # K, V read; dK, dV written (KV heads)
                + 4 * b * h * n)           # LSE read (float32)
    assert c.bytes == expected
    assert c.flops == 5 * b * h * (d + d) * n * n  # 2.5 * 2*B*H*(D+Dv)*N^2
    assert c.flops == it.attention_flops(n, d, batch=b, heads=h, backward=True)


def test_float64_lse_is_8_bytes_and_int_dtype():
    c = it.fused_attention_cost(64, 16, dtype="float64")
    assert dict(c.traffic)["LSE write"] == 8 * 64
    assert it.fused_attention_cost(64, 16, dtype=4).bytes == it.fused_attention_cost(
        64, 16, dtype="float32").bytes
    assert it.element_bytes("bf16") == 2
    assert it.element_bytes(np.float16) == 2
    assert it.element_bytes(np.dtype("float64")) == 8
    assert it.element_bytes(1) == 1


def test_empty_rows_read_nothing_but_are_written():
    # Causal Sq=10 > Sk=4: rows 0..5 see no key; Q rows read: 4, O/LSE written for all 10.
    c = it.fused_attention_cost(10, 8, seqlen_k=4, causal=True)
    t = dict(c.traffic)
    assert t["Q read"] == 4 * 4 * 8
    assert t["O write"] == 4 * 10 * 8
    assert t["LSE write"] == 4 * 10
    assert c.flops == 2 * 16 * (1 + 2 + 3 + 4)


# ---------------------------------------------------------------------------------- roofline


def test_device_presets_quote_the_datasheets():
    assert it.DEVICES["a100"].fp16_tensor_tflops == 312
    assert it.DEVICES["a100"].fp32_tflops == 19.5
    assert it.DEVICES["a100"].hbm_gb_per_s == 2039
    assert it.DEVICES["h100"].fp16_tensor_tflops == 989.4
    assert it.DEVICES["h100"].fp32_tflops == 67
    assert it.DEVICES["h100"].hbm_gb_per_s == 3350
    h200 = it.DEVICES["h200"]
    assert (h200.fp16_tensor_tflops, h200.fp32_tflops) == (989.4, 67)
    assert (h200.hbm_gb_per_s, h200.memory_gb) == (4800, 141)
    for dev in it.DEVICES.values():
        assert "datasheet" in dev.source
        with pytest.raises(dataclasses.FrozenInstanceError):
            dev.hbm_gb_per_s = 1.0
    assert it.H100.ridge_point("bfloat16") == pytest.approx(989.4e12 / 3350e9)
    assert it.H100.peak_tflops("float32", tf32=True) == 494.7


def test_roofline_math():
    r = it.roofline(10**12, 10**9, "h100", dtype="bfloat16")
    assert r.compute_s == pytest.approx(1e12 / 989.4e12)
    assert r.memory_s == pytest.approx(1e9 / 3350e9)
    assert r.time_s == max(r.compute_s, r.memory_s)
    assert r.bound == "compute"
    r = it.roofline(10**9, 10**10, it.A100, dtype="float32")
    assert r.memory_s == pytest.approx(1e10 / 2039e9)
    assert r.time_s == r.memory_s
    assert r.bound == "memory"
    assert r.tflops_at_bound == pytest.approx(1e9 / r.memory_s / 1e12)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_naive_is_memory_bound_fused_compute_bound_on_h100(dtype):
    naive = it.naive_attention_cost(2048, 64, batch=4, heads=16, dtype=dtype)
    fused = it.fused_attention_cost(2048, 64, batch=4, heads=16, dtype=dtype)
    rn, rf = naive.roofline("h100"), fused.roofline("h100")
    assert rn.bound == "memory"
    assert naive.intensity < it.H100.ridge_point(dtype)
    assert rf.bound == "compute"
    assert fused.intensity > it.H100.ridge_point(dtype)
    assert rn.time_s > rf.time_s
    # Same FLOPs without a mask, so the time ratio is the memory term against compute.
    assert naive.flops == fused.flops
    assert rn.time_s / rf.time_s == pytest.approx(
        (naive.bytes / 3350e9) / (fused.flops / (it.H100.peak_tflops(dtype) * 1e12)))


def test_cost_is_frozen():
    c = it.fused_attention_cost(128, 64)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.bytes = 0
    assert c.bytes == sum(n for _, n in c.traffic)


# ---------------------------------------------------------------------------------- CLI


def test_cli_reproduces_the_dense_analysis(capsys):
    assert it.main(["--seqlen", "2048", "--head-dim", "64", "--dtype", "float32", "--device", "h100"]) == 0
    out = capsys.readouterr().out
    assert "H100 SXM" in out
    naive = next(line for line in out.splitlines() if line.startswith("naive fwd"))
    fused = next(line for line in out.splitlines() if line.startswith("fused fwd"))
    assert naive.split()[-1] == "memory"
    assert fused.split()[-1] == "compute"
    # Intensities: N*d/(4(N+d)) = 15.5 and N*d/(4d+1) = 510.0.
    assert f"{2048 * 64 / (4 * 2112):.1f}" in naive
    assert f"{2048 * 64 / 257:.1f}" in fused
    # The sweep prints the dense law's N/4 column with 512 at N = 2048.
    sweep = next(line for line in out.splitlines() if line.split()[:1] == ["2048"])
    assert sweep.split()[-1] == "512"
    assert "N/4" in out


def test_cli_backward_gqa_no_l2(capsys):
    argv = ["--seqlen", "1024", "--seqlen-k", "4096", "--head-dim", "128", "--heads", "16",
            "--heads-k", "4", "--dtype", "bf16", "--causal", "--backward", "--device", "a100",
            "--no-l2", "--block-m", "64"]
    assert it.main(argv) == 0
    out = capsys.readouterr().out
    for label in ("naive fwd", "fused fwd", "naive bwd", "fused bwd"):
        assert label in out
    assert "A100" in out and "Hk=4" in out and "causal" in out and "Br=64" in out
    assert "N/2" not in out  # the dense law is not claimed for causal GQA


@pytest.mark.parametrize("argv, message", [
    (["--seqlen", "-3"], "argument --seqlen: expected a positive integer, got -3"),
    (["--window", "-4", "0"], "argument --window: expected an integer >= -1, got -4"),
    (["--dtype", "int7"], "argument --dtype: 'int7' is not a dtype; expected one of float16 (fp16"),
    (["--device", "p100"], "argument --device: invalid choice: 'p100'"),
])
def test_cli_bad_arguments(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        it.main(argv)
    assert exit_info.value.code == 2
    assert f"python -m cuflash intensity: error: {message}" in capsys.readouterr().err


def test_cli_model_errors_name_the_flags(capsys):
    assert it.main(["--heads", "3", "--heads-k", "2"]) == 2
    assert capsys.readouterr().err == ("python -m cuflash intensity: error: --heads=3 must be a multiple of "
                                       "--heads-k=2 (GQA)\n")


def test_cli_through_the_dispatcher(capsys):
    from cuflash.__main__ import main as dispatch
    assert dispatch(["intensity", "--seqlen", "512", "--head-dim", "32"]) == 0
    assert "fused fwd" in capsys.readouterr().out


# ---------------------------------------------------------------------------------- validation


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(seqlen_q=-3), ValueError, r"seqlen_q must be a positive int, got -3"),
    (dict(seqlen_q=0), ValueError, r"seqlen_q must be a positive int, got 0"),
    (dict(seqlen_q=2.0), TypeError, r"seqlen_q must be an int, got float"),
    (dict(seqlen_q=True), TypeError, r"seqlen_q must be an int, got bool"),
    (dict(headdim=0), ValueError, r"headdim must be a positive int, got 0"),
    (dict(seqlen_k=-1), ValueError, r"seqlen_k must be a positive int, got -1"),
    (dict(heads=6, heads_k=4), ValueError, r"heads=6 must be a multiple of heads_k=4"),
    (dict(dtype="int8"), ValueError, r"dtype must be one of .* got 'int8'"),
    (dict(dtype=0), ValueError, r"dtype \(bytes per element\) must be a positive int, got 0"),
    (dict(dtype=[4]), TypeError, r"dtype must be a dtype name or a size in bytes"),
    (dict(window_size=(-2, 0)), ValueError, r"window_size\[0\] must be an int >= -1, got -2"),
    (dict(window_size=3), TypeError, r"window_size must be a pair"),
    (dict(causal=1), TypeError, r"causal must be a bool, got int"),
    (dict(block_m=0, l2_reuse=False), ValueError, r"block_m must be a positive int, got 0"),
    (dict(l2_reuse="no"), TypeError, r"l2_reuse must be a bool"),
])
def test_validation(kwargs, exc, match):
    args = dict(seqlen_q=64, headdim=16)
    args.update(kwargs)
    with pytest.raises(exc, match=r"^cuflash\.intensity: " + match):
        it.fused_attention_cost(args.pop("seqlen_q"), args.pop("headdim"), **args)


def test_roofline_validation():
    with pytest.raises(ValueError, match="device must be one of .* got 'p100'"):
        it.roofline(1, 1, "p100")
    with pytest.raises(TypeError, match="device must be a Device"):
        it.roofline(1, 1, 42)
    with pytest.raises(ValueError, match="nbytes must be an int >= 0, got -1"):
        it.roofline(1, -1, "h100")
    with pytest.raises(ValueError, match="no peak FLOP rate for 1-byte elements"):
        it.roofline(1, 1, "h100", dtype=1)
