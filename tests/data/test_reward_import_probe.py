"""A reward module whose import ends the process or never returns is refused, not obeyed: it is
imported in a child process first (`data.import_probe`), so `ehp-fsm check` says what the module
did instead of exiting 0 without a word (`os._exit(0)`) or hanging (a loop at its top level)."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ehp_fsm.data import import_probe
from ehp_fsm.data.rewards import RewardError, resolve_reward

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SCORE = "def score(prompt, completion, label, metadata):\n    return 1.0\n"


@pytest.fixture
def name() -> Iterator[str]:
    """A fresh module name; it leaves `sys.modules` and `sys.path` as they were."""
    name = f"ehp_probe_{uuid.uuid4().hex[:8]}"
    path = list(sys.path)
    yield name
    sys.modules.pop(name, None)
    sys.path[:] = path


@pytest.mark.parametrize(
    ("top", "said"),
    [
        ("import os\nos._exit(0)\n", "the process exited with code 0"),
        ("import os\nos._exit(3)\n", "the process exited with code 3"),
        ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n", "killed by SIGKILL"),
        (
            "import os, sys\nprint('bye now', file=sys.stderr)\nos._exit(0)\n",
            "it wrote: 'bye now'",
        ),
    ],
)
def test_a_reward_module_that_ends_the_process_at_import_is_refused(
    tmp_path: Path, name: str, top: str, said: str
) -> None:
    (tmp_path / f"{name}.py").write_text(top + SCORE)
    with pytest.raises(RewardError) as err:
        resolve_reward(f"{name}:score", folder=tmp_path)
    text = str(err.value)
    assert f"reward module {name!r} cannot be imported" in text, text
    assert "importing it ended the process" in text and said in text, text
    assert '__name__ == "__main__"' in err.value.fix
    assert name not in sys.modules  # the refusal came before this process imported it


def test_a_reward_module_that_never_ends_its_import_is_ended_and_said(
    tmp_path: Path, name: str
) -> None:
    """The loop is ended with what it started (its own session), and the time allowed is said."""
    (tmp_path / f"{name}.py").write_text(_sleeper(name) + "while True:\n    pass\n" + SCORE)
    sys.path.append(str(tmp_path))
    started = time.monotonic()
    ended = import_probe.probe(name, timeout_s=3.0, slow_s=1.0)
    assert ended is not None and time.monotonic() - started < 30
    why, fix = ended
    assert "did not end in 3 s (it was ended)" in why and "waits or loops" in why, why
    assert "first call" in fix
    assert name not in sys.modules
    _gone(name)


def _gone(name: str) -> None:
    """What `_sleeper(name)` started is ended (a SIGKILLed process ends a moment later)."""
    deadline = time.monotonic() + 5
    while _sleepers(name) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _sleepers(name)


def _sleeper(name: str) -> str:
    """Module code that starts a process marked with `name` (found by `_sleepers`)."""
    return (
        "import subprocess, sys\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)  # {name}'])\n"
    )


def _sleepers(name: str) -> list[int]:
    """Live processes that `_sleeper(name)` started."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmd = (entry / "cmdline").read_bytes() if entry.name.isdigit() else b""
            state = (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0] if cmd else ""
        except OSError:
            continue
        if f"# {name}".encode() in cmd and state != "Z":
            found.append(int(entry.name))
    return found


def test_a_module_that_starts_a_process_at_import_is_no_hang_and_leaves_none_behind(
    tmp_path: Path, name: str
) -> None:
    """A reward module that starts a helper process at import (a sandbox server) keeps a pipe
    open after the child ended; the child's stderr goes to a file, so its end is seen at once.
    The helper the probe's import started is ended with the child's session."""
    (tmp_path / f"{name}.py").write_text(_sleeper(name) + SCORE)
    sys.path.append(str(tmp_path))
    started = time.monotonic()
    assert import_probe.probe(name, timeout_s=20.0) is None
    assert time.monotonic() - started < 10
    assert name not in sys.modules
    _gone(name)


def test_a_module_that_raises_or_exits_is_still_said_by_the_import_here(
    tmp_path: Path, name: str
) -> None:
    """The child's "raised" leaves the saying to this process's import, which names the error
    (and `sys.exit`, with its own message), as before the probe."""
    (tmp_path / f"{name}.py").write_text("raise ValueError('no config file')\n" + SCORE)
    with pytest.raises(RewardError) as err:
        resolve_reward(f"{name}:score", folder=tmp_path)
    assert "ValueError: no config file" in str(err.value)
    sys.modules.pop(name, None)
    (tmp_path / f"{name}.py").write_text("import sys\nsys.exit(0)\n" + SCORE)
    with pytest.raises(RewardError, match="ended the process as it was imported"):
        resolve_reward(f"{name}:score", folder=tmp_path)


def test_a_module_already_imported_is_not_probed(
    tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / f"{name}.py").write_text(SCORE)
    assert resolve_reward(f"{name}:score", folder=tmp_path) is not None
    monkeypatch.setattr(import_probe, "probe", lambda *a, **k: pytest.fail("probed twice"))
    assert resolve_reward(f"{name}:score", folder=tmp_path) is not None


def test_check_of_a_plan_whose_reward_exits_at_import_fails_naming_it(tmp_path: Path) -> None:
    """The whole command, as a CI step runs it: exit 2 and the reason, not exit 0 and silence."""
    name = f"ehp_probe_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text("import os\nos._exit(0)\n" + SCORE)
    text = (EXAMPLES / "short.toml").read_text()
    text = text.replace('function = "exact_match"', f'function = "{name}:score"')
    text = text.replace('train = "data/', f'train = "{EXAMPLES}/data/')
    text = text.replace('path = "../runs/', f'path = "{tmp_path}/')
    (tmp_path / "plan.toml").write_text(text)
    done = subprocess.run(
        [sys.executable, "-m", "ehp_fsm.cli", "check", str(tmp_path / "plan.toml")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert f"reward module {name!r} cannot be imported" in done.stderr, done.stderr
    assert "the process exited with code 0" in done.stderr, done.stderr
