"""The prepared GPU check (`benchmarks/gpu/megatron_check.py`).

On a GPU machine (`-m gpu`, run by `benchmarks/gpu/megatron_check.sh`; never in CPU CI) it must
pass with CUDA + NCCL on a tiny model. In CPU CI its own logic runs as a dry run (`--cpu`: Gloo
and the tests' CPU compatibility layer), so a change of the backend's API that would break the
script is caught here rather than on a scarce GPU machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, mode: str) -> subprocess.CompletedProcess[str]:
    # Keep the caller's PYTHONPATH (megatron_check.sh may add carried wheels to it).
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run(
        [
            sys.executable,
            "-W",
            "ignore",
            str(ROOT / "benchmarks/gpu/megatron_check.py"),
            mode,
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


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_megatron_gpu_check_small_model_passes(tmp_path: Path) -> None:
    result = _run(tmp_path, "--small")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "megatron_check: PASS" in result.stdout


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_megatron_gpu_check_logic_dry_run_on_cpu(tmp_path: Path) -> None:
    result = _run(tmp_path, "--cpu")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "megatron_check: PASS (bug b, restore, next update = [True, True, True]" in out
    assert "restored state bitwise equal to the Core's: PASS" in out
    assert "gather/pinned = " in out  # the bandwidth line is printed


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_megatron_lanes_gpu_check_logic_dry_run_on_cpu(tmp_path: Path) -> None:
    # the script `benchmarks/gpu/device_check.sh` runs on a lent GPU: its Core and Hybrid lanes,
    # the DP-zero hand-over through a file and the worker's park, on CPU with the tiny model
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    result = subprocess.run(
        [
            sys.executable,
            "-W",
            "ignore",
            str(ROOT / "benchmarks/gpu/megatron_lanes_check.py"),
            "--cpu",
            "--workdir",
            str(tmp_path / "work"),
            "--timeout",
            "200",
        ],
        capture_output=True,
        text=True,
        timeout=230,
        env={**os.environ, "PYTHONPATH": path},
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    for check in ("restore bit-exact", "next update bit-exact", "parked lane emptied"):
        assert f"PASS {check}" in out, out
    assert "megatron_lanes_check: PASS" in out
