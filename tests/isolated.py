"""Run a test's body in a child process of its own, so that what it starts (engine agents and their
progress threads) ends with that process instead of living on in pytest's."""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from multiprocessing.connection import wait
from typing import Callable

from kvplan.tools.target_process import start_child


def report_and_exit(report, target: Callable[..., object], *args) -> None:
    """A child's body: ``target(*args)``, then ``("result", its value)`` or ``("error", traceback)``
    sent through ``report``, and the process ends at once."""
    try:
        report.send(("result", target(*args)))  # a pipe's send is written before it returns: safe before os._exit
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test with it
        report.send(("error", traceback.format_exc()))
    finally:
        # an engine's threads may still run: leave without waiting for them or their finalizers
        os._exit(0)


def end_all(procs) -> None:
    """Join each child process by its own handle, killing one that has not ended within 10 s."""
    for proc in procs:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def run_isolated(target: Callable[..., object], *args, timeout: float, env: dict[str, str] | None = None) -> object:
    """Run ``target(*args)`` (a module-level function, importable by a fresh interpreter) in a child of
    its own (:func:`kvplan.tools.target_process.start_child`, with ``env`` if given) and return what
    it returned; raise ``AssertionError`` with the child's traceback if it failed, or if it neither
    ended nor reported within ``timeout`` seconds (the child is then killed by its handle)."""
    reports, report = mp.Pipe(duplex=False)
    child = start_child(report_and_exit, report, target, *args, env=env)
    report.close()
    try:
        wait([reports, child.sentinel], timeout)  # a report, the child's end, or the deadline
        if not reports.poll():
            raise AssertionError(f"{target.__name__} reported nothing: its child ended with code "
                                 f"{child.exitcode} (None: still running at the {timeout} s deadline)")
        kind, payload = reports.recv()
        failure = payload if kind == "error" else None
    finally:
        reports.close()
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
            child.join(timeout=5)
    if failure is not None:
        raise AssertionError(f"{target.__name__} failed in its child process:\n{failure}")
    return payload
