"""Two-process hand-off harness: a decode process and a prefill process on 127.0.0.1.

Both rebuild the same scenario from a seed; each backs its own side with real memory. The decode
side checks every byte it received against what a reference execution of the same plan, on its
own copy of the source memory, says it should hold.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from dataclasses import dataclass, replace

import numpy as np
import torch

from kvplan.planner.destinations import PreallocatedRequest
from kvplan.planner.model import Attention, Batch, StateKind
from kvplan.planner.reference import plan_reference
from kvplan.scenarios import ComponentShape, ModelShape, build_batch, materialize
from kvplan.transport.control import ControlChannel
from kvplan.transport.endpoints import Chunk, DecodeEndpoint, PrefillEndpoint
from kvplan.transport.engines import make_engine
from tests.memory import AddressSpace, execute

for key, value in (("UCX_NET_DEVICES", "lo"), ("NIXL_LOG_LEVEL", "WARN"),
                   ("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "65535"), ("MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER", "65535")):
    os.environ.setdefault(key, value)

HYBRID = ModelShape(
    "hybrid-test", Attention.MHA, 2, 32, 4,
    state=(ComponentShape(StateKind.SWA, 2, 96, window=10), ComponentShape(StateKind.DSA, 1, 80),
           ComponentShape(StateKind.SWA_RING, 2, 48, window=6, ring_size=8), ComponentShape(StateKind.MAMBA, 3, 144)),
    num_kv_heads=2, aux_items=(16, 64),
)
HEAD_SLICED = ModelShape("tp2to4-test", Attention.MHA, 2, 64, 4, num_kv_heads=4, src_tp=2, dst_tp=4)
SHAPES = {"hybrid": HYBRID, "head_sliced": HEAD_SLICED}
LENGTHS = [100, 37, 64]


@dataclass(frozen=True)
class Case:
    engine: str
    shape: str = "hybrid"
    mode: str = "direct"
    seed: int = 3
    timeout: float = 30.0
    bad_registration: bool = False  # the decode side registers no aux buffers
    device: str = "cpu"  # "cuda": pools, token tables and staging in GPU memory, registered as VRAM

    @property
    def memory(self) -> str:
        return "VRAM" if self.device == "cuda" else "DRAM"


def scenario(case: Case) -> Batch:
    return build_batch(SHAPES[case.shape], len(LENGTHS), LENGTHS, chunks=2, prefix_len=8, seed=case.seed,
                       src_rank=1 if case.shape == "head_sliced" else 0, dst_rank=2 if case.shape == "head_sliced" else 0)


def _staging(case: Case) -> torch.Tensor:
    return torch.zeros(1 << 22, dtype=torch.uint8, device=case.device)


def on_device(side, device: str):
    """The side with its token table and slot maps as tensors on ``device``."""
    state = tuple(replace(c, slot_map=None if c.slot_map is None else torch.as_tensor(c.slot_map).to(device))
                  for c in side.state)
    return replace(side, state=state, req_to_token=torch.as_tensor(side.req_to_token).to(device))


def decode_main(case: Case, conn) -> None:
    try:
        batch = scenario(case)
        side, dst_tensors = materialize(batch.dsts[0], case.device)
        side = on_device(side, case.device)
        if case.bad_registration:
            side = replace(side, aux=())
        staging = _staging(case) if case.mode == "staged" else None
        endpoint = DecodeEndpoint(side, make_engine(case.engine, "decode", case.memory), ControlChannel(), staging)
        conn.send(("port", endpoint.channel.port))
        endpoint.register()
        last = {t.request: t for t in batch.transfers if t.last}
        endpoint.publish([PreallocatedRequest(r, t.src_row, t.prompt_len, t.prefix_len, t.aux_dst)
                          for r, t in last.items()], timeout=case.timeout)
        states = endpoint.wait()
        failures = {r: endpoint.tracker.failure(r) for r in states}
        verified = None
        if all(s == "complete" for s in states.values()):
            # expected bytes: the reference plan of the same batch, executed on a local copy of the source
            src, src_tensors = materialize(batch.src, case.device, seed=case.seed)
            real = Batch(src, (replace(side, req_to_token=batch.dsts[0].req_to_token),), batch.transfers)
            expected = AddressSpace.of_tensors(dst_tensors, zero=True)
            execute(plan_reference(real).descriptors()[0], AddressSpace.of_tensors(src_tensors), expected)
            verified = expected.matches(dst_tensors)
        conn.send(("result", states, failures, verified))
    except Exception:  # noqa: BLE001 - reported to the test process
        conn.send(("error", traceback.format_exc()))
    conn.poll(60)


def prefill_main(case: Case, port: int, conn, exit_after_accept: bool = False) -> None:
    try:
        batch = scenario(case)
        side, _ = materialize(batch.src, case.device, seed=case.seed)
        side = on_device(side, case.device)
        staging = _staging(case) if case.mode == "staged" else None
        endpoint = PrefillEndpoint(side, make_engine(case.engine, "prefill", case.memory), ControlChannel(port), staging)
        try:
            endpoint.accept(timeout=case.timeout)
        except Exception as err:  # noqa: BLE001
            conn.send(("refused", f"{type(err).__name__}: {err}"))
            conn.poll(60)
            return
        if exit_after_accept:
            os._exit(0)
        endpoint.receive_requests(len(LENGTHS), timeout=case.timeout)
        conn.send(("ready",))
        conn.poll(60)  # the test may kill the decode side, or never say go
        if conn.recv() != "go":
            return
        transfers = [endpoint.transfer(Chunk(t.request, t.src_row, t.start, t.fill_len, t.prompt_len, t.last, t.aux_src))
                     for t in batch.transfers]
        result = endpoint.send(transfers, case.mode, timeout=case.timeout)
        conn.send(("sent", result))
    except Exception:  # noqa: BLE001
        conn.send(("error", traceback.format_exc()))
    conn.poll(60)


class Pair:
    """The two processes of a case, each joined or killed by its own handle."""

    def __init__(self, case: Case, exit_after_accept: bool = False):
        ctx = mp.get_context("spawn")
        self.decode_conn, there = ctx.Pipe()
        self.decode = ctx.Process(target=decode_main, args=(case, there), daemon=True)
        self.decode.start()
        kind, port = self.recv(self.decode_conn, "decode")
        assert kind == "port", port
        self.prefill_conn, there = ctx.Pipe()
        self.prefill = ctx.Process(target=prefill_main, args=(case, port, there, exit_after_accept), daemon=True)
        self.prefill.start()

    @staticmethod
    def recv(conn, who: str, timeout: float = 90.0):
        if not conn.poll(timeout):
            raise AssertionError(f"the {who} process said nothing for {timeout} s")
        msg = conn.recv()
        if msg[0] == "error":
            raise AssertionError(f"the {who} process failed:\n{msg[1]}")
        return msg

    def close(self) -> None:
        for conn in (self.decode_conn, self.prefill_conn):
            try:
                conn.send("bye")
            except (BrokenPipeError, OSError):
                pass
        for proc in (self.decode, self.prefill):
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)

    def kill_decode(self) -> None:
        self.decode.kill()
        self.decode.join(5)


def wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


__all__ = ["Case", "Pair", "np", "wait_for"]
