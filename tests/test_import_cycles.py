"""No import circle under ``kvplan/``: every ``import`` and ``from ... import`` of a kvplan module, at
module level, inside a function (a lazy import is still a dependency) or under ``if TYPE_CHECKING:``
(a type-only import still says the two modules know each other), makes an edge; the graph must have
no cycle. The planner's rooms then show in its imports, folder by folder: the contract, the
reference, the device planner."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "kvplan"


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(tree: ast.AST):
    """Every import node, type-only ones included."""
    return (node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)))


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps = set()
        for node in _imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else node.module or ""
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            deps |= {t for t in targets if t in modules and t != name}
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, found, counter = {}, {}, set(), [], [], [0]
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_module_of_kvplan_imports_itself_back():
    assert cycles(import_graph()) == []


def test_the_walker_sees_a_lazy_cycle_and_a_type_only_import():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .x import Y\n"
                     "def f():\n    from .z import W\n")
    assert sorted(n.module for n in _imports(tree) if isinstance(n, ast.ImportFrom)) == ["typing", "x", "z"]
    graph = import_graph()
    assert "kvplan.planner.contract.state_kinds" in graph["kvplan.planner"]  # (the package registers the kinds)


# The planner's rooms (kvplan/planner/__init__.py), one folder each: each may import its own and those
# before it.
def test_the_planner_s_rooms_import_only_their_own_and_those_before():
    from kvplan.planner import ROOMS

    graph = import_graph()
    planner = sorted(n for n in graph if n.startswith("kvplan.planner."))
    room_of = {n: n.split(".")[2] for n in planner}
    assert set(room_of.values()) == set(ROOMS), "every planner module lives in one of the rooms' folders"
    assert sorted((ROOT / "planner").glob("*.py")) == [ROOT / "planner" / "__init__.py"], "no module outside a room"
    upward = [(m, d) for m in planner for d in graph[m]
              if d in room_of and ROOMS.index(room_of[d]) > ROOMS.index(room_of[m])]
    assert upward == [], f"a room imports one after it: {upward}"


# The package's layers (README, Layout): integrations and tools use transport, transport uses the
# planner, the planner uses kernels; never the other way.
LAYERS = ("kvplan.errors", "kvplan.env", "kvplan.kernels", "kvplan.compat", "kvplan.planner", "kvplan.transport",
          "kvplan.integrations", "kvplan.tools", "kvplan.cli")


def test_the_package_s_layers_point_one_way():
    def layer(name: str) -> int | None:
        return next((k for k, prefix in enumerate(LAYERS) if name == prefix or name.startswith(prefix + ".")), None)

    graph = import_graph()
    upward = [(m, d) for m, deps in graph.items() for d in deps
              if layer(m) is not None and layer(d) is not None and layer(d) > layer(m)]
    assert upward == [], f"a layer imports one above it: {upward}"
