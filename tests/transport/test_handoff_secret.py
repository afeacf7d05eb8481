"""The two-process hand-off and a fault drill with the control plane's shared secret set
(``KVPLAN_SECRET``, which both of the demo's sides read), over NIXL and Mooncake: every pairing proves the
secret, every control message carries its code, and the bytes still arrive whole."""

import pytest

from kvplan.tools.demo import run_demo
from tests.transport.test_handoff import ENGINES, config

pytestmark = pytest.mark.engines


@pytest.mark.parametrize("engine", ENGINES)
def test_a_staged_batch_arrives_byte_for_byte_with_a_secret(engine, monkeypatch):
    monkeypatch.setenv("KVPLAN_SECRET", "the deployment's secret")
    monkeypatch.delenv("KVPLAN_SECRET_FILE", raising=False)
    report = run_demo(config(engine, "hybrid", "staged", deployed=True))
    assert set(report.states.values()) == {"complete"}, report.failures
    assert report.verified is True and report.ok


@pytest.mark.parametrize("engine", ENGINES)
def test_a_dead_decode_drill_with_a_secret_fails_every_request_naming_why(engine, monkeypatch, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("from a file\n")
    secret.chmod(0o600)  # (a secret's file is its owner's alone)
    monkeypatch.delenv("KVPLAN_SECRET", raising=False)
    monkeypatch.setenv("KVPLAN_SECRET_FILE", str(secret))
    report = run_demo(config(engine, fault="dead-decode", timeout=20))
    assert all("the decode side is gone" in (why or "") for why in report.send_failures.values()), \
        report.send_failures
    assert report.drill_observed()
