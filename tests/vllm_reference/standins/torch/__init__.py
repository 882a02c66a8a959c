"""Stand-in for torch: an inert package (torch is not installed; no tensor ever flows
through the coordinator protocol). ``torch.Tensor`` etc. are placeholder classes."""

import sys

from _vllm_standin import inert_package

__version__ = "2.11.0"
inert_package(sys.modules[__name__])
