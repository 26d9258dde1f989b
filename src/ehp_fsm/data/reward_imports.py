"""The user's own modules a reward's module imports, the packages it is in, and the digest of a
source file: what `rewards.reward_code` holds a resume to besides the reward's module itself.

Knows: import statements, read from the source with `ast` (nothing is imported for this); the
folder a module was imported from (its `sys.path` entry); which imported names are modules of
that folder; the bounds that keep the scan short whatever the folder holds (`MAX_LOCAL_MODULES`,
`MAX_SOURCE_BYTES`, `MAX_SCANNED_BYTES`). A source file is read only when it is a regular file
(a FIFO named `helper.py` is not waited on, a link to `/dev/zero` not read) and only within
those bounds. Does not know: rewards, plans, resumes.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib.util
import os
import sys
import sysconfig
from collections import deque
from pathlib import Path
from typing import Final

from ehp_fsm.fspaths import open_regular, path_kind, read_regular

#: At most this many of the user's modules are followed from a reward's module (a reward in a
#: large source tree is held by the first this many it reaches).
MAX_LOCAL_MODULES: Final = 1000
#: A source file larger than this is held by its digest, but the imports in it are not
#: followed: parsing runs at a few MB/s, and the user's own modules are far smaller (a
#: generated one may not be).
MAX_SOURCE_BYTES: Final = 1 << 20
#: The most source, all files together, parsed for their imports (~1 s of `ast.parse` at
#: most); the files found by then are held, no further ones.
MAX_SCANNED_BYTES: Final = 4 << 20
#: A dotted name longer than a path may be (Linux's PATH_MAX) names no module file.
_LONGEST_NAME: Final = 4096


def source_digest(path: Path) -> str | None:
    """The digest ("sha256:<hex>") of the regular file at `path`; None when it cannot be read
    or is not a regular file (a FIFO put there since: its open waited for a writer for ever)."""
    try:
        with open_regular(path) as fh:
            return "sha256:" + hashlib.file_digest(fh, "sha256").hexdigest()
    except OSError:
        return None


def local_imports(module_name: str, file: Path) -> list[Path]:
    """The source files of the modules `file` (module `module_name`) imports that lie in the
    folder it was imported from (its `sys.path` entry: the plan's folder, a PYTHONPATH folder),
    and theirs, transitively, in the order found — read from their import statements, anywhere
    in a file (functions included). A resume held to the reward module's own file alone went
    on without a word when a helper module beside it (`from my_helpers import parse`) was
    edited. Nothing is followed from a module of the standard library or of an installed
    package: their code is the environment's, as numpy's or torch's is. Bounded: at most
    `MAX_LOCAL_MODULES` files; a file over `MAX_SOURCE_BYTES`, one that does not parse (nested
    past the parser's depth included) or one past `MAX_SCANNED_BYTES` in all is held, its
    imports not followed."""
    root = _import_root(module_name, file)
    if root is None or _installed(root):
        return []
    return _Scan(root).follow(module_name, file.resolve())


def enclosing_packages(module_name: str, file: Path) -> list[tuple[Path, str]]:
    """The `__init__.py` of each package above `module_name` (at `file`), outermost first, with
    its module's name: importing `pkg.rewards` runs `pkg/__init__.py` first, and a reward named
    `pkg.rewards:score` was held by `rewards.py` alone (its package's `__init__.py`, setting
    what the reward reads, edited between a kill and its resume went on without a word).
    Nothing for a module of the standard library or an installed package (`local_imports`)."""
    root = _import_root(module_name, file)
    if root is None or _installed(root):
        return []
    parts = module_name.split(".")[:-1]  # (a package's own `__init__.py` is `file`)
    out: list[tuple[Path, str]] = []
    folder = root
    for i, part in enumerate(parts):
        folder = folder / part
        init = folder / "__init__.py"
        if _is_file(init):  # (a namespace package has none)
            out.append((init, ".".join(parts[: i + 1])))
    return out


class _Scan:
    """One walk of a reward's imports under `root`, remembering what each name resolved to
    (a name a thousand modules import is looked up once) and how much source it has parsed."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.left = MAX_SCANNED_BYTES
        self._tops: dict[str, bool] = {}
        self._files: dict[str, tuple[list[tuple[Path, str]], Path | None]] = {}
        self._entries: frozenset[str] | None = None  # the names in `root`, read once
        self._listed = False  # (a folder that cannot be listed: each name is looked at)

    def follow(self, module_name: str, file: Path) -> list[Path]:
        found: dict[Path, None] = {}
        todo = deque([(module_name, file)])
        while todo and len(found) < MAX_LOCAL_MODULES:
            name, path = todo.popleft()
            for imported, subs in self._imports(name, path):
                files, folder = self._module_files(imported)
                if folder is not None and subs:  # `from pkg import b`: b may be a module
                    files = files + [f for sub in subs if (f := _submodule(folder, imported, sub))]
                for candidate, its_name in files:
                    if candidate not in found and candidate != file:
                        found[candidate] = None
                        todo.append((its_name, candidate))
        return list(found)[:MAX_LOCAL_MODULES]

    def _imports(self, module_name: str, file: Path) -> list[tuple[str, tuple[str, ...]]]:
        """`file`'s import statements, anywhere in it, as (absolute dotted name, the names
        imported from it): `import a.b` is ("a.b", ()), `from a import b, c` ("a", ("b", "c")).
        Nothing when it is not a regular file, is past the bounds (`MAX_SOURCE_BYTES`, what is
        left of `MAX_SCANNED_BYTES`), or does not parse."""
        try:
            source = read_regular(file, min(MAX_SOURCE_BYTES, self.left))
        except (OSError, ValueError):  # not a file (a FIFO, a folder), or too large
            return []
        self.left -= len(source)
        try:
            tree = ast.parse(source, filename=str(file))
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return []  # ("-" * 200_000 + "1": MemoryError; "a." * 200_000: RecursionError)
        return _import_statements(module_name, file, tree)

    def _module_files(self, name: str) -> tuple[list[tuple[Path, str]], Path | None]:
        """The files under `root` that importing `name` runs (each package's `__init__.py` on
        the way, the module's own file), each with its module's name, and the folder `name`
        is when it is a package (None when it is a module, or not found); nothing when `name`'s
        top-level module is not the one in `root` (a name Python finds first elsewhere: `json`
        beside `json.py` of the plan's folder is the standard library's)."""
        if (known := self._files.get(name)) is not None:
            return known
        parts = name.split(".") if len(name) <= _LONGEST_NAME else []
        out: list[tuple[Path, str]] = []
        folder: Path | None = None
        if parts and self._top_is_local(parts[0]):
            folder = self.root
            for i, part in enumerate(parts):
                its_name = ".".join(parts[: i + 1])
                if (found := _submodule(folder, its_name.rpartition(".")[0], part)) is not None:
                    out.append(found)
                    if found[0].name != "__init__.py":
                        folder = None  # a module, not a package: a name after it is an attribute
                        break
                elif not _is_folder(folder / part):
                    folder = None
                    break
                folder = folder / part
        self._files[name] = (out, folder)
        return out, folder

    def _top_is_local(self, top: str) -> bool:
        """Importing the top-level module `top` finds the one in `root`. A name with nothing
        of that name in `root` (its listing, read once) is not looked up at all (`find_spec`
        searches every `sys.path` entry: ~0.1 ms a name, seconds for a tree of modules
        importing thousands)."""
        if (known := self._tops.get(top)) is not None:
            return known
        if not self._listed:
            self._listed = True
            with contextlib.suppress(OSError):
                self._entries = frozenset(os.listdir(self.root))
        local = False
        named = self._entries is None or top in self._entries or f"{top}.py" in self._entries
        if named and (_is_file(self.root / f"{top}.py") or _is_folder(self.root / top)):
            where = _where_imported(top)
            try:
                local = where is not None and self.root in Path(where).resolve().parents
            except OSError:
                local = False
        self._tops[top] = local
        return local


def _where_imported(top: str) -> str | None:
    """The file or folder the top-level module `top` is (or would be) imported from."""
    module = sys.modules.get(top)
    if module is not None:
        return getattr(module, "__file__", None) or next(
            iter(getattr(module, "__path__", [])), None
        )
    try:
        spec = importlib.util.find_spec(top)  # a top-level name: nothing runs
    except Exception:  # a broken path hook or finder: not followed
        return None
    if spec is None:
        return None
    return (
        spec.origin
        if spec.has_location
        else next(iter(spec.submodule_search_locations or []), None)
    )


def _is_file(path: Path) -> bool:
    return path_kind(path) == "a file"


def _is_folder(path: Path) -> bool:
    return path_kind(path) == "a folder"


def _submodule(folder: Path, package: str, name: str) -> tuple[Path, str] | None:
    """The file of module `name` in the package folder `folder` (package `package`, "" at the
    top): its `__init__.py` when it is a package, else its `.py`; None when it has neither."""
    init, plain = folder / name / "__init__.py", folder / f"{name}.py"
    its_name = f"{package}.{name}" if package else name
    if _is_file(init):
        return init, its_name
    if _is_file(plain):
        return plain, its_name
    return None


def _import_statements(
    module_name: str, file: Path, tree: ast.AST
) -> list[tuple[str, tuple[str, ...]]]:
    """See `_Scan._imports`. The names after `from a import` are kept apart, never joined to
    `a`: `from <a name of 500 KB> import b0, ..., b99999` (1 MB of source) made 100,000 names
    of 500 KB, 50 GB, before any was looked at."""
    package = module_name if file.name == "__init__.py" else module_name.rpartition(".")[0]
    out: dict[tuple[str, tuple[str, ...]], None] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(dict.fromkeys((alias.name, ()) for alias in node.names))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".") if package else []
                if node.level - 1 > len(parts) or not parts:
                    continue  # beyond the top package: Python refuses it too
                base = ".".join(parts[: len(parts) - (node.level - 1)])
                base = f"{base}.{node.module}" if node.module else base
            elif node.module:
                base = node.module
            else:
                continue
            out[base, tuple(a.name for a in node.names if a.name != "*")] = None
    return list(out)


def _import_root(module_name: str, file: Path) -> Path | None:
    """The folder `module_name` was imported from (`a.b` at `/x/a/b.py`: `/x`)."""
    depth = module_name.count(".") + (1 if file.name == "__init__.py" else 0)
    try:
        return file.resolve().parents[depth]
    except (IndexError, OSError):
        return None


def _installed(folder: Path) -> bool:
    """`folder` is (or lies in) the standard library or a site-packages folder."""
    roots = {sysconfig.get_path(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    for r in filter(None, roots):
        try:
            if folder == Path(r).resolve() or Path(r).resolve() in folder.parents:
                return True
        except OSError:
            continue
    return any(part in ("site-packages", "dist-packages") for part in folder.parts)
