"""Engine choice, sans-IO: which rank a front-end sends a request to.

:class:`EngineChooser` is what every front-end here uses (the engine client, the
front-end of a standalone coordinator, the simulated front-end, the vLLM plugin's
optional routing): vLLM 0.33.0's score by default (:func:`vllm_score`), or with
``routing="prefix"`` the prefix policy (:class:`PrefixRouting` settings, the
:class:`PrefixRouter` over a per-rank :class:`RankPrefixIndex` of :func:`block_keys`).
Plain objects: inputs are loads, prompts' token ids, KV-event batches and clock
readings; the output is a rank.

Names are imported on first use, so ``trio_dpcoord.routing.vllm_score`` costs the
standard library only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from ._chooser import ROUTINGS as ROUTINGS
    from ._chooser import ChooserStatistics as ChooserStatistics
    from ._chooser import EngineChooser as EngineChooser
    from ._chooser import Routing as Routing
    from ._decision import RouteDecision as RouteDecision
    from ._decision import RouterStatistics as RouterStatistics
    from ._keys import CHUNK_BLOCKS as CHUNK_BLOCKS
    from ._keys import DEFAULT_BLOCK_SIZE as DEFAULT_BLOCK_SIZE
    from ._keys import ChunkedKeys as ChunkedKeys
    from ._keys import ChunkKeys as ChunkKeys
    from ._keys import block_keys as block_keys
    from ._prefix_index import RankPrefixIndex as RankPrefixIndex
    from ._prefix_router import PrefixRouter as PrefixRouter
    from ._score import vllm_score as vllm_score
    from ._settings import PrefixRouting as PrefixRouting

__all__ = [
    "CHUNK_BLOCKS",
    "DEFAULT_BLOCK_SIZE",
    "ROUTINGS",
    "ChooserStatistics",
    "ChunkKeys",
    "ChunkedKeys",
    "EngineChooser",
    "PrefixRouter",
    "PrefixRouting",
    "RankPrefixIndex",
    "RouteDecision",
    "RouterStatistics",
    "Routing",
    "block_keys",
    "vllm_score",
]

_EXPORTS: dict[str, str] = {
    "CHUNK_BLOCKS": "._keys",
    "ChunkKeys": "._keys",
    "ChunkedKeys": "._keys",
    "DEFAULT_BLOCK_SIZE": "._keys",
    "ROUTINGS": "._chooser",
    "ChooserStatistics": "._chooser",
    "EngineChooser": "._chooser",
    "PrefixRouter": "._prefix_router",
    "PrefixRouting": "._settings",
    "RankPrefixIndex": "._prefix_index",
    "RouteDecision": "._decision",
    "RouterStatistics": "._decision",
    "Routing": "._chooser",
    "block_keys": "._keys",
    "vllm_score": "._score",
}

if not TYPE_CHECKING:  # for type checkers, the imports above are the package
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
