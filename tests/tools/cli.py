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
