"""kvplan as a vLLM KV connector (issue 39; docs/vllm.md).

A vLLM user enables it with::

    --kv-transfer-config '{"kv_connector": "KvplanConnector",
                           "kv_connector_module_path": "kvplan.integrations.vllm",
                           "kv_role": "kv_both", "kv_connector_extra_config": {"port": 17500}}'

vLLM's connector factory imports this package and builds :class:`KvplanConnector` once per role:

* the scheduler side (:mod:`.scheduler`) decides, with the semantics of vLLM's NIXL connector in push
  mode, which requests load remotely, which blocks they land in, and when a prefill's blocks may be
  freed; it needs nothing but vLLM's scheduler objects;
* the worker side (moving the bytes through kvplan's endpoints) is not built yet: a worker-role
  connector is refused at construction, with the reason, rather than moving nothing.

Only full-attention KV cache groups are covered; sliding-window, Mamba and other groups, and
multi-token prefill lookahead, are refused at construction (docs/vllm.md says why).

``KvplanConnector`` is imported on first use: it needs vLLM installed.
"""

from typing import Any

__all__ = ["KvplanConnector"]


def __getattr__(name: str) -> Any:
    if name == "KvplanConnector":
        from .connector import KvplanConnector

        return KvplanConnector
    raise AttributeError(name)
