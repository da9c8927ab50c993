"""``cuflash.intensity``: the FLOP/byte model's public import path. It is the module
:mod:`cuflash.analysis.intensity` itself (FLOPs, HBM bytes, arithmetic intensity and roofline
time of naive vs. fused attention; ``python -m cuflash intensity``).

Imports: :mod:`cuflash.analysis`.
"""

import sys

from cuflash.analysis import intensity

sys.modules[__name__] = intensity
