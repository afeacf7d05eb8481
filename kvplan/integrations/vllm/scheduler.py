"""The scheduler side of kvplan's vLLM connector: what loads remotely, into which blocks, and when a
prefill's blocks may be freed.

kvplan pushes, as SGLang does and as vLLM's NIXL connector does in push mode: the decode registers the
blocks it allocated with the prefill, and the prefill writes into them. The decisions here follow the
semantics of vLLM 0.33's ``NixlPushConnectorScheduler`` (the tests run both on the same requests and
compare them):

* decode (a request whose ``kv_transfer_params`` say ``do_remote_prefill``):
  :meth:`get_num_new_matched_tokens` reports the prompt tokens not computed here as loaded
  asynchronously; :meth:`update_state_after_alloc` records the blocks vLLM allocated for them, once;
  :meth:`build_connector_meta` hands them to the workers, which publish them to the prefill. A request
  aborted before its blocks were allocated is still handed over, with no blocks, so that the prefill
  frees its own.
* prefill (``do_remote_decode``): :meth:`request_finished` keeps a finished request's blocks until its
  workers report the write done (``finished_sending``), and returns the parameters the decode needs:
  this engine's id and where its workers listen.

One full-attention KV cache group is covered, with any sliding-window and Mamba groups (:mod:`.groups`), and
no multi-token prefill lookahead (MTP): the rest is refused at construction, naming it (docs/vllm.md).

**Mamba.** A Mamba state holds every token it has seen, so the decode cannot take the state of the whole
prompt and then compute the prompt's last token again, as it does with attention KV: with a Mamba group
the prefill computes all but the prompt's last token (:meth:`on_new_request` shortens a prefill request's
prompt by one token and its output to one token, once) and the decode loads that many tokens, KV and
state, and computes the last one itself. vLLM 0.33's NIXL connector does the same.

Example::

    scheduler = ConnectorScheduler(vllm_config, engine_id, kv_cache_config, ListenAddress("10.0.0.3", 17500))
    count, is_async = scheduler.get_num_new_matched_tokens(request, num_computed_tokens=0)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from .groups import UnsupportedConfig, transfer_groups

__all__ = ["ConnectorScheduler", "ListenAddress", "ReceiveRequest", "SendRequest", "UnsupportedConfig",
           "TRANSFER_MODE"]

log = logging.getLogger(__name__)

_SHORTENED = "_kvplan_shortened"  # in a prefill request's parameters once on_new_request shortened its prompt
TRANSFER_MODE = "kvplan-push"  # in the parameters a prefill returns (vLLM's own connectors say "push" or "pull")
_DONE = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")  # a prefill request that finished normally


@dataclass(frozen=True)
class ListenAddress:
    """Where this engine's workers listen for decodes: rank ``r`` at ``host:port + r``."""

    host: str
    port: int


@dataclass(frozen=True)
class ReceiveRequest:
    """A decode request whose blocks its workers publish to the prefill that computed it."""

    block_ids: tuple[list[int], ...]  # per KV cache group (an empty tuple: nothing to receive, free the prefill's)
    num_tokens: int  # the prompt tokens that land in them
    remote_engine_id: str | None
    remote_request_id: str | None
    remote_host: str | None
    remote_port: int | None
    remote_tp_size: int | None
    prefix_len: int = 0  # prompt tokens this side holds already (its own prefix cache): the blocks follow them


@dataclass(frozen=True)
class SendRequest:
    """A finished prefill request whose blocks stay allocated until its workers have written them."""

    block_ids: tuple[list[int], ...]
    num_tokens: int


@dataclass
class SchedulerStep:
    """What one step hands to the workers (the connector metadata's content)."""

    receive: dict[str, ReceiveRequest] = field(default_factory=dict)
    send: dict[str, SendRequest] = field(default_factory=dict)
    not_processed: set[str] = field(default_factory=set)  # prefill requests that finished without a hand-off


class ConnectorScheduler:
    """The scheduler side (see the module docstring)."""

    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any, listen: ListenAddress):
        # (refuses, naming them, the groups it does not cover)
        self.groups = transfer_groups(kv_cache_config, int(vllm_config.parallel_config.tensor_parallel_size))
        lookahead = int(getattr(vllm_config, "num_prefill_lookahead_tokens", 1) or 1)
        if lookahead > 1:
            raise UnsupportedConfig(f"a prefill lookahead of {lookahead} tokens (multi-token prediction) is not "
                                    "covered: the decode would have to recompute the prompt's last tokens")
        # prompt tokens the prefill leaves to the decode (the module docstring: Mamba)
        self.backoff = 1 if any(g.mamba for g in self.groups) else 0
        self.engine_id, self.listen = engine_id, listen
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        self.kv_cache_config = kv_cache_config
        self._step = SchedulerStep()
        self._sending: dict[str, SendRequest] = {}  # finished prefill requests until their write is done

    # -- prefill ----------------------------------------------------------------------------------
    def on_new_request(self, request: Any) -> None:
        """With a Mamba group, a new prefill request (``do_remote_decode``) loses its prompt's last token and
        may output one token: its prefill stops where the decode takes over (the module docstring). Once per
        request (a preempted one comes back already shortened), and not for a request that reads no prefix
        cache (prompt logprobs): its decode loads nothing and computes its whole prompt."""
        params = request.kv_transfer_params
        if not self.backoff or not params or not params.get("do_remote_decode") or params.get(_SHORTENED):
            return
        skips = getattr(request, "get_skip_reading_prefix_cache", None)
        if int(request.num_prompt_tokens) <= self.backoff or (skips is not None and skips()):
            return
        if request.prompt_token_ids is not None:
            del request.prompt_token_ids[-self.backoff:]
        elif getattr(request, "prompt_embeds", None) is not None:
            request.prompt_embeds = request.prompt_embeds[: -self.backoff]
        else:
            return
        del request._all_token_ids[-self.backoff:]
        request.num_prompt_tokens -= self.backoff
        request.max_tokens = 1
        params[_SHORTENED] = True

    # -- decode -----------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """The prompt tokens a decode request loads from its prefill (asynchronously), or ``(0, False)``:
        with a Mamba group all but the last (the prefill computed no more)."""
        params = request.kv_transfer_params
        if params is not None and params.get("do_remote_prefill"):
            count = self._loaded(len(request.prompt_token_ids or [])) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def _loaded(self, prompt_tokens: int) -> int:
        """Of a decode request's prompt, the tokens its prefill computed (all but the backoff's)."""
        return prompt_tokens - self.backoff if prompt_tokens > self.backoff else prompt_tokens

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Record, once per request, the blocks vLLM allocated for the tokens it loads."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or num_external_tokens <= 0:
            return  # (all of it computed here: it stays marked, so that its end frees the prefill's blocks)
        prefix = max(0, self._loaded(len(request.prompt_token_ids or [])) - num_external_tokens)
        block_ids = self._transfer_blocks(self._blocks_in_place(blocks, prefix))
        self._step.receive[request.request_id] = self._receive(params, block_ids, num_external_tokens, prefix)
        params["do_remote_prefill"] = False  # (a rescheduled request does not register again)

    def _receive(self, params: dict, block_ids: tuple[list[int], ...], num_tokens: int,
                 prefix_len: int = 0) -> ReceiveRequest:
        port = params.get("remote_port")
        return ReceiveRequest(block_ids, num_tokens, params.get("remote_engine_id"), params.get("remote_request_id"),
                              params.get("remote_host"), int(port) if port is not None else None,
                              params.get("tp_size"), prefix_len)

    # -- both ---------------------------------------------------------------------------------------
    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        """Whether a finished request's blocks stay allocated (a prefill's, until they are written), and
        the parameters its decode needs."""
        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill"):  # a decode request aborted before its blocks were allocated:
            params["do_remote_prefill"] = False  # its prefill is told, so that it frees its blocks
            self._step.receive[request.request_id] = self._receive(params, (), 0)
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if getattr(request.status, "name", str(request.status)) not in _DONE:
            self._step.not_processed.add(request.request_id)
            return False, None
        block_ids = self._transfer_blocks(block_ids)
        keep = any(len(group) > 0 for group in block_ids)
        num_tokens = int(request.num_computed_tokens) if keep else 0
        if keep:
            self._sending[request.request_id] = self._step.send[request.request_id] = SendRequest(block_ids,
                                                                                                  num_tokens)
        return keep, {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": block_ids,
                      "remote_engine_id": self.engine_id, "remote_request_id": request.request_id,
                      "remote_host": self.listen.host, "remote_port": self.listen.port, "tp_size": self.tp_size,
                      "remote_num_tokens": num_tokens, "transfer_mode": TRANSFER_MODE}

    def build_step(self) -> SchedulerStep:
        """What the workers act on this step; the scheduler starts the next one empty."""
        step, self._step = self._step, SchedulerStep()
        return step

    def finished(self, finished_sending: Any, finished_recving: Any) -> None:
        """The workers' report of a step: prefill requests whose blocks were written may be freed."""
        for request_id in finished_sending or ():
            self._sending.pop(request_id, None)

    def has_pending_push_work(self) -> bool:
        """Whether the engine loop must keep stepping for writes in flight or registrations not yet handed over."""
        return bool(self._sending or self._step.receive)

    def _blocks_in_place(self, blocks: Any, prefix_len: int) -> list[list[int]]:
        """Each group's blocks past the ``prefix_len`` tokens computed here, block ``i`` holding the ``i``-th
        block of tokens after them: vLLM's null block kept in its place as 0. vLLM hands a sliding-window
        group its null block for every block wholly before the window, and its
        ``get_unhashed_block_ids_all_groups`` drops those from the head, which would shift every block of the
        window by as many places (a 47-token prompt, window 32, blocks of 16: ``[0, 4, 5]`` became ``[4,
        5]``, and the load failed). A stand-in without vLLM's blocks is read as its lists."""
        groups = getattr(blocks, "blocks", None)
        specs = getattr(self.kv_cache_config, "kv_cache_groups", None)
        if groups is None or specs is None or len(groups) != len(specs):
            return blocks.get_unhashed_block_ids_all_groups()
        out = []
        for group, spec in zip(groups, specs):
            first = prefix_len // spec.kv_cache_spec.block_size  # (the prefix's blocks: cached, computed here)
            out.append([0 if getattr(b, "is_null", False) else b.block_id for b in group[first:]])
        return out

    def _transfer_blocks(self, block_ids: Any) -> tuple[list[int], ...]:
        """The block lists of the groups that transfer (vLLM's own selection, where it has one), a Mamba
        group's cut to its state block (:meth:`~.groups.KVGroup.state_block`)."""
        if len(block_ids) == 0:
            return ()
        select = getattr(self.kv_cache_config, "select_transfer_block_ids", None)
        block_ids = tuple(select(block_ids)) if select is not None else tuple(block_ids)
        if len(block_ids) != len(self.groups):
            return block_ids
        return tuple(g.state_block(list(blocks)) for g, blocks in zip(self.groups, block_ids))
