"""A reward module whose import calls `os._exit` is refused, not obeyed, and one whose import
does not end is said while it runs (`data.import_watch`): `ehp-fsm check` exited 0 without a
word on the first and hung without a word on the second."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ehp_fsm.data import import_watch
from ehp_fsm.data.rewards import RewardError, resolve_reward

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SCORE = "def score(prompt, completion, label, metadata):\n    return 1.0\n"


@pytest.fixture
def name() -> Iterator[str]:
    """A fresh module name; it leaves `sys.modules` and `sys.path` as they were."""
    name = f"ehp_watch_{uuid.uuid4().hex[:8]}"
    path = list(sys.path)
    yield name
    sys.modules.pop(name, None)
    sys.path[:] = path


@pytest.mark.parametrize("code", [0, 3])
def test_a_reward_module_that_calls_os_exit_at_import_is_refused(
    tmp_path: Path, name: str, code: int
) -> None:
    (tmp_path / f"{name}.py").write_text(f"import os\nos._exit({code})\n" + SCORE)
    with pytest.raises(RewardError) as err:
        resolve_reward(f"{name}:score", folder=tmp_path)
    text = str(err.value)
    assert f"reward module {name!r} ended the process as it was imported (os._exit({code}))" in (
        text
    ), text
    assert '__name__ == "__main__"' in err.value.fix


def test_os_exit_from_a_from_import_or_after_a_broad_except_is_refused_too(
    tmp_path: Path, name: str
) -> None:
    """`from os import _exit` takes the function as it is at import time (the watched one), and
    a module's `except Exception` does not swallow the refusal."""
    (tmp_path / f"{name}.py").write_text(
        "from os import _exit\ntry:\n    _exit(0)\nexcept Exception:\n    pass\n" + SCORE
    )
    with pytest.raises(RewardError, match=r"os\._exit\(0\)"):
        resolve_reward(f"{name}:score", folder=tmp_path)


def test_a_process_forked_during_the_import_exits_as_it_would(tmp_path: Path, name: str) -> None:
    """multiprocessing's forked children end by `os._exit`: in them it is the real one (else
    the child went on running this process's code after its work)."""
    (tmp_path / f"{name}.py").write_text(
        "import os\npid = os.fork()\nif pid == 0:\n    os._exit(7)\n"
        "_, status = os.waitpid(pid, 0)\nCHILD = os.waitstatus_to_exitcode(status)\n" + SCORE
    )
    assert resolve_reward(f"{name}:score", folder=tmp_path) is not None
    assert sys.modules[name].CHILD == 7


def test_a_slow_import_is_said_while_it_runs_and_not_ended(
    tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A loop at the top level: said every so often (here after 0.2 s, then every 0.2 s); the
    import itself is never ended — a module that loads a large model at import takes minutes."""
    (tmp_path / f"{name}.py").write_text("import time\ntime.sleep(1.0)\n" + SCORE)
    sys.path.append(str(tmp_path))
    import importlib

    with import_watch.watched_import(name, say_after_s=0.2, say_every_s=0.2):
        importlib.import_module(name)
    said = capsys.readouterr()
    text = said.out + said.err
    assert text.count("reward_import_slow") >= 3, text
    assert "still importing the reward module" in text and name in text
    time.sleep(0.5)
    assert capsys.readouterr().err.count("reward_import_slow") == 0  # the watcher ended with it


def test_check_of_a_plan_whose_reward_exits_at_import_fails_naming_it(tmp_path: Path) -> None:
    """The whole command, as a CI step runs it: exit 2 and the reason, not exit 0 and silence."""
    name = f"ehp_watch_{uuid.uuid4().hex[:8]}"
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
    assert f"reward module {name!r} ended the process as it was imported" in done.stderr
    assert "os._exit(0)" in done.stderr, done.stderr


def test_a_thread_the_reward_leaves_running_does_not_keep_the_command_from_exiting(
    tmp_path: Path,
) -> None:
    """A reward that starts a thread and never stops it (a worker pool it leaves open): `run`
    printed its summary and then hung until a Ctrl-C ("Exception ignored ... _shutdown").
    Here `check`, whose reward module starts one at import: it exits with its code at once,
    naming the thread; the exit handlers still ran."""
    name = f"ehp_watch_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "import atexit, sys, threading, time\n"
        "atexit.register(lambda: print('exit handlers ran', file=sys.stderr))\n"
        "threading.Thread(target=time.sleep, args=(600,), name='reward-pool').start()\n" + SCORE
    )
    text = (EXAMPLES / "short.toml").read_text()
    text = text.replace('function = "exact_match"', f'function = "{name}:score"')
    text = text.replace('train = "data/', f'train = "{EXAMPLES}/data/')
    text = text.replace('path = "../runs/', f'path = "{tmp_path}/')
    (tmp_path / "plan.toml").write_text(text)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "ehp_fsm.cli", "check", str(tmp_path / "plan.toml")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - started < 100
    assert "valid" in done.stdout
    assert "not waiting for 1 thread still running (reward-pool)" in done.stderr, done.stderr
    assert "exit handlers ran" in done.stderr


def test_a_thread_of_ehp_fsm_s_own_left_running_is_not_blamed_on_the_reward() -> None:
    """A run stopped by a full disk mid-step left its step thread (`ehp-train_0`, a thread
    pool's: not a daemon) running, and the command said it was "started by user code (the
    reward's)" (an operator's find). ehp-fsm's own threads are named as its own; a user's
    beside them as the user's."""
    script = (
        "import threading, time\n"
        "from ehp_fsm.cli import _not_waiting_for_stray_threads\n"
        "for name in ('ehp-train_0', 'reward-pool'):\n"
        "    threading.Thread(target=time.sleep, args=(600,), name=name).start()\n"
        "_not_waiting_for_stray_threads(3)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 3, done.stderr
    assert (
        "not waiting for 2 threads still running (ehp-train_0, reward-pool): 1 of ehp-fsm's "
        "own, still in work the run's end cut short; 1 started by user code (the reward's)"
    ) in done.stderr, done.stderr
