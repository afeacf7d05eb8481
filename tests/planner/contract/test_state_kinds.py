"""State kinds are described once (kvplan.planner.contract.state_kinds) and the device path is independent of the reference."""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest

from kvplan.errors import LayoutError
from kvplan.planner.contract.batch import Entry, StateComponent, StateKind
from kvplan.planner.contract.state_kinds import RULES, rules_of

PACKAGE = pathlib.Path(__file__).resolve().parents[3] / "kvplan"

# modules allowed to name a kind: the enum, its rules, and the independent baselines and presets
NAMES_KINDS = {"planner/contract/batch.py", "planner/contract/state_kinds.py", "tools/baseline.py", "tools/host_baselines.py",
               "tools/scenarios.py"}


def test_every_kind_has_rules_and_unknown_kinds_raise():
    assert set(RULES) == set(StateKind)
    for kind, rules in RULES.items():
        assert rules.kind is kind
    with pytest.raises(LayoutError, match="no rules"):
        rules_of("paged_attention_v9")


@pytest.mark.parametrize("kind", list(StateKind))
def test_component_validation_comes_from_the_kind(kind):
    rules = rules_of(kind)
    entries = (Entry(0x1000, 64, 16),)
    if rules.needs_window or rules.needs_ring:
        with pytest.raises(LayoutError):
            StateComponent(kind, entries, window=0, ring_size=0)
    comp = StateComponent(kind, entries, window=4, ring_size=4)
    if rules.needs_map:
        with pytest.raises(LayoutError, match="slot_map"):
            comp.require_map()
    else:
        comp.require_map()


@pytest.mark.parametrize("kind", list(StateKind))
def test_list_shape_counts_match_the_host_formula(kind):
    """The device's list shape and the host list agree in length for every kind and sequence length."""
    from kvplan.planner.contract.batch import Attention, KVLayout, SideMemory

    ps, rows, ctx = 4, 3, 64
    table = np.zeros((rows, ctx), np.int32)
    table[1] = np.arange(4 * ps, 4 * ps + ctx)
    slot_map = np.arange(4 * ps + ctx + 8, dtype=np.int64) if kind is StateKind.SWA else np.array([0, 5, 6])
    comp = StateComponent(kind, (Entry(0, 64, 256),), window=9, ring_size=16, slot_map=slot_map)
    side = SideMemory(KVLayout(Attention.MLA, ps, (Entry(0, 64, 256),)), (comp,), req_to_token=table)
    rules = rules_of(kind)
    for seq in (1, 4, 9, 10, 33, 64):
        shape = rules.list_shape(comp, ps, seq)
        ids = rules.host_list(side, comp, 1, seq, "r", "strict", True)
        assert shape.n == len(ids), (kind, seq)


def _imports(path: pathlib.Path) -> set[str]:
    """kvplan modules ``path`` imports, as paths relative to the package (``planner/contract/rules.py``)."""
    tree = ast.parse(path.read_text())
    here = path.relative_to(PACKAGE).parent
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = here
            for _ in range(node.level - 1):
                base = base.parent
            names = [node.module] if node.module else [a.name for a in node.names]
            for name in names:
                target = base.joinpath(*name.split("."))
                for candidate in (target.with_suffix(".py"), target / "__init__.py"):
                    if (PACKAGE / candidate).exists():
                        out.add(str(candidate))
    return out


def test_the_device_path_does_not_import_the_reference():
    seen, todo = set(), ["planner/device/planner.py", "planner/device/eager.py", "planner/device/destinations.py"]
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        todo.extend(m for m in _imports(PACKAGE / mod) if not m.endswith("__init__.py"))
    assert "planner/reference/oracle.py" not in seen
    assert "planner/contract/rules.py" in seen and "planner/contract/state_kinds.py" in seen  # the scan sees real imports


def test_only_the_kind_registry_branches_on_kinds():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        rel = str(path.relative_to(PACKAGE))
        if rel in NAMES_KINDS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "StateKind":
                offenders.append(f"{rel}:{node.lineno} StateKind.{node.attr}")
    assert not offenders, offenders


@pytest.mark.parametrize("kind", [StateKind.SWA, StateKind.DSA])
def test_lists_from_the_decode_prefix_are_sglang_s(kind):
    """``from_prefix``: SGLang 0.5.23's lists after a decode prefix P (window start max(P, seq - W), DSA
    pages of [P, seq)), by hand; without it the lists start at 0 (planning.md §6)."""
    from kvplan.planner.contract.batch import Attention, KVLayout, SideMemory

    ps, prefix, seq = 4, 8, 20
    table = np.zeros((3, 64), np.int32)
    table[1] = np.arange(4 * ps, 4 * ps + 64)  # row 1 holds pages 4, 5, 6, ...
    slot_map = np.arange(4 * ps + 72, dtype=np.int64) + 100  # slot s -> SWA slot s + 100 (SWA page p + 25)
    lists = {}
    for from_prefix in (False, True):
        comp = StateComponent(kind, (Entry(0, 64, 256),), window=16, slot_map=slot_map, from_prefix=from_prefix)
        side = SideMemory(KVLayout(Attention.MLA, ps, (Entry(0, 64, 256),)), (comp,), req_to_token=table)
        rules = rules_of(kind)
        ids = rules.host_list(side, comp, 1, seq, "r", "strict", True, prefix)
        shape = rules.list_shape(comp, ps, seq, prefix)
        assert shape.n == len(ids) and shape.a == rules.list_start(comp, ps, seq, prefix)
        lists[from_prefix] = ids.tolist()
    offset = 25 if kind is StateKind.SWA else 0
    # SWA: window start max(0, 20 - 16) = 4 -> pages of tokens 4..19; from the prefix: max(8, 4) = 8
    want = [5, 6, 7, 8] if kind is StateKind.SWA else [4, 5, 6, 7, 8]
    assert lists[False] == [p + offset for p in want]
    assert lists[True] == [p + offset for p in (6, 7, 8)]


@pytest.mark.parametrize("kind", [StateKind.SWA_RING, StateKind.MAMBA])
def test_only_swa_and_dsa_have_the_prefix_variant(kind):
    with pytest.raises(LayoutError, match="from_prefix"):
        StateComponent(kind, (Entry(0, 64, 16),), window=4, ring_size=4, from_prefix=True)


def test_sides_that_start_their_lists_differently_do_not_pair():
    from kvplan.planner.contract.batch import Attention, KVLayout, SideMemory
    from kvplan.planner.contract.pairing import pair_sides

    def side(from_prefix):
        comp = StateComponent(StateKind.DSA, (Entry(0, 64, 256),), from_prefix=from_prefix)
        return SideMemory(KVLayout(Attention.MLA, 4, (Entry(1 << 30, 64, 256),)), (comp,))

    pair_sides(side(True), side(True))
    with pytest.raises(LayoutError, match="from_prefix is True on the source and False"):
        pair_sides(side(True), side(False))
