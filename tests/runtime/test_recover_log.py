"""`recover_log` cuts a crash's torn tail off a log it can recover, and leaves a log it cannot
recover exactly as it was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ehp_fsm.runtime.recovery import RecoveryError, recover_log
from tests.golden.scenarios import HERE

GOLDEN = HERE / "borrow_and_return.jsonl"


def test_a_torn_last_line_is_cut_and_the_log_replays(tmp_path: Path) -> None:
    log = tmp_path / "t.jsonl"
    whole = GOLDEN.read_bytes()
    log.write_bytes(whole + b'{"seq": 99999, "ev')
    _, report = recover_log(log)
    assert log.read_bytes() == whole
    assert report.truncated_bytes == len(b'{"seq": 99999, "ev')
    assert "torn" in report.describe()


def test_a_log_that_diverges_early_is_refused_and_left_untouched(tmp_path: Path) -> None:
    """Before, the torn tail was cut before the replay found the early divergence: the refused
    log had lost its last bytes."""
    lines = GOLDEN.read_text().splitlines(keepends=True)
    n = next(i for i, raw in enumerate(lines) if i > 0 and json.loads(raw)["event"] == "activate")
    lines[n] = lines[n].replace('"dest":"active"', '"dest":"ready"')
    log = tmp_path / "t.jsonl"
    damaged = "".join(lines).encode() + b'{"seq": 99999, "ev'
    log.write_bytes(damaged)
    with pytest.raises(RecoveryError, match="diverges before its last event"):
        recover_log(log)
    assert log.read_bytes() == damaged
