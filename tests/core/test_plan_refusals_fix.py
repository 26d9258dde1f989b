"""Every refusal of a plan key says what to do: each `_Reader.err(key, why, fix)` in `plan.py`
is given its fix (32 said only what was wrong — "must be 'cpu' or 'cuda'", "a plan needs at
least one [[hosts]] entry" — where every other refusal of the project ends in "Fix: ...")."""

from __future__ import annotations

import ast
from pathlib import Path

import ehp_fsm.plan

PLAN_PY = Path(ehp_fsm.plan.__file__)


def test_every_plan_key_refusal_is_given_a_fix() -> None:
    src = PLAN_PY.read_text()
    missing = [
        f"line {node.lineno}: {ast.get_source_segment(src, node)}"
        for node in ast.walk(ast.parse(src))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "err"
        and len(node.args) < 3
        and not node.keywords
        and not any(isinstance(a, ast.Starred) for a in node.args)
    ]
    assert not missing, "\n".join(missing)
