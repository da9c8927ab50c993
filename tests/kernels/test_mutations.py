"""The mutation suite over our own kernels (tests/support/mutations.py says how it works).

The default run takes one mutant of each (kernel file, probe) pair and ``slow`` every other one;
each runs once, against the probe the kill map records for it, and requires the probe to fail (mutated texts get their own keys in the session's temporary simulator cache); the map and the list of explained survivors must cover exactly the mutants the
kernels have today (a new barrier or wait in a kernel must be registered, by running
``python tests/support/mutations.py --write``). Under ``slow`` the full search runs again and must
find every mutant killed. Each mutant is one g++ build of the mutated kernel in a private
simulator cache (about 2 s).
"""

from __future__ import annotations

import pytest
from support.mutations import (
    FILES,
    KILL_MAP_PATH,
    PROBES,
    SLOW_PROBES,
    SURVIVORS,
    killed_by,
    load_kill_map,
    mutants,
    mutated_tree,
    search,
)

from cuflash.runtime import paths

KILL_MAP = load_kill_map()
MUTANTS = mutants(paths.kernels_dir())


def test_kill_map_covers_exactly_the_kernels_mutants():
    ids = {m.id for m in MUTANTS}
    assert KILL_MAP_PATH.is_file()
    missing = sorted(ids - set(KILL_MAP) - set(SURVIVORS))
    stale = sorted((set(KILL_MAP) | set(SURVIVORS)) - ids)
    assert not missing, f"mutants with no recorded killer (run python tests/support/mutations.py --write): {missing}"
    assert not stale, f"kill map entries for statements the kernels no longer have: {stale}"
    assert all(probe in PROBES for probe in KILL_MAP.values())
    assert len(MUTANTS) >= 20 and {m.file for m in MUTANTS} == set(FILES)   # 20 syncs today


def test_the_split_kv_combine_barrier_is_killed():
    """Issue 22's combine: each lane publishes its splits' weights in shared memory and the warp
    reads all of them after a __syncwarp; without it a lane reads a weight not yet written."""
    assert KILL_MAP.get("attention_combine.cu|__syncwarp();|#0|delete")


def test_the_pipeline_mutations_of_the_tensor_core_forward_are_killed():
    """Issue 16's named mutations, in the one-barrier pipeline of issue 17: the barrier at the top
    of the K/V loop (it both publishes tile j's copies and orders the refill of the other stage
    after every reader of tile j - 1, the roles of the old kernel's two barriers), the wait before
    it deleted or relaxed (wait_group 0 -> 1: tile j read before it lands), and the one-stage
    kernels' barrier before their refill."""
    for mid in ("attention_fwd_mma.cu|__syncthreads();|#0|delete", "attention_fwd_mma.cu|__syncthreads();|#3|delete",
                "attention_fwd_mma.cu|ptx_cp_async_wait<0>();|#0|delete",
                "attention_fwd_mma.cu|ptx_cp_async_wait<0>();|#0|relax"):
        assert KILL_MAP.get(mid), mid


def test_the_fp8_cache_pipeline_of_the_tensor_core_forward_is_killed():
    """The fp8-cache form's own wait (deleted, or relaxed to wait_group 1: a thread converts its
    chunks of tile j before they land) and its two barriers (before the conversion: every reader of
    tile j - 1's K/V done; after it: tile j's converted K/V published), each killed by the
    tensor-core probe in checked mode, whose second call decodes over fp8 caches."""
    for mid in ("attention_fwd_mma.cu|ptx_cp_async_wait<0>();|#1|delete",
                "attention_fwd_mma.cu|ptx_cp_async_wait<0>();|#1|relax",
                "attention_fwd_mma.cu|__syncthreads();|#1|delete", "attention_fwd_mma.cu|__syncthreads();|#2|delete"):
        assert KILL_MAP.get(mid) == "fwd_mma_checked", mid


def test_the_pipeline_mutations_of_the_tensor_core_backward_are_killed():
    """Issue 18's pipeline: the barrier at the top of the query-tile loop (publishes tile i's
    Q/dO/lse/Dd and orders the refill of the other stage and the P/dS stores after every reader of
    tile i - 1), the wait before it deleted or relaxed, the barrier between the P/dS stores and
    the products that read them, and the one-stage kernels' barrier before their refill."""
    for mid in ("attention_bwd_mma.cu|__syncthreads();|#0|delete", "attention_bwd_mma.cu|__syncthreads();|#1|delete",
                "attention_bwd_mma.cu|__syncthreads();|#2|delete",
                "attention_bwd_mma.cu|ptx_cp_async_wait<0>();|#0|delete",
                "attention_bwd_mma.cu|ptx_cp_async_wait<0>();|#0|relax"):
        assert KILL_MAP.get(mid), mid


#: the barriers the sm_75 (Turing) form runs, each with the sm_75 probe that must see it go: every
#: __syncthreads and __syncwarp of the two tensor-core kernels but the fp8-cache form's two (#1, #2
#: of the forward: no fp8 cache on that probe's path). Its cp.async waits are empty on sm_75, so
#: their mutants change nothing there (the sm_80 probes kill them).
SM75_BARRIERS = [("attention_fwd_mma.cu|__syncthreads();|#0|delete", "fwd_mma_sm75_checked"),
                 ("attention_fwd_mma.cu|__syncthreads();|#3|delete", "fwd_mma_sm75_checked"),
                 ("attention_fwd_mma.cu|__syncwarp();|#0|delete", "fwd_mma_sm75_checked"),
                 ("attention_fwd_mma.cu|__syncwarp();|#1|delete", "fwd_mma_sm75_checked"),
                 ("attention_bwd_mma.cu|__syncthreads();|#0|delete", "bwd_mma_sm75_checked"),
                 ("attention_bwd_mma.cu|__syncthreads();|#1|delete", "bwd_mma_sm75_checked"),
                 ("attention_bwd_mma.cu|__syncthreads();|#2|delete", "bwd_mma_sm75_checked")]


@pytest.mark.slow
@pytest.mark.checked
@pytest.mark.parametrize("mid,probe", SM75_BARRIERS, ids=[m for m, _ in SM75_BARRIERS])
def test_the_sm75_form_barriers_are_killed_by_the_sm75_probes(mid, probe, tmp_path, monkeypatch):
    """The sm_75 form is the same kernel text built with other ptx.cuh wrappers (m16n8k8, register-
    staged copies): each barrier it runs, deleted, is seen by the sm_75 probe in checked mode, not
    only by the sm_80 probe the kill map records."""
    (mutant,) = [m for m in MUTANTS if m.id == mid]
    tree = mutated_tree(paths.kernels_dir(), mutant, tmp_path / "kernels")
    monkeypatch.setattr(paths, "kernels_dir", lambda: tree)
    assert killed_by(probe), f"{mid} (line {mutant.line}) survived the sm_75 probe {probe}"


@pytest.mark.parametrize("probe", [p if p in KILL_MAP.values() and p not in SLOW_PROBES
                                   else pytest.param(p, marks=pytest.mark.slow) for p in sorted(PROBES)])
def test_probes_pass_on_the_real_kernels(probe):   # (the default run: the probes the kill map names)
    assert killed_by(probe) is None  # otherwise a "kill" would mean nothing


def _mutant_params():
    """Every recorded mutant; the default run takes the first of each (kernel file, probe) pair,
    so every kernel file and every probe that kills something is shown to, and the rest run
    under ``slow``."""
    first = set()
    params = []
    for m in MUTANTS:
        if m.id not in KILL_MAP:
            continue
        key = (m.file, KILL_MAP[m.id])
        marks = () if key not in first and key[1] not in SLOW_PROBES else (pytest.mark.slow,)
        first.add(key)
        params.append(pytest.param(m, id=m.id, marks=marks))
    return params


def test_the_default_mutants_cover_every_kernel_file_and_probe():
    default = [p.values[0] for p in _mutant_params() if not p.marks]
    assert {m.file for m in default} == set(FILES)
    assert {KILL_MAP[m.id] for m in default} == set(KILL_MAP.values()) - set(SLOW_PROBES)
    assert set(SLOW_PROBES) <= set(PROBES)
    assert len(default) < len(KILL_MAP) / 3   # the point of the sample


@pytest.mark.checked
@pytest.mark.parametrize("mutant", _mutant_params())
def test_mutant_is_killed(mutant, tmp_path, monkeypatch):
    tree = mutated_tree(paths.kernels_dir(), mutant, tmp_path / "kernels")
    assert (tree / mutant.file).read_text() != (paths.kernels_dir() / mutant.file).read_text()
    monkeypatch.setattr(paths, "kernels_dir", lambda: tree)
    why = killed_by(KILL_MAP[mutant.id])
    assert why, f"{mutant.id} (line {mutant.line}) survived its recorded probe {KILL_MAP[mutant.id]}"


def test_mutant_edit_is_exactly_one_statement():
    text = (paths.kernels_dir() / "attention_fwd_mma.cu").read_text()
    m = next(m for m in MUTANTS if m.id == "attention_fwd_mma.cu|ptx_cp_async_wait<0>();|#0|relax")
    out = m.apply(text)
    diff = [(a, b) for a, b in zip(text.split("\n"), out.split("\n")) if a != b]
    assert len(diff) == 1 and "ptx_cp_async_wait<1>();" in diff[0][1] and "//" in diff[0][1]


@pytest.mark.slow
def test_full_search_kills_every_mutant(tmp_path):
    kill, survive = search(paths.kernels_dir(), tmp_path, log=lambda s: None)
    assert set(survive) <= set(SURVIVORS), f"new survivors: {sorted(set(survive) - set(SURVIVORS))}"
    assert set(kill) | set(survive) == {m.id for m in MUTANTS}


def test_the_hopper_synchronisations_are_killed():
    """Issue 19's deletions in the sm_90a probes: every wgmma fence, commit and wait, every mbarrier
    wait and arrive, the fences of the proxies (fence.proxy.async before the TMA store,
    fence.mbarrier_init before TMA completes on a barrier), the named barrier before the store, the
    bulk commit and wait; the kill map names a probe for each (none survives)."""
    hopper = [m for m in MUTANTS if m.file == "hopper_probe.cu"]
    kinds = {m.statement.split("(")[0].split("<")[0] for m in hopper}
    assert {"ptx_wgmma_fence", "ptx_wgmma_commit", "ptx_wgmma_wait", "ptx_mbarrier_wait", "ptx_mbarrier_arrive",
            "ptx_fence_proxy_async", "ptx_fence_mbarrier_init", "ptx_bar_sync", "ptx_bulk_commit",
            "ptx_bulk_wait"} <= kinds
    assert all(KILL_MAP.get(m.id) for m in hopper) and not any(m.id in SURVIVORS for m in hopper)


#: the synchronisations of the Hopper forward's pipeline that the fp8 form leans on in its own way
#: (the P V wgmma on V^T tiles, V's ring, O staged after the V ring): each, removed, is seen by the
#: fp8 probes too (the fixed and the packed fp8 form's), not only by the 16-bit probe the kill map
#: records
FP8_FORM_MUTANTS = ["attention_fwd_sm90.cu|ptx_wgmma_fence();|#1|delete",
                    "attention_fwd_sm90.cu|ptx_mbarrier_wait(bar_fv + 8 * sv, ph ^ sv);|#0|delete",
                    "attention_fwd_sm90.cu|ptx_mbarrier_wait(&empty_v[s], ((j / STAGES) - 1) & 1);|#0|delete",
                    "attention_fwd_sm90.cu|ptx_wgmma_wait<0>();|#1|relax",
                    "attention_fwd_sm90.cu|ptx_fence_proxy_async();|#4|delete",
                    "attention_fwd_sm90.cu|ptx_bar_sync(EPILOGUE_BAR + c, 128);|#0|delete"]


@pytest.mark.slow
@pytest.mark.checked
@pytest.mark.parametrize("mid", FP8_FORM_MUTANTS)
@pytest.mark.parametrize("probe", ["fwd_sm90_fp8_checked", "fwd_sm90_fp8_varlen_checked"])
def test_the_fp8_form_sees_the_pipeline_mutants(probe, mid, tmp_path, monkeypatch):
    (mutant,) = [m for m in MUTANTS if m.id == mid]
    tree = mutated_tree(paths.kernels_dir(), mutant, tmp_path / "kernels")
    monkeypatch.setattr(paths, "kernels_dir", lambda: tree)
    assert killed_by(probe), f"{mid} (line {mutant.line}) survived the {probe} probe"


@pytest.mark.slow
@pytest.mark.checked
def test_the_packed_fp8_probe_passes_on_the_kernel():
    """The packed fp8 probe passes on the unmutated kernel, so a kill above is the mutant's."""
    assert killed_by("fwd_sm90_fp8_varlen_checked") is None


#: the KV-cache producer's gather pipeline (each K/V slot's release wait, the cp.async waits, the
#: proxy fence and the full-barrier arrivals) and the consumers' full waits, which the
#: chunked-prefill form runs with packed queries: each, removed, is seen by its probe too, not only
#: by the KV-cache probe the kill map records
PREFILL_FORM_MUTANTS = ["attention_fwd_sm90.cu|ptx_mbarrier_wait(&empty_k[s], ((j / STAGES) - 1) & 1);|#1|delete",
                        "attention_fwd_sm90.cu|ptx_mbarrier_arrive(&full_v[(j - 1) % STAGES]);|#0|delete",
                        "attention_fwd_sm90.cu|ptx_mbarrier_wait(&empty_v[s], ((j / STAGES) - 1) & 1);|#1|delete",
                        "attention_fwd_sm90.cu|ptx_mbarrier_arrive(&full_k[s]);|#0|delete",
                        "attention_fwd_sm90.cu|ptx_cp_async_wait<0>();|#0|relax",
                        "attention_fwd_sm90.cu|ptx_fence_proxy_async();|#3|delete",
                        "attention_fwd_sm90.cu|ptx_mbarrier_wait(bar_fk + 8 * s, ph);|#0|delete",
                        "attention_fwd_sm90.cu|ptx_bar_sync(EPILOGUE_BAR + c, 128);|#0|delete"]


@pytest.mark.slow
@pytest.mark.checked
@pytest.mark.parametrize("mid", PREFILL_FORM_MUTANTS)
@pytest.mark.parametrize("probe", ["fwd_sm90_prefill_checked", "fwd_sm90_gqa_checked", "fwd_sm90_kvtma_checked"])
def test_the_gathering_forms_see_the_gather_mutants(probe, mid, tmp_path, monkeypatch):
    """The producer's page gather and pipeline as the chunked-prefill form runs it, as the
    KV-cache form's GQA packing does (rows of 8 heads at 24 positions), and as the form with TMA
    over the cache does (whole tiles by TMA, the edge tile gathered)."""
    (mutant,) = [m for m in MUTANTS if m.id == mid]
    tree = mutated_tree(paths.kernels_dir(), mutant, tmp_path / "kernels")
    monkeypatch.setattr(paths, "kernels_dir", lambda: tree)
    assert killed_by(probe), f"{mid} (line {mutant.line}) survived {probe}"


#: the TMA path's own synchronisation (no SYNC statement: the arrive.expect_tx and the guards that
#: keep thread 0 from arriving twice on a TMA tile's full barrier), as literal edits: (text, new text)
KV_TMA_MUTANTS = [("\n    ptx_mbarrier_arrive_expect_tx(bar, NP * PANEL_KV);\n", "\n    ptx_mbarrier_arrive(bar);\n"),
                  ("\n                if (!tma_v || ptid != 0)\n", "\n"),
                  ("\n            if (!tma || ptid != 0)\n", "\n"),
                  ("\n            if (!tma_v || ptid != 0)\n", "\n"),
                  ("\n            tma_v = tma;\n", "\n")]


@pytest.mark.slow
@pytest.mark.checked
@pytest.mark.parametrize("edit", KV_TMA_MUTANTS, ids=range(len(KV_TMA_MUTANTS)))
def test_the_kv_tma_probe_sees_the_tma_path_mutants(edit, tmp_path, monkeypatch):
    """Each edit of the TMA path's barrier protocol (the expect_tx made a plain arrival, a guard
    removed so thread 0 arrives twice, the V tile's TMA flag not carried) is killed by its probe."""
    old, new = edit
    tree = tmp_path / "kernels"
    tree.mkdir()
    for f in paths.kernels_dir().iterdir():
        if f.is_file():
            (tree / f.name).write_bytes(f.read_bytes())
    src = (tree / "attention_fwd_sm90.cu").read_text()
    assert src.count(old) == 1, old
    (tree / "attention_fwd_sm90.cu").write_text(src.replace(old, new))
    monkeypatch.setattr(paths, "kernels_dir", lambda: tree)
    assert killed_by("fwd_sm90_kvtma_checked"), f"{old.strip()!r} -> {new.strip()!r} survived the TMA probe"


@pytest.mark.slow
@pytest.mark.checked
@pytest.mark.parametrize("probe", ["fwd_sm90_gqa_checked", "fwd_sm90_gqa_fixed_checked", "fwd_sm90_kvtma_checked"])
def test_the_gqa_packed_probes_pass_on_the_kernel(probe):
    """The GQA-packed probes pass on the unmutated kernel, so a kill is the mutant's."""
    assert killed_by(probe) is None


@pytest.mark.slow
@pytest.mark.checked
@pytest.mark.parametrize("mid", FP8_FORM_MUTANTS)
def test_the_fixed_gqa_packed_form_sees_the_pipeline_mutants(mid, tmp_path, monkeypatch):
    """The TMA pipeline's mutants (V's ring, the wgmma fence and waits, the proxy fence, the
    epilogue barrier) as the fixed-shape GQA-packed form runs them."""
    (mutant,) = [m for m in MUTANTS if m.id == mid]
    tree = mutated_tree(paths.kernels_dir(), mutant, tmp_path / "kernels")
    monkeypatch.setattr(paths, "kernels_dir", lambda: tree)
    assert killed_by("fwd_sm90_gqa_fixed_checked"), f"{mid} (line {mutant.line}) survived the fixed GQA probe"


def test_the_hopper_forward_synchronisations_are_killed():
    """Issue 20's kernel: every mbarrier wait and arrive, wgmma fence/commit/wait, the proxy fences,
    the epilogue's named barrier and bulk commit/wait are killed; only the last tile's ping-pong turn
    (a scheduling barrier, no data crosses it) survives, with its reason."""
    mine = [m for m in MUTANTS if m.file == "attention_fwd_sm90.cu"]
    assert len(mine) >= 20
    window = [m.id for m in mine if m.id in SURVIVORS and "cp_async_wait<1>" not in m.id
              and m.id not in ("attention_fwd_sm90.cu|ptx_fence_proxy_async();|#1|delete",
                               "attention_fwd_sm90.cu|ptx_fence_proxy_async();|#2|delete")]
    # (besides the KV-cache producer's per-tile publication, whose timing window the simulator's
    # scheduling never opens: tests/support/mutations.py, _KV_WINDOW)
    assert window == ["attention_fwd_sm90.cu|ptx_bar_sync(TURN_BAR + c, 256);|#2|delete"]
    assert all(KILL_MAP.get(m.id) for m in mine if m.id not in SURVIVORS)


def test_the_hopper_backward_synchronisations_are_killed_or_explained():
    """The Hopper backward: every mbarrier wait and arrive, the proxy fences, the dQ buffer's full
    barrier and the bulk commit and read wait, the wgmma fences, commits and waits of S, dP and dQ, and
    deterministic mode's proxy fences, full wait and release increment are killed; the seven survivors of
    five statements (SURVIVORS) are synchronisations a GPU needs that the simulator cannot show missing,
    and the eighth, deterministic mode's turn wait, is seen by a slow test only; each with its reason.
    The traced form's wait for S^T and dP^T before its per-pair code is killed by its own probe."""
    mine = [m for m in MUTANTS if m.file == "attention_bwd_sm90.cu"]
    assert len(mine) >= 25
    survivors = sorted(m.id for m in mine if m.id in SURVIVORS)
    assert len(survivors) == 8 and all(KILL_MAP.get(m.id) for m in mine if m.id not in SURVIVORS)
    for kind in ("delete", "relax"):
        assert KILL_MAP[f"attention_bwd_sm90.cu|ptx_wgmma_wait<0>();|#1|{kind}"] == "bwd_sm90_um_checked"
