"""What the test modules share (no test module imports another): the options of a call spelled as
the public functions take them (:mod:`~support.options`), a simulated device call
(:mod:`~support.device`), input builders (:mod:`~support.inputs`), the tolerance rule's
assertions (:mod:`~support.tolerance`, :mod:`~support.grads`), the KV-cache checks
(:mod:`~support.kvcache`), the simulator's probe plans (:mod:`~support.simtools`), the mutation
suite's machinery (:mod:`~support.mutations`) and the context-parallel ranks' body
(:mod:`~support.cp_worker`). ``tests/`` is on the import path (``pythonpath`` in setup.cfg).
"""
