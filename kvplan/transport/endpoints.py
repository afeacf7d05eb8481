"""The two ends of a prefill-to-decode hand-off (:mod:`.decode` and :mod:`.prefill`), in one import,
with what streaming in layer groups needs (:mod:`.readiness`)."""

from ..planner.contract.layer_groups import LayerGroups
from .decode import DecodeEndpoint
from .prefill import MODES, Chunk, PrefillEndpoint
from .readiness import LayerReadiness, LayerStreaming

__all__ = ["Chunk", "DecodeEndpoint", "LayerGroups", "LayerReadiness", "LayerStreaming", "MODES", "PrefillEndpoint"]
