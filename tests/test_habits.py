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
