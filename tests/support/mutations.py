"""The mutation suite's machinery: mutants of our kernels and the probes that must notice them.

A mutant is one kernel file of ``kernels_cu/`` with one synchronisation removed (a
``__syncthreads``, a ``__syncwarp``, a ``cp.async`` wait, a fence; on sm_90a also a
``wgmma.fence`` / ``commit_group`` / ``wait_group``, an mbarrier wait or arrive, a
``fence.proxy.async`` or ``fence.mbarrier_init``, a named barrier, a bulk commit or wait) or one
numbered wait relaxed (``wait_group N`` -> ``N + 1``). A probe runs one kernel tier on the simulator, in
normal mode under several seeds or in checked mode, and holds its result to the float64 oracle;
a probe *kills* a mutant when it fails on it (a wrong result or a simulator error) while it
passes on the real kernels. ``KILL_MAP`` (``tests/support/mutation_kill_map.json``) records, for every
mutant, the probe that kills it, so CI runs each mutant once against that probe
(tests/kernels/test_mutations.py); ``python tests/support/mutations.py`` searches every probe for every
mutant (minutes) and prints the map to commit. A mutant no probe kills must be listed in
``SURVIVORS`` with the reason it is harmless, or the simulator or the probes have a gap.

Run as a script, it changes nothing: it prints the map (``--write`` writes the JSON file).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
KILL_MAP_PATH = HERE / "mutation_kill_map.json"

#: the statements a mutant removes (or, for the waits, relaxes)
SYNC = re.compile(r"\b(__syncthreads\(\)|__syncwarp\([^()]*\)|__threadfence(?:_block)?\(\)|"
                  r"ptx_(?:cp_async|wgmma|bulk)_wait(?:_read)?<(\d+)>\(\)|ptx_cp_async_wait_all\(\)|"
                  r"ptx_mbarrier_wait[a-z_]*\([^;]*\)|ptx_mbarrier_arrive\([^;]*\)|ptx_wgmma_fence\(\)|"
                  r"ptx_wgmma_commit\(\)|ptx_fence_proxy_async\(\)|ptx_fence_mbarrier_init\(\)|"
                  r"ptx_bar_sync\([^;]*\)|ptx_bulk_commit\(\)|ptx_fence_proxy_async_global\(\)|"
                  r"ptx_wait_eq_acquire\([^;]*\)|ptx_red_release_add\([^;]*\))\s*;")
#: kernel files and the probes of the tiers built from them
FILES = {
    "attention_fwd_mma.cu": ("fwd_mma_checked", "fwd_mma_seeds", "fwd_mma_d256_checked", "fwd_mma_empty_checked",
                             "fwd_mma_sm75_checked"),
    "attention_fwd_simt.cu": ("fwd_simt_checked", "fwd_simt_seeds"),
    "attention_bwd_mma.cu": ("bwd_mma_checked", "bwd_mma_seeds", "bwd_mma_s1_checked", "bwd_mma_det_checked",
                             "bwd_mma_det_window_checked", "bwd_mma_sm75_checked"),
    "attention_bwd_simt.cu": ("bwd_simt_checked", "bwd_simt_seeds"),
    "softmax.cu": ("softmax_checked", "softmax_seeds"),
    "attention_combine.cu": ("kvcache_split_checked", "kvcache_split_seeds"),
    "hopper_probe.cu": ("hopper_checked", "hopper_seeds"),
    "attention_fwd_sm90.cu": ("fwd_sm90_checked", "fwd_sm90_seeds", "fwd_sm90_local_checked",
                              "fwd_sm90_varlen_checked", "fwd_sm90_kvcache_checked", "fwd_sm90_bs_checked",
                              "fwd_sm90_fp8_checked", "fwd_sm90_fp8_varlen_checked", "fwd_sm90_prefill_checked",
                              "fwd_sm90_gqa_checked", "fwd_sm90_gqa_fixed_checked", "fwd_sm90_kvtma_checked"),
    "attention_bwd_sm90.cu": ("bwd_sm90_checked", "bwd_sm90_seeds", "bwd_sm90_um_checked"),
}
#: probes whose simulator build alone takes about a minute of the default run's 2 cores: they and
#: the mutants they kill run under ``slow`` only (tests/kernels/test_mutations.py), each with why
SLOW_PROBES = {
    "bwd_sm90_um_checked": "the Hopper backward's traced form is a build of its own (a checked g++ build of the "
                           "whole warp-specialized kernel: 40-73 s at load 10-13 on the 2 cores) that no default test "
                           "compiles",
    "fwd_sm90_fp8_checked": "the Hopper forward's fp8 form in checked mode is a g++ build of its own that no default "
                            "test compiles (the default fp8 test runs the normal build); the pipeline it runs is the "
                            "plain form's, whose mutants the default probes kill",
    "fwd_sm90_prefill_checked": "the chunked-prefill form in checked mode is one more build of its own; its pipeline "
                                "is the KV-cache form's (the same gather, rings and barriers; only Q's and O's "
                                "boxes and the sequence's key count differ)",
    "fwd_sm90_gqa_checked": "the GQA-packed KV-cache form in checked mode is one more build of its own; its pipeline "
                            "is the KV-cache form's (only Q's and O's boxes, the rows' positions and the lse and "
                            "partial rows' heads differ)",
    "fwd_sm90_kvtma_checked": "the KV-cache form with TMA over the cache in checked mode is one more build of its "
                              "own; its rings, barriers and gathered edge tiles are the KV-cache form's (only the "
                              "whole tiles' loads differ)",
    "fwd_sm90_gqa_fixed_checked": "the fixed-shape GQA-packed form in checked mode is one more build of its own; its "
                                  "pipeline is the fixed form's (only Q's and O's boxes, the rows' positions and the "
                                  "lse rows' heads differ)",
    "fwd_sm90_fp8_varlen_checked": "the packed fp8 form in checked mode is one more build of its own; its pipeline is "
                                   "the fixed fp8 form's (only V^T's key coordinate differs)",
}
#: mutants no probe kills, each with why removing that line is harmless (or what gap it shows)
SURVIVORS: dict[str, str] = {
    "attention_fwd_sm90.cu|ptx_bar_sync(TURN_BAR + c, 256);|#2|delete":
        "the last tile's ping-pong turn (FA3 3.1; the P V wgmma after the loop) orders the two consumers' use of "
        "the tensor cores for speed only: "
        "each consumer's data is its own (its Q rows, its registers) and the shared K/V stages are guarded by "
        "the full/empty mbarriers, so without the turn the result is the same; its arrivals then complete "
        "phases with no waiter, which is harmless",
    # The Hopper backward: five needed synchronisations (seven mutants) the simulator cannot show missing. It runs a
    # fiber until it blocks, so one warpgroup never lags a whole tile behind the other or behind the
    # dQ warp, and checked mode orders a generic write before an async-proxy read (wgmma, bulk
    # reduce) only by that writer's fence, not by a barrier between two threads: gaps of the
    # simulator, listed rather than hidden.
    "attention_bwd_sm90.cu|ptx_bulk_wait<0>();|#1|delete":
        "the dQ warp's last wait for its bulk reduce-adds' global writes before it exits: the simulator "
        "completes a reduce's shared-memory read and its global adds together, so after the loop's "
        "wait_group.read 0 nothing is left for it; on a GPU it orders the last adds before the thread's exit",
    "attention_bwd_sm90.cu|ptx_bulk_wait<0>();|#1|relax": "as its deletion (wait_group 1 after wait_group.read 0)",
    "attention_bwd_sm90.cu|ptx_wait_eq_acquire(sem, int(blockIdx.x) - first);|#0|delete":
        "deterministic mode's wait for this key tile's turn: without it the adds to a query tile come in the "
        "order the blocks reach it, which changes the float32 sums only with three or more key tiles adding "
        "(two commute) on workers running in parallel; the probe has two key tiles (a third would add "
        "default-run time). The slow test test_deterministic_adds_in_key_tile_order sees it: its causal case "
        "on three workers gives a workspace that differs from the key-tile order (as the non-deterministic "
        "mode does there, 1873 of 38400 words)",
    "attention_bwd_sm90.cu|ptx_wgmma_commit();|#2|delete":
        "the commit that closes dV/dK's wgmma group: without it they join dQ's group, and the wait_group 1 "
        "before the stage's release no longer covers them, so the producer may refill Q/dO while they read "
        "it; in the simulator the consumer always reaches its wait_group 0 before the producer's refill "
        "lands (no lagging warpgroup)",
    "attention_bwd_sm90.cu|ptx_bar_sync(DS_BAR, 256);|#0|delete":
        "the consumers' barrier between their dS^T halves and the dQ wgmma that reads both: the two "
        "warpgroups meet at every wgmma rendezvous in the simulator, so each half is always stored first, "
        "and checked mode does not order another thread's generic store before a wgmma read",
    "attention_bwd_sm90.cu|ptx_wgmma_wait<1>();|#1|delete":
        "the wait for dV/dK's wgmmas before the stage's release (empty arrival): as the commit above, the "
        "refill of that stage never overtakes the consumer's wait_group 0 in the simulator",
    "attention_bwd_sm90.cu|ptx_wgmma_wait<1>();|#1|relax": "as its deletion",
    "attention_bwd_sm90.cu|ptx_bar_sync(DQ_EMPTY, 288);|#0|delete":
        "the consumers' wait for the dQ warp to have read the dQ buffer: the dQ warp runs its reduce and "
        "wait_group.read as soon as the consumers block at their next rendezvous, before they store the "
        "next tile's dQ, so the simulator never shows the overwrite",
}
#: the KV-cache producer's per-tile publication (cp.async wait, fence.proxy.async, then the full
#: barrier's arrival): without one of these waits or fences the arrival comes before the tile's
#: copies landed or were fenced for the async proxy, and a consumer could read it early on a GPU.
#: On the simulator the producer's fiber runs on from the arrival to its next wait and fence, which
#: cover the same copies, before any consumer resumes, so the window never opens (a gap of the
#: simulator's scheduling, not a harmless line; neither the checked probe nor 4 seeds of thread
#: orders kill them). The last tile's wait and fence, which nothing later covers, are killed.
_KV_WINDOW = ("a gap of the simulator's scheduling (the KV-cache producer's publication of a tile; see "
              "_KV_WINDOW's comment): a GPU needs the line")
SURVIVORS.update({f"attention_fwd_sm90.cu|{stmt}|#{n}|{kind}": _KV_WINDOW
                  for stmt, n, kind in (("ptx_cp_async_wait<1>();", 0, "delete"), ("ptx_cp_async_wait<1>();", 0, "relax"),
                                        ("ptx_cp_async_wait<1>();", 1, "delete"), ("ptx_cp_async_wait<1>();", 1, "relax"),
                                        ("ptx_fence_proxy_async();", 1, "delete"),
                                        ("ptx_fence_proxy_async();", 2, "delete"))})


@dataclasses.dataclass(frozen=True)
class Mutant:
    file: str
    statement: str   # the statement as written, e.g. "__syncthreads();"
    occurrence: int  # which occurrence of that statement in the file (0-based)
    kind: str        # "delete" or "relax" (cp.async wait_group N -> N + 1)
    line: int        # 1-based line (for messages; not part of the id)

    @property
    def id(self) -> str:
        return f"{self.file}|{self.statement}|#{self.occurrence}|{self.kind}"

    def apply(self, text: str) -> str:
        lines = text.split("\n")
        seen = 0
        for i, line in enumerate(lines):
            code = line.split("//", 1)[0]
            for m in SYNC.finditer(code):
                if m.group(0).strip() != self.statement:
                    continue
                if seen == self.occurrence:
                    if self.kind == "delete":
                        new = ";"
                    else:
                        new = self.statement.replace(f"<{m.group(2)}>", f"<{int(m.group(2)) + 1}>")
                    lines[i] = code[: m.start()] + new + code[m.end():] + line[len(code):]
                    return "\n".join(lines)
                seen += 1
        raise LookupError(f"{self.id}: statement not found")


def mutants(kernels_dir: Path) -> list[Mutant]:
    found = []
    for name in FILES:
        counts: dict = {}
        for no, line in enumerate((kernels_dir / name).read_text(encoding="utf-8").split("\n"), 1):
            for m in SYNC.finditer(line.split("//", 1)[0]):
                stmt = m.group(0).strip()
                occ = counts.get(stmt, 0)
                counts[stmt] = occ + 1
                found.append(Mutant(name, stmt, occ, "delete", no))
                if m.group(2) is not None:
                    found.append(Mutant(name, stmt, occ, "relax", no))
    return found


def mutated_tree(kernels_dir: Path, mutant: Mutant, dest: Path) -> Path:
    """A copy of ``kernels_dir`` in ``dest`` with ``mutant`` applied; returns ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in kernels_dir.iterdir():
        if f.is_file():
            shutil.copy(f, dest / f.name)
    path = dest / mutant.file
    path.write_text(mutant.apply(path.read_text(encoding="utf-8")), encoding="utf-8")
    return dest


# ------------------------------------------------------------------------------------ probes

SEEDS = (0, 1, 2, 3)


def _attention_case(dtype, d, sq, sk, causal, arch, checked, seeds, backward, hq=2, window=(-1, -1),
                    deterministic=False):
    import cuflash
    from cuflash import sim
    from cuflash.reference import tolerance

    rng = np.random.default_rng(sq * 7 + d)
    q = rng.standard_normal((1, hq, sq, d)).astype(dtype)
    k = rng.standard_normal((1, 1, sk, d)).astype(dtype)
    v = rng.standard_normal((1, 1, sk, d)).astype(dtype)
    for seed in seeds:
        with sim.options(arch=arch, checked=checked, seed=seed):
            kw = dict(causal=causal, window_size=window)
            out, lse = cuflash.attention(q, k, v, return_lse=True, backend="sim", **kw)
            ok, msg, _ = tolerance.compare(out, q, k, v, lse=lse, **kw)
            assert ok, f"forward, seed {seed}: {msg}"
            if backward:
                from support.grads import check_grads_close

                dout = rng.standard_normal(out.shape).astype(dtype)
                grads = cuflash.attention_backward(dout, q, k, v, out, lse, backend="sim",
                                                   deterministic=deterministic, **kw)
                check_grads_close(grads, dout, q, k, v, out, lse, **kw)


def _softmax_case(checked, seeds):
    import cuflash
    from cuflash import reference as ref
    from cuflash import sim

    x = np.random.default_rng(5).standard_normal((3, 3000)).astype(np.float32)  # the block-per-row kernel
    for seed in seeds:
        with sim.options(checked=checked, seed=seed):
            y = cuflash.softmax(x, backend="sim")
        np.testing.assert_allclose(y, ref.softmax(x.astype(np.float64)), rtol=1e-5, atol=1e-7)


def _kvcache_case(checked, seeds):
    """A paged decode step split three ways over the keys: the KV-cache forward, then the combine."""
    import cuflash
    from cuflash import sim
    from cuflash.reference import tolerance

    rng = np.random.default_rng(11)
    page, lengths = 16, np.array([150, 40], np.int32)
    kc = rng.standard_normal((24, page, 2, 64)).astype(np.float16)
    vc = rng.standard_normal((24, page, 2, 64)).astype(np.float16)
    bt = rng.permutation(24)[:20].reshape(2, 10).astype(np.int32)
    q = rng.standard_normal((2, 1, 8, 64)).astype(np.float16)
    for seed in seeds:
        with sim.options(checked=checked, seed=seed):
            out = cuflash.attention_with_kvcache(q, kc, vc, lengths, block_table=bt, num_splits=3, backend="sim")
        for b, n in enumerate(lengths):
            idx = np.arange(n)
            kb, vb = kc[bt[b, idx // page], idx % page][None], vc[bt[b, idx // page], idx % page][None]
            ok, msg, _ = tolerance.compare(out[b:b + 1], q[b:b + 1], kb, vb, layout="bshd")
            assert ok, f"kv cache, seed {seed}, sequence {b}: {msg}"


def _fp8_kvcache_case(checked, seeds):
    """A decode step over fp8 caches (the KV-cache kernel's fp8-cache form): paged sequences of 5
    key tiles and of 1 (pages of 16 rows: each tile gathered row by row), GQA 4:1, two query rows,
    per-head descales; each (sequence, kv head) against the float64 oracle of the dequantized
    cache (:func:`support.kvcache.check_fp8_result`)."""
    import ml_dtypes

    import cuflash
    from cuflash import sim
    from support.kvcache import check_fp8_result

    rng = np.random.default_rng(12)
    e4m3 = ml_dtypes.float8_e4m3fn
    page, lengths = 16, np.array([300, 40], np.int32)
    kc = (rng.standard_normal((44, page, 2, 64)) * 4).astype(e4m3)
    vc = (rng.standard_normal((44, page, 2, 64)) * 4).astype(e4m3)
    bt = rng.permutation(44)[:42].reshape(2, 21).astype(np.int32)
    kw = dict(block_table=bt, k_descale=rng.uniform(0.25, 2, (2, 2)).astype(np.float32),
              v_descale=rng.uniform(0.25, 2, (2, 2)).astype(np.float32))
    q = rng.standard_normal((2, 2, 8, 64)).astype(np.float16)
    for seed in seeds:
        with sim.options(checked=checked, seed=seed):
            out, lse = cuflash.attention_with_kvcache(q, kc, vc, lengths, num_splits=1, return_lse=True,
                                                      backend="sim", **kw)
        check_fp8_result(out, lse, q, kc, vc, lengths, kw, page, False, (-1, -1))


def _hopper_case(checked, seeds):
    """The sm_90a probes (kernels_cu/hopper_probe.cu): a TMA-fed wgmma GEMM from shared memory and
    one from registers, the warp-specialized pipeline, stmatrix, the e4m3 wgmma GEMMs."""
    from cuflash import sim
    from cuflash.kernels import hopper_probe as hp
    from cuflash.runtime import source
    from cuflash.sim import launcher

    for seed in seeds:
        with sim.options(arch=90, checked=checked, seed=seed) as o:
            mod = launcher.load_source(source.build_source(hp.VARIANT), origin=hp.VARIANT.source, options=o)
            for sw, nm, regs, m, k in ((128, False, False, 100, 128), (128, True, True, 64, 128)):
                a, b, c, want = hp.gemm_inputs(m, k, nm, seed=seed)
                mod.launch(hp.plan_gemm(a, b, c, swizzle=sw, nmajor=nm, a_regs=regs), o)
                np.testing.assert_array_equal(c, want, err_msg=f"gemm sw{sw} nmajor={nm} regs={regs}, seed {seed}")
            a, b, c, want = hp.gemm_inputs(200, 256, False, seed=seed)
            mod.launch(hp.plan_pipeline(a, b, c), o)
            np.testing.assert_array_equal(c, want, err_msg=f"pipeline, seed {seed}")
            out = np.zeros((6, 16, 16), np.uint16)
            mod.launch(hp.plan_stmatrix(out), o)
            np.testing.assert_array_equal(out, hp.expected_stmatrix(), err_msg=f"stmatrix, seed {seed}")
            for regs in (False, True):   # the e4m3 wgmma (k32), its operands stored by the generic proxy
                a, b, c, want = hp.gemm_e4m3_inputs(100, 96, seed=seed)
                mod.launch(hp.plan_gemm_e4m3(a, b, c, a_regs=regs), o)
                np.testing.assert_array_equal(c, want, err_msg=f"gemm e4m3 regs={regs}, seed {seed}")


def _sm90_case(dtype, d, sq, sk, causal, checked, seeds):
    """The Hopper forward through the dispatcher (its tier asserted), against the oracle."""
    import cuflash
    from cuflash import sim
    from cuflash.reference import tolerance

    rng = np.random.default_rng(sq + d)
    q = rng.standard_normal((1, 2, sq, d)).astype(dtype)
    k = rng.standard_normal((1, 1, sk, d)).astype(dtype)
    v = rng.standard_normal((1, 1, sk, d)).astype(dtype)
    for seed in seeds:
        with sim.options(arch="sm_90", checked=checked, seed=seed):
            assert cuflash.explain(q, k, v, causal=causal, backend="sim")["tier"] == "attention_fwd_sm90"
            out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True, backend="sim")
        ok, msg, _ = tolerance.compare(out, q, k, v, lse=lse, causal=causal)
        assert ok, f"Hopper forward, seed {seed}: {msg}"


def _sm90_fp8_case(checked, seeds):
    """The Hopper forward's fp8 form (e4m3 q, k, v; V through its key-contiguous copy): 5 key tiles
    (each ring slot refilled twice), 2 query tiles, causal, GQA 2:1, descales per (batch, kv head),
    bf16 output, against the fp8 rule."""
    import ml_dtypes

    import cuflash
    from cuflash import sim
    from cuflash.reference import tolerance

    rng = np.random.default_rng(8)
    e4m3 = ml_dtypes.float8_e4m3fn
    q, k, v = ((rng.standard_normal(s) * 3).astype(e4m3) for s in ((1, 2, 200, 64), (1, 1, 600, 64), (1, 1, 600, 64)))
    kw = dict(causal=True, q_descale=np.float32([[0.3]]), k_descale=np.float32([[0.2]]), v_descale=np.float32([[2.0]]))
    for seed in seeds:
        with sim.options(arch="sm_90", checked=checked, seed=seed):
            assert cuflash.explain(q, k, v, backend="sim", **kw)["entry"].endswith("_e4m3")
            out, lse = cuflash.attention(q, k, v, return_lse=True, backend="sim", **kw)
        ok, msg, _ = tolerance.compare(out, q, k, v, lse=lse, **kw)
        assert ok, f"Hopper fp8 forward, seed {seed}: {msg}"


def _sm90_fp8_varlen_case(checked, seeds):
    """The Hopper forward's packed fp8 form (e4m3, head dim 64, causal, GQA 2:1, descales per
    (sequence, kv head), bf16 output): a sequence of 5 key tiles (each ring slot refilled twice),
    an empty one, one shorter than a tile; each sequence against the fp8 rule on its own slices."""
    import ml_dtypes

    import cuflash
    from cuflash import sim
    from cuflash.reference import tolerance

    rng = np.random.default_rng(9)
    e4m3 = ml_dtypes.float8_e4m3fn
    lq, lk = (150, 0, 60), (600, 5, 30)
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    q, k, v = ((rng.standard_normal(s) * 3).astype(e4m3) for s in ((int(cq[-1]), 2, 64), (int(ck[-1]), 1, 64),
                                                                    (int(ck[-1]), 1, 64)))
    ds = {n: rng.uniform(0.1, 0.4, (3, 1)).astype(np.float32) for n in ("q_descale", "k_descale", "v_descale")}
    for seed in seeds:
        with sim.options(arch="sm_90", checked=checked, seed=seed):
            ex = cuflash.explain_varlen(q, k, v, cq, ck, max(lq), max(lk), causal=True, backend="sim", **ds)
            assert ex["entry"].endswith("_varlen_e4m3"), ex["choice"]
            out, lse = cuflash.attention_varlen(q, k, v, cq, ck, max(lq), max(lk), causal=True, return_lse=True,
                                                backend="sim", **ds)
        for b in range(len(lq)):
            rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
            if lq[b]:
                row = {n: d[b:b + 1] for n, d in ds.items()}
                ok, msg, _ = tolerance.compare(out[None, rq], q[None, rq], k[None, rk], v[None, rk],
                                               lse=np.ascontiguousarray(lse[None, :, rq]), causal=True, layout="bshd",
                                               **row)
                assert ok, f"Hopper packed fp8 forward, sequence {b}, seed {seed}: {msg}"


def _sm90_block_sparse_case(checked, seeds):
    """The Hopper forward's block-sparse form (a traced causal document mask's block mask, 128 x 64
    blocks) through the dispatcher (its form asserted): query tiles that walk 1 to 5 listed key
    tiles, partial and full, so the rings turn over with tiles taken from the lists; against the
    oracle with the dense mask_mod."""
    import cuflash
    from cuflash import mods, sim
    from cuflash.reference import tolerance

    rng = np.random.default_rng(43)
    doc = np.repeat(np.arange(2, dtype=np.int32), (300, 212))
    bm = mods.document_block_mask(doc, causal=True, BLOCK_SIZE=(128, 64))
    q = rng.standard_normal((1, 2, 512, 64)).astype(np.float16)
    k = rng.standard_normal((1, 1, 512, 64)).astype(np.float16)
    v = rng.standard_normal((1, 1, 512, 64)).astype(np.float16)
    for seed in seeds:
        with sim.options(arch="sm_90", checked=checked, seed=seed):
            assert cuflash.explain(q, k, v, block_mask=bm, backend="sim")["variant"].endswith("_n64_bs")
            out, lse = cuflash.attention(q, k, v, block_mask=bm, return_lse=True, backend="sim")
        ok, msg, _ = tolerance.compare(out, q, k, v, lse=lse, mask_mod=bm.mask_mod)
        assert ok, f"Hopper block-sparse forward, seed {seed}: {msg}"


def _sm90_varlen_case(checked, seeds):
    """The Hopper forward's packed form (f16, head dim 64, causal, GQA) through the dispatcher (its
    tier asserted): a sequence of 4 key tiles, an empty one, one shorter than a tile; each
    sequence against the oracle of its own slices."""
    import cuflash
    from cuflash import sim
    from cuflash.kernels import attention_fwd_sm90, dispatch
    from cuflash.reference import tolerance
    from support.options import check_varlen

    rng = np.random.default_rng(11)
    lq, lk = (150, 0, 60), (400, 5, 30)
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    q = rng.standard_normal((int(cq[-1]), 2, 64)).astype(F16)
    k = rng.standard_normal((int(ck[-1]), 1, 64)).astype(F16)
    v = rng.standard_normal((int(ck[-1]), 1, 64)).astype(F16)
    problem = check_varlen(q, k, v, cq, ck, max(lq), max(lk), causal=True)
    assert dispatch.forward_tier(problem, 90, (q, k, v)) is attention_fwd_sm90
    for seed in seeds:
        with sim.options(arch="sm_90", checked=checked, seed=seed):
            out, lse = cuflash.attention_varlen(q, k, v, cq, ck, max(lq), max(lk), causal=True, return_lse=True,
                                                backend="sim")
        for b in range(len(lq)):
            rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
            if lq[b]:
                ok, msg, _ = tolerance.compare(out[None, rq], q[None, rq], k[None, rk], v[None, rk],
                                               lse=np.ascontiguousarray(lse[None, :, rq]), causal=True, layout="bshd")
                assert ok, f"Hopper packed forward, sequence {b}, seed {seed}: {msg}"


def _sm90_bwd_case(checked, seeds):
    """The Hopper backward's main stage (f16, head dim 128, causal, GQA 2:1), run directly between the
    shared dot and convert stages: 2 query tiles of each of 2 heads per key tile (the Q/dO ring
    wraps both parities, the dQ buffer and both dS^T buffers are reused), the second key tile
    reaching past Sk; then deterministic mode on one query head (the second key tile waits for the
    first's adds to query tile 1); against the float64 gradients (the same number of tiles as the
    probe's earlier single run of 4 query tiles)."""
    import cuflash
    from cuflash import sim
    from cuflash.kernels import attention_bwd_sm90
    from support.device import sim_backward
    from support.grads import check_grads_close

    rng = np.random.default_rng(40)
    q = rng.standard_normal((1, 2, 100, 128)).astype(F16)
    k = rng.standard_normal((1, 1, 150, 128)).astype(F16)
    v = rng.standard_normal((1, 1, 150, 128)).astype(F16)
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)   # the NumPy forward
    dout = rng.standard_normal(out.shape).astype(F16)
    for seed in seeds:
        for det in (False, True):   # the default mode, then the deterministic one on query head 0
            args = (dout, q, k, v, out, lse) if not det else (dout[:, :1], q[:, :1], k, v, out[:, :1], lse[:, :1])
            with sim.options(arch="sm_90", checked=checked, seed=seed):
                grads = sim_backward(attention_bwd_sm90, *args, causal=True, deterministic=det)
            check_grads_close(grads, *args, causal=True)
def _sm90_bwd_traced_case(checked, seeds):
    """The Hopper backward's traced form (score_mod and mask_mod; f16, head dim 64, GQA 2:1) through
    the dispatcher (its form asserted): 2 query tiles of each of 2 heads per key tile, the first in
    the masked loop, a softcapped per-head ALiBi and a document mask, rows that see no key; the
    gradients under the rule of every tier against the float64 oracle with the same functions."""
    import cuflash
    from cuflash import mods, sim
    from support.grads import assert_grads_within_twice_the_numpy_path

    rng = np.random.default_rng(43)
    q = rng.standard_normal((1, 2, 128, 64)).astype(F16)
    k = rng.standard_normal((1, 1, 150, 64)).astype(F16)
    v = rng.standard_normal((1, 1, 150, 64)).astype(F16)
    slopes = np.array([0.1, 0.3], F32)
    doc = np.repeat(np.arange(3, dtype=np.int32), (40, 60, 50))
    doc_q = np.concatenate([np.full(10, 9, np.int32), doc[32:]])   # 10 rows in no key's document

    def score_fn(score, b, h, q_idx, kv_idx):
        return 10.0 * mods.tanh(score / 10.0) - slopes[h] * abs(q_idx + 22 - kv_idx)

    kw = dict(score_mod=score_fn, mask_mod=lambda b, h, i, j: doc_q[i] == doc[j], causal=True)
    assert "bwd_sm90_main_f16_d64_um" in cuflash.explain(q, k, v, arch=90, **kw)["backward"]
    out, lse = cuflash.attention(q, k, v, return_lse=True, **kw)   # the NumPy forward
    dout = rng.standard_normal(out.shape).astype(F16)
    for seed in seeds:
        with sim.options(arch="sm_90", checked=checked, seed=seed):
            grads = cuflash.attention_backward(dout, q, k, v, out, lse, backend="sim", **kw)
        assert_grads_within_twice_the_numpy_path(grads, q, k, v, dout, F16, **kw)


def _sm90_kvcache_case(checked, seeds, gqa=False, page=16):
    """The Hopper KV-cache form (f16, head dim 64, causal, GQA 2 over 128 query rows: unpacked) through the dispatcher
    (its form asserted): a paged cache of 16-row pages (gathered by cp.async), sequences of 600, 0
    and 37 keys in 2 splits (split 0 of the first reuses both ring slots), NaN in every row not to
    be read. ``gqa``: its GQA-packed form, 24 positions of a group of 8 query heads (192 rows: two
    query tiles, the second half empty), in 2 splits and unsplit (the 5-d TMA store's epilogue).
    ``page=128``: the form with TMA over the cache (its variant asserted), whose 600 keys are 4 whole
    tiles by TMA and an 88-key edge tile gathered, in 2 splits (3 TMA tiles through the ring, then
    one TMA and the gathered edge) and unsplit (5 tiles, the ring's slots mixed)."""
    import cuflash
    from cuflash import sim
    from cuflash.kernels import attention_fwd_sm90, kvcache_run
    from cuflash.reference import kvcache as ref_kvcache
    from cuflash.reference import tolerance
    from support.options import check_kvcache

    rng = np.random.default_rng(12)
    lengths = np.array([600, 0, 37], np.int32)
    pages = [-(-int(n) // page) for n in lengths]
    bt = np.full((3, max(pages) + 1), -1, np.int32)
    ids = rng.permutation(sum(pages) + 1).astype(np.int32)
    at = 0
    for b, n in enumerate(pages):
        bt[b, :n] = ids[at:at + n]
        at += n
    kc = np.full((sum(pages) + 1, page, 1, 64), np.nan, F16)
    vc = np.full_like(kc, np.nan)
    for b, n in enumerate(lengths):
        i0, i1 = ref_kvcache.cache_rows(b, 0, int(n), page_size=page, block_table=bt)
        kc[i0, i1] = rng.standard_normal((len(i0), 1, 64))
        vc[i0, i1] = rng.standard_normal((len(i0), 1, 64))
    q = rng.standard_normal((3, 24, 8, 64) if gqa else (3, 128, 2, 64)).astype(F16)
    problem = check_kvcache(q, kc, vc, lengths, causal=True, num_splits=2, block_table=bt)
    variant, splits = kvcache_run.choose(problem, 90, (q, kc, vc), sim.sm_count(90))
    assert isinstance(variant, attention_fwd_sm90.Sm90ForwardVariant) and splits == 2 and variant.gqa == gqa
    assert variant.kv_tma == (page == 128)
    # (packed: unsplit too, so that the epilogue's 5-d TMA store runs as well as the partials' stores)
    for seed, n_splits in [(seed, n) for seed in seeds for n in ((2, 1) if gqa or page == 128 else (2,))]:
        with sim.options(arch="sm_90", checked=checked, seed=seed):
            out, lse = cuflash.attention_with_kvcache(q, kc, vc, lengths, causal=True, num_splits=n_splits,
                                                      block_table=bt, return_lse=True, backend="sim")
        for b, n in enumerate(lengths):
            kb = ref_kvcache.gather(kc, b, 0, int(n), page_size=page, block_table=bt)[None]
            vb = ref_kvcache.gather(vc, b, 0, int(n), page_size=page, block_table=bt)[None]
            ok, msg, _ = tolerance.compare(out[b:b + 1], q[b:b + 1], kb, vb, lse=np.ascontiguousarray(lse[b:b + 1]),
                                           causal=True, layout="bshd")
            assert ok, f"Hopper KV-cache form, sequence {b}, seed {seed}, {n_splits} splits: {msg}"


def _sm90_gqa_fixed_case(checked, seeds):
    """The Hopper forward's fixed-shape GQA packing (f16, head dim 64, causal) through the dispatcher
    (its form asserted): 24 positions of a group of 6 query heads (10 positions, 60 rows a consumer:
    each consumer's 4 dead rows zeroed before the first wgmma reads them; two query tiles, the second
    mostly empty) over 600 keys (5 key tiles: both ring slots reused), two batches."""
    import cuflash
    from cuflash import sim
    from cuflash.reference import tolerance

    rng = np.random.default_rng(14)
    q = rng.standard_normal((2, 6, 24, 64)).astype(F16)
    k, v = (rng.standard_normal((2, 1, 600, 64)).astype(F16) for _ in range(2))
    info = cuflash.explain(q, k, v, causal=True, arch=90, backend="sim")
    assert info["variant"] == "f16_d64_local_gqa", info["choice"]
    for seed in seeds:
        with sim.options(arch="sm_90", checked=checked, seed=seed):
            out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True, backend="sim")
        ok, msg, _ = tolerance.compare(out, q, k, v, lse=lse, causal=True)
        assert ok, f"Hopper fixed-shape GQA packing, seed {seed}: {msg}"


def _sm90_prefill_case(checked, seeds):
    """The Hopper chunked-prefill form (f16, head dim 64, causal, GQA 2) through the dispatcher
    (its form asserted): packed sequences of 70, 0 and 3 query rows over 600, 5 and 37 keys of a
    paged cache of 16-row pages (5 key tiles: both ring slots reused), NaN in every row not to be read."""
    import cuflash
    from cuflash import sim
    from support.kvcache import check_prefill, make_prefill

    rng = np.random.default_rng(13)
    q, kc, vc, cq, ck, mq, mk, _, bt = make_prefill(rng, [(70, 600), (0, 5), (3, 37)], 16, (2, 1), 64, F16, "all")
    info = cuflash.explain_varlen(q, kc, vc, cq, ck, mq, mk, causal=True, block_table=bt, backend="sim", arch=90)
    assert info["variant"] == "f16_d64_local_varlen_kvcache", info["choice"]
    for seed in seeds:
        with sim.options(arch="sm_90", checked=checked, seed=seed):
            out, lse = cuflash.attention_varlen(q, kc, vc, cq, ck, mq, mk, causal=True, block_table=bt,
                                                return_lse=True, backend="sim")
        check_prefill(out, lse, q, kc, vc, cq, ck, None, bt, 16, True, (-1, -1))


F16, F32 = np.float16, np.float32
PROBES = {
    # (and the fp8-cache form's pipeline: its own wait, the barrier before the conversion, every
    # reader of tile j - 1 done, and the one after it, tile j's conversion published)
    "fwd_mma_checked": lambda: (_attention_case(F16, 64, 200, 300, True, "sm_80", True, (0,), False),
                                _fp8_kvcache_case(True, (0,))),
    "fwd_mma_seeds": lambda: _attention_case(F16, 64, 200, 300, True, "sm_80", False, SEEDS, False),
    "fwd_mma_d256_checked": lambda: _attention_case(F16, 256, 70, 90, False, "sm_80", True, (0,), False),
    "fwd_mma_empty_checked": lambda: _attention_case(F16, 64, 146, 1, True, "sm_80", True, (0,), False),
    # the sm_75 (Turing) form: synchronous copies (its cp.async waits are empty), one stage, m16n8k8
    "fwd_mma_sm75_checked": lambda: _attention_case(F16, 64, 200, 300, True, "sm_75", True, (0,), False),
    "bwd_mma_sm75_checked": lambda: _attention_case(F16, 64, 250, 150, True, "sm_75", True, (0,), True),
    "fwd_simt_checked": lambda: _attention_case(F32, 32, 70, 130, True, "sm_75", True, (0,), False),
    "fwd_simt_seeds": lambda: _attention_case(F32, 32, 70, 130, True, "sm_75", False, SEEDS, False),
    # four query tiles per key tile (both Q/dO stages refilled while other warps may still read)
    "bwd_mma_checked": lambda: _attention_case(F16, 64, 250, 150, True, "sm_80", True, (0,), True),
    "bwd_mma_seeds": lambda: _attention_case(F16, 64, 250, 150, True, "sm_80", False, SEEDS, True),
    # the one-stage pipeline of head dim 192 on sm_80 (its refill barrier)
    "bwd_mma_s1_checked": lambda: _attention_case(F16, 192, 200, 100, False, "sm_80", True, (0,), True),
    # deterministic mode: 17 key tiles over 16 splits, so split 0 runs in two launches
    "bwd_mma_det_checked": lambda: _attention_case(F16, 64, 64, 2100, True, "sm_80", True, (0,), True, hq=1,
                                                   deterministic=True),
    # ... and a window only the last key tiles reach: most blocks have no query row
    "bwd_mma_det_window_checked": lambda: _attention_case(F16, 64, 64, 2100, False, "sm_80", True, (0,), True,
                                                          hq=1, window=(5, 0), deterministic=True),
    "bwd_simt_checked": lambda: _attention_case(F32, 32, 40, 70, True, "sm_75", True, (0,), True),
    "bwd_simt_seeds": lambda: _attention_case(F32, 32, 40, 70, True, "sm_75", False, SEEDS, True),
    "softmax_checked": lambda: _softmax_case(True, (0,)),
    "kvcache_split_checked": lambda: _kvcache_case(True, (0,)),
    "kvcache_split_seeds": lambda: _kvcache_case(False, SEEDS),
    "softmax_seeds": lambda: _softmax_case(False, SEEDS),
    "hopper_checked": lambda: _hopper_case(True, (0,)),
    # the Hopper forward: 3 key tiles through the 2-stage ring (both parities), 2 query tiles, GQA
    # 5 key tiles: the producer reuses each K and V slot at least twice (the ring's releases matter)
    "fwd_sm90_checked": lambda: _sm90_case(F16, 64, 200, 600, False, True, (0,)),
    "fwd_sm90_seeds": lambda: _sm90_case(F16, 64, 200, 300, False, False, SEEDS),
    "fwd_sm90_local_checked": lambda: _sm90_case(F16, 128, 190, 260, True, True, (0,)),
    "fwd_sm90_varlen_checked": lambda: _sm90_varlen_case(True, (0,)),
    "fwd_sm90_kvcache_checked": lambda: _sm90_kvcache_case(True, (0,)),
    "fwd_sm90_gqa_checked": lambda: _sm90_kvcache_case(True, (0,), gqa=True),
    "fwd_sm90_gqa_fixed_checked": lambda: _sm90_gqa_fixed_case(True, (0,)),
    # TMA over a paged cache: whole tiles by TMA (thread 0's arrive.expect_tx), the edge gathered
    "fwd_sm90_kvtma_checked": lambda: _sm90_kvcache_case(True, (0,), page=128),
    # chunked prefill: the KV-cache form's gather and rings under packed queries
    "fwd_sm90_prefill_checked": lambda: _sm90_prefill_case(True, (0,)),
    # the block-sparse form: the same rings and turns over key tiles taken from a block mask's lists
    "fwd_sm90_bs_checked": lambda: _sm90_block_sparse_case(True, (0,)),
    # the fp8 form: its V^T tiles (a 128-byte swizzle of keys), O staged after the V ring
    "fwd_sm90_fp8_checked": lambda: _sm90_fp8_case(True, (0,)),
    # the packed fp8 form: the same pipeline, V^T tiles from each sequence's padded columns
    "fwd_sm90_fp8_varlen_checked": lambda: _sm90_fp8_varlen_case(True, (0,)),
    "hopper_seeds": lambda: _hopper_case(False, SEEDS),
    "bwd_sm90_checked": lambda: _sm90_bwd_case(True, (0,)),
    "bwd_sm90_seeds": lambda: _sm90_bwd_case(False, SEEDS),
    # the traced form's wait for S^T and dP^T before its per-pair code (score_mod, mask_mod)
    "bwd_sm90_um_checked": lambda: _sm90_bwd_traced_case(True, (0,)),
}


def killed_by(probe: str) -> str | None:
    """Run ``probe``; the failure it reports (None when it passes)."""
    from cuflash.sim import SimError

    try:
        PROBES[probe]()
    except (AssertionError, SimError) as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return None


def load_kill_map() -> dict:
    return json.loads(KILL_MAP_PATH.read_text(encoding="utf-8")) if KILL_MAP_PATH.is_file() else {}


def search(kernels_dir: Path, work: Path, log=print) -> tuple[dict, dict]:
    """``(kill map, survivors)`` found by running every probe of a mutant's file until one kills it.

    Runs with the kernel sources swapped for the mutated copy (``paths.kernels_dir``) and a
    private simulator cache under ``work``."""
    import os

    from cuflash.runtime import paths

    saved_cache = os.environ.get("CUFLASH_SIM_CACHE_DIR")
    os.environ["CUFLASH_SIM_CACHE_DIR"] = str(work / "sim-cache")  # mutants never reach the user's cache
    real = paths.kernels_dir
    for probe in PROBES:  # a probe that fails on the real kernels would "kill" everything
        why = killed_by(probe)
        if why:
            raise AssertionError(f"probe {probe} fails on the unmutated kernels: {why}")
    kill, survive = {}, {}
    try:
        for i, m in enumerate(mutants(real())):
            tree = mutated_tree(real(), m, work / f"m{i}")
            paths.kernels_dir = lambda tree=tree: tree
            for probe in FILES[m.file]:
                why = killed_by(probe)
                if why:
                    kill[m.id] = probe
                    log(f"killed   {m.id} (line {m.line}) by {probe}: {why}")
                    break
            else:
                survive[m.id] = f"line {m.line}"
                log(f"SURVIVED {m.id} (line {m.line})")
    finally:
        paths.kernels_dir = real
        if saved_cache is None:
            os.environ.pop("CUFLASH_SIM_CACHE_DIR", None)
        else:
            os.environ["CUFLASH_SIM_CACHE_DIR"] = saved_cache
    return kill, survive


if __name__ == "__main__":  # pragma: no cover - a developer's command
    import tempfile

    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parent))
    from cuflash.runtime import paths as _paths

    with tempfile.TemporaryDirectory() as tmp:
        kill_map, survivors = search(_paths.kernels_dir(), Path(tmp), log=lambda s: print(s, file=sys.stderr))
    text = json.dumps(kill_map, indent=1, sort_keys=True) + "\n"
    if "--write" in sys.argv:
        KILL_MAP_PATH.write_text(text, encoding="utf-8")
    print(text, end="")
    print(f"{len(kill_map)} killed, {len(survivors)} survived: {sorted(survivors)}", file=sys.stderr)
