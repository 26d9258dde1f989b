"""The CPU compatibility layer is test support: the backend itself never imports it."""

from __future__ import annotations

import ast
from pathlib import Path

BACKEND = Path(__file__).resolve().parents[2] / "src/ehp_fsm/backends/megatron"


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_backend_modules_never_import_the_cpu_compat_layer() -> None:
    modules = [p for p in BACKEND.rglob("*.py") if "testing" not in p.parts]
    assert {p.name for p in modules} >= {"backend.py", "state.py", "__init__.py"}
    for path in modules:
        bad = {n for n in _imports(path) if "testing" in n or "cpu_compat" in n}
        assert not bad, f"{path.name} imports {bad}"
