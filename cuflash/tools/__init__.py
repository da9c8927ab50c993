"""The commands of ``python -m cuflash``: ``check`` (GPU self-check), ``bench`` (GPU
benchmarks) and ``demo`` (SmolLM2-135M on cuflash attention, with its GGUF reader
:mod:`~cuflash.tools.smollm2` and :mod:`~cuflash.tools.make_demo_data`). The other two,
``intensity`` and ``roofline``, are the command lines of :mod:`cuflash.analysis.intensity` and
:mod:`cuflash.analysis.roofline`.

Imports: anything of cuflash. Nothing in the package imports this folder (only
``cuflash/__main__.py`` names its modules).
"""
