"""Habits the house keeps that a test can hold (the linter holds the rest: ``make lint``)."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvplan"


def test_the_package_its_tests_and_its_docs_name_no_issue_numbers():
    """Code, tests and docs say what a thing does and why, not which issue asked for it (those numbers
    resolve nowhere in the repository). The history keeps them (results/archive/)."""
    pattern = re.compile(r"\bissues? \d+|\bissue-\d+", re.IGNORECASE)
    texts = [*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.md"), *(ROOT / "tests").rglob("*.py"),
             *(ROOT / "docs").glob("*.md"), ROOT / "README.md", ROOT / "benchmarks" / "RESULTS.md"]
    found = [f"{p.relative_to(ROOT)}:{n}" for p in texts
             for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == [], f"issue numbers in code or docs: {found}"


def test_the_docs_name_no_work_periods():
    """What a reader of the docs meets is dated, not numbered by the project's work periods (the work log
    keeps those: benchmarks/results/archive/WORKLOG.md). Paths of results folders may carry them."""
    pattern = re.compile(r"\bsessions? \d+", re.IGNORECASE)
    texts = [*(ROOT / "docs").glob("*.md"), ROOT / "README.md", ROOT / "CHANGELOG.md"]
    found = [f"{p.relative_to(ROOT)}:{n}" for p in texts
             for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == [], f"work periods named in the docs: {found}"


def test_no_module_of_the_package_is_over_600_lines():
    """A module holds one role; one that outgrows 600 lines has grown a second (split it by role, as
    the endpoints' ``*_messages.py`` and the SGLang manager's role halves are)."""
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 600}
    assert long == {}, f"modules over 600 lines: {long}"


def test_no_sender_reaches_into_the_endpoint():
    """The senders see the prefill endpoint only through their context (``senders/context.py``): no
    private member of it, no import of its module."""
    reach = re.compile(r"\bep\._\w+|from \.\.prefill import")
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in (PACKAGE / "transport" / "senders").glob("*.py")
             for n, line in enumerate(p.read_text().splitlines(), 1) if reach.search(line.split("#")[0])]
    assert found == [], f"a sender reaches into the endpoint: {found}"


def test_each_probe_says_its_question_and_its_answer():
    """``benchmarks/probes/`` holds one-off measurements, apart from the suites; each opens with the
    question it asked and the answer it gave (or where the answer is)."""
    import ast

    probes = [p for p in (ROOT / "benchmarks" / "probes").glob("*.py") if p.name != "__init__.py"]
    assert probes
    silent = [p.name for p in probes if "Answer" not in (ast.get_docstring(ast.parse(p.read_text())) or "")]
    assert silent == [], f"probes without their answer: {silent}"
