"""The block-sparse forms' launch arguments (``launch_args.block_sparse_args``) on the host, without
a kernel: which lists the forward and the backward get, their element strides (0 on an axis the
block mask broadcasts), the block sizes in each direction, and the simulator's tile counter (only
inside ``counting_tiles`` and only on the simulator). The kernels that read them run under
``-m slow`` (tests/kernels/test_block_mask_kernels.py)."""

from __future__ import annotations

import dataclasses
import types

import numpy as np

from cuflash import mods
from cuflash.kernels import launch_args as la


def _call(backend):
    return types.SimpleNamespace(device=types.SimpleNamespace(backend=backend, to_host_kind=lambda a: a), xp=np,
                                 empty_index=np.empty(0, np.int32),
                                 pointer=lambda name, a, writable=False: (name, a.shape, writable))


def _scalars(args):
    return {a.name: int(a.value) for a in args if hasattr(a, "value")}


def test_forward_and_backward_lists_strides_and_block_sizes():
    # 3 documents of 64 tokens, 128-query by 64-key blocks: 2 query blocks, 3 key blocks
    doc = np.repeat(np.arange(3, dtype=np.int32), 64)
    bm = mods.document_block_mask(doc, causal=True, BLOCK_SIZE=(128, 64))
    p = types.SimpleNamespace(modifiers=types.SimpleNamespace(block_mask=bm))
    with la.counting_tiles() as found:
        fwd = la.block_sparse_args(p, _call("sim"), False, 3)
        bwd = la.block_sparse_args(p, _call("sim"), True, 4)
    assert [a.name for a in fwd[:4]] == ["bs_num", "bs_idx", "bs_full_num", "bs_full_idx"]
    # one mask for every batch entry and head: stride 0 there; a list row holds one entry per block
    assert _scalars(fwd) == dict(bs_num_bs=0, bs_num_hs=0, bs_idx_bs=0, bs_idx_hs=0, bs_idx_rs=3,
                                 bs_outer=128, bs_inner=64, bs_count=1)
    assert _scalars(bwd) == dict(bs_num_bs=0, bs_num_hs=0, bs_idx_bs=0, bs_idx_hs=0, bs_idx_rs=2,
                                 bs_outer=64, bs_inner=128, bs_count=1)
    assert fwd[-2] == ("bs_counts", (3, 2), True) and bwd[-2] == ("bs_counts", (4, 2), True)
    assert [c.shape for c in found] == [(3, 2), (4, 2)]


def test_per_batch_mask_strides_and_no_counter_off_the_simulator():
    doc = np.repeat(np.arange(2, dtype=np.int32), 64)
    bm = mods.document_block_mask(doc, BLOCK_SIZE=64)
    lists = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
             "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")
    two = dataclasses.replace(bm, **{f: np.concatenate([getattr(bm, f)] * 2) for f in lists})   # B = 2
    p = types.SimpleNamespace(modifiers=types.SimpleNamespace(block_mask=two))
    with la.counting_tiles() as found:
        args = la.block_sparse_args(p, _call("cupy"), False, 5)
    s = _scalars(args)
    # batch axis of 2: num (2, 1, 2) -> 2 elements a batch entry; idx (2, 1, 2, 2) -> 4
    assert (s["bs_num_bs"], s["bs_num_hs"], s["bs_idx_bs"], s["bs_idx_hs"], s["bs_idx_rs"]) == (2, 0, 4, 0, 2)
    assert s["bs_count"] == 0 and args[-2][1] == (0,) and found == []
