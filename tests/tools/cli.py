"""``kvplan``'s command line run in this process, for the checks of what it refuses (they end before
any process starts, so a fresh interpreter per case would only cost its two seconds of imports); the
end-to-end runs stay real subprocesses."""

from __future__ import annotations

import pytest

from kvplan.cli import main


def run_cli(args: list[str], capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> tuple[int, str, str]:
    """``kvplan *args``: its exit code, standard output and standard error."""
    monkeypatch.setenv("KVPLAN_LOG_LEVEL", "WARNING")  # main() sets it; restored after the test
    capsys.readouterr()
    try:
        code = main(args)
    except SystemExit as exit_:  # argparse's refusals
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


# what the Makefile and conftest export for the tests; a new user's shell has none of them
_EXPORTED = ("TRITON_INTERPRET", "UCX_NET_DEVICES", "NIXL_LOG_LEVEL", "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER",
             "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER", "KVPLAN_LOG_LEVEL")


def plain_env() -> dict[str, str]:
    """This process's environment without what the tests export: a command run with it chooses the
    interpreter, the loopback device and the engines' settings itself, as on a user's CPU box."""
    import os

    return {k: v for k, v in os.environ.items() if k not in _EXPORTED}
