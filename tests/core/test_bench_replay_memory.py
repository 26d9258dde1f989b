"""`benchmarks/replay_memory.py` (a README benchmark row): a replay that fails is reported with
its own error, not as a bare `CalledProcessError` of the child."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

import ehp_fsm


def _bench() -> object:
    # the benchmarks beside the package's tree (src/ehp_fsm -> benchmarks/)
    path = Path(ehp_fsm.__file__).resolve().parents[2] / "benchmarks" / "replay_memory.py"
    spec = importlib.util.spec_from_file_location("bench_replay_memory", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_a_failed_replay_names_its_error(tmp_path: Path) -> None:
    """The baseline tree (default: main) may not read this tree's log (a log schema newer than
    it knows): the child crashed reading a transition count from the error's empty output, and
    the benchmark died of `CalledProcessError` with the replay's error unshown."""
    log, receipt = tmp_path / "transitions.jsonl", tmp_path / "receipt.json"
    log.write_text('{"schema_version": 99}\n')
    receipt.write_text('{"log_chain": {"count": 1, "hash": "00"}}')
    src = Path(ehp_fsm.__file__).resolve().parents[1]
    with pytest.raises(SystemExit) as err:
        _bench().measure(src, log, receipt)  # type: ignore[attr-defined]
    text = str(err.value)
    assert f"replay of {log} with {src} failed" in text, text
    assert "ehp-fsm: error: transition log line 1" in text, text
    assert "Fix: give --ref or --base a tree that reads this tree's logs" in text, text
