"""The embedding example under examples/ runs as documented."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
