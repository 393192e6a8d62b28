"""No import cycle among quantpipe's modules, function-level imports included: a lazy import
that closes a cycle only hides it (docs/design.md)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "quantpipe"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def import_graph() -> dict[str, set[str]]:
    """module -> the quantpipe modules it imports anywhere in its body (a package's own
    submodules and its parents left out)."""
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for module, path in mods.items():
        package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = module.split(".") if package else module.split(".")[:-1]
                    anchor = anchor[:len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            else:
                continue
            for target in targets:
                found = resolve(target) if target.split(".")[0] == "quantpipe" else None
                if (found and found not in (module, "quantpipe") and not found.startswith(module + ".")
                        and not module.startswith(found + ".")):
                    graph[module].add(found)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_in_quantpipe():
    assert cycles(import_graph()) == []


def test_the_check_sees_a_cycle_closed_by_a_lazy_import():
    graph = import_graph()
    assert "quantpipe.errors" in graph["quantpipe.machine"]  # top-level imports are edges
    # A function-level import in quantpipe.machine (io.read_json inside load) is an edge too.
    assert "quantpipe.io" in graph["quantpipe.machine"]
    graph["quantpipe.errors"] = graph["quantpipe.errors"] | {"quantpipe.machine"}
    (cycle,) = cycles(graph)  # machine -> io -> errors -> machine, and machine -> errors
    assert {"quantpipe.errors", "quantpipe.machine", "quantpipe.io"} <= set(cycle)


# A stage script says what the stage does at a glance (DVC's example-get-started keeps its stage
# scripts at 50-100 lines); what it does in detail is the library's (docs/design.md).
MAX_STAGE_LINES = 100


def test_every_stage_script_reads_at_a_glance():
    long = {path.name: n for path in sorted((ROOT / "stages").glob("*.py"))
            if (n := len(path.read_text().splitlines())) > MAX_STAGE_LINES}
    assert not long, f"stage scripts over {MAX_STAGE_LINES} lines: {long}"
