"""On a CUDA host a GPU is confirmed free only when NVML (`nvidia-ml-py`, where installed) or
else `nvidia-smi` says no process is on it; when it cannot tell (NVML cannot be asked;
`nvidia-smi` fails, hangs, exits non-zero) the GPU is not confirmed — a doubt used to read as
"free", and the ledger could hand a GPU that still held a process to a new owner. With neither,
process exit is the only evidence, and the agent says so once.

What is faked: `nvidia-smi` (a script first on PATH), the NVML bindings (a `pynvml` module
first on `sys.path`, answering from a file the test writes) and the agent's device kind
(`cuda`, set after start-up): these machines have no GPU. The agent, its endpoint, the
controller endpoint and the sockets are real."""

from __future__ import annotations

import json
import os
import stat
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from ehp_fsm.runtime.agent_processes import cuda_check_tool, cuda_device_busy

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


_FAKE_PYNVML = textwrap.dedent(
    """
    import json, os
    from types import SimpleNamespace

    class NVMLError(Exception):
        pass

    def _said():
        with open(os.environ["FAKE_NVML"]) as f:
            return json.load(f)

    def nvmlInit():
        if _said() == "no driver":
            raise NVMLError("Driver Not Loaded")

    def nvmlShutdown():
        pass

    def nvmlDeviceGetHandleByIndex(index):
        return index

    def nvmlDeviceGetComputeRunningProcesses(handle):
        said = _said()
        if said == "error":
            raise NVMLError("Unknown Error")
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in said[str(handle)]]

    def nvmlDeviceGetGraphicsRunningProcesses(handle):  # a display server's, for good
        return [SimpleNamespace(pid=1, usedGpuMemory=1 << 20)]
    """
)


@pytest.fixture
def nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The fake NVML bindings, importable as `pynvml`; what they answer is the JSON in the file
    this yields: {device index: [[pid, used bytes], ...]}, "no driver" or "error"."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "pynvml.py").write_text(_FAKE_PYNVML)
    said = tmp_path / "nvml.json"
    said.write_text(json.dumps({"0": []}))
    monkeypatch.setenv("FAKE_NVML", str(said))
    monkeypatch.syspath_prepend(str(site))
    yield said
    sys.modules.pop("pynvml", None)


@pytest.mark.parametrize(
    ("said", "answer"),
    [
        ({"0": []}, False),  # no compute process on device 0 (the display server's is not one)
        ({"0": [[4242, 1 << 30]]}, True),
        ({"0": [[4242, None]]}, True),  # the driver hides the figure: still a process
        ("no driver", None),
        ("error", None),
    ],
)
def test_nvml_answers_busy_free_or_unknown_and_is_asked_before_nvidia_smi(
    nvml: Path, bin_dir: Path, said: object, answer: bool | None
) -> None:
    fake_nvidia_smi(bin_dir, "echo 4242; exit 0")  # would say busy: not asked
    nvml.write_text(json.dumps(said))
    assert cuda_check_tool() == "nvml"
    assert cuda_device_busy("0", timeout_s=0.5) is answer


@pytest.mark.timeout(60)
def test_a_gpu_is_not_confirmed_free_while_nvml_lists_a_process_on_it(
    nvml: Path, tmp_path: Path
) -> None:
    nvml.write_text(json.dumps({"0": [[4242, 1 << 30]]}))  # a process the agent did not start
    with agent_rig(tmp_path, slots=1) as rig:
        rig.agent.processes.device = "cuda"  # the faked edge: a CUDA host
        rig.command("confirm_gpu_free", {"gpu": "h1:g0", "owner": "engine:e0"}, seconds=2.5)
        assert rig.freed() == []
        nvml.write_text(json.dumps({"0": []}))  # it exited: nothing on the device
        rig.pump(2.5)
        assert rig.freed() == ["h1:g0"]


@pytest.mark.timeout(60)
def test_a_cuda_host_with_neither_nvml_nor_nvidia_smi_frees_by_exit_and_says_so_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))  # no nvidia-smi; and no pynvml in this environment
    assert cuda_check_tool() is None
    with structlog.testing.capture_logs() as logs, agent_rig(tmp_path, slots=2) as rig:
        rig.agent.processes.device = "cuda"
        rig.command("confirm_gpu_free", {"gpu": "h1:g0", "owner": "engine:e0"}, seconds=1.5)
        rig.command("confirm_gpu_free", {"gpu": "h1:g1", "owner": "engine:e1"}, seconds=1.5)
        assert rig.freed() == ["h1:g0", "h1:g1"]
    said = [e for e in logs if e["event"] == "gpu_free_by_exit_only"]
    assert len(said) == 1 and "nvidia-ml-py" in said[0]["why"], logs
    assert "ehp-fsm[gpu]" in said[0]["fix"]
