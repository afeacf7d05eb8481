"""``KvplanConnector``: the class vLLM's connector factory builds from a ``KVTransferConfig``, once per
role: the scheduler side (:mod:`.scheduler`) and, in each worker, the worker side (:mod:`.worker`).

Settings come from ``kv_connector_extra_config`` (:mod:`.settings`: host, port, engine,
engine_settings, timeout_s, max_requests).

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
    KVConnectorTransferResults,
    SupportsHMA,
)

from .connector_stats import KvplanConnectorStats
from .scheduler import ConnectorScheduler, SchedulerStep, UnsupportedConfig
from .settings import DEFAULT_PORT, Settings, layout_setting
from .worker import ConnectorWorker

__all__ = ["DEFAULT_PORT", "KvplanConnector", "KvplanConnectorMetadata"]


class KvplanConnectorMetadata(KVConnectorMetadata):
    """One scheduler step's decisions, for the workers (:class:`~.scheduler.SchedulerStep`)."""

    def __init__(self, step: SchedulerStep):
        self.step = step


class KvplanConnector(KVConnectorBase_V1, SupportsHMA):
    """kvplan's KV connector for vLLM (see the package docstring). One full-attention KV cache group, with any
    sliding-window and Mamba groups (vLLM's hybrid KV cache manager); a model with other groups is refused
    (:class:`~.groups.UnsupportedConfig`)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any):
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = self._kv_transfer_config
        tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        scheduler_config = getattr(vllm_config, "scheduler_config", None)
        settings = Settings.parse(transfer.kv_connector_extra_config, tp_size,
                                  int(getattr(scheduler_config, "max_num_seqs", 256) or 256))
        # (the scheduler side refuses what is not covered; the worker side is built from the same checks)
        self.scheduler: ConnectorScheduler | None = ConnectorScheduler(vllm_config, str(transfer.engine_id),
                                                                       kv_cache_config, settings.listen)
        self.worker: ConnectorWorker | None = None
        if role == KVConnectorRole.WORKER:
            model_config = getattr(vllm_config, "model_config", None)
            self.worker = ConnectorWorker(
                settings, str(transfer.engine_id), _tp_rank(tp_size), tp_size,
                int(vllm_config.cache_config.block_size), int(getattr(model_config, "max_model_len", 0) or 1 << 17),
                sends=transfer.kv_role != "kv_consumer", receives=transfer.kv_role != "kv_producer",
                groups=self.scheduler.groups)
            self.scheduler = None

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """The ``layout`` setting, where the model has KV heads: ``LBHNC`` by default (each head's tokens of a
        block in a row, as vLLM's NIXL connector asks; the two sides may differ in TP size, and a rank's heads
        of a block move as one span), or ``LBNHC`` (the sides may also differ in block size; docs/vllm.md).
        vLLM takes it where the attention backend supports it, else its own choice; the connector moves
        whatever it gets between sides laid out alike. ``None`` for MLA models (no heads to slice)."""
        model_config = getattr(vllm_config, "model_config", None)
        if model_config is None or getattr(model_config, "use_mla", False):
            return None
        transfer = getattr(vllm_config, "kv_transfer_config", None)
        return layout_setting(getattr(transfer, "kv_connector_extra_config", None))

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """False: sleep mode frees and remaps the KV cache, and kvplan's engines keep the registrations of
        the memory they were given (no ``unregister_kv_caches`` / ``restore_kv_caches`` yet). vLLM then
        refuses ``enable_sleep_mode`` with kvplan's connector at start, rather than let a write land in
        memory that was remapped."""
        return False

    # -- scheduler side ---------------------------------------------------------------------------
    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        """Every transfer group: a load writes the request's own blocks in each group kvplan moves (the
        full-attention group and every sliding-window group), so vLLM must zero none of them after it."""
        return tuple(self._kv_cache_config.transfer_group_ids)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def on_new_request(self, request: Any) -> None:
        self.scheduler.on_new_request(request)

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

    # -- worker side ----------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, KvplanConnectorMetadata):
            raise TypeError(f"the scheduler handed {type(metadata).__name__}, not kvplan's connector metadata")
        self.worker.start_load_kv(metadata.step)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: a request runs once vLLM hears it finished receiving

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # a prefill sends a request's blocks once it has finished (request_finished), not per layer

    def wait_for_save(self) -> None:
        return  # the blocks stay allocated until finished_sending: nothing to wait for here

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = self.worker.get_transfer_results(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=results.finished_sending,
                                          finished_recving=results.finished_recving,
                                          failed_recving=results.failed_recving)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.worker.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> KvplanConnectorStats | None:
        """kvplan's counters since the last call (worker side; the scheduler side counts nothing):
        :mod:`.connector_stats`."""
        if self.worker is None or getattr(self.worker, "view", None) is None:
            return None
        data = self.worker.interval_stats()
        return None if data is None else KvplanConnectorStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvplanConnectorStats | None:
        return KvplanConnectorStats(data=data) if data is not None else KvplanConnectorStats()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()


def _tp_rank(tp_size: int) -> int:
    """This worker's TP rank, from vLLM's parallel state (rank 0 of TP 1 where it is not set up)."""
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return int(parallel_state.get_tensor_model_parallel_rank())
    if tp_size == 1:
        return 0
    raise UnsupportedConfig(f"TP {tp_size}, but vLLM's tensor-parallel group is not set up: this worker's rank is "
                            "not known")
