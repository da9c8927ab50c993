"""Context parallelism (issue 27): ring and Ulysses attention over torch.distributed, on CPU
tensors over gloo on loopback. One spawn per world size (2 and 4) runs every case inside
(tests/support/cp_worker.py): forward and the gradients of q, k, v against single-process attention,
causal (zigzag and contiguous) and not, GQA, head dims 64 and 128, shard lengths that are not
powers of two, float32 and float64; a group of one equal to plain attention bit for bit; the
zigzag round trip; misuse raising the same error on every rank. Bounded by a timeout."""

from __future__ import annotations

import socket
import time

import pytest

torch = pytest.importorskip("torch")
import torch.multiprocessing as mp  # noqa: E402

import cuflash.torch as ct  # noqa: E402

TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port):
    from support import cp_worker

    cp_worker.run(rank, world, port)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_ring_and_ulysses_match_single_process_attention(world):
    ctx = mp.start_processes(_worker, args=(world, _free_port()), nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the {world} ranks did not finish within {TIMEOUT_S} s (a hang)")


def test_no_process_group_is_a_clear_error():
    x = torch.zeros(1, 4, 2, 8)
    with pytest.raises(ValueError, match="no process group is initialised"):
        ct.ring_attention(x, x, x)
    with pytest.raises(ValueError, match="no process group is initialised"):
        ct.ulysses_attention(x, x, x)
    with pytest.raises(ValueError, match="no process group is initialised"):
        ct.zigzag_split(x)


def test_readme_example_runs_under_torchrun(tmp_path):
    """The README's two-process example, as written, under torchrun on CPU (gloo)."""
    import subprocess
    import sys
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    code = text.split("<!-- cp-example -->\n```python\n")[1].split("```")[0]
    script = tmp_path / "ring_demo.py"
    script.write_text(code, encoding="utf-8")
    root = str(Path(__file__).resolve().parents[2])
    env = dict(__import__("os").environ, PYTHONPATH=root + ":" + __import__("os").environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--master-port", str(_free_port()), str(script)], capture_output=True, text=True,
                       timeout=TIMEOUT_S, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rank 0: (1, 32, 4, 32) of (1, 64, 4, 32), dk (1, 32, 4, 32)" in r.stdout
    assert "rank 1:" in r.stdout
