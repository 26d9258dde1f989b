"""On a CUDA host a GPU is confirmed free only when `nvidia-smi` says no compute process is on
it; when `nvidia-smi` cannot tell (fails, hangs, exits non-zero) the GPU is not confirmed — a
doubt used to read as "free", and the ledger could hand a GPU that still held a process to a
new owner.

What is faked: `nvidia-smi` (a script first on PATH) and the agent's device kind (`cuda`, set
after start-up): these machines have no GPU. The agent, its endpoint, the controller endpoint
and the sockets are real."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from ehp_fsm.runtime.agent_processes import cuda_device_busy

from .agent_rig import agent_rig


def fake_nvidia_smi(bin_dir: Path, body: str) -> None:
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\n{body}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def bin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "bin"
    monkeypatch.setenv("PATH", f"{d}{os.pathsep}{os.environ['PATH']}")
    return d


@pytest.mark.parametrize(
    ("body", "answer"),
    [
        ("exit 0", False),  # no compute process listed
        ("echo 4242; exit 0", True),
        ("echo 'NVIDIA-SMI has failed' >&2; exit 9", None),
        ("exec sleep 5", None),  # hangs past the timeout
    ],
)
def test_nvidia_smi_answers_busy_free_or_unknown(bin_dir: Path, body: str, answer: bool) -> None:
    fake_nvidia_smi(bin_dir, body)
    assert cuda_device_busy("0", timeout_s=0.5) is answer


@pytest.mark.timeout(60)
def test_a_gpu_is_not_confirmed_free_while_nvidia_smi_cannot_tell(bin_dir: Path) -> None:
    fake_nvidia_smi(bin_dir, "exit 9")
    with agent_rig(bin_dir.parent, slots=1) as rig:
        rig.agent.processes.device = "cuda"  # the faked edge: a CUDA host
        rig.command("confirm_gpu_free", {"gpu": "h1:g0", "owner": "engine:e0"}, seconds=2.5)
        assert rig.freed() == []  # nvidia-smi failed: no verdict, no "free"
        fake_nvidia_smi(bin_dir, "exit 0")  # the driver answers again: nothing on the device
        rig.pump(2.5)
        assert rig.freed() == ["h1:g0"]
