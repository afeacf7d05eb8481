"""kvplan as a vLLM KV connector (docs/vllm.md).

A vLLM user enables it with::

    --kv-transfer-config '{"kv_connector": "KvplanConnector",
                           "kv_connector_module_path": "kvplan.integrations.vllm",
                           "kv_role": "kv_both", "kv_connector_extra_config": {"port": 17500}}'

vLLM's connector factory imports this package and builds :class:`KvplanConnector` once per role:

* the scheduler side (:mod:`.scheduler`) decides, with the semantics of vLLM's NIXL connector in push
  mode, which requests load remotely, which blocks they land in, and when a prefill's blocks may be
  freed; it needs nothing but vLLM's scheduler objects;
* the worker side (:mod:`.worker`) moves the bytes through kvplan's endpoints: a prefill rank sends a
  finished request's blocks once its decode has published where they go, a decode rank publishes the
  blocks vLLM allocated and reports them received once every byte landed (or failed once no write into
  them can land any more); pairing with a prefill runs on a thread of its own, off the step's path.

One full-attention KV cache group is covered, with any sliding-window and Mamba groups over it (attention
groups may differ in block size); multi-token prefill lookahead is
refused at construction, naming what is refused (docs/vllm.md says why); so is sleep mode, by vLLM at start
(``supports_sleep_mode``).

``KvplanConnector`` is imported on first use: it needs vLLM installed.
"""

from typing import Any

__all__ = ["KvplanConnector"]


def __getattr__(name: str) -> Any:
    if name == "KvplanConnector":
        from .connector import KvplanConnector

        return KvplanConnector
    raise AttributeError(name)
