"""``kvplan load`` on this machine: serving-shaped load through real engines and
processes, with aborts and deadlines on a schedule and a decode killed mid-run; every completed
request byte-equal, every failure one that was injected, and nothing left behind or growing."""


from kvplan.tools.load import LoadConfig, LoadReport, _check_resources, run_load, schedule

SHORT = dict(rate=10.0, duration=3.0, decodes=2, device="cpu", fault_every=6)


def _check_run(config: LoadConfig, report: dict) -> None:
    """A finished run's report (``LoadReport.as_dict``): every surviving request byte-equal, every
    failure an injected one, the tables drained, and the endpoints' own counters agreeing."""
    assert not report["problems"], report["problems"]
    assert report["completed"] and report["verified"] == report["completed"]
    kill_at = config.kill_at
    injected = [a for a in schedule(config) if a.fault and not (kill_at and a.decode == config.decodes - 1)]
    assert sum(report["failures"].values()) == len(injected) and set(report["failures"]) <= {"abort", "deadline"}
    if kill_at:
        assert report["with_killed_decode"] and "decode 1" not in report["resources"]
    for who, samples in report["resources"].items():  # the endpoints' tables drained
        assert samples[-1]["tracked" if who != "prefill" else "lists"] == 0
    decodes = [s for who, s in report["stats"].items() if who != "prefill"]
    assert sum(s["requests"].get("complete", 0) for s in decodes) == report["completed"]
    assert all(s["in_flight"] == 0 and s["latency_ms"]["count"] == s["requests"].get("complete", 0) for s in decodes)
    failed = sum(s["failures"].get("aborted", 0) + s["failures"].get("deadline", 0) for s in decodes)
    assert failed == len(injected)
    assert report["stats"]["prefill"]["bytes"] > 0 and report["stats"]["prefill"]["requests"]["sent"] >= report["completed"]
    # each process's CPU time (all its threads) per request, and the share of a core it kept busy
    cpu = report["cpu_per_request"]
    assert set(cpu) == set(report["stats"]), cpu
    assert all(v["ms"] > 0 and 0 < v["busy"] < 64 for v in cpu.values()), cpu


def test_a_short_load_run_with_faults_moves_every_surviving_request_byte_for_byte(tmp_path):
    """The command as a user on a CPU box runs it: nothing exported (it chooses the interpreter and, on
    loopback, UCX's device itself), its progress line, the CPU caveat, no injected fault logged as a warning."""
    import json
    import subprocess
    import sys

    from tests.tools.cli import plain_env

    # three processes on a 2-core machine: NIXL runs without its progress thread, which spins a core each
    config = LoadConfig(engine="nixl", engine_extra=(("progress_thread", False),), **SHORT)
    out = tmp_path / "load.json"
    done = subprocess.run([sys.executable, "-m", "kvplan", "load", "--rate", str(config.rate), "--duration",
                           str(config.duration), "--device", "cpu", "--fault-every", str(config.fault_every),
                           "--engine-setting", "progress_thread=false", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env=plain_env())
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "[load]" in done.stderr and "not a speed measurement" in done.stdout, done.stderr
    assert "process CPU   prefill " in done.stdout and "of a core)" in done.stdout, done.stdout
    assert "failed: load: an abort" not in done.stderr  # an injected fault is no warning (shown with -v)
    _check_run(config, json.loads(out.read_text()))


def test_a_decode_killed_mid_run_leaves_the_others_requests_whole():
    config = LoadConfig(engine="mooncake", kill_at=1.5, **SHORT)
    _check_run(config, run_load(config).as_dict())


def test_the_schedule_is_the_same_in_every_process_and_faults_reach_every_decode():
    config = LoadConfig(rate=50, duration=4, decodes=3, fault_every=4)
    first, again = schedule(config), schedule(config)
    assert first == again
    assert {a.decode for a in first if a.fault} == {0, 1, 2}
    assert all(a.prefix_len % config.page_size == 0 and a.prefix_len < a.prompt_len <= config.prompt_max
               for a in first)


def test_growth_and_undrained_tables_are_reported():
    report = LoadReport(LoadConfig(duration=4))
    base = {"t": 0.0, "rss_kib": 1000, "fds": 30, "sockets": 5, "engine_regions": 1, "engine_handles": 0,
            "tracked": 0, "lists": 0}
    report.resources["decode 0"] = [base, {**base, "t": 1.0}, {**base, "t": 4.0, "fds": 90, "sockets": 65,
                                                               "tracked": 3}]
    _check_resources(report)
    assert not report.ok
    assert any("fds grew from 30 to 90" in p for p in report.problems)
    assert any("did not drain" in p and "'tracked': 3" in p for p in report.problems)



def test_an_overloaded_run_refuses_the_excess_as_overload_and_every_table_drains():
    """Far more offered than this machine moves: each decode lets `queue` arrivals wait for a row and
    refuses the newest beyond at once (before any page is taken), so every failure is an ``overload``
    refusal, the requests admitted complete byte for byte, and nothing is left behind."""
    config = LoadConfig(rate=40.0, duration=2.0, decodes=2, device="cpu", fault_every=0, rows=2, queue=2,
                        prompt_median=48, prompt_max=96, chunk_tokens=32,
                        engine_extra=(("progress_thread", False),))
    report = run_load(config)
    assert report.ok, report.problems
    assert report.completed >= 1 and report.verified == report.completed
    assert set(report.failures) == {"overload"} and report.failures["overload"] >= report.requests // 2, report.failures
    assert report.completed + report.failures["overload"] == report.requests
    for who, samples in report.resources.items():  # the endpoints' tables drained
        assert samples[-1]["tracked" if who != "prefill" else "lists"] == 0
    decodes = [s for who, s in report.stats.items() if who != "prefill"]
    assert sum(s["failures"].get("overload", 0) for s in decodes) == report.failures["overload"]
    # where the completed requests' time went: every phase measured, none negative
    phases = report.phases_ms
    assert set(phases) == {"published->taken", "taken->last submitted", "last submitted->sent",
                           "last submitted->complete"}, phases
    assert all(0 <= v["p50"] <= v["p99"] for v in phases.values()), phases


def test_the_stand_in_writes_and_checks_a_turn_at_once_as_the_host_check_does_request_by_request():
    from kvplan.tools.load import Arrival
    from kvplan.tools.load_pools import Pools

    config = LoadConfig(layers=2, page_size=4, token_bytes=8, prompt_max=40, rows=3)
    pools = Pools(config, "cpu", 3)
    arrivals = [Arrival(0, "q0", 0.0, 30, 8, 0, None), Arrival(1, "q1", 0.0, 17, 0, 0, None)]
    held = [(a, *pools.take(a.prompt_len)) for a in arrivals]
    assert not pools.table.any()  # (taken rows reach the table at the next flush, in one copy)
    pools.flush()
    for a, row, pages in held:  # each token's slot: its page's, in order
        want = [p * 4 + k for p in pages for k in range(4)][: a.prompt_len]
        assert pools.table[row, : a.prompt_len].tolist() == want and not pools.table[row, a.prompt_len :].any()
    pools.write_many([(a, row, a.prefix_len, 20) for a, row, _ in held[:1]] +  # in two turns, chunked
                     [(a, row, 0, a.prompt_len) for a, row, _ in held[1:]])
    pools.write_many([(a, row, 20, a.prompt_len) for a, row, _ in held[:1]])
    for a, row, _ in held:
        pools.aux[row] = a.index % 251 + 1
    done = [(a, row) for a, row, _ in held]
    assert pools.check_many(done) == [True, True] == [pools.check(a, row) for a, row in done]
    slot = int(pools.table[held[1][1], 5])  # one byte of q1's token 5, in the last entry
    pools.kv[-1][slot // 4, slot % 4, 3] ^= 1
    assert pools.check_many(done) == [True, False] == [pools.check(a, row) for a, row in done]
    checked = pools.check_later(done, again=done[::-1])  # (the second way, for a sample, in the same answer)
    assert checked.ready() and checked.results() == ([True, False], [False, True])


def test_the_llama8b_preset_gives_each_token_an_8b_model_s_kv(capsys, monkeypatch):
    """``--preset llama8b``: Llama-3.1-8B's KV in bf16, 128 KiB a token (``--layers``/``--page-size`` still win)."""
    from kvplan.tools.load_config import KV_SHAPES
    from tests.tools.cli import run_cli

    layers, entry, page = KV_SHAPES["llama8b"]
    assert layers * 2 * entry == 128 << 10 and page == 16
    seen = {}
    monkeypatch.setattr("kvplan.tools.load.run_load", lambda config, **kw: seen.setdefault("config", config) and 1 / 0)
    for args, want in ((["--preset", "llama8b"], (32, 2048, 16)), (["--preset", "llama8b", "--layers", "2"], (2, 2048, 16)),
                       ([], (4, 64, 16))):
        seen.clear()
        try:
            run_cli(["load", "--device", "cpu", *args], capsys, monkeypatch)
        except ZeroDivisionError:
            pass
        config = seen["config"]
        assert (config.layers, config.token_bytes, config.page_size) == want, (args, config)
