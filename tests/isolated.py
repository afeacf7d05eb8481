"""Run a test's body in a child process of its own, so that what it starts (engine agents and their
progress threads) ends with that process instead of living on in pytest's."""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from multiprocessing.connection import wait
from typing import Callable

from kvplan.tools.target_process import start_child


def _child(target: Callable[..., None], args: tuple, report) -> None:
    try:
        target(*args)
        report.send(None)  # a pipe's send is written before it returns: safe before os._exit
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test with it
        report.send(traceback.format_exc())
    finally:
        # an engine's threads may still run: leave without waiting for them or their finalizers
        os._exit(0)


def run_isolated(target: Callable[..., None], *args, timeout: float) -> None:
    """Run ``target(*args)`` (a module-level function, importable by a fresh interpreter) in a child of
    its own (:func:`kvplan.tools.target_process.start_child`); raise ``AssertionError`` with the child's traceback if it failed, or if it neither ended nor
    reported within ``timeout`` seconds (the child is then killed by its handle)."""
    reports, report = mp.Pipe(duplex=False)
    child = start_child(_child, target, args, report)
    report.close()
    try:
        wait([reports, child.sentinel], timeout)  # a report, the child's end, or the deadline
        if not reports.poll():
            raise AssertionError(f"{target.__name__} reported nothing: its child ended with code "
                                 f"{child.exitcode} (None: still running at the {timeout} s deadline)")
        failure = reports.recv()
    finally:
        reports.close()
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
            child.join(timeout=5)
    if failure is not None:
        raise AssertionError(f"{target.__name__} failed in its child process:\n{failure}")
