"""The two processes of a benchmark run (a prefill and a decode, each a command printing one JSON line at its
end), each waited for under one deadline and killed by its own handle past it."""

from __future__ import annotations

import json
import subprocess
import time


def run_sides(commands: dict[str, list[str]], env: dict[str, str], wait_s: float) -> dict[str, dict]:
    """Start every command, then wait for each, all within ``wait_s``: each one's last stdout line as JSON, by
    role, or ``{"error": ...}`` with the end of its stderr where it failed or had to be killed.

    Example::

        got = run_sides({"prefill": [...], "decode": [...]}, dict(os.environ), 120)
    """
    procs = {role: subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for role, argv in commands.items()}
    until = time.monotonic() + wait_s
    out: dict[str, dict] = {}
    for role, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=max(1.0, until - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate(timeout=30)
        lines = stdout.strip().splitlines()
        out[role] = json.loads(lines[-1]) if proc.returncode == 0 and lines else {
            "error": f"exit {proc.returncode}: {stderr[-1500:]}"}
    return out
