"""The planner is pure: its modules import no clock, I/O, logging, randomness or torch."""

from __future__ import annotations

import ast
from pathlib import Path

import ehp_fsm.core.planner as planner

ALLOWED = {
    "__future__",
    "collections",
    "collections.abc",
    "dataclasses",
    "functools",
    "heapq",
    "itertools",
    "math",
    "statistics",
    "typing",
    "ehp_fsm.errors",
    "ehp_fsm.core.planner_alloc",
    "ehp_fsm.core.planner_model",
    "ehp_fsm.core.planner_predict",
}


def test_planner_modules_import_only_pure_modules() -> None:
    core = Path(planner.__file__).parent
    files = sorted(core.glob("planner*.py"))
    assert len(files) >= 3
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name in ALLOWED, f"{path.name} imports {name}"
