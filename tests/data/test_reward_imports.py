"""The user's modules a reward imports, as `reward_code` holds a resume to them: the scan of
their import statements stays short and never fails, whatever the plan's folder holds (a helper
nested past the parser's depth, source files of megabytes, thousands of imported names, a FIFO
where a helper's source is)."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ehp_fsm.data.rewards import reward_code


@pytest.fixture
def tag() -> Iterator[str]:
    """A fresh module-name prefix; its modules leave `sys.modules` (and `sys.path`) after."""
    name = f"ehp_ri_{uuid.uuid4().hex[:8]}"
    path = list(sys.path)
    yield name
    for module in [m for m in sys.modules if m.startswith(name)]:
        del sys.modules[module]
    sys.path[:] = path


def _reward(folder: Path, tag: str, *imported: str) -> str:
    """A reward module in `folder` that imports `imported` when first called (so none is
    imported by resolving it): its "module:callable"."""
    lines = "".join(f"    import {name}\n" for name in imported)
    (folder / f"{tag}.py").write_text(
        f"def score(prompt, completion, label, metadata):\n{lines}    return 1.0\n"
    )
    return f"{tag}:score"


@pytest.mark.parametrize(
    "nested",
    [
        "x = " + "-" * 200_000 + "1\n",  # the parser runs out of its stack: MemoryError
        "x = a" + ".b" * 200_000 + "\n",  # an attribute chain: RecursionError
        "x = f" + "()" * 200_000 + "\n",  # call chain: RecursionError
    ],
)
def test_a_helper_nested_past_the_parsers_depth_is_held_not_a_crash(
    tmp_path: Path, tag: str, nested: str
) -> None:
    """A helper the reward imports inside its function (never compiled by the import) whose
    code nests past what `ast.parse` takes raised MemoryError or RecursionError out of
    `reward_code`: a traceback from `ehp-fsm run` at its start and at every `--resume`. Its
    file is held (digest) and its imports, unreadable, not followed."""
    spec = _reward(tmp_path, tag, f"{tag}_deep")
    (tmp_path / f"{tag}_deep.py").write_text(nested)
    code = reward_code(spec, folder=tmp_path)
    assert code is not None
    assert set(code) == {str(tmp_path / f"{tag}.py"), str(tmp_path / f"{tag}_deep.py")}


def test_a_helper_over_the_source_bound_is_held_its_imports_not_followed(
    tmp_path: Path, tag: str
) -> None:
    """A helper's source was read and parsed whole, however large (30 helpers of 1 MiB of
    imports took `reward_code` 57 s; a link named `helper.py` to a file of gigabytes was read
    into memory). One over `MAX_SOURCE_BYTES` is held by its digest, its imports not followed;
    and all files together are parsed within `MAX_SCANNED_BYTES`."""
    spec = _reward(tmp_path, tag, f"{tag}_big", f"{tag}_chain0")
    big = tmp_path / f"{tag}_big.py"
    padding = "# " + "x" * 97 + "\n"  # 100 bytes
    big.write_text(padding * 20_000 + f"import {tag}_c\n")  # 2 MB
    (tmp_path / f"{tag}_c.py").write_text("")
    count = 6  # a chain of helpers of ~1 MB each: 6 MB in all
    for i in range(count):
        (tmp_path / f"{tag}_chain{i}.py").write_text(
            f"import {tag}_chain{i + 1}\n" + padding * 9_999
        )
    (tmp_path / f"{tag}_chain{count}.py").write_text("")
    code = reward_code(spec, folder=tmp_path)
    assert code is not None
    assert str(big) in code  # held
    assert str(tmp_path / f"{tag}_c.py") not in code  # not followed from a file past the bound
    chain = [i for i in range(count + 1) if str(tmp_path / f"{tag}_chain{i}.py") in code]
    assert chain == list(range(len(chain))) and len(chain) < count + 1, chain

    from ehp_fsm.data.reward_imports import MAX_SCANNED_BYTES, MAX_SOURCE_BYTES

    assert 1_000_000 < MAX_SOURCE_BYTES < 2_000_000
    assert len(chain) == MAX_SCANNED_BYTES // 1_000_000 + 1  # the last found, not followed


def test_a_name_imported_by_every_module_is_looked_up_once(
    tmp_path: Path, tag: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each imported name not yet in `sys.modules` was looked up with `find_spec` (which
    searches every `sys.path` entry) once per import statement: 1,000 modules of 30 imports
    each took `reward_code` 2-4 s (0.3-0.5 s now), at `ehp-fsm run`'s start and every resume.
    A name with nothing of that name in the folder is not looked up; one that has is looked up
    once."""
    calls: list[str] = []
    real = importlib.util.find_spec

    def counted(name: str, package: str | None = None) -> Any:
        calls.append(name)
        return real(name, package)

    n, absent = 40, [f"{tag}_absent{j}" for j in range(20)]
    for i in range(n):
        lines = [f"import {tag}_m{(i + 1) % n}", f"import {tag}_m{(i * 7) % n}"]
        lines += [f"import {name}" for name in absent]  # installed nowhere, not in the folder
        body = "".join(f"    {line}\n" for line in lines)
        (tmp_path / f"{tag}_m{i}.py").write_text(f"def f():\n{body}")
    spec = _reward(tmp_path, tag, f"{tag}_m0")
    monkeypatch.setattr(importlib.util, "find_spec", counted)
    t0 = time.perf_counter()
    code = reward_code(spec, folder=tmp_path)
    took = time.perf_counter() - t0
    assert code is not None and len(code) == n + 1
    assert len(calls) == len(set(calls)) <= n + 1, sorted(calls)[:10]
    assert not set(calls) & set(absent)
    assert took < 5, took


def test_a_fifo_or_a_device_where_a_helper_is_is_not_read(tmp_path: Path, tag: str) -> None:
    """A FIFO named as a helper module (or a link to /dev/zero) is not waited on nor read: the
    reward's own file is held, nothing else."""
    spec = _reward(tmp_path, tag, f"{tag}_fifo", f"{tag}_zero", f"{tag}_pkg.sub")
    os.mkfifo(tmp_path / f"{tag}_fifo.py")
    (tmp_path / f"{tag}_zero.py").symlink_to("/dev/zero")
    (tmp_path / f"{tag}_pkg").mkdir()
    os.mkfifo(tmp_path / f"{tag}_pkg" / "__init__.py")
    (tmp_path / f"{tag}_pkg" / "sub.py").mkdir()  # a folder named like a module
    code = reward_code(spec, folder=tmp_path)
    assert code is not None and set(code) == {str(tmp_path / f"{tag}.py")}, code


def test_the_source_readers_refuse_a_fifo_without_waiting(tmp_path: Path) -> None:
    """`fspaths.open_regular` (what a reward's source is hashed through) and `read_regular`
    refuse a FIFO at once, naming it, and a file over the limit by its size."""
    from ehp_fsm.data.reward_imports import source_digest
    from ehp_fsm.fspaths import read_regular

    fifo = tmp_path / "helper.py"
    os.mkfifo(fifo)
    assert source_digest(fifo) is None
    with pytest.raises(OSError, match="is a FIFO, not a file"):
        read_regular(fifo, 100)
    big = tmp_path / "big.py"
    big.write_bytes(b"#" * 101)
    with pytest.raises(ValueError, match="larger than 100 bytes"):
        read_regular(big, 100)
    assert read_regular(big, 101) == b"#" * 101


def test_names_imported_from_a_module_are_not_joined_to_it_before_it_is_found(
    tmp_path: Path, tag: str
) -> None:
    """`from <a name of 10 KB> import b0, ..., b9999` (79 KB of source) made 10,000 names of
    10 KB (107 MB; 1 MB of source, 50 GB) before any was looked at: the run killed for memory
    at its start. A name after `from a import` is looked for only in a package of the folder."""
    import tracemalloc

    spec = _reward(tmp_path, tag, f"{tag}_h")
    names = ", ".join(f"b{i}" for i in range(10_000))
    (tmp_path / f"{tag}_h.py").write_text(f"def f():\n    from {'a' * 10_000} import {names}\n")
    tracemalloc.start()
    try:
        code = reward_code(spec, folder=tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert code is not None and str(tmp_path / f"{tag}_h.py") in code
    assert peak < 40e6, f"{peak / 1e6:.0f} MB"


def test_an_imported_name_too_long_for_a_file_is_not_a_crash(tmp_path: Path, tag: str) -> None:
    """`import pkg.<300 letters>` (or `from pkg import <300 letters>`) of a package in the
    folder raised OSError ("File name too long") out of `reward_code`: a traceback at the run's
    start. Such a name is no module file; the package's `__init__.py` is held."""
    long = "a" * 300
    spec = _reward(tmp_path, tag, f"{tag}_pkg.{long}")
    with (tmp_path / f"{tag}.py").open("a") as fh:
        fh.write(f"\n\ndef other():\n    from {tag}_pkg import {long}, sub\n")
    (tmp_path / f"{tag}_pkg").mkdir()
    init = tmp_path / f"{tag}_pkg" / "__init__.py"
    init.write_text("")
    sub = tmp_path / f"{tag}_pkg" / "sub.py"
    sub.write_text("")
    code = reward_code(spec, folder=tmp_path)
    assert code is not None and set(code) == {str(tmp_path / f"{tag}.py"), str(init), str(sub)}


def test_the_package_of_a_reward_module_is_held_by_its_init(tmp_path: Path, tag: str) -> None:
    """`[reward] function = "pkg.plain:score"`: importing `pkg.plain` runs `pkg/__init__.py`
    first, and what it sets (a scale, a patched helper) is what the reward runs with. The
    reward was held by `plain.py` alone: `__init__.py` edited between a kill and its resume
    went on without a word. Each package's `__init__.py` on the way is held, and the user's
    modules it imports; a namespace package (no `__init__.py`) adds nothing."""
    pkg = tmp_path / tag
    (pkg / "ns").mkdir(parents=True)
    init = pkg / "__init__.py"
    init.write_text(f"from {tag}_cfg import SCALE\n")
    cfg = tmp_path / f"{tag}_cfg.py"
    cfg.write_text("SCALE = 1.0\n")
    plain = pkg / "ns" / "plain.py"
    plain.write_text("def score(prompt, completion, label, metadata):\n    return 1.0\n")
    code = reward_code(f"{tag}.ns.plain:score", folder=tmp_path)
    assert code is not None and set(code) == {str(init), str(cfg), str(plain)}, sorted(code or {})
