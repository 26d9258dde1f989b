"""The error tree drawn in `ehp_fsm.errors`'s docstring is the tree the code defines.

The drawing is read by indentation: one class per line, its depth the width of the tree prefix
(`├── `, `│   `, ... four columns a level), its parent the nearest line above it one level up,
and a trailing `(module)` naming the module that defines it relative to `ehp_fsm` (none: the
errors module itself). The code's tree is every subclass of `EhpError` defined anywhere in
`ehp_fsm` (every module is imported, torch and Megatron-Core included) with its direct base.
Adding, moving or re-parenting an error class without redrawing the tree fails here.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import warnings
from dataclasses import dataclass

import ehp_fsm
from ehp_fsm import errors
from ehp_fsm.errors import EhpError

_LINE = re.compile(
    r"^(?P<prefix>(?:[│ ]   )*(?:[├└]── )?)"  # the tree drawing, four columns a level
    r"(?P<name>[A-Z]\w*)"
    r"(?P<rest>.*?)"  # what it means
    r"(?:\((?P<module>[a-z_][\w.]*)\))?$"  # where it is defined
)


@dataclass(frozen=True)
class Drawn:
    parent: str | None
    module: str


def drawn_tree(doc: str) -> dict[str, Drawn]:
    """Class name → (parent, module) as the docstring draws them. The drawing is the indented
    block that starts with `EhpError` and ends at the first blank line."""
    lines = doc.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("EhpError"))
    indent = len(lines[start]) - len(lines[start].lstrip())
    tree: dict[str, Drawn] = {}
    path: list[str] = []  # the names on the way down to the current line
    for number, line in enumerate(lines[start:], start=start + 1):
        if not line.strip():
            break
        match = _LINE.match(line[indent:])
        assert match is not None, f"docstring line {number} is not `<tree prefix>Name ...`: {line}"
        prefix, name = match["prefix"], match["name"]
        depth = len(prefix) // 4
        assert depth <= len(path), f"docstring line {number} skips a level: {line}"
        assert name not in tree, f"{name} is drawn twice (line {number})"
        assert (depth == 0) == (not tree), f"docstring line {number}: one root, drawn first"
        del path[depth:]
        parent = path[-1] if path else None
        tree[name] = Drawn(parent, match["module"] or "errors")
        path.append(name)
    return tree


def _subclasses(cls: type) -> set[type]:
    found: set[type] = set()
    for sub in cls.__subclasses__():
        found |= {sub, *_subclasses(sub)}
    return found


def defined_tree() -> dict[str, Drawn]:
    """Class name → (direct base, module) for `EhpError` and every subclass `ehp_fsm` defines."""
    with warnings.catch_warnings():
        # Megatron-Core and torch warn on import (Apex/TE fallbacks, deprecations): not our subject
        warnings.simplefilter("ignore")
        for info in pkgutil.walk_packages(ehp_fsm.__path__, "ehp_fsm."):
            importlib.import_module(info.name)
    tree: dict[str, Drawn] = {"EhpError": Drawn(None, "errors")}
    for cls in _subclasses(EhpError):
        if not cls.__module__.startswith("ehp_fsm."):
            continue  # a test's own subclass
        bases = [b.__name__ for b in cls.__bases__ if issubclass(b, EhpError)]
        assert len(bases) == 1, f"{cls.__module__}.{cls.__name__} has EhpError bases {bases}"
        assert cls.__name__ not in tree, f"two error classes are named {cls.__name__}"
        tree[cls.__name__] = Drawn(bases[0], cls.__module__.removeprefix("ehp_fsm."))
    return tree


def test_the_drawn_error_tree_is_the_defined_one() -> None:
    assert errors.__doc__ is not None
    drawn, defined = drawn_tree(errors.__doc__), defined_tree()
    missing = sorted(set(defined) - set(drawn))
    extra = sorted(set(drawn) - set(defined))
    moved = sorted(
        f"{name}: drawn {drawn[name]}, defined {defined[name]}"
        for name in set(drawn) & set(defined)
        if drawn[name] != defined[name]
    )
    assert (missing, extra, moved) == ([], [], []), (
        "redraw the tree in ehp_fsm/errors.py's docstring:\n"
        f"  not drawn: {missing}\n  drawn but not defined: {extra}\n  misplaced: {moved}"
    )


def test_the_reader_takes_parents_from_indentation() -> None:
    doc = """Tree:

    EhpError                 root
    ├── AError               a                      (a.mod)
    │   ├── BError                                  (a.mod)
    │   │   └── CError       c (not a module)
    │   └── DError
    └── EError               e                      (e)

Prose.
"""
    assert drawn_tree(doc) == {
        "EhpError": Drawn(None, "errors"),
        "AError": Drawn("EhpError", "a.mod"),
        "BError": Drawn("AError", "a.mod"),
        "CError": Drawn("BError", "errors"),
        "DError": Drawn("AError", "errors"),
        "EError": Drawn("EhpError", "e"),
    }
