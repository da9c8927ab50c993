"""A whole call's instruction mix: ``python -m cuflash roofline --call-mix``.

For a call shape (Sq, Sk, causal or a window, batch x heads), how many tiles of each named path
of the forward's key walk the grid runs, times each path's per-warp instructions counted from the
SASS (:mod:`cuflash.analysis.sass_count`), summed by instruction class. A count, never a speed.

Paths (one compiled loop each, in the Hopper forward's source order):

* ``first``: tile 0 of each walk, run before the loops (its S and masked softmax; the P V of the
  walk's last tile runs after them). It is no loop, so the SASS gives it no count of its own: its
  per-warp figure is *assumed* to be the walk's fullest masked loop pass (``both`` where the
  kernel has it, else ``right``), and totals are given with and without it;
* ``steady``: a tile no mask cuts;
* ``left``: a tile a window's left edge cuts;
* ``right``: a tile the diagonal, a window's right edge or Sk cuts;
* ``both``: a tile both edges cut (a window narrower than a tile).

The masks are docs/conventions.md's: key j is visible to row i iff ``0 <= j < Sk`` and
``i + Sk - Sq - left <= j <= i + Sk - Sq + right`` (-1 unbounded; causal is ``right = 0``).

Imports: nothing of cuflash (pure tile arithmetic).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PATHS", "Walk", "hopper_walk", "anchor_walk", "window_of"]

#: the named paths, in report order
PATHS = ("first", "steady", "left", "right", "both")


@dataclass(frozen=True)
class Walk:
    """The tiles of each path a call's grid runs.

    ``tiles`` maps each of :data:`PATHS` to a count of passes, each a ``rows`` x ``block_n`` tile
    run by ``warps`` warps (a query tile's share one warp group walks: the Hopper forward's two
    consumer warp groups walk 64 rows each, each with its own edges)."""

    tiles: dict
    rows: int
    block_n: int
    warps: int

    @property
    def total(self) -> int:
        return sum(self.tiles.values())


def window_of(causal: bool, window: tuple[int, int] | None) -> tuple[int, int]:
    """``(left, right)`` of a call: ``window`` (default unbounded), the right bound 0 when causal.

    Raises
    ------
    ValueError
        A bound below -1, or a causal call with a right bound other than 0 or -1.
    """
    left, right = (-1, -1) if window is None else (int(window[0]), int(window[1]))
    if left < -1 or right < -1:
        raise ValueError(f"cuflash.roofline: --window: bounds must be >= -1 (-1 unbounded), got ({left}, {right})")
    if causal:
        if right not in (-1, 0):
            raise ValueError(f"cuflash.roofline: --window: with --causal the right bound is 0 (or -1), got {right}")
        right = 0
    return left, right


def _check(sq, sk, block_m, block_n, rows=None):
    for name, v in (("seqlen", sq), ("seqlen-k", sk), ("block-m", block_m), ("block-n", block_n)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"cuflash.roofline: --{name}: expected a positive integer, got {v!r}")
    if rows is not None and block_m % rows:
        raise ValueError(f"cuflash.roofline: --block-m: {block_m} is not a multiple of the warp group's {rows} rows")


def _key_range(m0, last_row, sk, diag, left, right):
    """``[kv_lo, kv_hi)``: the keys rows ``m0 .. last_row`` see (empty: kv_hi <= kv_lo)."""
    kv_lo = max(0, m0 + diag - left) if left >= 0 else 0
    kv_hi = min(sk, last_row + diag + right + 1) if right >= 0 else sk
    return kv_lo, kv_hi


def hopper_walk(sq: int, sk: int, *, left: int = -1, right: int = -1, block_m: int = 128, block_n: int = 128,
                rows: int = 64) -> Walk:
    """The tiles of each path the Hopper forward (kernels_cu/attention_fwd_sm90.cu, the plain
    forms) runs for one (batch, head): per query tile, the key tiles ``[tile_lo, tile_hi)`` some
    row of the block sees; per consumer warp group (``rows`` query rows), tile 0 first, then the
    kernel's loops over the rest: with its steady range ``[lo, hi)`` (the tiles no edge cuts for
    its rows, ``SteadyTiles``) the left-edge loop, the both-edges loop, the steady loop and the
    right-edge loop, in that order. A call without a window or causal mask runs the form without
    the left loops, whose right loop takes the tile that straddles Sk.

    Parameters
    ----------
    sq, sk : int
        Query and key lengths (>= 1).
    left, right : int
        Bottom-right window bounds, -1 unbounded (causal: ``right=0``).
    block_m, block_n : int
        The query and key tile (the d128 forward: 128 x 128).
    rows : int
        Query rows per consumer warp group (64).

    Returns
    -------
    Walk
        Passes per path, each a ``rows`` x ``block_n`` tile of 4 warps.
    """
    _check(sq, sk, block_m, block_n, rows)
    local = left >= 0 or right >= 0
    diag = sk - sq
    tiles = dict.fromkeys(PATHS, 0)
    for m0 in range(0, sq, block_m):
        kv_lo, kv_hi = _key_range(m0, m0 + block_m - 1, sk, diag, left, right) if local else (0, sk)
        tile_lo = kv_lo // block_n
        tile_hi = -(-kv_hi // block_n) if kv_hi > kv_lo else tile_lo
        n = tile_hi - tile_lo
        if n <= 0:
            continue
        for r0 in range(m0, m0 + block_m, rows):
            lo, hi = 0, sk // block_n
            if local and left >= 0:
                lo = -((-(r0 + rows - 1 + diag - left)) // block_n)
            if local and right >= 0:
                hi = min(hi, (r0 + diag + right + 1) // block_n)
            ta, tb = max(1, min(n, lo - tile_lo)), max(1, min(n, hi - tile_lo))
            tiles["first"] += 1
            j = 1
            for path, end in (("left", min(ta, tb) if local else 1), ("both", ta if local else 1),
                              ("steady", tb), ("right", n)):
                k = max(j, end)
                tiles[path] += k - j
                j = k
    return Walk(tiles, rows, block_n, 4)


def anchor_walk(sq: int, sk: int, *, left: int = -1, right: int = -1, block_m: int = 128, block_n: int = 128,
                order: str = "down", warps: int | None = None) -> Walk:
    """The tiles of each path a kernel with the described walk runs for one (batch, head): per
    query tile of ``block_m`` rows (one CTA: every warp takes the same path), the key tiles some
    row sees; the first tile of the walk (the last key tile for ``order="down"``, the first for
    ``"up"``) is ``first``; every other tile is the path of the edges its mask cuts for the
    block's rows (``steady`` where none does).

    This describes a kernel that masks exactly the tiles the mask cuts. FlashAttention-3's
    forward walks keys downward, runs its first tile (the one holding the diagonal, or Sk) before
    its loops with the mask, then a masking loop for the further tiles the diagonal or a window's
    right edge cuts, a steady loop, and (local) a loop for the left edge; its bound for the
    masking loop can take one tile more than the cut ones where a row's last visible key ends a
    tile. In a causal call with ``Sq == Sk`` and a square tile the diagonal cuts only the first
    tile of each walk.

    Parameters
    ----------
    order : {"down", "up"}
        Keys walked from the last tile down (FlashAttention-3) or from the first up.
    warps : int, optional
        Warps running the loop per tile (default ``block_m // 16``).
    """
    _check(sq, sk, block_m, block_n)
    if order not in ("down", "up"):
        raise ValueError(f"cuflash.roofline: --walk: expected 'down' or 'up', got {order!r}")
    diag = sk - sq
    tiles = dict.fromkeys(PATHS, 0)
    for m0 in range(0, sq, block_m):
        last = m0 + block_m - 1
        kv_lo, kv_hi = _key_range(m0, last, sk, diag, left, right)
        if kv_hi <= kv_lo:
            continue
        tile_lo, tile_hi = kv_lo // block_n, -(-kv_hi // block_n)
        # tiles t < cl: the left edge cuts them (a key left of the last row's first visible one);
        # t >= cr: the right edge (a key right of the first row's last visible one, or >= Sk)
        cl = -((-(last + diag - left)) // block_n) if left >= 0 else tile_lo
        cr = min(sk // block_n, (m0 + diag + right + 1) // block_n if right >= 0 else tile_hi)

        def span(a, b):
            return max(0, min(b, tile_hi) - max(a, tile_lo))

        got = {"left": span(tile_lo, min(cl, cr)), "both": span(cr, cl), "steady": span(cl, cr),
               "right": span(max(cl, cr), tile_hi)}
        first = tile_hi - 1 if order == "down" else tile_lo
        got[("steady", "left", "right", "both")[(first < cl) + 2 * (first >= cr)]] -= 1
        tiles["first"] += 1
        for k, v in got.items():
            tiles[k] += v
    return Walk(tiles, block_m, block_n, block_m // 16 if warps is None else warps)


def _loop_figure(counts: dict):
    """The per-tile figure of one loop (a dict of :func:`sass_count.count_loops`): its pass with
    every tensor instruction and copy and the fewest instructions (``+rescale`` where the loop
    has a rescale block, the figure docs/roofline.md compares)."""
    for label in ("steady+rescale", "steady"):
        if label in counts:
            return counts[label]
    return min(counts.values(), key=lambda c: c.instructions)


#: the Hopper forward's loops in code order (the plain forms, with and without the window code)
HOPPER_LOOPS = {True: ("left", "both", "steady", "right"), False: ("steady", "right")}


def hopper_paths(loops: list, local: bool) -> tuple[dict, str]:
    """``(path -> per-warp count, the path assumed for "first")`` of the Hopper forward's loops
    (:func:`sass_count.count_loops`, in code order: left, both, steady, right; without the window
    code steady, right).

    Raises
    ------
    ValueError
        If the SASS holds another number of loops, or its steady loop is not the shortest.
    """
    names = HOPPER_LOOPS[bool(local)]
    figures = [_loop_figure(c) for c in loops]
    if len(figures) != len(names):
        raise ValueError(f"cuflash.roofline: --call-mix: expected the Hopper forward's {len(names)} loops "
                         f"({', '.join(names)}), the SASS has {len(figures)}")
    paths = dict(zip(names, figures))
    if paths["steady"].instructions != min(f.instructions for f in figures):
        raise ValueError("cuflash.roofline: --call-mix: the loop in the steady loop's place is not the shortest "
                         f"({[f.instructions for f in figures]}); the loops are not in the expected order")
    assumed = "both" if local else "right"
    return {**paths, "first": paths[assumed]}, assumed


def anchor_paths(loops: list) -> tuple[dict, str]:
    """``(path -> per-warp count, the path assumed for "first")`` of a kernel's loops: ``steady``
    from the loop whose pass is shortest, every masked path (and the first tile) from the
    longest (a kernel with one loop: both from it)."""
    figures = sorted((_loop_figure(c) for c in loops), key=lambda f: f.instructions)
    masked = figures[-1]
    return {"first": masked, "steady": figures[0], "left": masked, "right": masked, "both": masked}, "longest"


@dataclass(frozen=True)
class Mix:
    """A call's instruction mix: per path, tiles (passes of ``walk.warps`` warps) times the
    per-warp count of that path, times ``batch_heads``. ``per_warp[path]`` has ``.instructions``
    and ``.classes`` (a :class:`cuflash.analysis.sass_count.LoopCount`); ``first_as`` names the
    loop whose figure the first tile is assumed to cost."""

    kernel: str
    walk: Walk
    per_warp: dict
    first_as: str
    batch_heads: int = 1

    def instructions(self, path: str) -> int:
        """Instructions all warps execute on ``path`` in the whole call."""
        n = self.walk.tiles[path]
        return n * self.walk.warps * self.per_warp[path].instructions * self.batch_heads if n else 0

    def classes(self, *, first: bool = True) -> dict:
        """Instructions per class in the whole call (``first``: with the first tiles' assumed
        figure)."""
        out = {}
        for path in PATHS:
            n = self.walk.tiles[path]
            if not n or (path == "first" and not first):
                continue
            for k, v in self.per_warp[path].classes.items():
                out[k] = out.get(k, 0) + n * self.walk.warps * v * self.batch_heads
        return out

    def total(self, *, first: bool = True) -> int:
        return sum(self.classes(first=first).values())

    def as_dict(self) -> dict:
        return {"kernel": self.kernel, "rows_per_tile": self.walk.rows, "block_n": self.walk.block_n,
                "warps_per_tile": self.walk.warps, "batch_heads": self.batch_heads, "first_assumed_as": self.first_as,
                "paths": {p: {"tiles": self.walk.tiles[p], "instructions_per_warp": self.per_warp[p].instructions,
                              "instructions": self.instructions(p)} for p in PATHS if self.walk.tiles[p]},
                "total": self.total(), "total_loops_only": self.total(first=False),
                "classes": self.classes(), "classes_loops_only": self.classes(first=False)}


def format_mix(mix: Mix, classes: tuple) -> str:
    """The table of a :class:`Mix`: per path tiles, per-warp instructions and the call's total;
    then the totals and their class mix (with and without the first tiles)."""
    w = mix.walk
    lines = [f"kernel: {mix.kernel}",
             f"tiles of {w.rows} query rows x {w.block_n} keys, {w.warps} warps each, x {mix.batch_heads} (batch x heads)",
             f"{'path':<8} {'tiles':>10} {'insns/warp':>11} {'instructions':>15}", "-" * 47]
    for p in PATHS:
        if w.tiles[p]:
            note = f"  (assumed: the {mix.first_as} loop's)" if p == "first" else ""
            lines.append(f"{p:<8} {w.tiles[p] * mix.batch_heads:>10} {mix.per_warp[p].instructions:>11} "
                         f"{mix.instructions(p):>15,}{note}")
    for label, first in (("loops", False), ("all", True)):
        c, t = mix.classes(first=first), mix.total(first=first)
        lines.append(f"{label:<8} {'':>10} {'':>11} {t:>15,}")
        lines.append("         " + "  ".join(f"{k} {100 * c.get(k, 0) / t:.1f}%" for k in classes if c.get(k, 0))
                     if t else "")
    return "\n".join(lines)
