"""Bad input, tried by a machine: a property test of every public entry point.

Hypothesis draws calls of ``cuflash.attention``, ``attention_backward``, ``attention_varlen``,
``attention_varlen_backward``, ``attention_with_kvcache``, ``merge_attention``, ``softmax`` and
``explain``: shapes, strides (views of NaN-filled buffers, transposes, steps, stride-0
broadcasts, and as mutations negative, zero and non-unit last-axis strides), dtypes, layouts,
masks, windows, index arrays, modifiers, ``out=`` buffers, in NumPy, torch CPU or JAX CPU
arrays, valid or broken by up to two mutations (:mod:`support.bad_input`). Every call must
either raise ``TypeError``/``ValueError``/``NotImplementedError``/``MemoryError`` with a message
that begins with the function's name and names the argument, or return results within the
tolerance rule of the float64 oracle, leaving its inputs unchanged (``out=`` and the appended KV
caches aside). Failures found here become plain tests in ``test_bad_input_regressions.py``.

The default run tries a few examples of each, derandomized (reproducible); ``-m slow`` runs
thousands (``CUFLASH_HYPOTHESIS_EXAMPLES`` sets how many; ``--hypothesis-seed`` varies them).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, assume, given, settings
from support import bad_input as bi

import cuflash

SLOW_EXAMPLES = int(os.environ.get("CUFLASH_HYPOTHESIS_EXAMPLES", "2000"))
QUICK = dict(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
SLOW = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck))

#: examples per entry point in the default run (NumPy path)
DEFAULT_EXAMPLES = {"attention": 40, "attention_backward": 25, "attention_varlen": 25, "attention_varlen_backward": 20,
                    "attention_with_kvcache": 30, "merge_attention": 20, "softmax": 20, "explain": 20}

NUMPY = bi.Profile()
HOST_KINDS = bi.Profile(kinds=("numpy", "torch", "jax"))
#: the simulator in the default run: bad input only, refused before any kernel is compiled (a
#: compile costs seconds of g++, which the default run cannot spend); valid calls run under slow
SIM_QUICK = bi.Profile(dtypes=(bi.F16, bi.BF16, bi.F32), backend="sim", head_dims=(8, 16), max_len=4,
                       mutations=(1, 1, 2))
#: the simulator under slow: 16-bit dtypes, tiny shapes, every feature
SIM_SLOW = bi.Profile(dtypes=(bi.F16, bi.BF16), backend="sim", head_dims=(8, 16, 40), max_len=4)


@pytest.mark.parametrize("entry", bi.ENTRIES)
def test_numpy_path_keeps_the_contract(entry):
    @settings(max_examples=DEFAULT_EXAMPLES[entry], **QUICK)
    @given(bi.calls(entry, NUMPY))
    def run(call):
        bi.check(call)

    run()


def _refused_by_explain(call) -> bool:
    """Whether :func:`cuflash.explain` (which validates as attention does, from metadata) refuses
    the call: then attention must refuse it too, before compiling anything."""
    args, kwargs = bi.materialize(call)
    for name in ("return_lse", "out", "dropout_p", "dropout_seed", "dropout_offset"):
        kwargs.pop(name, None)
    try:
        cuflash.explain(*args, **kwargs)
    except Exception:   # noqa: BLE001 - the call itself is judged by bi.check
        return True
    return False


def test_simulator_refuses_bad_input_before_any_compile():
    @settings(max_examples=30, **QUICK)
    @given(bi.calls("attention", SIM_QUICK))
    def run(call):
        assume(_refused_by_explain(call))
        assert bi.check(call) in ("error", "known"), f"explain refused what attention ran: {call.describe()}"

    run()


@pytest.mark.slow
@pytest.mark.parametrize("entry", bi.ENTRIES)
def test_host_paths_keep_the_contract_many_examples(entry):
    """Thousands of calls, in NumPy, torch CPU and JAX CPU arrays."""
    pytest.importorskip("torch")
    pytest.importorskip("jax")

    @settings(max_examples=SLOW_EXAMPLES, **SLOW)
    @given(bi.calls(entry, HOST_KINDS))
    def run(call):
        bi.check(call)

    run()


@pytest.mark.slow
@pytest.mark.parametrize("entry", bi.ENTRIES)
def test_simulator_keeps_the_contract_many_examples(entry):
    """The kernels on the simulator: float16/bfloat16, tiny shapes, every feature (each new
    variant compiles once per process)."""
    @settings(max_examples=max(SLOW_EXAMPLES // 10, 20), **SLOW)
    @given(bi.calls(entry, SIM_SLOW))
    def run(call):
        bi.check(call)

    run()
