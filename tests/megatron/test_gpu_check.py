"""GPU-only: the prepared GPU check passes on a real CUDA device with NCCL (tiny model).

Run by `benchmarks/gpu/megatron_check.sh` (pytest -m gpu); never in CPU CI.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_megatron_gpu_check_small_model_passes(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks/gpu/megatron_check.py"),
            "--small",
            "--workdir",
            str(tmp_path),
            "--timeout",
            "200",
        ],
        capture_output=True,
        text=True,
        timeout=230,
        env=env,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "megatron_check: PASS" in result.stdout
