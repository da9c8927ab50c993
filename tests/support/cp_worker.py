"""The body of tests/adapters/test_context_parallel.py's spawned ranks (importable by the children).

Every rank builds the same full q, k, v (one seed), takes its shard, runs ring or Ulysses
attention and its backward, and compares its rows of the output and its shards' gradients with
single-process ``cuflash.torch.attention`` on the full sequence. Each case raises on failure; the
parent sees the traceback of any rank.
"""

from __future__ import annotations

import datetime
import zlib

import torch
import torch.distributed as dist

import cuflash.torch as ct

#: (mode, causal, (Hq, Hk), head dim, zigzag)
CASES = [
    ("ring", False, (4, 4), 64, None), ("ring", True, (4, 2), 64, None), ("ring", True, (4, 1), 128, None),
    ("ring", False, (8, 2), 128, None), ("ring", True, (4, 4), 64, False),
    ("ulysses", False, (4, 4), 64, None), ("ulysses", True, (8, 2), 64, None), ("ulysses", True, (4, 1), 128, None),
    ("ulysses", False, (8, 4), 128, None),
]
#: shard length per rank: not powers of two, even (zigzag's two chunks)
SHARD = 14


def _full(seed, b, s, hq, hk, d, dtype):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=dtype) for shape in
            ((b, s, hq, d), (b, s, hk, d), (b, s, hk, d), (b, s, hq, d))]


def _shard(x, mode, causal, zigzag, world, rank):
    if mode == "ring" and causal and zigzag is not False:
        return ct.zigzag_split(x)
    return x.chunk(world, dim=1)[rank]


def _close(name, got, want, tol):
    err = (got.double() - want.double()).abs().max().item()
    scale = max(1.0, want.double().abs().max().item())
    if not err <= tol * scale:
        raise AssertionError(f"{name}: max error {err:.3g} > {tol * scale:.3g}")


def check_case(mode, causal, heads, d, zigzag, world, rank, dtype=torch.float32):
    hq, hk = heads
    seed = zlib.crc32(repr((mode, causal, heads, d)).encode())   # the same on every rank (hash() is not)
    q, k, v, w = _full(seed, 2, SHARD * world, hq, hk, d, dtype)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = ct.attention(*leaves, causal=causal, layout="bshd")
    (ref * w).sum().backward()
    shards = [_shard(x, mode, causal, zigzag, world, rank).detach().clone().requires_grad_() for x in (q, k, v)]
    fn = ct.ring_attention if mode == "ring" else ct.ulysses_attention
    kw = dict(causal=causal)
    if mode == "ring" and zigzag is not None:
        kw["zigzag"] = zigzag
    out = fn(*shards, **kw)
    (out * _shard(w, mode, causal, zigzag, world, rank)).sum().backward()
    # 16-bit: each block's output is rounded before the merge (single-process attention rounds once)
    tol = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    _close(f"{mode} out", out, _shard(ref.detach(), mode, causal, zigzag, world, rank), tol)
    for name, s, full in zip("qkv", shards, leaves):
        _close(f"{mode} d{name}", s.grad, _shard(full.grad, mode, causal, zigzag, world, rank), tol)


def expect_error(exc, match, fn):
    try:
        fn()
    except exc as e:
        if match not in str(e):
            raise AssertionError(f"expected {exc.__name__} with {match!r}, got: {e}") from e
        return
    raise AssertionError(f"expected {exc.__name__} with {match!r}, nothing was raised")


def run(rank: int, world: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        for case in CASES:
            mode, causal, heads, d, zigzag = case
            if mode == "ulysses" and heads[0] % world:
                continue
            check_case(*case, world, rank)
        check_case("ring", True, (4, 2), 64, None, world, rank, dtype=torch.float64)
        for dt in (torch.bfloat16, torch.float16):   # 16-bit blocks join float32 accumulators
            check_case("ring", True, (4, 2), 64, None, world, rank, dtype=dt)
            check_case("ring", False, (4, 1), 64, False, world, rank, dtype=dt)
            check_case("ulysses", True, (4, 2), 64, None, world, rank, dtype=dt)
        # world size 1 (a group of this rank alone): plain attention, bit for bit
        singles = [dist.new_group([r]) for r in range(world)]
        q, k, v, _ = _full(5, 1, 9, 4, 2, 64, torch.float32)
        for causal in (False, True):
            want = ct.attention(q, k, v, causal=causal, layout="bshd")
            for fn in (ct.ring_attention, ct.ulysses_attention):
                got = fn(q, k, v, causal=causal, group=singles[rank], zigzag=False) if fn is ct.ring_attention \
                    else fn(q, k, v, causal=causal, group=singles[rank])
                if not torch.equal(got, want):
                    raise AssertionError(f"{fn.__name__} on a group of one differs from plain attention")
        # zigzag split/merge round trip, exactly
        x = torch.randn(2, 4 * world * 3, 3, 5, generator=torch.Generator().manual_seed(9))   # one x on every rank
        if not torch.equal(ct.zigzag_merge(ct.zigzag_split(x)), x):
            raise AssertionError("zigzag_merge(zigzag_split(x)) != x")
        # misuse: the same clear error on every rank, no hang
        mine = torch.randn(1, 10 + 2 * rank, 4, 16)
        expect_error(ValueError, "shard lengths differ", lambda: ct.ring_attention(mine, mine, mine))
        typed = torch.randn(1, 10, 4, 16, dtype=torch.float32 if rank == 0 else torch.float64)
        expect_error(ValueError, "q dtypes differ", lambda: ct.ulysses_attention(typed, typed, typed))
        odd = torch.randn(1, 10, 3 * world + 1, 16)
        expect_error(ValueError, "query heads must be divisible by the world size",
                     lambda: ct.ulysses_attention(odd, odd, odd))
        expect_error(NotImplementedError, "ring attention takes no window",
                     lambda: ct.ring_attention(q, k, v, window_size=(4, 0)))
        dist.barrier()
    finally:
        dist.destroy_process_group()
