"""Each module of hf_zero3_loader/ uses only the modules below it: no import cycle, counting imports at module level
and inside functions alike (a function-local import that closes a circle is still a circle). Reads the sources with
`ast`; imports nothing of the package, so it runs in a fraction of a second."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "hf_zero3_loader"


def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported package module: line of the first such import}."""
    modules = _modules()
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[:len(package) - node.level + 1] if node.level else [])
                base = ".".join(p for p in (base, node.module or "") if p)
                # `from . import x` names a module; `from .m import f` names something in m
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            else:
                continue
            for target in targets:
                while target not in modules and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in modules and target != name:
                    edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_the_package():
    graph = import_graph()
    assert "hf_zero3_loader.planner.plan" in graph and "hf_zero3_loader.reader" in graph
    assert "hf_zero3_loader.read_item" in graph["hf_zero3_loader.reader"]
    assert "hf_zero3_loader.planner.ops" in graph["hf_zero3_loader.planner.plan"]


def test_no_import_cycle_inside_the_package():
    graph = import_graph()
    found = cycles(graph)
    details = [" <-> ".join(c) + ": " + "; ".join(f"{a} -> {b} (line {graph[a][b]})" for a in c for b in graph[a]
                                                   if b in c) for c in found]
    assert not found, "import cycles:\n" + "\n".join(details)


def test_the_private_api_modules_are_the_bottom_layer():
    """`_transformers_private` and `_deepspeed_private` use nothing of the package but its errors and the declaration
    of the private hooks they touch (`_hooks`, which uses nothing of the package)."""
    graph = import_graph()
    assert not graph["hf_zero3_loader._hooks"], graph["hf_zero3_loader._hooks"]
    for name in ("hf_zero3_loader._transformers_private", "hf_zero3_loader._deepspeed_private"):
        assert set(graph[name]) <= {"hf_zero3_loader.errors", "hf_zero3_loader._hooks"}, (name, graph[name])


def test_the_detector_finds_a_cycle():
    assert cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c"]]


def test_the_module_map_in_the_design_doc_is_the_layering():
    """docs/design.md lists every module, each after every package module it imports."""
    import re

    graph = import_graph()
    text = (PACKAGE.parent / "docs" / "design.md").read_text()
    rows = re.findall(r"^\| `([^`]+)` \|", text.split("## Module map", 1)[1], re.M)
    listed: list[list[str]] = []
    for row in rows:
        if row == "__init__.py":
            listed.append(["hf_zero3_loader"])
        elif row.endswith("/"):  # a subpackage: all its modules
            prefix = "hf_zero3_loader." + row.rstrip("/").replace("/", ".")
            listed.append([m for m in graph if m == prefix or m.startswith(prefix + ".")])
        else:
            listed.append(["hf_zero3_loader." + row.removesuffix(".py").replace("/", ".")])
    seen: set[str] = set()
    out_of_order = []
    for group in listed:
        for name in group:
            assert name in graph, f"docs/design.md lists {name}, which does not exist"
            out_of_order += [f"{name} imports {d}, listed after it" for d in graph[name] if d not in seen | set(group)]
        seen.update(group)
    assert not out_of_order, out_of_order
    unlisted = set(graph) - seen - {"hf_zero3_loader.planner"}  # planner/__init__.py is empty
    assert not unlisted, f"modules missing from docs/design.md's module map: {sorted(unlisted)}"
