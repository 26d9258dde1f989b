"""The log header records the ehp-fsm version that wrote it (`ehp_fsm_version`), and every
message that sends the reader to "the ehp-fsm that wrote it" names that version (and this
one's); a log from before the header recorded it still replays, and its messages say the version
is unknown. Before, the header had no version and the messages named none: the reader was told
to find "the ehp-fsm that wrote it" with nothing to tell which."""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path

import pytest

from ehp_fsm.errors import LogFormatError, ReplayDivergence
from ehp_fsm.replay import replay
from ehp_fsm.translog import VERSION_KEY
from tests.core.logedit import rechain, without_version
from tests.golden.scenarios import HERE, borrow_and_return

GOLDEN = HERE / "borrow_and_return.jsonl"
UNVERSIONED = HERE / "borrow_and_return.unversioned.jsonl"
THIS = version("ehp-fsm")
UNKNOWN = "version unknown (written before version 0.1.1 recorded it)"


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines(keepends=True)


def _header_edited(tmp_path: Path, source: Path, **changes: object) -> Path:
    lines = _lines(source)
    head = json.loads(lines[0])
    head.update(changes)
    out = tmp_path / "edited.jsonl"
    out.write_text("".join(rechain([json.dumps(head), *lines[1:]])))
    return out


def test_the_header_records_the_version_as_the_package_reports_it(tmp_path: Path) -> None:
    log = tmp_path / "t.jsonl"
    borrow_and_return(log)
    head = json.loads(_lines(log)[0])
    assert head[VERSION_KEY] == THIS
    assert list(head)[:2] == ["schema_version", VERSION_KEY]
    assert replay(log).header[VERSION_KEY] == THIS


def test_a_log_from_before_the_version_replays_as_before() -> None:
    """The unversioned golden log is the golden log as the code before wrote it (byte for
    byte: only the header's field and the chain differ) and replays to the same world."""
    assert "".join(without_version(_lines(GOLDEN))) == UNVERSIONED.read_text()
    old, new = replay(UNVERSIONED), replay(GOLDEN)
    assert VERSION_KEY not in old.header
    assert (old.transitions, old.world.snapshot()) == (new.transitions, new.world.snapshot())


@pytest.mark.parametrize(("source", "named"), [(GOLDEN, f"version {THIS}"), (UNVERSIONED, UNKNOWN)])
def test_other_specs_name_the_version_that_wrote_the_log(
    tmp_path: Path, source: Path, named: str
) -> None:
    specs = json.loads(_lines(source)[0])["specs"]
    log = _header_edited(tmp_path, source, specs={**specs, "gpu": "0" * 16})
    with pytest.raises(LogFormatError, match="other machine specs") as what:
        replay(log)
    assert what.value.fix == (
        f"replay it with the ehp-fsm (and specs/) that wrote it: {named} (this is {THIS})"
    )


@pytest.mark.parametrize(("source", "named"), [(GOLDEN, "version 9.9.9"), (UNVERSIONED, UNKNOWN)])
def test_an_unreadable_schema_names_the_version_that_wrote_the_log(
    tmp_path: Path, source: Path, named: str
) -> None:
    changes: dict[str, object] = {"schema_version": 99}
    if source == GOLDEN:
        changes[VERSION_KEY] = "9.9.9"
    log = _header_edited(tmp_path, source, **changes)
    with pytest.raises(LogFormatError, match="schema version 99") as what:
        replay(log)
    assert what.value.fix == f"replay it with the ehp-fsm that wrote it: {named} (this is {THIS})"


def test_a_version_that_is_not_text_is_named_as_it_is(tmp_path: Path) -> None:
    log = _header_edited(tmp_path, GOLDEN, schema_version=99, **{VERSION_KEY: ["\x1b[2J"]})
    with pytest.raises(LogFormatError) as what:
        replay(log)
    assert f"version unknown (the header's {VERSION_KEY} is ['\\x1b[2J'])" in what.value.fix


@pytest.mark.parametrize("jobs", [1, 3])
def test_a_divergence_names_the_version_that_wrote_the_log(tmp_path: Path, jobs: int) -> None:
    """A divergence may be another engine's decision (a guard's code changed, its name and the
    spec fingerprints not): the fix names the version that wrote the log, also when a worker
    process found it (`--jobs`)."""
    log = tmp_path / "cp.jsonl"
    borrow_and_return(log, checkpoint_every=2)
    lines = _lines(log)
    n = max(i for i, x in enumerate(lines) if '"dest":"active"' in x)
    lines[n] = lines[n].replace('"dest":"active"', '"dest":"ready"')
    log.write_text("".join(rechain(lines)))
    with pytest.raises(ReplayDivergence) as what:
        replay(log, jobs=jobs)
    assert what.value.line == n + 1
    assert what.value.fix == (
        "restore the original log, or replay it with the ehp-fsm (and specs/) that wrote it: "
        f"version {THIS} (this is {THIS})"
    )
