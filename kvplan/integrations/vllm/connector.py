"""``KvplanConnector``: the class vLLM's connector factory builds from a ``KVTransferConfig``.

Settings, in ``kv_connector_extra_config``:

======= ============================ ==========================================================
key     default                      meaning
======= ============================ ==========================================================
host    vLLM's ``get_ip()``          the address this engine's workers listen at (decodes connect)
port    17500                        worker rank ``r`` listens at ``port + r``
======= ============================ ==========================================================

Example::

    from vllm.config import KVTransferConfig
    config = KVTransferConfig(kv_connector="KvplanConnector", kv_connector_module_path="kvplan.integrations.vllm",
                              kv_role="kv_both", kv_connector_extra_config={"host": "10.0.0.3"})
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from ...errors import KvplanError
from .scheduler import ConnectorScheduler, ListenAddress, SchedulerStep, UnsupportedConfig

__all__ = ["DEFAULT_PORT", "KvplanConnector", "KvplanConnectorMetadata", "WorkerNotBuilt"]

DEFAULT_PORT = 17500


class WorkerNotBuilt(KvplanError, NotImplementedError):
    """The worker side (the bytes) is not built yet: refused at construction, never a silent no-op."""

    def __init__(self) -> None:
        super().__init__("kvplan's vLLM connector has a scheduler side only so far: its worker side, which moves the "
                         "KV blocks through kvplan's endpoints, is not built yet (issue 39). Use vLLM's NixlConnector "
                         "for the transfers meanwhile.")


class KvplanConnectorMetadata(KVConnectorMetadata):
    """One scheduler step's decisions, for the workers (:class:`~.scheduler.SchedulerStep`)."""

    def __init__(self, step: SchedulerStep):
        self.step = step


class KvplanConnector(KVConnectorBase_V1, SupportsHMA):
    """kvplan's KV connector for vLLM (see the package docstring). Full-attention groups only: with the
    hybrid KV cache manager on, a model with other groups is refused (:class:`~.scheduler.UnsupportedConfig`)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any):
        super().__init__(vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.WORKER:
            raise WorkerNotBuilt()
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.scheduler = ConnectorScheduler(vllm_config, str(self._kv_transfer_config.engine_id), kv_cache_config,
                                            _listen_address(extra, int(vllm_config.parallel_config.tensor_parallel_size)))

    # -- scheduler side ---------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KvplanConnectorMetadata(self.scheduler.build_step())

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, (block_ids,))

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output: Any) -> None:
        self.scheduler.finished(connector_output.finished_sending, connector_output.finished_recving)

    def has_pending_push_work(self) -> bool:
        return self.scheduler.has_pending_push_work()

    # -- worker side (refused at construction: these are never reached) ----------------------------
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        raise WorkerNotBuilt()

    def wait_for_layer_load(self, layer_name: str) -> None:
        raise WorkerNotBuilt()

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        raise WorkerNotBuilt()

    def wait_for_save(self) -> None:
        raise WorkerNotBuilt()


def _listen_address(extra: dict[str, Any], tp_size: int) -> ListenAddress:
    """Where the workers listen, from ``kv_connector_extra_config`` (refused with the reason when it cannot be)."""
    unknown = sorted(set(extra) - {"host", "port"})
    if unknown:
        raise UnsupportedConfig(f"kv_connector_extra_config: unknown keys {unknown}; kvplan takes 'host' and 'port'")
    port = extra.get("port", DEFAULT_PORT)
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port <= 65536 - tp_size:
        raise UnsupportedConfig(f"kv_connector_extra_config: port {port!r} is not a port number from which "
                                f"{tp_size} ranks' ports (port + rank) fit")
    host = extra.get("host")
    if host is None:
        from vllm.utils.network_utils import get_ip

        host = get_ip()  # vLLM's own choice of this node's address (VLLM_HOST_IP first)
    if not isinstance(host, str) or not host:
        raise UnsupportedConfig(f"kv_connector_extra_config: host {host!r} is not an address")
    return ListenAddress(host, port)
