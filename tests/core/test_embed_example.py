"""The embedding example under examples/ runs as documented."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from ehp_fsm import Accepted, Event, EventError, Orchestrator, load_plan
from ehp_fsm.replay import replay

ROOT = Path(__file__).resolve().parents[2]


def test_embedding_example_runs(tmp_path: Path) -> None:
    log = tmp_path / "t.jsonl"
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "embed.py"), str(log)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "a reused pid is not the same process" in out.stdout
    assert "transitions verified; h1:g0 owned by engine:e3" in out.stdout


@pytest.mark.parametrize(
    ("event", "named"),
    [
        (Event("rollout_engine", "e0", "launch", float("nan"), {}), "`time` is nan"),
        (Event("rollout_engine", "e0", "launch", "12:00", {}), "`time` is '12:00'"),  # type: ignore[arg-type]
        (Event("rollout_engine", "e0", "launch", True, {}), "`time` is True"),
        (Event("rollout_engine", "e0", "launch", 1.0, None), "`payload` is None"),  # type: ignore[arg-type]
    ],
)
def test_an_event_of_the_wrong_types_raises_naming_the_field_and_logs_nothing(
    tmp_path: Path, event: Event, named: str
) -> None:
    """A NaN time was accepted and logged as `null` (the log no longer replayed); a payload of
    None was an AttributeError deep in a guard."""
    log = tmp_path / "t.jsonl"
    engine = Orchestrator.from_plan(load_plan(ROOT / "examples" / "local.toml"), log_path=log)
    before = engine.chain_head
    with pytest.raises(EventError, match=re.escape(named)):
        engine.handle(event)
    assert engine.chain_head == before
    ok = Event(
        "rollout_engine",
        "e0",
        "launch",
        1.0,
        {"host": "h1", "gpus": ["h1:g0"], "tp": 1, "token": "t"},
    )
    assert isinstance(engine.handle(ok), Accepted)
    engine.close()
    assert replay(log).transitions > 0


def test_the_readme_snippet_prints_what_its_comment_says(tmp_path: Path) -> None:
    """README's embedding snippet, run as written (from the repository's root): the reason it
    prints is the one its comment quotes (it quoted a 'starting' engine's refusal, where the
    snippet's engine does not exist yet)."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index("```python\nfrom ehp_fsm import Event, Orchestrator, load_plan")
    block = readme[start + len("```python\n") : readme.index("```", start + 10)]
    quoted = re.search(r'print\(out\.reason\)\s+# "([^"]+)"', block)
    assert quoted is not None, block
    code = block.replace('log_path="t.jsonl"', f"log_path={str(tmp_path / 't.jsonl')!r}")
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == quoted.group(1), (out.stdout, quoted.group(1))
