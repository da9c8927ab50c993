"""``cuflash.torch_sdpa``: the import path of the SDPA drop-in's helpers, kept for code that uses it
(``cuflash.torch_sdpa.top_left_causal``). It is the module :mod:`cuflash.torch.sdpa` itself.

Imports: torch (importing it imports :mod:`cuflash.torch`).
"""

import sys

from cuflash.torch import sdpa

sys.modules[__name__] = sdpa
