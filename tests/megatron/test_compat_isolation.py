"""The CPU compatibility layer (`backends/megatron/cpu.py`) is applied by the processes that run
Megatron on CPU, never by the backend itself: no backend module imports it, and the only runtime
module that does (`training/lanes.py`) applies it only for a pool whose device is the CPU."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src/ehp_fsm"
BACKEND = SRC / "backends/megatron"


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_backend_modules_never_import_the_cpu_layer() -> None:
    modules = [p for p in BACKEND.rglob("*.py") if p.name != "cpu.py"]
    assert {p.name for p in modules} >= {"backend.py", "state.py", "hf.py", "__init__.py"}
    for path in modules:
        bad = {n for n in _imports(path) if n.endswith(".cpu") or n.endswith("megatron.cpu")}
        assert not bad, f"{path.name} imports {bad}"


def test_only_the_lane_builder_applies_it_and_only_on_cpu() -> None:
    importers = [
        p.relative_to(SRC).as_posix()
        for p in SRC.rglob("*.py")
        if p.name != "cpu.py" and "ehp_fsm.backends.megatron.cpu" in _imports(p)
    ]
    assert importers == ["training/lanes.py"], importers
    tree = ast.parse((SRC / "training/lanes.py").read_text())
    guards = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.If)
        and ast.unparse(node.test) == "config.device == 'cpu'"
        and "cpu.apply()" in ast.unparse(node)
    ]
    assert len(guards) == 1, "cpu.apply() must sit under `if config.device == 'cpu'`"
