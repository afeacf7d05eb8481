"""The control messages' registry (kvplan/transport/control_messages.py): docs/transport.md's table is its
rendering, and the endpoints name every kind through it, never by a string of their own."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from kvplan.transport.control_messages import MESSAGES, Kind, markdown_table

ROOT = Path(__file__).resolve().parents[2]


def test_the_docs_table_is_the_registry_s():
    text = (ROOT / "docs" / "transport.md").read_text()
    table = re.search(r"<!-- control messages -->\n(.*?)\n<!-- end of control messages -->", text, re.S).group(1)
    assert table == markdown_table(), "docs/transport.md's table differs from control_messages.py: render it again"


def test_every_kind_has_its_record_and_travels_as_its_string():
    assert set(MESSAGES) == set(Kind)
    for kind, message in MESSAGES.items():
        assert message.kind is kind and message.sender in ("decode", "prefill") and message.fields
        assert kind == kind.value and f"{kind}" == kind.value and kind.encode() == kind.value.encode()


def _kind_literals(path: Path) -> list[str]:
    """String literals a module sends on a channel (``x.send("kind", ...)``) or compares a kind to."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "send" \
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            found.append(f"{path.name}: send({node.args[0].value!r})")
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Name) and node.left.id == "kind":
            found += [f"{path.name}: kind == {c.value!r}" for c in node.comparators
                      if isinstance(c, ast.Constant) and isinstance(c.value, str) and not c.value.startswith("_")]
    return found


def test_the_endpoints_name_kinds_only_through_the_registry():
    endpoints = [p for p in (ROOT / "kvplan" / "transport").rglob("*.py")
                 if not p.name.startswith(("control", "listener"))]  # (the channel itself and its handshake)
    endpoints += [ROOT / "kvplan" / "integrations" / "sglang" / "decode_manager.py",
                  ROOT / "kvplan" / "integrations" / "vllm" / "decode_pairing.py"]
    found = [hit for p in endpoints for hit in _kind_literals(p)]
    assert found == [], f"control kinds named by a string of their own: {found}"


def test_the_walker_sees_a_literal_kind(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('ch.send("abort", {})\nif kind == "paired":\n    pass\nif kind == "_hello":\n    pass\n'
                      'ch.send(Kind.ABORT, {})\n')
    assert _kind_literals(sample) == ["sample.py: send('abort')", "sample.py: kind == 'paired'"]
