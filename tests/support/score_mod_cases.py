"""The traced functions the kernel tests run on every tier that takes them: the ready-made
``cuflash.mods`` examples and an invented pair (the oracle holds each tier to the same ones)."""

from __future__ import annotations

import numpy as np

from cuflash import mods

#: the ready-made examples, by name
READY_MADE = ("alibi", "alibi_per_batch", "softcap", "relative_position_bias", "document_mask", "prefix_lm",
              "sliding_window")


def ready_made(name, rng, s, b, hq):
    """``(score_mod, mask_mod)`` of the example ``name`` for Sq = Sk = ``s``, ``b`` batch entries and
    ``hq`` query heads (every example's arrays are drawn, so ``rng`` advances the same for each)."""
    slopes = rng.uniform(0.05, 0.5, hq).astype(np.float32)
    return {
        "alibi": (mods.alibi(slopes), None),
        "alibi_per_batch": (mods.alibi(rng.uniform(0.05, 0.5, (b, hq)).astype(np.float32)), None),
        "softcap": (mods.softcap(5.0), None),
        "relative_position_bias": (mods.relative_position_bias(rng.standard_normal((hq, 9)).astype(np.float32), 4),
                                   None),
        "document_mask": (None, mods.document_mask(np.sort(rng.integers(0, 5, s)).astype(np.int32), causal=True)),
        "prefix_lm": (None, mods.prefix_lm(np.array([3, 4 * s // 7], np.int32))),
        "sliding_window": (None, mods.sliding_window(9, 2)),
    }[name]


def invented(table, keep):
    """Integer division and modulo, where, log, maximum, a (B, Hq) table and a bool array."""
    def score_fn(score, b, h, q_idx, kv_idx):
        near = mods.maximum(score, -2.0) + 0.25 * mods.log(1.0 + abs(q_idx - kv_idx))
        return mods.where((kv_idx // 8) % 3 == 1, score * table[b, h], near)

    def mask_fn(b, h, q_idx, kv_idx):
        return keep[kv_idx] | (kv_idx % 5 == 0)

    return score_fn, mask_fn
