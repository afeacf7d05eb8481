"""The two processes of a benchmark run (a prefill and a decode, each a command printing one JSON line at its
end), each waited for under one deadline and killed by its own handle past it."""

from __future__ import annotations

import json
import signal
import subprocess
import time


def run_sides(commands: dict[str, list[str]], env: dict[str, str], wait_s: float) -> dict[str, dict]:
    """Start every command, then wait for each, all within ``wait_s``: each one's last stdout line as JSON, by
    role, or ``{"error": ...}`` with the end of its stderr where it failed or had to be killed.

    Example::

        got = run_sides({"prefill": [...], "decode": [...]}, dict(os.environ), 120)
    """
    env = {**env, "PYTHONFAULTHANDLER": "1"}  # (a side stopped past the deadline prints where each thread was)
    procs = {role: subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for role, argv in commands.items()}
    until = time.monotonic() + wait_s
    out: dict[str, dict] = {}
    for role, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=max(1.0, until - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)  # (faulthandler's stacks), then killed if that did not end it
            try:
                stdout, stderr = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                stdout, stderr = proc.communicate(timeout=30)
        lines = stdout.strip().splitlines()
        out[role] = json.loads(lines[-1]) if proc.returncode == 0 and lines else {
            "error": f"exit {proc.returncode}: {stderr[-4000:]}"}
    return out


def side_errors(got: dict[str, dict]) -> str | None:
    """What failed of a run's prefill and decode (each one named), or None where both reported."""
    errors = {r: got.get(r, {"error": "no result"}).get("error") for r in ("prefill", "decode")}
    return "; ".join(f"{r}: {e}" for r, e in errors.items() if e) or None


def print_row(name: str, row: dict) -> None:
    """One run's line (a row with ``ok``, ``requests``, ``decode_s``, ``requests_per_s``, ``gib_per_s``, ``ready``
    and each side's ``*_step`` timings), or why it failed."""
    if "error" in row:
        print(f"{name:16s} failed: {row['error'][:800]}", flush=True)
        return
    p, d, ready = row["prefill_step"], row["decode_step"], row["ready"]
    print(f"{name:16s} {row['ok']}/{row['requests']} ok in {row['decode_s']:.3f} s ({row['requests_per_s']} req/s, "
          f"{row['gib_per_s']:.3f} GiB/s); to ready p50 {ready['p50_ms']:.1f} p99 {ready['p99_ms']:.1f} ms; "
          f"prefill step p50 {p['p50_ms']:.3f} p99 {p['p99_ms']:.3f} max {p['max_ms']:.1f} ms; "
          f"decode step p50 {d['p50_ms']:.3f} p99 {d['p99_ms']:.3f} max {d['max_ms']:.1f} ms", flush=True)
