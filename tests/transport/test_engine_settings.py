"""Engines take their network from the caller: NIXL sets no UCX variable behind the
caller's back, and Mooncake initialises on the caller's host, protocol and metadata service."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENGINES = os.environ.get("KVPLAN_TEST_ENGINES", "nixl,mooncake").split(",")


@pytest.mark.engines
@pytest.mark.skipif("nixl" not in ENGINES, reason="KVPLAN_TEST_ENGINES leaves NIXL out")
def test_a_nixl_engine_sets_no_ucx_variable():
    probe = ("import os; from kvplan.transport.engines import make_engine; e = make_engine('nixl', 'probe', "
             "progress_thread=False); print(sorted(k for k in os.environ if k.startswith('UCX_'))); e.close()")
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.engines
@pytest.mark.skipif("mooncake" not in ENGINES, reason="KVPLAN_TEST_ENGINES leaves Mooncake out")
def test_a_mooncake_engine_is_reached_at_the_caller_s_host():
    from kvplan.transport.engines import make_engine

    engine = make_engine("mooncake", "probe", local_hostname="127.0.0.1")
    try:
        assert engine.segment.startswith("127.0.0.1:")
    finally:
        engine.close()


@pytest.mark.engines
@pytest.mark.skipif("mooncake" not in ENGINES, reason="KVPLAN_TEST_ENGINES leaves Mooncake out")
def test_mooncake_s_tcp_settings_are_refused_for_another_protocol():
    from kvplan.transport.engines import make_engine

    with pytest.raises(ValueError, match="TCP settings, not rdma's"):
        make_engine("mooncake", "probe", local_hostname="127.0.0.1", protocol="rdma", lanes=4)
