"""The two ends of a prefill-to-decode hand-off (:mod:`.decode` and :mod:`.prefill`), in one import."""

from .decode import DecodeEndpoint
from .prefill import MODES, Chunk, PrefillEndpoint

__all__ = ["Chunk", "DecodeEndpoint", "MODES", "PrefillEndpoint"]
