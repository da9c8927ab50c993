"""The analysis of kernels without running them: :mod:`~cuflash.analysis.intensity` (FLOPs, HBM
bytes, arithmetic intensity and roofline time of naive vs. fused attention; public as
``cuflash.intensity``), :mod:`~cuflash.analysis.roofline` (per-pipe model of a kernel's main
loop read from its own SASS; ``python -m cuflash roofline``), and :mod:`~cuflash.analysis.cli`, the
pieces every ``python -m cuflash`` command shares (the dtype names, range-checked numbers, the
default device, the error form, progress).

Imports: :mod:`cuflash.kernels` and :mod:`cuflash.runtime` (never the public functions, the
adapters or the tools).
"""
