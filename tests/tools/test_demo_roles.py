"""``kvplan demo --role``: the two sides as two commands, as on two machines.

Both commands are started here, bound to a non-loopback address of this host where it has one (else
127.0.0.1): the decode with ``--listen ADDR:PORT``, the prefill with ``--peer ADDR:PORT``. The decode
verifies every byte; each exits 0. Over NIXL (UCX picks the device for the address: the library sets no
``UCX_*``) and Mooncake (its ``local_hostname`` is the address).
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tools.cli import plain_env, run_cli

pytestmark = pytest.mark.engines
ROOT = Path(__file__).resolve().parents[2]
SCENARIO = ["--requests", "2", "--prompt-len", "64", "--layers", "2", "--no-progress"]


def _host_address() -> str:
    """A non-loopback IPv4 address of this host (what a second machine would reach), else 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: the kernel picks the outgoing address
            address = s.getsockname()[0]
        except OSError:
            return "127.0.0.1"
    return address if not address.startswith("127.") else "127.0.0.1"


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _secret_file(folder: Path) -> Path:
    """A secret as docs/cli.md makes one for two hosts: random, in a file private to the user."""
    import os
    import secrets

    path = folder / "kvplan.secret"
    path.write_text(secrets.token_hex(32) + "\n")
    os.chmod(path, 0o600)
    return path


@pytest.mark.parametrize("engine", ["nixl", "mooncake"])
def test_the_two_sides_run_as_two_commands_bound_to_the_host_s_address(engine, tmp_path):
    host = _host_address()
    port = _free_port(host)
    # as on a real host: UCX chooses, and the command chooses the interpreter itself; both sides hold the
    # secret file docs/cli.md's commands name (off loopback nothing starts without one)
    env = {**plain_env(), "KVPLAN_SECRET_FILE": str(_secret_file(tmp_path))}
    cmd = [sys.executable, "-m", "kvplan", "demo", "--engine", engine, *SCENARIO]
    decode = subprocess.Popen(cmd + ["--role", "decode", "--listen", f"{host}:{port}"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        prefill = subprocess.run(cmd + ["--role", "prefill", "--peer", f"{host}:{port}"], capture_output=True,
                                 text=True, timeout=300, env=env, cwd=ROOT)
        out, err = decode.communicate(timeout=120)
    finally:
        if decode.poll() is None:
            decode.kill()
            decode.wait(30)
    assert prefill.returncode == 0, prefill.stdout + prefill.stderr[-3000:]
    assert decode.returncode == 0, out + err[-3000:]
    assert f"{host}, decode side" in out and "every byte matches" in out and "completed     2 of 2" in out
    assert f"{host}, prefill side" in prefill.stdout and "completed     2 of 2" in prefill.stdout


@pytest.mark.parametrize("role, address", [("decode", "--listen"), ("prefill", "--peer")])
def test_off_loopback_a_side_without_a_secret_stops_at_once_saying_what_to_set(role, address):
    """Secure by default: no secret, no opt-out, a host that is not loopback: one line, exit 1, nothing bound."""
    env = {k: v for k, v in plain_env().items() if k not in ("KVPLAN_SECRET", "KVPLAN_SECRET_FILE", "KVPLAN_INSECURE")}
    done = subprocess.run([sys.executable, "-m", "kvplan", "demo", "--engine", "nixl", *SCENARIO, "--role", role,
                           address, "192.0.2.1:7000"], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stdout + done.stderr[-3000:]
    said = done.stdout + done.stderr
    assert "SettingError" in said and "192.0.2.1 (not loopback) has no shared secret" in said, said
    assert "KVPLAN_SECRET_FILE" in said and "KVPLAN_INSECURE=1" in said, said


def test_a_role_needs_its_address_and_refuses_the_other(capsys, monkeypatch):
    run = lambda *a: run_cli(["demo", *a], capsys, monkeypatch)  # noqa: E731
    assert "needs --listen" in run("--role", "decode")[2]
    assert "needs --peer" in run("--role", "prefill", "--listen", "127.0.0.1:5000")[2]
    assert "expected HOST:PORT" in run("--role", "decode", "--listen", "localhost")[2]
    assert "go with --role" in run("--peer", "127.0.0.1:5000")[2]


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True),
                                            ("localhost", True), ("10.0.0.2", False), ("fd00::2", False),
                                            ("decode-7.cluster", False)])
def test_the_tools_choose_ucx_s_loopback_device_only_for_a_loopback_host(host, loopback):
    from kvplan.tools.demo_config import is_loopback

    assert is_loopback(host) is loopback


@pytest.mark.parametrize("decode_secret, prefill_secret, prefill_says, decode_says", [
    ("decode's", "prefill's", "secret mismatch", "secret mismatch"),
    ("decode's", None, "peer requires a secret", "peer has no secret"),
])
def test_two_sides_whose_secrets_differ_name_it_in_one_line_as_the_handshake_fails(decode_secret, prefill_secret,
                                                                                  prefill_says, decode_says):
    """The connecting prefill names why it cannot pair as soon as the decode's hello and proof show it (its
    report, no traceback); the decode names it in one warning line as it refuses the pairing."""
    import threading
    import time

    port = _free_port("127.0.0.1")
    cmd = [sys.executable, "-m", "kvplan", "demo", "--engine", "nixl", *SCENARIO]

    def environment(secret):
        env = {k: v for k, v in plain_env().items() if k not in ("KVPLAN_SECRET", "KVPLAN_SECRET_FILE")}
        # (no secret: the explicit opt-out, else both would take the loopback secret)
        return {**env, "UCX_NET_DEVICES": "lo", **({"KVPLAN_SECRET": secret} if secret else {"KVPLAN_INSECURE": "1"})}

    decode = subprocess.Popen(cmd + ["--role", "decode", "--listen", f"127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, env=environment(decode_secret), cwd=ROOT)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(decode.stderr), daemon=True)
    reader.start()
    try:
        started = time.monotonic()
        prefill = subprocess.run(cmd + ["--role", "prefill", "--peer", f"127.0.0.1:{port}"], capture_output=True,
                                 text=True, timeout=120, env=environment(prefill_secret), cwd=ROOT)
        took = time.monotonic() - started
        deadline = time.monotonic() + 10
        while not any(decode_says in line for line in lines) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        decode.kill()
        decode.wait(30)
        reader.join(10)
    assert prefill.returncode == 1 and "Traceback" not in prefill.stderr, prefill.stdout + prefill.stderr[-3000:]
    assert f"pairing       refused: SecretMismatch: {prefill_says}: " in prefill.stdout, prefill.stdout
    assert took < 60, took  # (the process's start and imports, then one handshake: not the 60 s deadline)
    named = [line for line in lines if decode_says in line]
    assert len(named) == 1 and named[0].startswith("WARNING refused a message on the control channel"), lines
