"""``kvplan bench`` works end to end (tiny sizes in the interpreter; real numbers come from a GPU)."""

import json
import subprocess
import sys

import pytest

from kvplan.tools.bench import render, run_bench
from tests.tools.cli import plain_env, run_cli


def test_bench_rows_render_and_agree_with_the_baseline():
    names = ["llama70b-tp4to8-p64", "gptoss-swa-p16", "gptoss-swa-tp4to8-p16", "qwen3next-mamba-tp4to8-p64"]
    rows = run_bench(names, runs=1, scale=0.02)
    assert [r.scenario for r in rows] == names
    assert all(r.descriptors > 0 and r.kvplan_ms > 0 and r.baselines["numpy-batch"] > 0 for r in rows)
    assert all(r.ratios["descriptors"] > 0 for r in rows)
    table = render(rows)
    assert "llama70b-tp4to8-p64" in table and "Triton interpreter" in table


def test_bench_command_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, "-m", "kvplan", "bench", "--scenario", "qwen3next-mamba-p64", "--scale",
                           "0.02", "--runs", "1", "--json", str(out), "--no-progress"],
                          capture_output=True, text=True, timeout=300, env=plain_env())  # as a user's shell has it
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())
    assert rows[0]["scenario"] == "qwen3next-mamba-p64" and rows[0]["descriptors"] > 0
    assert {"numpy-batch", "prepared-ids", "sglang-loop"} <= set(rows[0]["baselines"])
    assert rows[0]["strongest_baseline"] == "numpy-batch" and "kvplan_graph_ms" in rows[0] and "floor_ms" in rows[0]


def test_bench_picks_a_small_scale_by_itself_without_a_gpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks a CPU machine's default")
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, "-m", "kvplan", "bench", "--scenario", "qwen3next-mamba-p64", "--runs", "1",
                           "--json", str(out), "--no-progress"], capture_output=True, text=True, timeout=300,
                          env=plain_env())
    assert done.returncode == 0 and "scaled by 0.02" in done.stderr, done.stderr
    assert json.loads(out.read_text())[0]["requests"] < 64


@pytest.mark.parametrize("args, message", [
    (["--scale", "0"], "must be in (0, 1]"),
    (["--scale", "1000"], "must be in (0, 1]"),
    (["--json", "/missing/dir/x.json"], "is not a folder this process can write to"),
])
def test_bench_options_that_cannot_run_are_refused_before_it_runs(args, message, capsys, monkeypatch):
    code, _, err = run_cli(["bench", "--no-progress", *args], capsys, monkeypatch)
    assert code == 2 and message in err, err
