"""``kvplan demo`` as a user runs it: the command line, end to end, on this machine. The default
batch runs as the command's defaults have it; the other end-to-end runs turn NIXL's progress thread
off (it spins a core while its agent lives, and ``make test`` runs two tests at once on two cores)."""

import re
import subprocess
import sys

import pytest

from tests.tools.cli import plain_env, run_cli


@pytest.mark.engines
def test_demo_command_moves_and_verifies_the_default_batch():
    """As a user runs it: nothing exported (the command chooses the interpreter itself), its progress
    bar showing each of its stages in order."""
    from kvplan.tools.demo import STAGES

    done = subprocess.run([sys.executable, "-m", "kvplan", "demo", "--requests", "4"],
                          capture_output=True, text=True, timeout=300, env=plain_env())
    assert done.returncode == 0, done.stdout + done.stderr
    assert "every byte matches" in done.stdout and "result        OK" in done.stdout
    shown = re.findall(r"\] (\d+/\d+) ", done.stderr)
    assert shown == [f"{k}/{len(STAGES)}" for k in range(1, len(STAGES) + 1)], done.stderr


@pytest.mark.engines
def test_a_fault_drill_that_observes_its_failure_exits_zero_and_says_which():
    done = subprocess.run([sys.executable, "-m", "kvplan", "demo", "--requests", "2", "--fault", "deadline",
                           "--no-progress", "--progress-thread", "off"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "deadline passed" in done.stdout and "drill         observed deadline: 2 of 2 requests failed" in done.stdout


def test_a_drill_report_with_another_failure_is_not_observed():
    from kvplan.tools.demo import DemoConfig, DemoReport

    report = DemoReport(DemoConfig(fault="deadline"), states={"r1": "failed", "r2": "failed"},
                        failures={"r1": "deadline passed before every section arrived", "r2": "engine error"})
    assert report.drill_observed() is None
    report.failures["r2"] = "deadline passed before every section arrived"
    assert report.drill_observed().startswith("deadline: 2 of 2")
    assert DemoReport(DemoConfig(fault="dead-prefill-mid"), states={"r1": "complete"}).drill_observed() is None


@pytest.mark.parametrize("args, message", [
    (["--prefix-len", "-16"], "--prefix-len must be a non-negative multiple"),
    (["--prefix-len", "4096", "--prompt-len", "2048"], "must be shorter than the prompt"),
    (["--timeout", "0"], "--timeout must be positive"),
    (["--timeout", "-1"], "--timeout must be positive"),
    (["--seed", "-3"], "--seed must be >= 0"),
    (["--chunks", "5000"], "--chunks 5000 needs a prompt of at least 5000 pages"),
    (["--layers", "100000"], "is more than gptoss-swa-p16's"),
    (["--requests", "100000"], "the pools need at least"),
    (["--gather", "--src-tp", "4", "--dst-tp", "8"], "--gather needs a larger TP size on the prefill side"),
    (["--gather", "--src-tp", "8", "--dst-tp", "4", "--fault", "deadline"], "--gather runs without --fault"),
    (["--src-tp", "3", "--dst-tp", "8"], "8 KV heads do not split over 3 ranks"),
    (["--engine-threads", "-1"], "must be >= 0"),
    (["--engine-setting", "protocol"], "expected KEY=VALUE"),
    (["--engine", "mooncake", "--engine-setting", "num_threads=2"], "mooncake has no setting 'num_threads'"),
])
def test_numbers_that_cannot_run_are_refused_before_any_process_starts(args, message, capsys, monkeypatch):
    code, _, err = run_cli(["demo", "--no-progress", *args], capsys, monkeypatch)
    assert code == 2 and message in err, err  # (1: a failed transfer)


def test_bad_options_get_a_clear_message(capsys, monkeypatch):
    code, _, err = run_cli(["demo", "--mode", "prepared", "--engine", "mooncake"], capsys, monkeypatch)
    assert code == 2 and "prepared lists are NIXL's" in err
    code, _, err = run_cli(["demo", "--requests", "0"], capsys, monkeypatch)
    assert code == 2 and "must be >= 1" in err


def test_a_refusal_from_the_command_line_exits_2_in_a_process_of_its_own():
    """The refusals above run in this process; one as a user meets it, through the installed entry point."""
    done = subprocess.run([sys.executable, "-m", "kvplan", "demo", "--no-progress", "--src-tp", "3", "--dst-tp", "8"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "8 KV heads do not split over 3 ranks" in done.stderr, done.stderr


@pytest.mark.engines
def test_verbose_after_the_subcommand_logs_each_batch():
    done = subprocess.run([sys.executable, "-m", "kvplan", "demo", "-v", "--requests", "2", "--no-progress",
                           "--progress-thread", "off"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "INFO" in done.stderr and "sending 4 transfers" in done.stderr


def test_staged_mode_on_the_cpu_gets_a_deadline_scaled_to_its_interpreted_copies():
    from kvplan.tools.demo_config import default_timeout
    from kvplan.tools.demo import DemoConfig

    assert default_timeout(DemoConfig(mode="direct", device="cpu")) == 60.0
    staged = default_timeout(DemoConfig(mode="staged", device="cpu"))
    assert staged > 60.0 + 100  # the default batch holds about 143 MB, copied at well under 1 MB/s interpreted
    assert default_timeout(DemoConfig(mode="staged", device="cpu", requests=2)) < staged


@pytest.mark.engines
def test_tp_sizes_of_the_two_sides_are_options():
    """gpt-oss's KV and SWA state head-sliced from TP 4 to TP 8 (docs/tp_state.md)."""
    done = subprocess.run([sys.executable, "-m", "kvplan", "demo", "--preset", "gptoss-swa-p16", "--src-tp", "4",
                           "--dst-tp", "8", "--requests", "2", "--prompt-len", "300", "--layers", "2", "--no-progress",
                           "--progress-thread", "off"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "head-sliced descriptors" in done.stdout and "every byte matches" in done.stdout


def test_engine_settings_from_the_command_line_reach_the_engine_and_win_over_the_demo_s():
    from kvplan.tools.demo import DemoConfig

    config = DemoConfig(engine="mooncake", host="192.0.2.7",
                        engine_extra=(("protocol", "nvlink_intra"), ("local_hostname", "10.0.0.1")))
    assert config.engine_settings(1) == {"device_id": 1, "local_hostname": "10.0.0.1", "protocol": "nvlink_intra"}
    assert DemoConfig(engine="nixl", engine_extra=(("num_threads", 4),)).engine_settings() == {"num_threads": 4}


def test_a_preset_between_tp_sizes_on_the_cpu_gets_a_deadline_scaled_to_its_head_sliced_plan():
    """The tp4to8 presets plan a descriptor per token and entry (131-139 thousand by default): interpreted,
    that took up to most of the 60 s default on a loaded 2-core machine, so their default grows with it."""
    from kvplan.tools.demo import DemoConfig
    from kvplan.tools.demo_config import default_timeout

    for preset in ("llama70b-tp4to8-p64", "gptoss-swa-tp4to8-p16", "qwen3next-mamba-tp4to8-p64"):
        config = DemoConfig(preset=preset, device="cpu", mode="direct")
        assert default_timeout(config) >= 60.0 + 130, (preset, default_timeout(config))
    assert default_timeout(DemoConfig(preset="llama70b-tp8-p64", device="cpu", mode="direct")) == 60.0
    assert default_timeout(DemoConfig(preset="llama70b-tp4to8-p64", device="cuda", mode="direct")) == 60.0
