"""The commands of ``python -m cuflash``: ``check`` (GPU self-check), ``bench`` (GPU
benchmarks), ``demo`` (SmolLM2-135M on cuflash attention, with its GGUF reader
:mod:`~cuflash.tools.smollm2` and :mod:`~cuflash.tools.make_demo_data`) and ``intensity``
(the CLI of :mod:`cuflash.intensity`).

Imports: anything of cuflash. Nothing in the package imports this folder (only
``cuflash/__main__.py`` names its modules).
"""
