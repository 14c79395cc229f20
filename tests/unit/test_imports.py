"""No import circles in llmtune: the module graph, built with `ast` from the source, has no cycle.

Two graphs are checked:
- runtime module-level imports (what Python executes when a module is imported; imports under
  `if TYPE_CHECKING:` are not executed and are left out): no cycle at all;
- every import, function-level and type-only included (a circle through a lazy import is still a circle for
  whoever reads the code): no cycle beyond the few listed in KNOWN, each with the reason it is still there.

A module's edges go to the modules it names: `from llmtune.launch import lobby` to llmtune.launch.lobby,
`from llmtune.plan import make_plan` to the package llmtune.plan. Parent packages that Python runs on the way
are not edges (a package's __init__ importing its own submodules is not a circle for a reader).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "llmtune"

# Cycles that pass only through function-level or type-only imports, in files this test's authors don't own.
# Remove an entry once its cycle is gone; never add one for a module-level cycle.
KNOWN: set[frozenset[str]] = set()


def module_names(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the package root."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def import_graph(root: Path, function_level: bool) -> dict[str, set[str]]:
    """Module -> modules of the same package it imports. function_level=False: runtime module-level imports only."""
    modules = module_names(root)
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        graph[name] = {edge for edge in _imports(tree, package, modules, function_level) if edge != name}
    return graph


def _imports(tree: ast.Module, package: str, modules: dict[str, Path], function_level: bool) -> set[str]:
    edges: set[str] = set()
    pending: list[tuple[ast.AST, bool]] = [(tree, False)]  # (node, inside a function or a TYPE_CHECKING block)
    while pending:
        node, lazy = pending.pop()
        if lazy and not function_level:
            continue
        if isinstance(node, ast.Import):
            edges.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from this module's package, up level-1 steps
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            for alias in node.names:
                target = f"{base}.{alias.name}"
                edges.add(target if target in modules else base)
        if isinstance(node, ast.If) and _is_type_checking(node):  # its `else:` runs; its body does not
            pending.extend((child, True) for child in node.body)
            pending.extend((child, lazy) for child in node.orelse)
            continue
        inner = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        pending.extend((child, inner) for child in ast.iter_child_nodes(node))
    return {edge for edge in edges if edge in modules}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected group of modules, as a path [a, b, ..., a]; [] when there is none."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def connect(node: str) -> None:  # Tarjan's algorithm (graphs here are a few hundred modules deep at most)
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1 or node in graph.get(node, ()):
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [_cycle_in(graph, group) for group in groups]


def _cycle_in(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A concrete path around a strongly connected group: breadth-first from its first member back to it."""
    start = min(group)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph.get(node, set()) & group):
                if target == start:
                    path = [start]
                    while node != start:
                        path.append(node)
                        node = came_from[node]
                    return [start, *reversed(path[1:]), start]
                if target not in came_from:
                    came_from[target] = node
                    following.append(target)
        frontier = following
    raise AssertionError(f"{sorted(group)} is not strongly connected")


def _describe(cycles: list[list[str]]) -> str:
    return "; ".join(" -> ".join(cycle) for cycle in cycles)


# ------------------------------------------------------------------------------------ the finder can fail
def test_cycle_finder_names_the_cycle_of_a_small_graph():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []
    assert find_cycles({"x": {"x"}}) == [["x", "x"]]
    two = find_cycles({"a": {"b"}, "b": {"a"}, "p": {"q"}, "q": {"r"}, "r": {"p"}})
    assert sorted(two) == [["a", "b", "a"], ["p", "q", "r", "p"]]


def test_graph_builder_tells_module_level_from_function_level_imports(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from pkg.sub import low\n")
    (package / "top.py").write_text(
        "from typing import TYPE_CHECKING\nimport pkg.sub.low\n"
        "if TYPE_CHECKING:\n    from pkg.other import Thing\n"
        "def later():\n    from pkg import other\n"
    )
    (package / "sub" / "low.py").write_text("from .. import top\n")  # relative, module-level: a real circle
    (package / "other.py").write_text("import json\n")
    runtime = import_graph(package, function_level=False)
    assert runtime["pkg.top"] == {"pkg.sub.low"}
    assert runtime["pkg.sub.low"] == {"pkg.top"} and runtime["pkg.sub"] == {"pkg.sub.low"}
    assert find_cycles(runtime) == [["pkg.sub.low", "pkg.top", "pkg.sub.low"]]
    every = import_graph(package, function_level=True)
    assert every["pkg.top"] == {"pkg.sub.low", "pkg.other"}


# ------------------------------------------------------------------------------------ llmtune itself
def test_module_level_imports_of_llmtune_form_no_cycle():
    graph = import_graph(ROOT, function_level=False)
    assert len(graph) > 50 and graph["llmtune.launch.runner"]  # the builder did see the package
    cycles = find_cycles(graph)
    assert not cycles, f"import cycle(s) at module level: {_describe(cycles)}"


def test_lazy_imports_of_llmtune_add_no_new_cycle():
    graph = import_graph(ROOT, function_level=True)
    cycles = [cycle for cycle in find_cycles(graph) if frozenset(cycle) not in KNOWN]
    assert not cycles, f"import cycle(s) through function-level or type-only imports: {_describe(cycles)}"
