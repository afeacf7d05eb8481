"""``kvplan demo``: a real prefill-to-decode hand-off on one machine, verified byte for byte.

Two processes on 127.0.0.1. The decode process backs a model-shaped paged pool (GPU memory when
a GPU is present) with fragmented allocation, pre-allocates pages and state for a batch of
requests and publishes them; the prefill process fills its pool with known bytes, plans the
batch with kvplan (chunked, with state components) and moves it through NIXL or Mooncake,
directly, through prepared lists or staged. The decode process checks every byte it received
against a reference execution of the same plan on its own copy of the source bytes.

``fault`` drills the failure paths: ``dead-decode`` (the receiver dies before the send),
``dead-decode-mid`` (it dies once its first request has completed), ``dead-prefill-mid`` (the
sender dies after the first chunks of every request have been sent),
``dead-prefill`` (the sender dies after pairing), ``bad-registration`` (the receiver's layout
does not pair), ``deadline`` (nothing is ever sent).

``layer_groups`` streams the batch behind a stand-in forward pass (:mod:`.forward`) in that many
layer groups (``layer_split``: tapered to a last group of two layers, or even); ``forward_dim``
sizes its per-layer matmul. With ``forward_dim`` alone the batch is sent once the pass has ended:
the non-streamed baseline. Either way the report says how long the pass took and how long after
its end the decode side had every request (the exposed transfer).

Example::

    report = run_demo(DemoConfig(preset="gptoss-swa-p16", engine="nixl"))
    print(report.render()); sys.exit(0 if report.ok else 1)
"""

from __future__ import annotations

import logging
import statistics
import sys
from dataclasses import dataclass, field
from typing import Any

from .target_process import SideFailed, child_message, child_pipe, start_child
from .demo_config import FAULTS, STAGES, DemoConfig
from .demo_roles import decode_process, prefill_process

__all__ = ["DemoConfig", "DemoReport", "FAULTS", "run_demo"]

log = logging.getLogger(__name__)


@dataclass
class DemoReport:
    config: DemoConfig
    device: str = ""
    transfers: int = 0
    descriptors: int = 0
    nbytes: int = 0
    mode: str = ""
    kvplan_ms: float | None = None
    baseline_ms: float | None = None
    warm_up_s: float | None = None  # the prefill endpoint's warm_up() (None: not called)
    transfer_s: float | None = None  # the first batch (after the warm-up, when there is one)
    steady_s: float | None = None  # median of the later batches (``repeat`` > 1)
    batch_s: list[float] = field(default_factory=list)  # every batch's time, in order
    forward_s: float | None = None  # the stand-in forward pass (median over batches)
    exposed_s: float | None = None  # from its end until the decode side had every request (median)
    exposed_each_s: list[float] = field(default_factory=list)  # the same, batch by batch (the first included)
    mode_used: str | None = None  # what ``auto`` chose
    states: dict[Any, str] = field(default_factory=dict)
    failures: dict[Any, str | None] = field(default_factory=dict)
    send_failures: dict[Any, str | None] = field(default_factory=dict)
    refused: str | None = None
    verified: bool | None = None
    role: str = "both"  # or the one side this command ran ("decode", "prefill": run_role)

    @property
    def ok(self) -> bool:
        complete = bool(self.states) and set(self.states.values()) == {"complete"}
        return complete and (self.verified is True or self.role == "prefill")  # (the decode side verifies)

    def drill_observed(self) -> str | None:
        """For a fault drill: what was observed when it is exactly the expected failure, else ``None``."""
        fault = self.config.fault
        failed = {r: why or "" for r, why in self.failures.items() if self.states.get(r) == "failed"}
        every = bool(self.states) and len(failed) == len(self.states)

        def all_say(*words: str) -> bool:
            return every and all(any(w in why for w in words) for why in failed.values())

        expected = {
            "dead-decode": bool(self.send_failures) and all(self.send_failures.values()),
            "dead-prefill": all_say("the prefill side is gone", "could not be published"),
            "dead-prefill-mid": all_say("the prefill side is gone"),
            "dead-decode-mid": bool(failed) and all("the decode side is gone" in why for why in failed.values()),
            "bad-registration": bool(self.refused) and all_say("refused the pairing"),
            "deadline": all_say("deadline passed"),
        }.get(fault, False)
        if not expected:
            return None
        return f"{fault}: {len(failed)} of {len(self.states)} requests failed as expected ({next(iter(failed.values()))})"

    def render(self) -> str:
        c = self.config
        model = c.model()
        pages = (f"page size {model.page_size}" if not self.config.dst_page_size else
                 f"page size {model.page_size} to {self.config.dst_page_size}")
        lines = [f"kvplan demo: {model.name} ({model.layers} layers, {pages}), "
                 f"{c.engine} {c.mode}{f' ({self.mode_used})' if self.mode_used and self.mode_used != c.mode else ''}, "
                 f"{self.device} memory, {c.host}" + (f", {self.role} side" if self.role != "both" else "")]
        if self.role == "decode":  # the prefill side plans and sends: its command reports those
            lines.append(f"  requests      {c.requests} x {c.prompt_len} tokens, from the prefill command")
        else:
            used = self.mode_used or c.mode
            form = {"staged": f"{self.mode} descriptors, moved through staging slots",
                    "prepared": f"{self.mode} descriptors, posted as NIXL prepared lists"}.get(
                used.split(",")[0], f"{self.mode} descriptors")
            lines.append(f"  requests      {c.requests} x {c.prompt_len} tokens in {self.transfers} chunks ({form})")
            lines.append(f"  descriptors   {self.descriptors:,}   bytes {self.nbytes:,}")
        if self.kvplan_ms is not None:
            where = "GPU" if self.device == "cuda" else "CPU, Triton interpreter: not a speed measurement"
            why = "different page sizes" if self.config.dst_page_size else "head-sliced"
            base = f"{self.baseline_ms:.2f} ms" if self.baseline_ms is not None else f"n/a ({why})"
            lines.append(f"  plan latency  kvplan {self.kvplan_ms:.2f} ms ({where}); SGLang-style {base}")
        if self.warm_up_s is not None:
            lines.append(f"  warm-up       {self.warm_up_s * 1e3:.1f} ms (the prefill endpoint's warm_up(), before the "
                         "first batch)")
        if self.transfer_s:
            lines.append(f"  transfer      {self.transfer_s * 1e3:.1f} ms, {self.nbytes / self.transfer_s / 2**30:.3f} GiB/s"
                         + (" (first batch)" if self.steady_s else ""))
        if self.steady_s:
            lines.append(f"  steady        {self.steady_s * 1e3:.1f} ms, {self.nbytes / self.steady_s / 2**30:.3f} GiB/s "
                         f"(median of batches 2..{c.repeat})")
            later = sorted(self.batch_s[1:])
            if len(later) >= 4:  # the spread of the later batches: a median can hide a slow half
                lines.append(f"  spread        {later[0] * 1e3:.2f} .. {later[len(later) // 10] * 1e3:.2f} (p10) .. "
                             f"{later[(9 * len(later)) // 10] * 1e3:.2f} (p90) .. {later[-1] * 1e3:.2f} ms")
        if self.forward_s is not None and self.exposed_s is not None:
            how = (f"streamed in {c.layer_groups} layer groups ({c.layer_split}: {c.groups().sizes} "
                   f"layers)" if c.layer_groups else "sent after the forward pass")
            lines.append(f"  forward       {self.forward_s * 1e3:.1f} ms (stand-in, {model.layers} layers); {how}")
            lines.append(f"  exposed       {self.exposed_s * 1e3:.1f} ms from the end of the forward pass to decode-ready")
        if self.refused:
            lines.append(f"  pairing       refused: {self.refused}")
        done = sum(1 for s in self.states.values() if s == "complete")
        lines.append(f"  completed     {done} of {len(self.states)} requests")
        for request, reason in self.failures.items():
            if reason:
                lines.append(f"  FAILED        {request}: {reason}")
        if c.fault != "deadline" and any("deadline" in str(r) for r in self.failures.values() if r):
            where = (" on a CPU, where kvplan's kernels run in Triton's interpreter" if self.device == "cpu" else "")
            lines.append(f"  hint          the deadline (--timeout {c.timeout:g} s) passed{where}: raise --timeout")
        verdict = {True: "every byte matches", False: "WRONG BYTES",
                   None: "on the decode side" if self.role == "prefill" else "not checked"}[self.verified]
        lines.append(f"  verification  {verdict}")
        lines.append("  result        " + ("OK" if self.ok else "FAILED"))
        return "\n".join(lines)


class _Progress:
    """A one-line progress bar on standard error (silent when not a terminal unless forced)."""

    def __init__(self, enabled: bool):
        self.enabled, self.done = enabled, 0

    def stage(self, name: str) -> None:
        if STAGES.index(name) + 1 <= self.done:
            return
        self.done = STAGES.index(name) + 1
        if self.enabled:
            bar = "#" * (3 * self.done) + "." * (3 * (len(STAGES) - self.done))
            sys.stderr.write(f"\r[{bar}] {self.done}/{len(STAGES)} {name:<14}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


class Processes:
    """The processes of a run (a decode, and a prefill per sending source rank), each joined or
    killed by its own handle."""

    def __init__(self, config: DemoConfig):
        self.decode_conn, there = child_pipe()
        self.decode = start_child(decode_process, config, there)
        kind, ports = self.recv(self.decode_conn, "decode", config.timeout + 60)
        self.prefill_conns, self.prefills = [], []
        for rank, port in zip(config.sources(), ports):
            conn, there = child_pipe()
            self.prefill_conns.append(conn)
            self.prefills.append(start_child(prefill_process, config, port, there, rank if config.gather else None))

    @property
    def prefill_conn(self):
        """The (first) prefill process's pipe."""
        return self.prefill_conns[0]

    def from_prefills(self, timeout: float) -> list:
        """One message from every prefill process."""
        return [self.recv(conn, "prefill", timeout) for conn in self.prefill_conns]

    recv = staticmethod(child_message)

    def kill_decode(self) -> None:
        self.decode.kill()
        self.decode.join(5)

    def close(self) -> None:
        for conn in (self.decode_conn, *self.prefill_conns):
            try:
                conn.send("bye")
            except (BrokenPipeError, OSError):
                pass
        for proc in (self.decode, *self.prefills):
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


def run_demo(config: DemoConfig, progress: bool = False) -> DemoReport:
    """Run both processes to the end and report (raises only on a crash of either process)."""
    if config.fault not in FAULTS:
        raise ValueError(f"unknown fault {config.fault!r}; choose one of {', '.join(FAULTS)}")
    report = DemoReport(config, device=config.resolved_device())
    bar = _Progress(progress)
    wait = config.timeout + 120  # process start-up, imports and interpreted kernels on a small machine
    procs = None
    spans: list = []  # the stand-in forward passes' (started, ended)
    try:
        bar.stage("start decode")
        procs = Processes(config)
        bar.stage("start prefill")
        paired = procs.from_prefills(wait)
        refused = [m[1] for m in paired if m[0] == "refused"]
        if refused:
            report.refused = refused[0]
        else:
            bar.stage("pair")
            if config.fault != "dead-prefill":
                planned = procs.from_prefills(wait)  # each source rank's part: counted together
                _, report.transfers, _, _, report.mode, report.kvplan_ms, report.baseline_ms, report.warm_up_s = planned[0]
                report.descriptors, report.nbytes = sum(m[2] for m in planned), sum(m[3] for m in planned)
                bar.stage("publish lists")  # (the prefill plans once it has the decode's lists)
                bar.stage("plan")
                if config.fault == "dead-decode":
                    procs.kill_decode()
                if config.fault != "deadline":
                    for conn in procs.prefill_conns:
                        conn.send("go")
                    sent = procs.from_prefills(wait)
                    report.mode_used, spans = sent[0][3], sent[0][4]
                    for m in sent:
                        for request, why in m[1].items():
                            report.send_failures[request] = report.send_failures.get(request) or why
                    times = [max(each) for each in zip(*(m[2] for m in sent))]  # a batch is sent when all have sent it
                    report.transfer_s = times[0]
                    report.steady_s = statistics.median(times[1:]) if len(times) > 1 else None
                    report.batch_s = times
                    bar.stage("transfer")
        if config.fault == "dead-decode":
            report.states = {r: "failed" for r in report.send_failures}
            report.failures = dict(report.send_failures)
        elif config.fault == "dead-decode-mid":  # the prefill's view: what it reported sent or failed
            report.states = {r: "failed" if why else "complete" for r, why in report.send_failures.items()}
            report.failures = dict(report.send_failures)
        else:
            while (msg := procs.recv(procs.decode_conn, "decode", wait))[0] == "stage":
                bar.stage(msg[1])
            _, report.states, report.failures, report.verified, ready = msg
            if spans and len(ready) == len(spans):
                later = slice(1 if len(spans) > 1 else 0, None)  # the first pass warms up, when there are more
                report.forward_s = statistics.median(end - start for start, end in spans[later])
                report.exposed_each_s = [r - end for r, (_, end) in zip(ready, spans)]
                report.exposed_s = statistics.median(report.exposed_each_s[later])
            bar.stage("verify")
    finally:
        bar.close()
        if procs is not None:
            procs.close()
    return report


class _RoleConn:
    """The parent's pipe, for a side that runs alone (:func:`run_role`): it keeps what the side reports,
    shows its stages, and answers "go" when the prefill asks."""

    def __init__(self, show: Any) -> None:
        self.messages: list[tuple] = []
        self.show = show

    def send(self, msg: Any) -> None:
        self.messages.append(msg)
        if msg[0] == "stage":
            self.show(msg[1])

    def poll(self, timeout: float | None = None) -> bool:
        return True

    def recv(self) -> str:
        return "go"

    def last(self, kind: str) -> tuple | None:
        return next((m for m in reversed(self.messages) if m[0] == kind), None)


def run_role(config: DemoConfig, role: str, peer_port: int = 0, progress: bool = False) -> DemoReport:
    """Run one side of the demo in this process, the other being a command on another machine: the
    decode listens on ``config.host:config.port``; the prefill connects to ``config.host:peer_port``.
    Both rebuild the same batch from the same settings (seed included). Only the decode verifies
    bytes; the prefill reports what it sent."""
    if role not in ("decode", "prefill"):
        raise ValueError(f"a role is 'decode' or 'prefill', not {role!r}")
    bar = _Progress(progress)
    report = DemoReport(config, device=config.resolved_device(), role=role)
    conn = _RoleConn(bar.stage)
    try:
        if role == "decode":
            decode_process(config, conn)
        else:
            prefill_process(config, peer_port, conn)
    finally:
        bar.close()
    if (error := conn.last("error")) is not None:
        raise RuntimeError(f"the {role} side failed:\n{error[1]}")
    if (failed := conn.last("failed")) is not None:
        raise SideFailed(f"the {role} side failed: {failed[1]}")
    if role == "decode":
        _, report.states, report.failures, report.verified, _ = conn.last("result")
        return report
    if (refused := conn.last("refused")) is not None:
        report.refused = refused[1]
        return report
    _, report.transfers, _, report.nbytes, report.mode, report.kvplan_ms, report.baseline_ms, report.warm_up_s = \
        conn.last("planned")
    report.descriptors = conn.last("planned")[2]
    _, sent, times, report.mode_used, _ = conn.last("sent")
    report.send_failures = dict(sent)
    report.states = {r: "failed" if why else "complete" for r, why in sent.items()}
    report.failures = {r: why for r, why in sent.items() if why}
    report.transfer_s, report.batch_s = (times[0] if times else None), list(times)
    return report
