"""fp8 (float8_e4m3fn) input through the public API: the NumPy path against the rule, descales and
their refusals, torch and CuPy byte views, the kernel tiers' refusals (simulator and explain), and
the fp8 KV cache (NumPy path; the simulator's append byte for byte)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash.reference import fp8 as rfp8
from cuflash.reference import tolerance
from support.tolerance import check_close

E4M3 = ml_dtypes.float8_e4m3fn
BF16 = ml_dtypes.bfloat16


def fp8(rng, shape, scale=3.0):
    return np.clip(rng.standard_normal(shape) * scale, -448, 448).astype(E4M3)


def descales(rng, shape):
    return rng.uniform(0.25, 4.0, shape).astype(np.float32)


# covering grid: layouts, GQA, Sq != Sk, causal / window, per-head and stride-0 descales, out_dtype
GRID = [
    ("bhsd", (2, 4, 9, 32), (2, 2, 23, 32), dict(causal=True), "per-head", None),
    ("bshd", (2, 17, 4, 64), (2, 6, 1, 64), dict(window_size=(3, 2)), "stride0", "float16"),
    ("bhsd", (1, 2, 30, 40), (1, 2, 30, 40), dict(), "none", "bfloat16"),   # Dv = 48
    ("bshd", (3, 5, 2, 16), (3, 12, 2, 16), dict(causal=True, window_size=(4, -1)), "per-head", "float16"),
]


@pytest.mark.parametrize("layout, qshape, kshape, mask, kind, out_dtype", GRID)
def test_fp8_numpy_path_within_the_rule(layout, qshape, kshape, mask, kind, out_dtype):
    rng = np.random.default_rng(len(qshape) + qshape[1])
    q, k = fp8(rng, qshape), fp8(rng, kshape)
    vshape = kshape[:-1] + (48 if kind == "none" else kshape[-1],)
    v = fp8(rng, vshape)
    b, hk = kshape[0], kshape[1 if layout == "bhsd" else 2]
    kw = dict(mask, layout=layout, out_dtype=out_dtype)
    if kind == "per-head":
        kw.update(q_descale=descales(rng, (b, hk)), k_descale=descales(rng, (b, hk)), v_descale=descales(rng, (b, hk)))
    elif kind == "stride0":
        kw.update(q_descale=np.broadcast_to(np.float32(0.5), (b, hk)), k_descale=np.broadcast_to(np.float32(0.125), (b, hk)),
                  v_descale=np.broadcast_to(np.float32(2.0), (b, hk)))
    out, lse = cuflash.attention(q, k, v, return_lse=True, **kw)
    assert out.dtype == np.dtype(out_dtype or BF16) and lse.dtype == np.float32
    check_close(out, q, k, v, lse=lse, **kw)


def test_values_near_e4m3_max_and_empty_rows():
    rng = np.random.default_rng(7)
    q = np.full((1, 2, 6, 16), 448, np.float32).astype(E4M3)
    q[..., ::2] = -448
    k, v = fp8(rng, (1, 2, 3, 16), 200), fp8(rng, (1, 2, 3, 16), 200)
    kw = dict(causal=True, q_descale=np.full((1, 2), 1 / 64, np.float32), k_descale=np.full((1, 2), 1 / 64, np.float32))
    out, lse = cuflash.attention(q, k, v, return_lse=True, **kw)
    # causal with Sq > Sk: the first three rows see no key (0, lse = -inf)
    assert (out[:, :, :3].astype(np.float32) == 0).all() and np.isneginf(lse[:, :, :3]).all()
    assert np.isfinite(out.astype(np.float32)).all()
    check_close(out, q, k, v, lse=lse, **kw)


def test_out_buffer_of_the_result_dtype():
    rng = np.random.default_rng(8)
    q, k, v = fp8(rng, (1, 2, 5, 16)), fp8(rng, (1, 2, 7, 16)), fp8(rng, (1, 2, 7, 16))
    out = np.empty((1, 2, 5, 16), np.float16)
    got = cuflash.attention(q, k, v, out=out, out_dtype="float16")
    assert got is out
    np.testing.assert_array_equal(out, cuflash.attention(q, k, v, out_dtype=np.float16))
    with pytest.raises(TypeError, match=r"out.dtype=float16 must equal the result's dtype bfloat16 \(out_dtype of fp8"):
        cuflash.attention(q, k, v, out=out)


def _qkv(rng=None):
    rng = rng or np.random.default_rng(0)
    return fp8(rng, (2, 4, 5, 8)), fp8(rng, (2, 2, 6, 8)), fp8(rng, (2, 2, 6, 8))


@pytest.mark.parametrize("kw, exc, pattern", [
    (dict(q_descale=np.ones((2, 4), np.float32)), ValueError, r"q_descale.shape=\(2, 4\) must be \(2, 2\) \(batch, kv heads\)"),
    (dict(k_descale=np.ones((2,), np.float32)), ValueError, r"k_descale.shape=\(2,\) must be \(2, 2\)"),
    (dict(v_descale=np.ones((2, 2), np.float64)), TypeError, r"v_descale must be float32, got v_descale.dtype=float64"),
    (dict(k_descale=np.array([[1, 0], [1, 1]], np.float32)), ValueError, r"k_descale\[0, 1\]=0.0 must be finite and > 0"),
    (dict(q_descale=np.array([[1, 1], [-2, 1]], np.float32)), ValueError, r"q_descale\[1, 0\]=-2.0 must be finite"),
    (dict(v_descale=np.array([[1, np.nan], [1, 1]], np.float32)), ValueError, r"v_descale\[0, 1\]=nan must be finite"),
    (dict(v_descale=np.array([[1, 1], [np.inf, 1]], np.float32)), ValueError, r"v_descale\[1, 0\]=inf must be finite"),
    (dict(q_descale=[[1.0, 1.0], [1.0, 1.0]]), TypeError, r"q_descale must be an array"),
    (dict(out_dtype="float32"), ValueError, r"out_dtype must be bfloat16 or float16 .* got 'float32'"),
    (dict(dropout_p=0.1, dropout_seed=1), NotImplementedError, r"float8_e4m3fn input takes no dropout"),
])
def test_fp8_refusals_name_the_argument(kw, exc, pattern):
    q, k, v = _qkv()
    with pytest.raises(exc, match=r"cuflash.attention: " + pattern):
        cuflash.attention(q, k, v, **kw)


def test_descales_and_out_dtype_need_fp8_input():
    q, k, v = (x.astype(np.float16) for x in _qkv())
    with pytest.raises(ValueError, match=r"q_descale is a descale of float8_e4m3fn input, but q.dtype=float16"):
        cuflash.attention(q, k, v, q_descale=np.ones((2, 2), np.float32))
    with pytest.raises(ValueError, match=r"out_dtype='bfloat16' applies to float8_e4m3fn input only"):
        cuflash.attention(q, k, v, out_dtype="bfloat16")
    q8, k8, v8 = _qkv()
    with pytest.raises(TypeError, match=r"k.dtype=float16 must equal q.dtype=float8_e4m3fn"):
        cuflash.attention(q8, k, v8)


def test_fp8_has_no_backward():
    q, k, v = _qkv()
    out = np.zeros((2, 4, 5, 8), BF16)
    lse = np.zeros((2, 4, 5), np.float32)
    with pytest.raises(NotImplementedError, match=r"cuflash.attention_backward: .*float8_e4m3fn.*a backward in fp8 is "
                                                  r"out of scope"):
        cuflash.attention_backward(out, q, k, v, out, lse)


def test_kernel_tiers_refuse_fp8_naming_tier_and_arch():
    """Off compute capability 9.0 no tier has an fp8 form: the refusal names each tier and the arch
    (the Hopper fp8 form runs on sm_90: tests/kernels/test_hopper_fp8.py)."""
    q, k, v = _qkv()
    with cuflash.sim.options(arch="sm_80"):
        with pytest.raises(NotImplementedError, match=r"cuflash.attention: no kernel takes this call on sm_80: Hopper "
                                                      r"wgmma tier not used: .*sm_90a.*; "
                                                      r"tensor-core mma.sync tier not used: it has no fp8"):
            cuflash.attention(q, k, v, backend="sim")
    with pytest.raises(NotImplementedError, match=r"cuflash.explain: no kernel takes this call on sm_80: Hopper wgmma tier "
                                                  r"not used: .*; tensor-core mma.sync tier not used: it has no fp8 "
                                                  r"\(float8_e4m3fn\) form"):
        cuflash.explain(q, k, v, arch=80)
    assert cuflash.explain(q, k, v)["backend"] == "numpy"


def test_explain_names_the_hopper_fp8_form():
    rng = np.random.default_rng(3)
    q, k, v = fp8(rng, (2, 4, 5, 16)), fp8(rng, (2, 2, 6, 16)), fp8(rng, (2, 2, 6, 16))
    got = cuflash.explain(q, k, v, causal=True, arch=90)
    assert got["tier"] == "attention_fwd_sm90" and got["entry"] == "cuflash_attn_fwd_sm90_bf16_d64_local_e4m3"
    assert "fp8 (float8_e4m3fn) q, k, v, bfloat16 output" in got["choice"] and "Bc=128" in got["choice"]
    assert cuflash.explain(q, k, v, arch=90, out_dtype="float16")["entry"] == "cuflash_attn_fwd_sm90_f16_d64_e4m3"
    # what the fp8 form does not take stays a clear refusal naming the reason
    with pytest.raises(NotImplementedError, match=r"Hopper wgmma tier not used: score modifiers \(softcap\) are not "
                                                  r"in the Hopper fp8 forward"):
        cuflash.explain(q, k, v, arch=90, softcap=5.0)
    with pytest.raises(NotImplementedError, match=r"Hopper wgmma tier not used: .*D a multiple of 16"):
        cuflash.explain(*_qkv(), arch=90)   # (head dim 8)


def test_fp8_view_of_numpy_bytes():
    rng = np.random.default_rng(2)
    q, k, v = _qkv(rng)
    qb, kb, vb = (x.view(np.uint8).copy() for x in (q, k, v))
    got = cuflash.attention(*(cuflash.fp8_view(x) for x in (qb, kb, vb)))
    np.testing.assert_array_equal(got, cuflash.attention(q, k, v))
    assert cuflash.fp8_view(q) is q
    with pytest.raises(TypeError, match=r"cuflash.fp8_view: x must be a uint8 array .* of dtype int8"):
        cuflash.fp8_view(qb.view(np.int8))


class FakeCupyArray:
    """Stands for cupy.ndarray (recognised by type name); a real one needs a GPU."""

    def __init__(self, a):
        self.shape, self.dtype, self.strides = a.shape, a.dtype, a.strides
        self.device = type("Device", (), {"id": 0})()


FakeCupyArray.__name__ = FakeCupyArray.__qualname__ = "ndarray"
FakeCupyArray.__module__ = "cupy._core.core"


def test_fp8_view_of_cupy_bytes_is_validated_before_device_work():
    q, k, v = (FakeCupyArray(x.view(np.uint8)) for x in _qkv())
    views = [cuflash.fp8_view(x) for x in (q, k, v)]
    assert all(isinstance(x, cuflash.runtime.interop.Float8Array) for x in views)
    with pytest.raises(TypeError, match=r"q.dtype=uint8 is not supported"):
        cuflash.attention(q, k, v)   # raw bytes without the view are not fp8
    with pytest.raises(ValueError, match=r"k_descale.shape=\(2, 4\) must be \(2, 2\)"):
        cuflash.attention(*views, k_descale=np.ones((2, 4), np.float32))   # (NumPy descales: refused by kind next)
    with pytest.raises(NotImplementedError, match=r"no kernel takes this call on sm_80: Hopper wgmma tier not used"):
        cuflash.explain(*views, arch=80)


def test_torch_fp8_tensors():
    torch = pytest.importorskip("torch")
    q, k, v = _qkv(np.random.default_rng(5))
    tq, tk, tv = (torch.from_numpy(x.view(np.uint8)).view(torch.float8_e4m3fn) for x in (q, k, v))
    # torch exports fp8 through DLPack, but NumPy's import refuses it: cuflash views the bytes instead
    with pytest.raises(Exception, match="Unsupported dtype"):
        np.from_dlpack(tq)
    d = torch.full((2, 2), 0.5)
    got = cuflash.attention(tq, tk, tv, q_descale=d, k_descale=d)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16
    want = cuflash.attention(q, k, v, q_descale=d.numpy(), k_descale=d.numpy())
    np.testing.assert_array_equal(got.view(torch.int16).numpy(), want.view(np.int16))
    assert cuflash.fp8_view(tq.view(torch.uint8)).dtype == torch.float8_e4m3fn


def test_torch_adapter_forwards_fp8_and_refuses_its_gradient():
    torch = pytest.importorskip("torch")
    import cuflash.torch as ct
    q, k, v = _qkv(np.random.default_rng(6))
    tq, tk, tv = (torch.from_numpy(x.view(np.uint8)).view(torch.float8_e4m3fn) for x in (q, k, v))
    d = torch.full((2, 2), 0.5)
    got = ct.attention(tq, tk, tv, q_descale=d, k_descale=d, out_dtype="float16")
    want = cuflash.attention(q, k, v, q_descale=d.numpy(), k_descale=d.numpy(), out_dtype="float16")
    assert got.dtype == torch.float16
    np.testing.assert_array_equal(got.numpy(), want)
    bq = torch.zeros(2, 2, 3, 16, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(TypeError, match="fp8 attention .* has no backward.*q requires grad"):
        ct.attention(bq, bq.detach(), bq.detach(), q_descale=d)


# --------------------------------------------------------------------------------------------
# the fp8 KV cache


def _cache_case(rng, paged):
    b, hq, hk, d = 2, 4, 2, 32
    q = rng.standard_normal((b, 2, hq, d)).astype(BF16)
    if paged:
        kc = fp8(rng, (5, 8, hk, d), 1.0)
        extra = dict(block_table=np.array([[3, 0, 4], [1, 2, 0]], np.int32))
    else:
        kc = fp8(rng, (3, 20, hk, d), 1.0)
        extra = dict(cache_batch_idx=np.array([2, 0], np.int32))
    vc = fp8(rng, kc.shape, 1.0)
    kn = (rng.standard_normal((b, 3, hk, d)) * 100).astype(BF16)
    vn = rng.standard_normal((b, 3, hk, d)).astype(BF16)
    kn[0, 0, 0, :8] = np.array([480, np.inf, -np.inf, np.nan, 464, 2.0**-10, 3 * 2.0**-11, -1e-30])   # descale 1 there
    kd = descales(rng, (b, hk))
    kd[0, 0] = 1.0
    vd = np.broadcast_to(np.float32(0.25), (b, hk))
    return q, kc, vc, np.array([5, 12], np.int32), dict(k=kn, v=vn, k_descale=kd, v_descale=vd, **extra)


def test_fp8_kv_cache_numpy_path_dequantizes_and_quantizes():
    rng = np.random.default_rng(11)
    q, kc, vc, seqlens, kw = _cache_case(rng, paged=True)
    kn, vn, kd, vd, bt = kw["k"], kw["v"], kw["k_descale"], kw["v_descale"], kw["block_table"]
    before = kc.copy()
    kn = kn.copy()
    kn[0, 0, 0, 3] = 1.0   # no NaN: the attention below must be finite
    kw["k"] = kn
    out, lse = cuflash.attention_with_kvcache(q, kc, vc, seqlens, causal=True, return_lse=True, **kw)
    assert out.dtype == BF16
    # the append: token t of sequence b at cache index seqlens[b] + t, stored as x / descale saturated
    page, row = bt[0, 5 // 8], 5 % 8
    np.testing.assert_array_equal(kc[page, row, 0, :3].astype(np.float32), [448, 448, -448])   # 480, inf, -inf
    assert (kc.view(np.uint8) != before.view(np.uint8)).sum() > 0
    for b in range(2):
        n = int(seqlens[b]) + 3
        pos = np.arange(n)
        rows = (bt[b, pos // 8], pos % 8)
        keys = kc[rows].astype(np.float64) * kd[b][:, None].astype(np.float64)   # (n, Hk, D)
        vals = vc[rows].astype(np.float64) * vd[b][:, None].astype(np.float64)
        qq = q[b].astype(np.float64)                                            # (Sq, Hq, D)
        ref = np.zeros((2, 4, 32))
        for h in range(4):
            s = qq[:, h] @ keys[:, h // 2].T / np.sqrt(32)
            s = np.where(pos[None, :] <= np.arange(2)[:, None] + n - 2, s, -np.inf)
            e = np.exp(s - s.max(axis=1, keepdims=True))
            ref[:, h] = (e / e.sum(axis=1, keepdims=True)) @ vals[:, h // 2]
        # bf16 output: unit roundoff 2**-9 of |out| <= max|v| (a convex combination), float32 work far below
        bound = 2.0**-8 * np.abs(vals).max()
        assert np.abs(out[b].astype(np.float64) - ref).max() <= bound


@pytest.mark.parametrize("paged", [True, False])
def test_fp8_append_on_the_simulator_writes_numpy_s_bytes(paged):
    """The append kernel (its fp8 store, cvt.rn.satfinite.e4m3x2.f32 emulated) and the NumPy path
    leave byte-for-byte equal caches, saturating values and NaN included."""
    from cuflash.kernels import kvcache_run
    from cuflash.runtime.device_call import DeviceCall
    from cuflash.runtime.options import CacheOptions, Fp8Options, Options
    from cuflash.runtime.validation_kvcache import check_attention_with_kvcache
    from cuflash.sim.device import SimDevice

    rng = np.random.default_rng(12 + paged)
    q, kc, vc, seqlens, kw = _cache_case(rng, paged)
    kc_sim, vc_sim = kc.copy(), vc.copy()
    cuflash.attention_with_kvcache(q, kc, vc, seqlens, **kw)   # the NumPy path's append (and attention)
    where = {n: kw.get(n) for n in ("cache_batch_idx", "block_table")}
    options = Options(layout="bshd", fp8=Fp8Options(None, kw["k_descale"], kw["v_descale"]),
                      cache=CacheOptions(seqlens, kw["k"], kw["v"], cache_batch_idx=where["cache_batch_idx"],
                                         block_table=where["block_table"]))
    problem = check_attention_with_kvcache(q, kc_sim, vc_sim, options)
    with DeviceCall(problem.func, SimDevice(), q) as call:
        kvcache_run.run_append(problem.on_device(call.import_array), call.import_array(q), call)
    np.testing.assert_array_equal(kc_sim.view(np.uint8), kc.view(np.uint8))
    np.testing.assert_array_equal(vc_sim.view(np.uint8), vc.view(np.uint8))
    assert 0x7F in kc.view(np.uint8) and 0x7E in kc.view(np.uint8)   # the NaN and the saturated 448 were written


def test_fp8_kv_cache_refusals():
    rng = np.random.default_rng(13)
    q, kc, vc, seqlens, kw = _cache_case(rng, paged=True)
    bt = kw["block_table"]
    before = kc.view(np.uint8).copy()
    with pytest.raises(NotImplementedError, match=r"cuflash.attention_with_kvcache: an fp8 \(float8_e4m3fn\) KV cache has "
                                                  r"no kernel for this call on sm_90: .*takes no score modifiers "
                                                  r"\(alibi_slopes given\).*Nothing was appended"):
        cuflash.attention_with_kvcache(q, kc, vc, seqlens, backend="sim", alibi_slopes=np.ones(4, np.float32), **kw)
    np.testing.assert_array_equal(kc.view(np.uint8), before)
    with pytest.raises(TypeError, match=r"v_cache.dtype=bfloat16 must equal k_cache.dtype=float8_e4m3fn"):
        cuflash.attention_with_kvcache(q, kc, vc.astype(BF16), seqlens, block_table=bt)
    with pytest.raises(ValueError, match=r"k_descale is a descale of float8_e4m3fn input, but k_cache.dtype=bfloat16"):
        cuflash.attention_with_kvcache(q, kc.astype(BF16), vc.astype(BF16), seqlens, block_table=bt,
                                       k_descale=kw["k_descale"])
    with pytest.raises(ValueError, match=r"k_descale.shape=\(2, 4\) must be \(2, 2\)"):
        cuflash.attention_with_kvcache(q, kc, vc, seqlens, block_table=bt, k_descale=np.ones((2, 4), np.float32))
    with pytest.raises(ValueError, match=r"v_descale\[0, 0\]=0.0 must be finite and > 0"):
        cuflash.attention_with_kvcache(q, kc, vc, seqlens, block_table=bt, v_descale=np.zeros((2, 2), np.float32))
    with pytest.raises(NotImplementedError, match=r"q.dtype=float8_e4m3fn: with a KV cache q is float16"):
        cuflash.attention_with_kvcache(q.astype(E4M3), kc, vc, seqlens, block_table=bt)
    np.testing.assert_array_equal(kc.view(np.uint8), before)


def test_fp8_append_kernel_compiles_with_the_satfinite_store():
    """The fp8-cache append compiles (NVRTC 12 where installed, else 13) without spills for sm_80
    (cuda_fp8.h's software conversion) and sm_90, whose SASS holds the e4m3 conversion."""
    import re

    from cuflash.kernels.kvcache_append import KVCacheAppend
    from cuflash.runtime import cuda_runner, nvrtc, source

    major = next((m for m in (12, 13) if nvrtc.find(m) is not None), None)
    if major is None:
        pytest.fail("no NVRTC installed (the test extra brings nvidia-cuda-nvrtc-cu12)")
    v = KVCacheAppend("bf16", "f32", "e4m3")
    assert v.entry == "cuflash_kvcache_append_bf16_f32_e4m3" and KVCacheAppend("bf16", "f32").entry.endswith("bf16_f32")
    for arch in (80, 90):
        cubin, log = cuda_runner.nvrtc_compile(source.build_source(v), arch, name=v.source,
                                               extra_options=("-Xptxas=-v",), nvrtc=nvrtc.load(major))
        spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", log)]
        assert spills and max(spills) == 0, log
    try:
        from cuflash.analysis.roofline import disassemble

        sass = disassemble(cubin)
    except RuntimeError:
        return   # the disassembler wheels are optional; the compile itself was checked
    assert "F2FP.SATFINITE.E4M3.F32" in sass


@pytest.mark.slow
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("mask", [dict(), dict(causal=True), dict(window_size=(17, 5)), dict(causal=True, window_size=(40, -1))])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)])
def test_fp8_numpy_path_full_grid(d, mask, heads):
    """The full cross-product (head dims 64/128/256, masks, MHA/GQA/MQA) with per-head descales
    and values up to e4m3's max."""
    rng = np.random.default_rng(d + heads[0] * 7 + len(mask))
    hq, hk = heads
    q, k, v = fp8(rng, (2, hq, 77, d), 100), fp8(rng, (2, hk, 131, d), 100), fp8(rng, (2, hk, 131, d), 100)
    kw = dict(mask, q_descale=descales(rng, (2, hk)) / 40, k_descale=descales(rng, (2, hk)) / 40,
              v_descale=descales(rng, (2, hk)))
    out, lse = cuflash.attention(q, k, v, return_lse=True, **kw)
    check_close(out, q, k, v, lse=lse, **kw)
