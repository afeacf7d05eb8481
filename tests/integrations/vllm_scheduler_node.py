"""A prefill or a decode vLLM engine core in a process of its own, driven by vLLM's own ``Scheduler`` with
kvplan's connector in both roles: requests enter through ``add_request`` (an abort through
``finish_requests``, as the engine core makes them), the scheduler builds the connector's metadata and asks it
what it asks a connector, the model runner's connector calls run in vLLM's order
(``kv_connector_model_runner_mixin``: bind, start_load_kv, wait_for_save, get_transfer_results,
get_block_ids_with_load_errors, clear) over CPU KV caches allocated as vLLM allocates them, and each step's
``ModelRunnerOutput`` (one token for each request the step finished prefilling or decoding, the
connector's output) goes back through ``update_from_output``.

The prefill writes each request's blocks with bytes drawn from its name when the scheduler first schedules
it, hands the decode what its finished requests returned (``kv_transfer_params``, as vLLM's proxy does) and
steps until each is reported sent. The decode adds a request per parameter set, checks every block of each
request the moment the scheduler hears it received, and steps until every request has finished (its tokens
decoded) or was reported failed. Each side reports what it saw (:func:`run`, under
:func:`tests.isolated.report_and_exit`).

    python -m tests.integrations.vllm_scheduler_node prefill --port 17500 --params /tmp/p.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
import zlib

import torch
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from tests.integrations.vllm_fakes import BLOCK, full_attention, kv_caches
from tests.integrations.vllm_node import HEAD_SIZE, HEADS, LAYERS, block_bytes

TOKEN = 7  # what the fake model samples (never the end of a sequence: requests end at max_tokens)


def model_dir(path: str) -> str:
    """A folder with facebook/opt-125m's ``config.json`` (its shape only: no weights, no download); both sides
    may write it, each replacing it whole."""
    from tests.integrations.vllm_suite.kvplan_vllm_plugin import OPT_125M

    config = os.path.join(path, "config.json")
    if not os.path.exists(config):
        os.makedirs(path, exist_ok=True)
        with open(f"{config}.{os.getpid()}", "w") as f:
            json.dump(OPT_125M, f)
        os.replace(f"{config}.{os.getpid()}", config)
    return path


class EngineCore:
    """vLLM's scheduler and kvplan's worker-side connector over one process's KV caches, stepped as vLLM's
    engine core and model runner step them."""

    def __init__(self, role: str, extra: dict, num_blocks: int, model: str, max_num_seqs: int):
        kv_cache = full_attention(LAYERS, num_blocks=num_blocks, heads=HEADS, head_size=HEAD_SIZE,
                                  layout=KVCacheLayout.LBNHC, block_size=BLOCK)
        cache = CacheConfig(block_size=BLOCK, cache_dtype="auto", enable_prefix_caching=False)
        cache.kv_cache_layout = "LBNHC"  # (vLLM resolves the layout before it builds connectors)
        cache.num_gpu_blocks = num_blocks
        model_config = ModelConfig(model=model, dtype="bfloat16", seed=42)
        self.config = VllmConfig(
            model_config=model_config, cache_config=cache, device_config=DeviceConfig("cpu"),
            scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=8192,
                                             max_model_len=model_config.max_model_len, is_encoder_decoder=False),
            kv_transfer_config=KVTransferConfig(kv_connector="KvplanConnector",
                                                kv_connector_module_path="kvplan.integrations.vllm",
                                                kv_role="kv_producer" if role == "prefill" else "kv_consumer",
                                                engine_id=f"{role}-engine", kv_connector_extra_config=extra))
        self.scheduler = Scheduler(vllm_config=self.config, kv_cache_config=kv_cache,
                                   structured_output_manager=StructuredOutputManager(self.config), block_size=BLOCK)
        self.worker = KVConnectorFactory.create_connector(self.config, KVConnectorRole.WORKER, kv_cache)
        self.caches = kv_caches(kv_cache, KVCacheLayout.LBNHC)
        self.worker.register_kv_caches(self.caches)
        self.finished: dict[str, str] = {}  # request id -> why it finished ("length", "abort", ...)
        self.returned: dict[str, dict] = {}  # request id -> the kv_transfer_params it finished with

    def add(self, request_id: str, prompt_len: int, params: dict, max_tokens: int) -> None:
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        first = zlib.crc32(request_id.encode()) % 30000
        request = Request(request_id, [1000 + (first + t) % 30000 for t in range(prompt_len)], sampling, None)
        request.kv_transfer_params = dict(params)
        self.scheduler.add_request(request)

    def abort(self, request_id: str) -> None:
        """What the engine core does when the client goes away."""
        self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)
        self.finished[request_id] = "abort"

    def blocks(self, request_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(request_id)[0])

    def step(self, on_scheduled=None) -> KVConnectorOutput:
        """One step: schedule, the model runner's connector calls around a forward pass that computes
        nothing (``on_scheduled`` stands for its writes), the output back to the scheduler."""
        out = self.scheduler.schedule()
        if on_scheduled is not None:
            on_scheduled(out)
        connector = self.worker
        connector.bind_connector_metadata(out.kv_connector_metadata)
        connector.start_load_kv(None)
        connector.wait_for_save()
        results = connector.get_transfer_results(out.finished_req_ids)
        output = KVConnectorOutput(finished_sending=results.finished_sending, finished_recving=results.finished_recving,
                                   failed_recving=results.failed_recving,
                                   invalid_block_ids=connector.get_block_ids_with_load_errors())
        connector.clear_connector_metadata()
        ids = [r.req_id for r in out.scheduled_new_reqs] + list(out.scheduled_cached_reqs.req_ids)
        sampled = []
        for request_id in ids:  # (a token where the step reaches the end of what the request has: none mid-prompt)
            request = self.scheduler.requests[request_id]
            done = request.num_computed_tokens + out.num_scheduled_tokens[request_id] >= request.num_tokens
            sampled.append([TOKEN] if done else [])
        runner = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: k for k, r in enumerate(ids)},
                                   sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
                                   pooler_output=[], kv_connector_output=output)
        for outputs in self.scheduler.update_from_output(out, runner).values():
            for each in outputs.outputs:
                if each.finish_reason is not None:
                    self.finished[each.request_id] = str(each.finish_reason)
                    self.returned[each.request_id] = each.kv_transfer_params
        return output

    def shutdown(self) -> None:
        self.worker.shutdown()


def prefill(args: argparse.Namespace) -> dict:
    extra = {"host": "127.0.0.1", "port": args.port, "engine": args.engine, "timeout_s": args.timeout}
    core = EngineCore("prefill", extra, 256, model_dir(args.params + ".model"), 64)
    names = [f"{args.names}{k}" for k in range(len(args.lengths))]
    for name, length in zip(names, args.lengths):
        core.add(name, length, {"do_remote_decode": True}, max_tokens=1)
    written: set[str] = set()

    def write(out) -> None:  # the forward pass: each new request's KV, drawn from its name
        for new in out.scheduled_new_reqs:
            for layer, layer_name in enumerate(LAYERS):
                for j, b in enumerate(new.block_ids[0]):
                    view = core.caches[layer_name][b]
                    view.copy_(block_bytes(new.req_id, j, layer, tuple(view.shape)))
            written.add(new.req_id)

    sent: set[str] = set()
    deadline = time.monotonic() + args.timeout + 30
    while len(core.finished) < len(names) and time.monotonic() < deadline:
        sent |= core.step(write).finished_sending or set()
    params = [core.returned[name] for name in names if name in core.returned]
    with open(args.params + ".tmp", "w") as f:
        json.dump(params, f)
    os.replace(args.params + ".tmp", args.params)
    while (sent != set(names) or not os.path.exists(args.params + ".done")) and time.monotonic() < deadline:
        sent |= core.step().finished_sending or set()
        time.sleep(0.002)
    waiting = len(core.scheduler.requests)  # (a request stays while its blocks wait for its decode)
    core.shutdown()
    return {"written": sorted(written), "sent": sorted(sent), "held": waiting, "reasons": sorted(set(core.finished.values()))}


def decode(args: argparse.Namespace) -> dict:
    extra = {"host": "127.0.0.1", "port": args.port, "engine": args.engine, "timeout_s": args.timeout,
             **({"max_requests": args.max_requests} if args.max_requests else {})}
    core = EngineCore("decode", extra, 256, model_dir(args.params + ".model"), args.max_num_seqs)
    mine: dict[str, dict] = {}
    received, released, failed, wrong, checked, ready_s = set(), set(), set(), [], 0, []
    for round_no, path in enumerate([args.params, *args.then_params]):  # (each round's prefill may be a new one)
        deadline = time.monotonic() + args.timeout + 30
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        with open(path) as f:
            params = json.load(f)
        added, steps = time.monotonic(), 0
        for k, p in enumerate(params):
            local = f"d{round_no or ''}-req-{k}"
            mine[local] = p
            core.add(local, p["remote_num_tokens"], p, max_tokens=args.max_tokens)
        # (until every request ended and the scheduler let go of each: an aborted one's blocks wait for its load's end)
        while (len(core.finished) < len(mine) or core.scheduler.requests) and time.monotonic() < deadline:
            output = core.step()
            steps += 1
            if steps == 1 and round_no == 0:  # (once the connector has them: each waits for its blocks)
                for local in args.abort:
                    core.abort(local)
            for local in sorted(output.finished_recving or ()):  # (checked before the scheduler runs it)
                if local in args.abort:  # (its load ended: the scheduler frees its blocks now)
                    released.add(local)
                    continue
                received.add(local)
                ready_s.append(time.monotonic() - added)
                name, count = mine[local]["remote_request_id"], -(-mine[local]["remote_num_tokens"] // BLOCK)
                for layer, layer_name in enumerate(LAYERS):
                    for j, b in enumerate(core.blocks(local)[:count]):
                        checked += 1
                        view = core.caches[layer_name][b]
                        if not torch.equal(view, block_bytes(name, j, layer, tuple(view.shape))):
                            wrong.append([local, j, layer])
            failed |= output.failed_recving or set()
            time.sleep(0.002)
        open(path + ".done", "w").close()  # (its prefill may end)
    left = len(core.scheduler.requests)
    core.shutdown()
    return {"received": sorted(received), "released": sorted(released), "failed": sorted(failed), "wrong": wrong,
            "blocks_checked": checked, "finished": dict(core.finished), "requests": sorted(mine), "left": left,
            "ready_s_max": round(max(ready_s, default=0.0), 3)}


def run(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=("prefill", "decode"))
    parser.add_argument("--port", type=int, default=17500)
    parser.add_argument("--params", required=True)
    parser.add_argument("--engine", default="nixl")
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--lengths", type=int, nargs="*", default=[100, 37, 64, 5])
    parser.add_argument("--names", default="p-req-")
    parser.add_argument("--max-tokens", type=int, default=4, help="(decode) tokens each request decodes")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="(decode) vLLM's max_num_seqs")
    parser.add_argument("--max-requests", type=int, default=0, help="(decode) the connector's planning rows")
    parser.add_argument("--abort", nargs="*", default=[], help="(decode) requests aborted once the connector has them")
    parser.add_argument("--then-params", nargs="*", default=[],
                        help="(decode) once every request of --params ended, those of each of these (a prefill "
                             "restarted at the same port writes them)")
    args = parser.parse_args(argv)
    return prefill(args) if args.role == "prefill" else decode(args)


if __name__ == "__main__":
    print(json.dumps(run(__import__("sys").argv[1:])), flush=True)
