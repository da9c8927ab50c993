"""``python -m cuflash bench --fp8``: the fp8 (float8_e4m3fn) measurements, beside an fp8 GEMM.

* The fp8 KV-cache decode step: :func:`cuflash.attention_with_kvcache` over e4m3 caches with
  per-(sequence, kv head) descales (the tensor-core KV-cache kernel's fp8-cache form), on the
  serving shape of ``bench --decode`` (B=64, Hq=32 over Hk=8, head dim 128, 8192 cached tokens
  each, pages of 16), and the same step over bfloat16 caches: TFLOP/s (``4 B Hq Sq Skv D`` flops:
  the two matrix products) and the cache bytes read per second.
* The fp8 forward: :func:`cuflash.attention` with e4m3 q, k, v and per-(batch, kv head) descales,
  bf16 output (the Hopper forward's fp8 form, which runs on compute capability 9.0 only; elsewhere
  the record says why it did not run), on :data:`FORWARD` non-causal and causal: TFLOP/s of
  ``4 B H S^2 D`` flops (half that causal). The time includes the copy of V the form makes first.
* An fp8 GEMM measured in the same run: ``torch._scaled_mm`` on e4m3 operands (M = N = K = 8192,
  bf16 output), TFLOP/s, where torch with CUDA provides it.
* cuDNN's fp8 attention, where an installed framework exposes it (torch's
  ``scaled_dot_product_attention`` does not take fp8 tensors): a record with the reason when none
  does.

Timing is ``bench``'s (CUDA events, L2 flushed, median). :func:`plan` lists what a run measures,
without a GPU.
"""

from __future__ import annotations

import numpy as np

from cuflash.tools.bench_decode import SHAPE

#: the fp8 GEMM timed (torch._scaled_mm): M, N, K
GEMM = (8192, 8192, 8192)
#: the fp8 forward's shape (FA3's benchmark: 16k tokens, head dim 128)
FORWARD = dict(batch=2, heads=16, seqlen=8192, head_dim=128)


def forward_flops(s: dict = FORWARD, causal: bool = False) -> float:
    """Flops of one forward of ``s``: ``4 B H S^2 D`` (the two products), half of it causal."""
    f = 4.0 * s["batch"] * s["heads"] * s["seqlen"] ** 2 * s["head_dim"]
    return f / 2 if causal else f


def decode_flops(s: dict = SHAPE) -> float:
    """Flops of one decode step of ``s`` (one query row per sequence): ``4 B Hq Skv D``."""
    return 4.0 * s["batch"] * s["heads_q"] * s["cache"] * s["head_dim"]


def plan() -> list[dict]:
    """The measurements of one ``--fp8`` run, in order: ``name``, ``what`` and ``flops`` (None:
    reported without a rate)."""
    s = SHAPE
    shape = (f"B={s['batch']}, Hq={s['heads_q']}, Hk={s['heads_k']}, D={s['head_dim']}, {s['cache']} cached tokens, "
             f"pages of {s['page']}")
    m, n, k = GEMM
    f = FORWARD
    fwd = f"B={f['batch']}, H={f['heads']}, S={f['seqlen']}, D={f['head_dim']}"
    return [
        dict(name="cuflash decode, fp8 cache", what=f"attention_with_kvcache, e4m3 caches with descales, {shape}",
             flops=decode_flops()),
        dict(name="cuflash decode, bf16 cache", what=f"attention_with_kvcache, bf16 caches, {shape}",
             flops=decode_flops()),
        *(dict(name="cuflash fp8 forward" + (", causal" if causal else ""), causal=causal, flops=forward_flops(causal=causal),
               what=f"attention, e4m3 q, k, v with descales -> bf16, {fwd}" + (", causal" if causal else ""))
          for causal in (False, True)),
        dict(name="fp8 GEMM (torch._scaled_mm)", what=f"e4m3 x e4m3 -> bf16, M={m} N={n} K={k}", flops=2.0 * m * n * k),
        dict(name="cuDNN fp8 attention", what="through a framework that exposes it", flops=None),
    ]


def _decode_inputs(cupy, fp8: bool):
    from cuflash.runtime.interop import fp8_view
    from cuflash.tools.bench_decode import _inputs

    s = SHAPE
    q, kc, vc, bt, seqlens = _inputs(cupy, np.random.default_rng(0), s["batch"], s["heads_q"], s["heads_k"],
                                     s["head_dim"], s["cache"], s["page"])
    if not fp8:
        return q, kc, vc, bt, seqlens, {}
    import ml_dtypes

    def e4m3(x):   # the bytes of float8_e4m3fn(x / 0.25), through NumPy's cast on the host
        host = (cupy.asnumpy(x).astype(np.float32) * 4).astype(ml_dtypes.float8_e4m3fn)
        return fp8_view(cupy.asarray(host.view(np.uint8)))

    descale = cupy.full((s["batch"], s["heads_k"]), 0.25, dtype=cupy.float32)
    return q, e4m3(kc), e4m3(vc), bt, seqlens, dict(k_descale=descale, v_descale=descale)


def run(timer, log=print) -> list[dict]:
    """Time every measurement of :func:`plan` that this machine can run; one record each
    (``ms``, ``tflops`` and ``gb_per_s`` None, with a ``note``, when it cannot)."""
    import cupy

    import cuflash

    steps = plan()
    records = []
    for fp8, step in ((True, steps[0]), (False, steps[1])):
        q, kc, vc, bt, seqlens, kw = _decode_inputs(cupy, fp8)
        out = cupy.empty(q.shape, q.dtype)
        cache_bytes = 2 * kc.size * (1 if fp8 else 2)
        try:
            ms = timer.median_ms(lambda: cuflash.attention_with_kvcache(q, kc, vc, seqlens, block_table=bt, out=out,
                                                                        **kw))
            records.append(dict(step, ms=ms, tflops=step["flops"] / (ms * 1e-3) / 1e12,
                                gb_per_s=cache_bytes / (ms * 1e-3) / 1e9))
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            records.append(dict(step, ms=None, tflops=None, gb_per_s=None, note=f"failed: {type(e).__name__}: {e}"[:160]))
    inputs = None   # made once for both forward steps, dropped after them
    for step in steps[2:4]:
        try:
            inputs = inputs or _forward_inputs(cupy)
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            records.append(dict(step, ms=None, tflops=None, gb_per_s=None, note=f"failed: {type(e).__name__}: {e}"[:160]))
            continue
        records.append(_forward(timer, inputs, step))
    del inputs
    records.append(_scaled_mm(timer, steps[4]))
    records.append(dict(steps[5], ms=None, tflops=None, gb_per_s=None,
                        note="not run: no installed framework exposes cuDNN's fp8 attention (torch's "
                             "scaled_dot_product_attention takes no fp8 tensors)"))
    return records


def _forward_inputs(cupy):
    """e4m3 q, k, v of :data:`FORWARD` (CuPy bytes through :func:`cuflash.fp8_view`) and descales."""
    import ml_dtypes

    from cuflash.runtime.interop import fp8_view

    f = FORWARD
    rng = np.random.default_rng(0)
    shape = (f["batch"], f["heads"], f["seqlen"], f["head_dim"])
    qkv = [fp8_view(cupy.asarray((rng.standard_normal(shape, np.float32) * 4).astype(ml_dtypes.float8_e4m3fn)
                                 .view(np.uint8))) for _ in range(3)]
    descale = cupy.full((f["batch"], f["heads"]), 0.25, dtype=cupy.float32)
    return qkv, dict(q_descale=descale, k_descale=descale, v_descale=descale)


def _forward(timer, inputs, step) -> dict:
    """One fp8 forward record over ``inputs`` (:func:`_forward_inputs`): timed where a kernel tier
    takes it, else the reason it did not run."""
    import cuflash

    try:
        (q, k, v), kw = inputs
        kw = dict(kw, causal=step["causal"])
        cuflash.explain(q, k, v, **kw)   # (a device without the fp8 form: NotImplementedError, reported)
        ms = timer.median_ms(lambda: cuflash.attention(q, k, v, **kw))
        return dict(step, ms=ms, tflops=step["flops"] / (ms * 1e-3) / 1e12, gb_per_s=None)
    except NotImplementedError as e:
        return dict(step, ms=None, tflops=None, gb_per_s=None, note=f"not run: {e}"[:200])
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        return dict(step, ms=None, tflops=None, gb_per_s=None, note=f"failed: {type(e).__name__}: {e}"[:160])


def _scaled_mm(timer, step) -> dict:
    try:
        import torch
    except ImportError:
        return dict(step, ms=None, tflops=None, gb_per_s=None, note="not run: torch is not installed")
    if not torch.cuda.is_available() or not hasattr(torch, "_scaled_mm"):
        return dict(step, ms=None, tflops=None, gb_per_s=None, note="not run: torch has no CUDA _scaled_mm here")
    try:
        m, n, k = GEMM
        a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn).t()   # column-major, as _scaled_mm wants
        one = torch.ones((), device="cuda")
        ms = timer.median_ms(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
        return dict(step, ms=ms, tflops=step["flops"] / (ms * 1e-3) / 1e12, gb_per_s=None)
    except Exception as e:  # noqa: BLE001 - a baseline that fails is reported, not fatal
        return dict(step, ms=None, tflops=None, gb_per_s=None, note=f"failed: {type(e).__name__}: {e}"[:160])


def format_table(records: list[dict], device: str) -> str:
    lines = [f"fp8 on {device} (TFLOP/s measured here; the decode also as cache GB/s)",
             f"{'measurement':<30} {'ms':>8} {'TFLOP/s':>8} {'GB/s':>8}  what"]
    for r in records:
        if r["ms"] is None:
            lines.append(f"{r['name']:<30} {'-':>8} {'-':>8} {'-':>8}  {r['what']}: {r.get('note', '')}")
        else:
            gbs = f"{r['gb_per_s']:>8.0f}" if r["gb_per_s"] is not None else f"{'-':>8}"
            lines.append(f"{r['name']:<30} {r['ms']:>8.3f} {r['tflops']:>8.1f} {gbs}  {r['what']}")
    return "\n".join(lines)
