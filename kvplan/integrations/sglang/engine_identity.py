"""How a kvplan engine appears in SGLang's protocol, per transfer backend: the one place that knows it.

SGLang names a decode rank's engine by a session id and, for NIXL, carries its agent in the
registration. A Mooncake rank's session id is its segment (``host:rpc_port``), which is also the name
kvplan's Mooncake engine writes to. A NIXL rank's session id is its agent's name; the prefill adds
the agent from its metadata, on the rank's GPU.

Example::

    fields = identity(engine, "nixl", 4)         # {"session_id": ..., "agent_metadata": ..., "gpu_id": ..., ...}
    name = peer_name(engine, "nixl", registration)  # what engine.post takes for that decode rank
"""

from __future__ import annotations

from typing import Any

from ...errors import LayoutError
from ...transport.engines.nixl import pack_metadata, unpack_metadata

__all__ = ["identity", "peer_name"]


def identity(engine: Any, backend: str, kv_entries: int) -> dict[str, Any]:
    """The :class:`~.wire.Registration` fields that name ``engine`` to SGLang's prefill (NIXL: also the
    memory kind of each of the ``kv_entries`` KV buffers, the engine's)."""
    if backend == "nixl":
        gpu_id, agent_metadata = unpack_metadata(engine.metadata())
        return {"session_id": engine.name, "agent_metadata": agent_metadata, "gpu_id": gpu_id,
                "kv_mem_kinds": (engine.memory,) * kv_entries}
    if backend == "mooncake":
        return {"session_id": engine.segment}
    raise LayoutError(f"no SGLang identity for the {backend!r} backend")


def peer_name(engine: Any, backend: str, registration: Any) -> str:
    """The name ``engine`` posts to for the decode rank that sent ``registration`` (connecting it first
    where the engine must: NIXL adds the rank's agent)."""
    if backend == "nixl":
        return engine.connect(pack_metadata(registration.gpu_id, registration.agent_metadata))
    if backend == "mooncake":
        return registration.session_id
    raise LayoutError(f"no SGLang identity for the {backend!r} backend")
