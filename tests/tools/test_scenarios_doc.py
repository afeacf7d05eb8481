"""One list of scenarios: the bench's, the demo's presets and docs/benchmarks.md's table are the same."""

from pathlib import Path

from kvplan.cli import build_parser
from kvplan.tools.bench import SCENARIOS as BENCH
from kvplan.tools.scenarios import PRESETS, SCENARIOS, scenarios_table

DOC = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"
START = "<!-- scenarios: rendered from kvplan/tools/scenarios.py (SCENARIOS); tests/tools/test_scenarios_doc.py checks it -->\n"
END = "<!-- end of scenarios -->\n"


def test_docs_benchmarks_table_is_the_rendered_list_of_scenarios():
    text = DOC.read_text()
    assert START in text and END in text, "the table's markers moved"
    table = text[text.index(START) + len(START):text.index(END)]
    assert table == scenarios_table(), "docs/benchmarks.md's table differs from SCENARIOS: paste scenarios_table()"


def _choices(command: str, flag: str) -> list[str]:
    sub = build_parser()._subparsers._group_actions[0].choices[command]
    return next(a.choices for a in sub._actions if flag in a.option_strings)


def test_the_demo_and_the_bench_offer_every_scenario_and_only_those():
    assert list(BENCH) == list(SCENARIOS)
    assert list(_choices("bench", "--scenario")) == list(SCENARIOS)
    assert list(_choices("demo", "--preset")) == list(SCENARIOS)
    assert all(s.preset in PRESETS for s in SCENARIOS.values())
