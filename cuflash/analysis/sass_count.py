"""Counting a kernel's main loop in any SASS: ``python -m cuflash roofline --sass-of FILE --kernel NAME``.

The rules (docs/roofline.md):

* the **main loop** is the innermost natural loop that holds tensor instructions (``HGMMA``,
  ``HMMA``, ...): a back edge ``latch -> header`` where the header dominates the latch, and the
  loop's blocks are those that reach the latch without passing the header, wherever they are
  placed in the code (before the header, or after the latch and branched to and back);
* a pass is a path from the header to a latch through the loop's blocks (inner loops without
  tensor instructions count one pass);
* the **named paths**: ``steady`` (every tensor instruction and copy into shared memory, the
  fewest instructions: no mask) and ``masked`` (every tensor instruction and copy, the most
  instructions), each ``+rescale`` (through the conditional block that scales the O accumulator:
  a block some pass skips holding at least :data:`RESCALE_FMULS` ``FMUL`` on an accumulator the
  loop carries) or ``-rescale`` (around it). The count to compare is the path that rescales, as
  kernels that always rescale have no other.
* :func:`best_passes` walks any per-instruction measure along the same passes: the roofline
  model (:mod:`cuflash.analysis.roofline`) counts its pipes with it.
* figures per warp and pass, and per 16 tensor instructions, so unrolling changes nothing.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

__all__ = ["Insn", "LoopCount", "CLASSES", "COPIES", "RESCALE_FMULS", "parse_functions", "select_function", "main_loop",
           "main_loops", "inner_loops", "best_passes", "count_loop", "count_loops", "read_sass", "classify", "find_tool", "mma_macs"]

_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Za-z0-9_]+)*)([^;]*);")
_FUNCTION = re.compile(r"Function : (\S+)")

#: the tensor instructions
TENSOR = ("HGMMA", "HMMA", "IMMA", "DMMA", "QGMMA", "IGMMA", "BMMA", "UTCHMMA", "UTCQMMA")
#: a conditional block with at least this many FMUL is the O rescale
RESCALE_FMULS = 8

#: instruction classes, in report order
CLASSES = ("tensor", "fp32", "mufu", "integer", "predicate", "memory", "conversion", "shuffle", "barrier", "other")

_CLASS_OF = {
    "fp32": ("FFMA", "FMUL", "FADD", "FMNMX", "FSWZADD", "FCHK"),
    "mufu": ("MUFU",),
    "integer": ("IADD3", "IMAD", "LOP3", "SHF", "LEA", "MOV", "IABS", "IMNMX", "POPC", "FLO", "BREV", "PRMT",
                "SGXT", "BMSK", "S2R", "S2UR", "CS2R", "R2UR", "UIADD3", "UIMAD", "ULOP3", "USHF", "ULEA", "UMOV",
                "UPRMT", "USEL", "UFLO", "UPOPC", "ULDC", "LDC", "IADD", "IMUL", "ISCADD", "UISETP", "USGXT",
                "UBMSK", "VIADD", "VIMNMX", "UIMNMX", "R2P", "P2R", "UP2UR", "PLOP3", "UPLOP3"),
    "predicate": ("ISETP", "FSETP", "FSEL", "SEL", "BRA", "BRX", "JMP", "EXIT", "RET", "BSSY", "BSYNC", "WARPSYNC",
                  "VOTE", "VOTEU", "PSETP", "HSETP2", "DSETP", "CALL", "YIELD"),
    "memory": ("LDS", "STS", "LDSM", "STSM", "LDG", "STG", "LDGSTS", "LD", "ST", "LDL", "STL", "ATOM", "ATOMS",
               "ATOMG", "RED", "UTMALDG", "UTMASTG", "UBLKCP", "UBLKRED", "UTMAPF", "UTMACCTL", "SYNCS", "LDGDEPBAR",
               "UCGABAR_ARV", "UCGABAR_WAIT", "CCTL", "MEMBAR", "FENCE", "ERRBAR"),
    "conversion": ("F2F", "F2FP", "I2F", "F2I", "I2FP", "F2IP", "HADD2", "HMUL2", "HFMA2"),
    "shuffle": ("SHFL",),
    "barrier": ("BAR", "WARPGROUP", "DEPBAR", "WARPGROUPSET", "ARRIVES", "USETMAXREG"),
}
_CLASS = {op: cls for cls, ops in _CLASS_OF.items() for op in ops}


def classify(op: str) -> str:
    """The class (one of :data:`CLASSES`) of an opcode without modifiers."""
    if op in TENSOR:
        return "tensor"
    return _CLASS.get(op, "other")


@dataclass(frozen=True)
class Insn:
    """One SASS instruction: address, guarded (``@P0``), opcode, modifiers, operands."""

    addr: int
    predicated: bool
    op: str
    mods: str
    operands: str

    @property
    def target(self) -> int | None:
        """The branch target address of a ``BRA``/``JMP`` (None otherwise)."""
        if self.op not in ("BRA", "JMP"):
            return None
        m = re.search(r"0x([0-9a-f]+)\s*$", self.operands) or re.search(r"0x([0-9a-f]+)", self.operands)
        return int(m.group(1), 16) if m else None

    @property
    def conditional(self) -> bool:
        """A guard, or a predicate operand before the target (``BRA.DIV``, ``BRA !P0, 0x..``)."""
        return self.predicated or "," in self.operands


def parse_functions(text: str) -> dict[str, list[Insn]]:
    """Every function of a ``cuobjdump -sass`` text: name -> instructions (functions without
    instructions left out)."""
    starts = [(m.start(), m.group(1)) for m in _FUNCTION.finditer(text)]
    out = {}
    for i, (lo, name) in enumerate(starts):
        hi = starts[i + 1][0] if i + 1 < len(starts) else len(text)
        insns = [Insn(int(m.group(1), 16), bool(m.group(2)) and "PT " not in m.group(2).replace("!", ""),
                      m.group(3), m.group(4), m.group(5).strip()) for m in _INSN.finditer(text, lo, hi)]
        if insns:
            out.setdefault(name, insns)
    return out


def _demangle(names: list[str]) -> dict[str, str]:
    tool = shutil.which("cu++filt") or shutil.which("c++filt")
    if tool is None or not names:
        return {n: n for n in names}
    r = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True, timeout=120)
    lines = r.stdout.splitlines()
    return dict(zip(names, lines)) if r.returncode == 0 and len(lines) == len(names) else {n: n for n in names}


def select_function(functions: dict[str, list[Insn]], name: str, *, source: str = "the SASS") -> str:
    """The one function whose mangled or demangled name contains ``name`` (an exact mangled name
    wins).

    Raises
    ------
    ValueError
        If none or several match (the message lists them) or there are no functions.
    """
    if not functions:
        raise ValueError(f"cuflash.roofline: --sass-of: {source} holds no SASS functions")
    if name in functions:
        return name
    demangled = _demangle(list(functions))
    found = [n for n in functions if name in n or name in demangled[n]]
    if not found:
        raise ValueError(f"cuflash.roofline: --kernel: no function of {source} contains {name!r} "
                         f"({len(functions)} functions)")
    if len(found) > 1:
        shown = "\n  ".join(demangled[n][:300] for n in found[:20])
        raise ValueError(f"cuflash.roofline: --kernel: {name!r} matches {len(found)} functions of {source}; "
                         f"give a more exact name:\n  {shown}")
    return found[0]


def find_tool(name: str) -> str | None:
    """``name`` from the nvidia-cuda-* wheels of this interpreter, else from PATH."""
    for entry in sys.path:
        root = Path(entry) / "nvidia"
        if root.is_dir():
            for cand in sorted(root.glob(f"*/bin/{name}")):
                if os.access(cand, os.X_OK):
                    return str(cand)
    return shutil.which(name)


def read_sass(path: str, kernel: str) -> tuple[str, list[Insn]]:
    """``(function name, instructions)`` of the function of ``path`` whose name contains
    ``kernel``: ``path`` a ``cuobjdump -sass`` text (``.sass``, ``.txt``) or a cubin / shared
    library / executable, disassembled with ``cuobjdump -sass``.

    Raises
    ------
    ValueError
        No such file, no SASS, no such kernel or several.
    RuntimeError
        cuobjdump missing or failing.
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"cuflash.roofline: --sass-of: no such file {path!r}")
    if p.suffix in (".sass", ".txt"):
        text = p.read_text(errors="replace")
    else:
        tool, nvdisasm = find_tool("cuobjdump"), find_tool("nvdisasm")
        if tool is None:
            raise RuntimeError("cuflash.roofline: cuobjdump not found; install the wheel nvidia-cuda-cuobjdump "
                               "(the 'test' extra) or put the CUDA toolkit's bin on PATH")
        env = dict(os.environ)
        if nvdisasm:
            env["PATH"] = os.path.dirname(nvdisasm) + os.pathsep + env.get("PATH", "")
        r = subprocess.run([tool, "-sass", "-fun", kernel, str(p)], capture_output=True, text=True, env=env,
                           timeout=1800)
        text = r.stdout
        if not _FUNCTION.search(text):   # not an exact name: every function, then the substring
            r = subprocess.run([tool, "-sass", str(p)], capture_output=True, text=True, env=env, timeout=1800)
            if r.returncode != 0 and not r.stdout:
                raise ValueError(f"cuflash.roofline: --sass-of: {path!r} holds no SASS ({r.stderr.strip()})")
            text = r.stdout
    functions = parse_functions(text)
    name = select_function(functions, kernel, source=repr(path))
    return name, functions[name]


def mma_macs(insn: Insn) -> int:
    """MACs per warp of a tensor instruction (``HMMA.16816``, ``.1688``, ``.884``; ``HGMMA.64xNxK``
    per warpgroup, a quarter per warp); 0 for a shape not listed."""
    if insn.op == "HMMA":
        for shape, macs in ((".16816", 16 * 8 * 16), (".1688", 16 * 8 * 8), (".884", 8 * 8 * 4)):
            if insn.mods.startswith(shape):
                return macs
        return 0
    m = re.match(r"\.64x(\d+)x(\d+)", insn.mods)
    return 64 * int(m.group(1)) * int(m.group(2)) // 4 if m else 0


# --------------------------------------------------------------------------------------------
# control flow

def _blocks(insns: list[Insn]):
    """``(starts, ends, succ)``: block i covers insns[starts[i]:ends[i]]; succ[i] block indices."""
    index = {x.addr: i for i, x in enumerate(insns)}
    leaders = {0}
    for i, x in enumerate(insns):
        t = x.target
        if t is not None and t in index:
            leaders.add(index[t])
        if (t is not None or x.op in ("EXIT", "RET", "BRX")) and i + 1 < len(insns):
            leaders.add(i + 1)
    starts = sorted(leaders)
    block_of = {s: b for b, s in enumerate(starts)}
    ends = starts[1:] + [len(insns)]
    succ = []
    for s, e in zip(starts, ends):
        last = insns[e - 1]
        out = []
        if last.target is not None and last.target in index:
            out.append(block_of[index[last.target]])
        stops = last.op in ("BRA", "JMP", "EXIT", "RET", "BRX") and not last.conditional
        if not stops and e < len(insns):
            out.append(block_of[e])
        succ.append(out)
    return starts, ends, succ


def _dominators(succ: list[list[int]]) -> list[set[int] | None]:
    n = len(succ)
    preds = [[] for _ in range(n)]
    for b, ss in enumerate(succ):
        for s in ss:
            preds[s].append(b)
    reach, todo = {0}, [0]
    while todo:
        for s in succ[todo.pop()]:
            if s not in reach:
                reach.add(s)
                todo.append(s)
    dom = [set(reach) if b in reach else None for b in range(n)]
    dom[0] = {0}
    changed = True
    while changed:
        changed = False
        for b in sorted(reach - {0}):
            ps = [dom[p] for p in preds[b] if dom[p] is not None]
            new = set.intersection(*ps) | {b} if ps else {b}
            if new != dom[b]:
                dom[b], changed = new, True
    return dom


def _natural_loops(succ):
    """header block -> (body blocks, latch blocks), back edges merged by header (computed once per
    control-flow graph; the result is shared, not to be changed)."""
    return _natural_loops_of(tuple(map(tuple, succ)))


def _back_edges(succ) -> set:
    """The (latch, header) edges of :func:`_natural_loops`."""
    return {(b, g) for g, (_, ls) in _natural_loops(succ).items() for b in ls}


@lru_cache(maxsize=8)
def _natural_loops_of(succ):
    dom = _dominators(succ)
    preds = [[] for _ in succ]
    for b, ss in enumerate(succ):
        for s in ss:
            preds[s].append(b)
    loops = {}
    for b, ss in enumerate(succ):
        for h in ss:
            if dom[b] is not None and h in dom[b]:
                body, latches = loops.setdefault(h, ({h}, set()))
                latches.add(b)
                todo = [b]
                while todo:
                    x = todo.pop()
                    if x not in body:
                        body.add(x)
                        todo.extend(preds[x])
    return loops


def main_loops(insns: list[Insn], *, innermost: bool = True):
    """``(blocks, [(header block, body blocks, latch blocks), ...])``: the innermost natural loops
    holding the most tensor instructions (a kernel that compiles its masked tiles as a loop of
    their own has two), else the loop with the most FP32 instructions. ``innermost=False``: the
    loops holding the most tensor instructions, outer ones included (a main loop with a loop of
    tensor instructions inside it; the roofline model of our own kernels, which have no
    persistent outer loop).

    Raises
    ------
    ValueError
        If the code has no loop.
    """
    blocks = _blocks(insns)
    starts, ends, succ = blocks
    loops = _natural_loops(succ)
    if not loops:
        raise ValueError("cuflash.roofline: the kernel has no loop")

    def n_of(body, cls):
        return sum(classify(x.op) == cls for b in body for x in insns[starts[b]:ends[b]])

    tensor = {h: n_of(body, "tensor") for h, (body, _) in loops.items()}
    with_tensor = [h for h in loops if tensor[h]]
    if with_tensor:
        inner = [h for h in with_tensor
                 if not innermost or not any(g != h and loops[g][0] < loops[h][0] and tensor[g] for g in with_tensor)]
        most = max(tensor[h] for h in inner)
        chosen = sorted(h for h in inner if tensor[h] == most)
    else:
        chosen = [max(loops, key=lambda h: (n_of(loops[h][0], "fp32"), -len(loops[h][0])))]
    return blocks, [(h, loops[h][0], loops[h][1]) for h in chosen]


def inner_loops(blocks, loop) -> list:
    """The natural loops nested in ``loop`` (``(header, body, latches)``), each as
    ``(header, body, latches)``, outermost first."""
    h, body, _ = loop
    found = [(g, b, ls) for g, (b, ls) in _natural_loops(blocks[2]).items() if g != h and g in body and b <= body]
    return sorted(found, key=lambda t: -len(t[1]))


def main_loop(insns: list[Insn]):
    """``(header block, body blocks, latch blocks, blocks)`` of the first of :func:`main_loops`."""
    blocks, found = main_loops(insns)
    return (*found[0], blocks)


@dataclass(frozen=True)
class LoopCount:
    """Per-warp counts of one named pass through the main loop."""

    path: str
    instructions: int
    classes: dict
    rescale: bool
    macs: int = 0

    def per_100k_macs(self, value: int | None = None) -> float:
        """``value`` (default: the non-tensor instructions) per 100k MACs of the pass (per warp)."""
        v = self.instructions - self.tensor if value is None else value
        return 1e5 * v / self.macs if self.macs else float("nan")

    @property
    def tensor(self) -> int:
        return self.classes["tensor"]

    def per_16_tensor(self, value: int | None = None) -> float:
        """``value`` (default: the instructions) per 16 tensor instructions."""
        v = self.instructions if value is None else value
        return 16 * v / self.tensor if self.tensor else float("nan")


def count_loop(insns: list[Insn]) -> dict[str, LoopCount]:
    """The named passes of the main loop (:func:`main_loop`): ``steady``, ``masked``, each with
    ``+rescale`` / ``-rescale`` where the loop has a rescale block (else only the two names).

    Passes follow the loop's edges without its back edges (inner loops count once). Where several
    innermost loops hold the most tensor instructions (masked tiles compiled as a loop of their
    own), ``steady`` paths come from the loop whose pass is shortest, ``masked`` from the longest.
    """
    out = {}
    for counts in count_loops(insns):
        for label, c in counts.items():
            shorter = c.instructions < out[label].instructions if label in out else True
            if label not in out or (shorter if label.startswith("steady") else not shorter):
                out[label] = c
    return out


def count_loops(insns: list[Insn]) -> list[dict[str, LoopCount]]:
    """The named passes (as :func:`count_loop` names them) of each of :func:`main_loops`' loops,
    in code order: a kernel that compiles its edge tiles as loops of their own has one entry per
    loop."""
    blocks, found = main_loops(insns)
    return [_count_one(insns, blocks, h, body, latches) for h, body, latches in found]


#: the instructions that copy into shared memory: a steady pass makes every copy of the next tile
COPIES = ("LDGSTS", "STS", "STSM")


def _measure_classes(x: Insn) -> dict:
    if x.op == "NOP":
        return {}
    c = {classify(x.op): 1}
    if x.op in COPIES:
        c["copies"] = 1
    return c


def best_passes(insns: list[Insn], blocks, loop, measure, keys, *, per_block=None) -> list:
    """Per key, the totals of the pass through ``loop`` (``(header, body, latches)`` of
    :func:`main_loops`) that maximizes ``key(totals)``, or None where no pass reaches a latch.

    A pass runs from the header to a latch along the loop's edges without its back edges (inner
    loops count one pass). ``measure(insn)`` is a dict of counts, summed along the pass (missing
    keys count 0); ``per_block``: block -> a dict added once for that block."""
    h, body, latches = loop
    starts, ends, succ = blocks
    back = _back_edges(succ)
    order = _topo(h, body, succ, back)
    counts = {}
    for b in body:
        c = dict((per_block or {}).get(b, {}))
        for x in insns[starts[b]:ends[b]]:
            for k, v in measure(x).items():
                c[k] = c.get(k, 0) + v
        counts[b] = c
    return [_best_pass(h, order, body, latches, succ, back, counts, key) for key in keys]


def _operands(x: Insn) -> list[str]:
    return [o.strip() for o in x.operands.split(",") if o.strip()]


def _accumulator_registers(tensor_insns: list[Insn]) -> set[int]:
    """The registers of the accumulators the loop carries: destinations of tensor instructions
    none of whose instances starts from zero (an ``RZ`` accumulator input), such as O += P V's
    (S = Q K^T starts from zero every tile)."""
    widths, fresh = {}, set()
    for x in tensor_insns:
        ops = _operands(x)
        if not ops or not re.fullmatch(r"R\d+", ops[0]):
            continue
        base = int(ops[0][1:])
        m = re.match(r"\.64x(\d+)x", x.mods)
        widths[base] = int(m.group(1)) // 2 if m else (2 if ".F16" in x.mods and ".F32" not in x.mods else 4)
        c = [o for o in ops[1:] if re.fullmatch(r"RZ|R\d+", o)]
        if c and c[-1] == "RZ":
            fresh.add(base)
    return {r for base, n in widths.items() if base not in fresh for r in range(base, base + n)}


def _rescale_blocks(insns, blocks, h, body, latches) -> set[int]:
    """The O rescale blocks: some pass skips them, and they hold :data:`RESCALE_FMULS` FMUL
    writing the accumulators the loop carries (any FMUL in a loop without tensor instructions)."""
    starts, ends, succ = blocks
    back = _back_edges(succ)
    tensor = [x for b in body for x in insns[starts[b]:ends[b]] if classify(x.op) == "tensor"]
    acc = _accumulator_registers(tensor)

    def on_acc(x):
        ops = _operands(x)
        return not tensor or (ops and re.fullmatch(r"R\d+", ops[0]) and int(ops[0][1:]) in acc)

    skippable = {b for b in body if b != h and not _on_every_pass(h, b, body, latches, succ, back)}
    return {b for b in skippable
            if sum(x.op == "FMUL" and on_acc(x) for x in insns[starts[b]:ends[b]]) >= RESCALE_FMULS}


def _count_one(insns, blocks, h, body, latches):
    starts, ends, succ = blocks
    rescale = _rescale_blocks(insns, blocks, h, body, latches)
    tensor_insns = [x for b in body for x in insns[starts[b]:ends[b]] if classify(x.op) == "tensor"]
    n_tensor = len(tensor_insns)
    macs = sum(mma_macs(x) for x in tensor_insns)
    keys, labels = [], []
    for name, sign in (("steady", 1), ("masked", -1)):
        for want in ((True, False) if rescale else (None,)):
            def key(t, sign=sign, want=want):
                ok = 0 if want is None else int((t.get("_rescale", 0) > 0) == want)
                return (ok, t.get("tensor", 0), t.get("copies", 0), -sign * sum(t.get(k, 0) for k in CLASSES))
            keys.append(key)
            labels.append((name if want is None else f"{name}{'+' if want else '-'}rescale", want))
    found = best_passes(insns, blocks, (h, body, latches), _measure_classes, keys,
                        per_block={b: {"_rescale": 1} for b in rescale})
    out = {}
    for (label, want), total in zip(labels, found):
        if total is None:
            raise ValueError("cuflash.roofline: no pass from the loop's header to a latch")
        r = total.get("_rescale", 0) > 0
        if want is not None and r != want:
            continue
        classes = {k: total.get(k, 0) for k in CLASSES}
        out[label] = LoopCount(label, sum(classes.values()), classes, r, macs if classes["tensor"] == n_tensor else 0)
    return out


def _topo(h, body, succ, back):
    seen, order = set(), []

    def visit(b):
        stack = [(b, iter(succ[b]))]
        seen.add(b)
        while stack:
            node, it = stack[-1]
            for s in it:
                if s in body and (node, s) not in back and s not in seen:
                    seen.add(s)
                    stack.append((s, iter(succ[s])))
                    break
            else:
                order.append(node)
                stack.pop()

    visit(h)
    return order[::-1]


def _on_every_pass(h, b, body, latches, succ, back):
    """Whether every pass from ``h`` to a latch goes through ``b``."""
    seen, todo = {h}, [h]
    while todo:
        x = todo.pop()
        if x in latches:
            return False
        for s in succ[x]:
            if s in body and (x, s) not in back and s != b and s not in seen:
                seen.add(s)
                todo.append(s)
    return True


def _best_pass(h, order, body, latches, succ, back, counts, key):
    best = {h: counts[h]}
    end = None
    for b in order:
        if b not in best:
            continue
        total = best[b]
        if b in latches and (end is None or key(total) > key(end)):
            end = total
        for s in succ[b]:
            if s in body and (b, s) not in back:
                cand = {k: total.get(k, 0) + counts[s].get(k, 0) for k in total.keys() | counts[s].keys()}
                if s not in best or key(cand) > key(best[s]):
                    best[s] = cand
    return end
