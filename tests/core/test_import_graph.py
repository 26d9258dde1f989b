"""No import cycles among the modules of `src/ehp_fsm`.

The graph is read from the source with `ast`, not from `sys.modules`: every `import` and
`from ... import` counts wherever it stands — inside a function, or under `if TYPE_CHECKING:` (a
cycle of types is still a cycle of design). Relative imports are resolved against the importing
module; `from pkg import sub` counts as importing the module `pkg.sub` (and `pkg` itself), and a
name that is not a module counts as its nearest enclosing module. A module importing its own
package (`ehp_fsm.runtime.agent` → `ehp_fsm.runtime`) is not an edge: Python has already run
that `__init__` by the time the module is imported.
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "ehp_fsm"


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name → file, for every `.py` file under the package directory `root`."""
    mods: dict[str, Path] = {}
    for f in sorted(root.rglob("*.py")):
        parts = list(f.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = f
    return mods


def _imported_names(module: str, is_package: bool, node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            here = module.split(".") if is_package else module.split(".")[:-1]
            here = here[: len(here) - (node.level - 1)]
            base = ".".join([*here, base] if base else here)
        return [base, *(f"{base}.{alias.name}" for alias in node.names)]
    return []


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module → the modules of the same package tree it imports."""
    mods = module_files(root)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for module, path in mods.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            for name in _imported_names(module, is_package, node):
                while name and name not in mods:
                    name = name.rpartition(".")[0]
                if name and name != module and not module.startswith(name + "."):
                    edges[module].add(name)
    return edges


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative): the components of more than one module, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, successors = work[-1]
            for w in successors:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[v])
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
    return sorted(found)


def shortest_cycle(edges: dict[str, set[str]], component: list[str]) -> list[str]:
    """One shortest cycle through the component's first module, as a path that ends where it
    starts (breadth-first search inside the component)."""
    inside = set(component)
    start = component[0]
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(edges[v] & inside):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if w not in came_from:
                came_from[w] = v
                queue.append(w)
    raise AssertionError(f"{component} is not strongly connected")


def describe(edges: dict[str, set[str]], components: list[list[str]]) -> str:
    lines = []
    for component in components:
        lines.append(f"cycle among {', '.join(component)}:")
        lines.append("    " + " -> ".join(shortest_cycle(edges, component)))
    return "\n".join(lines)


def test_src_has_no_import_cycle() -> None:
    edges = import_graph(SRC)
    assert "ehp_fsm.plan" in edges and "ehp_fsm.core.world" in edges  # it read the package
    cycles = strongly_connected(edges)
    report = describe(edges, cycles)
    if report:
        print(report)
    why = "import cycles in src/ehp_fsm (break each: move what both sides need, or compose)"
    assert cycles == [], f"{why}:\n{report}"


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_graph_counts_relative_type_checking_and_submodule_imports(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from .sub import b\n",
            "pkg/sub/__init__.py": "from pkg.sub.c import C\n",
            "pkg/sub/b.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import X\n"
            ),
            "pkg/sub/c.py": "import pkg.sub\ndef f():\n    from pkg import d\nC = 1\n",
            "pkg/d.py": "import os\nfrom pkg.sub.c import C as _C\n",
        },
    )
    edges = import_graph(tmp_path / "pkg")
    assert edges == {
        "pkg": set(),
        "pkg.a": {"pkg.sub", "pkg.sub.b"},
        "pkg.sub": {"pkg.sub.c"},
        "pkg.sub.b": {"pkg.a"},
        "pkg.sub.c": {"pkg.d"},  # its own package is not an edge
        "pkg.d": {"pkg.sub.c"},
    }
    cycles = strongly_connected(edges)
    assert cycles == [["pkg.a", "pkg.sub.b"], ["pkg.d", "pkg.sub.c"]]
    assert shortest_cycle(edges, cycles[0]) == ["pkg.a", "pkg.sub.b", "pkg.a"]
