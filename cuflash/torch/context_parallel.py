"""Context parallelism over ``torch.distributed``: ring attention and DeepSpeed-Ulysses, exported
as ``cuflash.torch.ring_attention``, ``ulysses_attention``, ``zigzag_split``, ``zigzag_merge``
and ``merge_attention``.

One sequence is split across the ranks of a process group, each holding an equal shard of q, k
and v; attention over the whole sequence is computed without any rank holding all of it:

* **Ring** (Liu et al. 2023, "Ring Attention with Blockwise Transformers"; the flash-attn LSE
  merge of ring-flash-attention): the K/V shards travel around the ring with point-to-point
  ``batch_isend_irecv``, the next transfer in flight while the current block is attended; each
  rank merges its partial outputs by their log-sum-exp (:func:`merge_attention`'s identity). The
  backward sends each K/V shard around again with its dK/dV accumulators, which arrive back at
  their owner after the last step; dQ stays local. With ``causal=True`` the shards should be laid
  out by :func:`zigzag_split` (rank ``r`` holds chunks ``r`` and ``2W - 1 - r`` of ``2W``), so every
  rank does the same work; blocks that causality hides entirely are never computed.
* **Ulysses** (Jacobs et al. 2023, "DeepSpeed Ulysses"): ``all_to_all_single`` turns the sequence
  shards into head shards (each rank then holds the full sequence for ``H / W`` heads), cuflash
  attention runs locally, and a second all-to-all turns the result back; the backward does the
  same with the gradients.

No communication layer of our own: ``torch.distributed`` (NCCL for CUDA tensors, gloo for CPU
tensors, where the local attention is the NumPy path). Each call starts with one small
``all_gather`` of the shards' shapes and dtypes, so a mismatch between ranks is a ``ValueError``
on every rank instead of a hang. Its cost: one collective of 11 integers and, with NCCL, a
device-to-host read of them (a host synchronization per call, before any attention work).

Imports: torch (it is an adapter); cuflash's public functions for the local attention.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from cuflash.api.attention import attention as _attention
from cuflash.api.backward import attention_backward as _attention_backward
from cuflash.runtime import validation

__all__ = ["ring_attention", "ulysses_attention", "zigzag_split", "zigzag_merge", "merge_attention"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# --------------------------------------------------------------------------------------------
# merging partial results


def merge_attention(outs, lses):
    """:func:`cuflash.merge_attention` in torch operations: differentiable in every ``out`` and
    ``lse`` (ring attention's backward needs it), on CPU and CUDA tensors, traceable by
    ``torch.compile``.

    ``lse = log(sum_i exp(lse_i))``, ``out = sum_i exp(lse_i - lse) out_i`` in float32 (float64
    for float64), with :func:`cuflash.merge_attention`'s rule for empty and non-finite parts: a
    part with ``lse = -inf`` adds nothing (even when its ``out`` holds NaN; its gradients are 0),
    a row empty in every part gives 0 and ``-inf`` with zero gradients (no NaN from ``-inf -
    -inf``), and a NaN ``lse``, or a NaN in the ``out`` of a part that counts, makes its row NaN.

    Parameters
    ----------
    outs : list or tuple of torch.Tensor ``(..., Sq, Dv)``
    lses : list or tuple of torch.Tensor ``(..., Sq)``

    Returns
    -------
    out : torch.Tensor of the parts' dtype; lse : float32 (float64) torch.Tensor

    Raises
    ------
    TypeError
        ``outs`` or ``lses`` not a list or tuple (a tensor is refused: its first axis is not a
        list of parts), a part that is not a tensor.
    ValueError
        No part, different numbers of ``outs`` and ``lses``, shapes or dtypes that disagree, a
        meta tensor.
    """
    func = "cuflash.torch.merge_attention"
    for name, seq in (("outs", outs), ("lses", lses)):
        if not isinstance(seq, (list, tuple)):
            raise TypeError(f"{func}: {name} must be a list or tuple of torch.Tensors (one per part), got "
                            f"{type(seq).__module__}.{type(seq).__qualname__}")
    outs, lses = list(outs), list(lses)
    if not outs or len(outs) != len(lses):
        raise ValueError(f"{func}: outs and lses must be non-empty and of one length, got {len(outs)} and {len(lses)}")
    for i, (o, s) in enumerate(zip(outs, lses)):
        if not isinstance(o, torch.Tensor) or not isinstance(s, torch.Tensor):
            raise TypeError(f"{func}: outs[{i}] and lses[{i}] must be torch.Tensors")
        for name, x in ((f"outs[{i}]", o), (f"lses[{i}]", s)):
            if x.device.type == "meta":
                raise ValueError(f"{func}: {name} is on device {x.device} (a tensor with a shape but no data), "
                                 f"which cuflash cannot compute on; expected CPU or CUDA tensors")
        if o.shape != outs[0].shape or o.dtype != outs[0].dtype:
            raise ValueError(f"{func}: outs[{i}] is {tuple(o.shape)} {o.dtype}, outs[0] {tuple(outs[0].shape)} "
                             f"{outs[0].dtype}; the parts must agree")
        if s.shape != o.shape[:-1]:
            raise ValueError(f"{func}: lses[{i}].shape={tuple(s.shape)} must be {tuple(o.shape[:-1])}")
    acc = torch.float64 if outs[0].dtype == torch.float64 or any(s.dtype == torch.float64 for s in lses) \
        else torch.float32
    lse = torch.stack([s.to(acc) for s in lses])
    m = lse.detach().amax(dim=0)
    m = torch.where(torch.isneginf(m) | torch.isnan(m), torch.zeros_like(m), m)
    w = torch.exp(lse - m)
    total = w.sum(dim=0)
    empty = total == 0
    total_safe = torch.where(empty, torch.ones_like(total), total)
    lse_out = torch.where(empty, torch.full_like(total, -math.inf), m + torch.log(total_safe))
    # a part with lse -inf adds nothing: its out is masked before the product (no 0 * NaN, and a
    # zero gradient for it)
    parts = (torch.where(torch.isneginf(lses[i]).unsqueeze(-1), 0.0, outs[i].to(acc)) for i in range(len(outs)))
    o = sum(w[i].unsqueeze(-1) * part for i, part in enumerate(parts))
    return (o / total_safe.unsqueeze(-1)).to(outs[0].dtype), lse_out


def _merge_into(out_acc, lse_acc, o, lse):
    """Merge one block's ``o`` ``(B, S, H, Dv)`` and ``lse`` ``(B, H, S)`` into the running float32
    (float64) accumulators (views of this rank's rows) with :func:`merge_attention`, in place; no
    autograd (the ring's own backward handles the gradients)."""
    with torch.no_grad():   # the block (16-bit for 16-bit input) joins in the accumulators' dtype
        out, new = merge_attention([out_acc.transpose(1, 2), o.to(out_acc.dtype).transpose(1, 2)], [lse_acc, lse])
    out_acc.copy_(out.transpose(1, 2))
    lse_acc.copy_(new)


# --------------------------------------------------------------------------------------------
# checks


def _group_of(group, func: str):
    if not dist.is_available():
        raise ValueError(f"{func}: torch.distributed is not available in this torch build")
    if not dist.is_initialized():
        raise ValueError(f"{func}: no process group is initialised; call torch.distributed.init_process_group "
                         f"(e.g. backend='gloo' for CPU tensors, 'nccl' for CUDA ones) first, or pass group=")
    return group if group is not None else dist.group.WORLD


def _to_bshd(x, layout: str):
    return x if layout == "bshd" else x.transpose(1, 2)


def _check_shards(func: str, q, k, v, layout: str, group) -> tuple[int, int]:
    """Local checks, then one all_gather of every rank's shapes and dtypes: the same error on
    every rank when they disagree. ``(world size, rank)``."""
    validation.check_layout(layout, func)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{func}: {name} must be a torch.Tensor, got {type(x).__qualname__}")
        if x.device.type == "meta":
            raise ValueError(f"{func}: {name} is on device {x.device} (a tensor with a shape but no data), which "
                             f"cuflash cannot compute on; expected CPU or CUDA tensors")
        if x.dim() != 4:
            want = "(B, S, H, D)" if layout == "bshd" else "(B, H, S, D)"
            raise ValueError(f"{func}: {name}.shape={tuple(x.shape)} must be {want} for layout={layout!r}")
        if x.dtype not in _DTYPES:
            raise TypeError(f"{func}: {name}.dtype={x.dtype} is not supported")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    qb, kb, vb = (_to_bshd(x, layout) for x in (q, k, v))
    code = _DTYPES.index(q.dtype)
    mine = torch.tensor([qb.shape[1], kb.shape[1], vb.shape[1], qb.shape[0], qb.shape[2], kb.shape[2], qb.shape[3],
                         vb.shape[3], code, _DTYPES.index(k.dtype), _DTYPES.index(v.dtype)], dtype=torch.int64)
    dev = q.device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    gathered = [torch.empty_like(mine, device=dev) for _ in range(world)]
    dist.all_gather(gathered, mine.to(dev), group=group)
    rows = [tuple(int(x) for x in g.cpu()) for g in gathered]
    names = ("q shard length", "k shard length", "v shard length", "batch", "query heads", "kv heads", "head dim",
             "value head dim", "q dtype", "k dtype", "v dtype")
    for i, name in enumerate(names):
        values = [r[i] for r in rows]
        if len(set(values)) > 1:
            shown = [str(_DTYPES[x]).replace("torch.", "") for x in values] if "dtype" in name else values
            raise ValueError(f"{func}: the ranks' {name}s differ ({', '.join(f'rank {j}: {s}' for j, s in enumerate(shown))}); "
                             f"every rank must hold an equal shard of one sequence, of one dtype")
    if rows[0][0] != rows[0][1]:
        raise ValueError(f"{func}: q and k shards must be of one length (self-attention over one sequence); "
                         f"got {rows[0][0]} and {rows[0][1]}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise TypeError(f"{func}: q, k and v must have one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    return world, rank


def _scale(softmax_scale, head_dim: int, func: str) -> float:
    return validation.check_softmax_scale(softmax_scale, head_dim, func)


# --------------------------------------------------------------------------------------------
# zigzag layout


def zigzag_split(x, group=None, *, dim: int = 1):
    """This rank's shard of the full sequence ``x`` in the zigzag layout causal ring attention
    balances with: the sequence axis ``dim`` (1 for "bshd") is cut into ``2W`` equal chunks and
    rank ``r`` keeps chunks ``r`` and ``2W - 1 - r``, concatenated (``W`` the group's size).
    Returns a tensor of ``x``'s dtype, ``1 / W`` of its length along ``dim``.

    Raises
    ------
    ValueError
        No process group, or a sequence length not divisible by ``2W``.
    """
    func = "cuflash.torch.zigzag_split"
    group = _group_of(group, func)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n = x.shape[dim]
    if n % (2 * world):
        raise ValueError(f"{func}: x.shape[{dim}]={n} must be divisible by 2 * world size = {2 * world}")
    chunks = x.chunk(2 * world, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=dim)


def zigzag_merge(shard, group=None, *, dim: int = 1):
    """The full sequence from every rank's zigzag shard (:func:`zigzag_split`'s inverse), gathered
    with ``all_gather``; every rank gets it.

    Parameters
    ----------
    shard : torch.Tensor
        This rank's shard, its two chunks concatenated along ``dim`` (any dtype; one shape on every
        rank).
    group : torch.distributed.ProcessGroup, optional
    dim : int
        The sequence axis (1 for "bshd").

    Returns
    -------
    torch.Tensor, ``shard``'s shape with ``W`` times its length along ``dim``.

    Raises
    ------
    ValueError
        No process group, or an odd shard length.
    """
    func = "cuflash.torch.zigzag_merge"
    group = _group_of(group, func)
    world = dist.get_world_size(group)
    if shard.shape[dim] % 2:
        raise ValueError(f"{func}: shard.shape[{dim}]={shard.shape[dim]} must be even (two chunks per rank)")
    parts = [torch.empty_like(shard) for _ in range(world)]
    dist.all_gather(parts, shard.contiguous(), group=group)
    chunks = [None] * (2 * world)
    for r, p in enumerate(parts):
        a, b = p.chunk(2, dim=dim)
        chunks[r], chunks[2 * world - 1 - r] = a, b
    return torch.cat(chunks, dim=dim)


# --------------------------------------------------------------------------------------------
# ring attention


def _pieces(rank: int, src: int, world: int, length: int, causal: bool, zigzag: bool):
    """The (query rows, key rows, causal) blocks rank ``rank`` attends with the K/V shard of rank
    ``src``; blocks causality hides entirely are left out."""
    whole = slice(0, length)
    if not causal:
        return [(whole, whole, False)]
    if not zigzag:
        return [(whole, whole, src == rank)] if src <= rank else []
    half = length // 2
    halves = (slice(0, half), slice(half, length))
    q_chunks, k_chunks = (rank, 2 * world - 1 - rank), (src, 2 * world - 1 - src)
    out = []
    for qc, qs in zip(q_chunks, halves):
        for kc, ks in zip(k_chunks, halves):
            if kc <= qc:
                out.append((qs, ks, kc == qc))
    return out


def _exchange(tensors, group, rank: int, world: int):
    """Send ``tensors`` to the next rank and receive the previous rank's, asynchronously:
    ``(received buffers, requests)``."""
    nxt = dist.get_global_rank(group, (rank + 1) % world) if group is not dist.group.WORLD else (rank + 1) % world
    prv = dist.get_global_rank(group, (rank - 1) % world) if group is not dist.group.WORLD else (rank - 1) % world
    bufs = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, nxt, group) for t in tensors] + \
        [dist.P2POp(dist.irecv, b, prv, group) for b in bufs]
    return bufs, dist.batch_isend_irecv(ops)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, zigzag, deterministic):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        length = q.shape[1]
        acc_t = torch.float64 if q.dtype == torch.float64 else torch.float32
        b, h, dv = q.shape[0], q.shape[2], v.shape[3]
        out_acc = torch.zeros((b, length, h, dv), dtype=acc_t, device=q.device)
        lse_acc = torch.full((b, h, length), -math.inf, dtype=acc_t, device=q.device)
        kv = (k.contiguous(), v.contiguous())
        for step in range(world):
            src = (rank - step) % world
            pending = _exchange(kv, group, rank, world) if step + 1 < world else None   # overlaps the math
            for qs, ks, c in _pieces(rank, src, world, length, causal, zigzag):
                o, lse = _attention(q[:, qs], kv[0][:, ks], kv[1][:, ks], causal=c, softmax_scale=scale,
                                           layout="bshd", return_lse=True)
                _merge_into(out_acc[:, qs], lse_acc[:, :, qs], o, lse)
            if pending is not None:
                bufs, reqs = pending
                for r in reqs:
                    r.wait()
                kv = tuple(bufs)
        out = out_acc.to(q.dtype)
        lse = lse_acc.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, causal, scale, zigzag, deterministic)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, scale, zigzag, deterministic = ctx.args
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        length = q.shape[1]
        acc_t = torch.float64 if q.dtype == torch.float64 else torch.float32
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=acc_t, device=q.device)
        kv = (k.contiguous(), v.contiguous())
        kw = dict(softmax_scale=scale, layout="bshd")
        if q.device.type == "cuda":
            kw["deterministic"] = deterministic
        incoming = None   # the dK/dV accumulators of the block held next, in flight from the previous rank
        for step in range(world):
            src = (rank - step) % world
            pending = _exchange(kv, group, rank, world) if step + 1 < world else None
            # this rank's share of the held block's dK/dV, while its accumulators are still travelling
            local = (torch.zeros(k.shape, dtype=acc_t, device=k.device), torch.zeros(v.shape, dtype=acc_t, device=v.device))
            for qs, ks, c in _pieces(rank, src, world, length, causal, zigzag):
                g = _attention_backward(dout[:, qs], q[:, qs], kv[0][:, ks], kv[1][:, ks], out[:, qs],
                                               lse[:, :, qs].contiguous(), causal=c, **kw)
                dq[:, qs] += g[0].to(acc_t)
                local[0][:, ks] += g[1].to(acc_t)
                local[1][:, ks] += g[2].to(acc_t)
            if incoming is not None:
                bufs_d, reqs_d = incoming
                for r in reqs_d:
                    r.wait()
                local[0].add_(bufs_d[0])
                local[1].add_(bufs_d[1])
            dkv = local
            if world > 1:   # the block's dK/dV move on with it (after the last step they reach their owner)
                incoming = _exchange(dkv, group, rank, world)
            if pending is not None:
                bufs, reqs = pending
                for r in reqs:
                    r.wait()
                kv = tuple(bufs)
        if incoming is not None:
            bufs_d, reqs_d = incoming
            for r in reqs_d:
                r.wait()
            dkv = tuple(bufs_d)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None


def ring_attention(q, k, v, *, group=None, causal=False, softmax_scale=None, window_size=(-1, -1), layout="bshd",
                   zigzag=None, deterministic=False, return_lse=False):
    """Attention over a sequence split across the ranks of ``group``, by ring attention.

    Every rank passes its shard: q ``(B, S_local, Hq, D)``, k/v ``(B, S_local, Hk, D|Dv)`` (layout
    "bshd"; "bhsd" takes ``(B, H, S_local, D)``), ``S_local`` equal on every rank; GQA as
    :func:`cuflash.attention`. The K/V shards travel around the ring (``W - 1`` steps of
    ``batch_isend_irecv``, each transfer overlapping a block's attention); partial results merge
    by their LSE. Differentiable: the backward sends each K/V shard around again with its dK/dV,
    which arrive back at the owner.

    Parameters
    ----------
    q, k, v : torch.Tensor
        One dtype and device; CPU tensors with a gloo group (the NumPy path), CUDA tensors with
        NCCL (the kernels, torch's current stream).
    group : torch.distributed.ProcessGroup, optional
        Default: the world.
    causal : bool
        Causal over the whole sequence. With ``zigzag`` (the default for causal) the shards are
        :func:`zigzag_split`'s layout (rank ``r`` holds chunks ``r`` and ``2W - 1 - r``, each rank
        the same work); with ``zigzag=False`` contiguous shards (rank ``r`` holds chunk ``r``; the
        last rank works ``W`` times as much as the first).
    softmax_scale : float, optional
        None means ``1/sqrt(D)``.
    window_size : (int, int)
        Only ``(-1, -1)``: local windows across shards are not implemented (use
        :func:`ulysses_attention`, which takes them).
    deterministic : bool
        Bit-identical gradients run to run (the local backward's; the ring's sums are in a fixed
        order anyway).
    return_lse : bool
        Also return the float32 LSE ``(B, Hq, S_local)``.

    Returns
    -------
    out : torch.Tensor, this rank's rows of the output, q's layout and dtype

    Raises
    ------
    ValueError
        No process group; shards of different lengths, heads or dtypes on different ranks (on
        every rank: one ``all_gather`` of the shapes comes first); an odd shard with ``zigzag``.
    NotImplementedError
        A window.

    Notes
    -----
    Per rank and step, the forward sends one K/V shard (``B S_local Hk (D + Dv)`` elements) and
    the backward that and its float32 dK/dV (``2x`` the bytes of K/V in float32 for 16-bit input):
    forward ``(W - 1)`` shard transfers, backward ``W`` of (K, V, dK, dV) minus the last K/V. Every
    transfer overlaps a block's attention: the next K/V while the current block is attended, the
    held block's incoming dK/dV while this rank computes its own share of them.
    """
    func = "cuflash.torch.ring_attention"
    group = _group_of(group, func)
    causal = validation.check_flag(causal, "causal", func)
    deterministic = validation.check_flag(deterministic, "deterministic", func)
    if validation.check_window_size(window_size, False, func) != (-1, -1):
        raise NotImplementedError(f"{func}: window_size={tuple(window_size)!r}: ring attention takes no window; "
                                  f"use cuflash.torch.ulysses_attention for local attention across shards")
    world, _ = _check_shards(func, q, k, v, layout, group)
    zigzag = causal if zigzag is None else validation.check_flag(zigzag, "zigzag", func)
    qb, kb, vb = (_to_bshd(x, layout) for x in (q, k, v))
    if causal and zigzag and qb.shape[1] % 2:
        raise ValueError(f"{func}: with zigzag, each rank holds two equal chunks: the shard length {qb.shape[1]} "
                         f"must be even")
    scale = _scale(softmax_scale, qb.shape[-1], func)
    out, lse = _RingAttention.apply(qb, kb, vb, group, causal, scale, zigzag and causal, deterministic)
    out = out if layout == "bshd" else out.transpose(1, 2)
    return (out, lse) if return_lse else out


# --------------------------------------------------------------------------------------------
# Ulysses


def _seq_to_heads(x, group, world: int):
    """``(B, S, H, D)`` sequence shard -> ``(B, W S, H / W, D)`` head shard (all_to_all_single)."""
    b, s, h, d = x.shape
    send = x.reshape(b, s, world, h // world, d).permute(2, 0, 1, 3, 4).contiguous()   # block w -> rank w
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)                                    # recv[w]: rank w's rows
    return recv.permute(1, 0, 2, 3, 4).reshape(b, world * s, h // world, d)


def _heads_to_seq(y, group, world: int):
    """``(B, W S, h, D)`` head shard -> ``(B, S, W h, D)`` sequence shard (the inverse)."""
    b, t, h, d = y.shape
    s = t // world
    send = y.reshape(b, world, s, h, d).permute(1, 0, 2, 3, 4).contiguous()   # rows of rank w -> rank w
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)                           # recv[w]: rank w's heads
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s, world * h, d)


class _Ulysses(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, window, deterministic, kv_repeat):
        world = dist.get_world_size(group)
        if kv_repeat > 1:
            k, v = (x.repeat_interleave(kv_repeat, dim=2) for x in (k, v))
        qh, kh, vh = (_seq_to_heads(x, group, world) for x in (q, k, v))
        oh, lseh = _attention(qh, kh, vh, causal=causal, softmax_scale=scale, window_size=window,
                                     layout="bshd", return_lse=True)
        ctx.save_for_backward(qh, kh, vh, oh, lseh)
        ctx.args = (group, causal, scale, window, deterministic, kv_repeat)
        return _heads_to_seq(oh, group, world)

    @staticmethod
    def backward(ctx, dout):
        qh, kh, vh, oh, lseh = ctx.saved_tensors
        group, causal, scale, window, deterministic, kv_repeat = ctx.args
        world = dist.get_world_size(group)
        doh = _seq_to_heads(dout.contiguous(), group, world)
        kw = dict(causal=causal, softmax_scale=scale, window_size=window, layout="bshd")
        if qh.device.type == "cuda":
            kw["deterministic"] = deterministic
        dqh, dkh, dvh = _attention_backward(doh, qh, kh, vh, oh, lseh, **kw)
        dq, dk, dv = (_heads_to_seq(x, group, world) for x in (dqh, dkh, dvh))
        if kv_repeat > 1:   # the replicas' gradients sum into their kv head
            b, s, hr, d = dk.shape
            dk = dk.reshape(b, s, hr // kv_repeat, kv_repeat, d).sum(3)
            dv = dv.reshape(b, s, hr // kv_repeat, kv_repeat, dv.shape[-1]).sum(3)
        return dq, dk, dv, None, None, None, None, None, None


def ulysses_attention(q, k, v, *, group=None, causal=False, softmax_scale=None, window_size=(-1, -1),
                      layout="bshd", deterministic=False):
    """Attention over a sequence split across the ranks of ``group``, by DeepSpeed-Ulysses.

    Every rank passes its contiguous shard (rank ``r`` holds rows ``[r S_local, (r + 1) S_local)``)
    of q ``(B, S_local, Hq, D)`` and k/v ``(B, S_local, Hk, D|Dv)`` ("bshd"; "bhsd" takes
    ``(B, H, S_local, D)``). ``all_to_all_single`` gives each rank the whole sequence for ``Hq / W``
    heads, :func:`cuflash.attention` runs there (any mask it takes: causal, windows, on the whole
    sequence), and a second all-to-all returns this rank's rows. Differentiable (the backward is
    the same exchange around :func:`cuflash.attention_backward`).

    ``Hq`` must be divisible by the world size ``W``; kv heads too, or ``W`` by ``Hk`` (each kv
    head is then replicated ``W / Hk`` times before the exchange, and its replicas' gradients
    summed).

    Raises
    ------
    ValueError
        No process group; heads not divisible; shards that differ between ranks (on every rank).

    Notes
    -----
    Per call each rank sends and receives ``(W - 1) / W`` of its q, k, v and out shards (and of the
    gradients in the backward): four all-to-alls forward, four backward.
    """
    func = "cuflash.torch.ulysses_attention"
    group = _group_of(group, func)
    causal = validation.check_flag(causal, "causal", func)
    deterministic = validation.check_flag(deterministic, "deterministic", func)
    world, _ = _check_shards(func, q, k, v, layout, group)
    qb, kb, vb = (_to_bshd(x, layout) for x in (q, k, v))
    hq, hk = qb.shape[2], kb.shape[2]
    if hq % world:
        raise ValueError(f"{func}: {hq} query heads must be divisible by the world size {world} (Ulysses shards heads)")
    if hk % world and world % hk:
        raise ValueError(f"{func}: {hk} kv heads must divide or be divisible by the world size {world}")
    if hq % hk:
        raise ValueError(f"{func}: {hq} query heads must be a multiple of {hk} kv heads (GQA)")
    kv_repeat = 1 if hk % world == 0 else world // hk
    left, right = validation.check_window_size(window_size, causal, func)
    scale = _scale(softmax_scale, qb.shape[-1], func)
    out = _Ulysses.apply(qb, kb, vb, group, causal, scale, (left, right), deterministic, kv_repeat)
    return out if layout == "bshd" else out.transpose(1, 2)
