"""The NumPy path's threads (cuflash.runtime.threads): the pool, the BLAS limit, and results that
do not depend on the number of threads."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import threadpoolctl

import cuflash
from cuflash import reference as ref
from cuflash.runtime import threads


def _blas_threads():
    return {i["filepath"]: i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"}


def test_run_keeps_order_spreads_over_threads_and_propagates_errors(monkeypatch):
    monkeypatch.setenv("CUFLASH_NUM_THREADS", "3")
    seen = set()
    barrier = threading.Barrier(3, timeout=10)

    def work(i):
        seen.add(threading.current_thread().name)
        if i < 3:
            barrier.wait()  # only returns once three workers run at the same time
        return i * i

    assert threads.run(work, range(9)) == [i * i for i in range(9)]
    assert len(seen) == 3 and all(name.startswith("cuflash") for name in seen)

    def boom(i):
        if i == 4:
            raise ValueError("item 4")
        return i

    with pytest.raises(ValueError, match="item 4"):
        threads.run(boom, range(8))


def test_nested_run_is_inline_and_one_thread_runs_in_the_caller(monkeypatch):
    monkeypatch.setenv("CUFLASH_NUM_THREADS", "2")
    outer = threads.run(lambda i: threads.run(lambda j: (i, j, threading.current_thread().name), range(2)), range(2))
    for i, inner in enumerate(outer):
        assert [x[:2] for x in inner] == [(i, 0), (i, 1)]
        assert len({x[2] for x in inner}) == 1  # the worker that ran the outer item
    monkeypatch.setenv("CUFLASH_NUM_THREADS", "1")
    assert threads.run(lambda i: threading.current_thread().name, range(3)) == [threading.current_thread().name] * 3


def test_blas_is_single_threaded_inside_and_restored_after():
    before = _blas_threads()
    assert before, "NumPy's BLAS is not visible to threadpoolctl"
    with threads.blas_single_threaded():
        assert set(_blas_threads().values()) == {1}
        with threads.blas_single_threaded():  # a second holder (another thread, a nested call)
            assert set(_blas_threads().values()) == {1}
        assert set(_blas_threads().values()) == {1}  # still held by the first
    assert _blas_threads() == before
    inside = threads.run(lambda i: set(_blas_threads().values()), range(4))
    assert all(x == {1} for x in inside)
    assert _blas_threads() == before


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_bad_thread_count_is_named(monkeypatch, value):
    monkeypatch.setenv("CUFLASH_NUM_THREADS", value)
    with pytest.raises(ValueError, match=rf"CUFLASH_NUM_THREADS must be a positive int, got '{value}'"):
        threads.num_threads()


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_results_do_not_depend_on_the_thread_count(monkeypatch, rng, dtype):
    q = rng.standard_normal((2, 6, 300, 40)).astype(dtype)
    k = rng.standard_normal((2, 2, 700, 40)).astype(dtype)  # GQA 6:2, several key tiles
    v = rng.standard_normal((2, 2, 700, 24)).astype(dtype)
    results = []
    for n in ("1", "2", "5"):
        monkeypatch.setenv("CUFLASH_NUM_THREADS", n)
        out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
        dout = np.ones_like(out)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)
        results.append((out, lse, *grads))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b)  # bit for bit
    o64 = ref.naive_attention(q, k, v, causal=True)
    assert np.max(np.abs(results[0][0].astype(np.float64) - o64)) < (2e-3 if dtype == np.float16 else 1e-5)


def test_without_threadpoolctl_the_pool_still_runs(monkeypatch):
    """A source tree on a machine image without threadpoolctl (the GPU image) runs, unlimited."""
    import sys

    monkeypatch.setitem(sys.modules, "threadpoolctl", None)  # import fails
    monkeypatch.setattr(threads, "_controller", None)
    monkeypatch.setenv("CUFLASH_NUM_THREADS", "2")
    assert threads.run(lambda i: i + 1, range(5)) == [1, 2, 3, 4, 5]
    assert threads._controller is False


def test_a_blas_loaded_after_the_first_call_is_held_too():
    """SciPy (which jax and transformers import) brings its own OpenBLAS; one loaded after the
    pool's first run must be held to one thread as well. A fresh interpreter fixes the order."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import sys, threadpoolctl
        from cuflash.runtime import threads
        blas = lambda: sorted(i["filepath"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas")
        threads.run(lambda i: i, range(2))
        before = blas()
        import scipy.linalg
        assert len(blas()) > len(before), ("scipy brought no BLAS of its own", before, blas())
        counts = threads.run(lambda i: {i["num_threads"] for i in threadpoolctl.threadpool_info()
                                        if i["user_api"] == "blas"}, range(2))
        print(counts)
        sys.exit(0 if all(c == {1} for c in counts) else 1)
        """
    )
    env = {**__import__("os").environ, "CUFLASH_NUM_THREADS": "2", "OPENBLAS_NUM_THREADS": "2"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
