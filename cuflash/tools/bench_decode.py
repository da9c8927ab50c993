"""``python -m cuflash bench --decode``: one paged decode step against the copy bandwidth.

A serving-sized decode shape (B=64 sequences, Hq=32 query heads over Hk=8 kv heads, head dim 128,
8192 cached tokens each, bf16, pages of 16 tokens scattered over the cache) through
:func:`cuflash.attention_with_kvcache` (split count from the heuristic, and 1), timed with CUDA
events (L2 flushed, median), as the cache bytes it must read per second (K and V of every cached
token, once per kv head), beside a device-to-device copy of a buffer as large as the cache
measured in the same run (read + write bytes per second: what the memory system sustains), and
FlashInfer's paged decode on the same cache when it is installed.
"""

from __future__ import annotations

import numpy as np

#: the decode shape timed: a serving batch (B=64, GQA 32/8, d128, 8192 cached tokens each, pages of 16)
SHAPE = dict(batch=64, heads_q=32, heads_k=8, head_dim=128, cache=8192, page=16)


def _inputs(cupy, rng, batch, heads_q, heads_k, head_dim, cache, page):
    from cuflash.runtime import dtypes

    pages = batch * cache // page
    bt = rng.permutation(pages).astype(np.int32).reshape(batch, cache // page)
    kc = cupy.random.standard_normal((pages, page, heads_k, head_dim), dtype=cupy.float32).astype(dtypes.bfloat16)
    vc = cupy.random.standard_normal((pages, page, heads_k, head_dim), dtype=cupy.float32).astype(dtypes.bfloat16)
    q = cupy.random.standard_normal((batch, 1, heads_q, head_dim), dtype=cupy.float32).astype(dtypes.bfloat16)
    return q, kc, vc, cupy.asarray(bt), cupy.full((batch,), cache, dtype=cupy.int32)


def run(timer, log=print) -> list[dict]:
    """Time the decode step and the copy; the records (one per implementation)."""
    import cupy

    import cuflash

    s = SHAPE
    rng = np.random.default_rng(0)
    q, kc, vc, bt, seqlens = _inputs(cupy, rng, s["batch"], s["heads_q"], s["heads_k"], s["head_dim"], s["cache"],
                                     s["page"])
    cache_bytes = 2 * kc.nbytes   # K and V, each byte read once per kv head
    out = cupy.empty(q.shape, q.dtype)
    records = []
    src = cupy.empty(kc.nbytes // 2, dtype=cupy.int32)
    dst = cupy.empty_like(src)
    ms = timer.median_ms(lambda: cupy.copyto(dst, src))
    copy_gbs = 2 * src.nbytes / (ms * 1e-3) / 1e9
    records.append(dict(impl="device copy", ms=ms, gb_per_s=copy_gbs, fraction_of_copy=1.0))
    for splits in (0, 1):
        ms = timer.median_ms(lambda splits=splits: cuflash.attention_with_kvcache(
            q, kc, vc, seqlens, block_table=bt, num_splits=splits, out=out))
        gbs = cache_bytes / (ms * 1e-3) / 1e9
        records.append(dict(impl=f"cuflash num_splits={splits}", ms=ms, gb_per_s=gbs, fraction_of_copy=gbs / copy_gbs))
    records.append(_flashinfer(timer, q, kc, vc, bt, s, cache_bytes, copy_gbs))
    return records


def _flashinfer(timer, q, kc, vc, bt, s, cache_bytes, copy_gbs) -> dict:
    try:
        import flashinfer
        import torch
    except ImportError:
        return dict(impl="flashinfer", ms=None, gb_per_s=None, fraction_of_copy=None, note="not installed")
    try:
        kv = torch.stack([torch.from_dlpack(kc), torch.from_dlpack(vc)], dim=1)   # (pages, 2, page, Hk, D)
        pages_per_seq = s["cache"] // s["page"]
        indptr = torch.arange(0, s["batch"] + 1, device="cuda", dtype=torch.int32) * pages_per_seq
        indices = torch.from_dlpack(bt).reshape(-1)
        last = torch.full((s["batch"],), s["page"], device="cuda", dtype=torch.int32)
        ws = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        wrapper.plan(indptr, indices, last, s["heads_q"], s["heads_k"], s["head_dim"], s["page"],
                     q_data_type=torch.bfloat16)
        qt = torch.from_dlpack(q).reshape(s["batch"], s["heads_q"], s["head_dim"])
        ms = timer.median_ms(lambda: wrapper.run(qt, kv))
        gbs = cache_bytes / (ms * 1e-3) / 1e9
        return dict(impl="flashinfer", ms=ms, gb_per_s=gbs, fraction_of_copy=gbs / copy_gbs)
    except Exception as e:  # noqa: BLE001 - a baseline that fails is reported, not fatal
        return dict(impl="flashinfer", ms=None, gb_per_s=None, fraction_of_copy=None,
                    note=f"failed: {type(e).__name__}: {e}"[:160])


def format_table(records: list[dict], device: str) -> str:
    s = SHAPE
    lines = [f"decode step on {device}: B={s['batch']}, Hq={s['heads_q']}, Hk={s['heads_k']}, D={s['head_dim']}, "
             f"{s['cache']} cached tokens each, bf16, pages of {s['page']} (GB/s of cache bytes read; the copy: "
             "read + write)",
             f"{'implementation':<24} {'ms':>8} {'GB/s':>8} {'of copy':>8}"]
    for r in records:
        if r["ms"] is None:
            lines.append(f"{r['impl']:<24} {'-':>8} {'-':>8} {'-':>8}  {r.get('note', '')}")
        else:
            lines.append(f"{r['impl']:<24} {r['ms']:>8.3f} {r['gb_per_s']:>8.0f} {100 * r['fraction_of_copy']:>7.0f}%")
    return "\n".join(lines)
