"""Habits the house keeps that a test can hold (the linter holds the rest: ``make lint``)."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvplan"


def test_the_package_and_its_docs_name_no_issue_numbers():
    """Code and docs say what a thing does and why, not which issue asked for it (those numbers resolve
    nowhere in the repository). README.md and benchmarks/RESULTS.md keep their history for now."""
    pattern = re.compile(r"\bissues? \d+|\bissue-\d+", re.IGNORECASE)
    found = [f"{p.relative_to(ROOT)}:{n}" for p in [*PACKAGE.rglob("*.py"), *(ROOT / "docs").glob("*.md")]
             for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == [], f"issue numbers in code or docs: {found}"
