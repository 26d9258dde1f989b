"""An SGLang engine's readiness probe waits as long as SGLang's `/health` takes to answer.

SGLang's `/health` is `/health_generate`: a one-token generation, answered no sooner than 1 s
after the request and then on a once-a-second check (SGLang 0.5.3
`entrypoints/http_server.py`). The launch probed with a 2 s wait: an engine whose token took
more than about a second at every probe was failed at the launch deadline while it served.

SGLang cannot run here: the engine is a stand-in process (the far edge, faked) started by the
real `launch_engine` in SGLang's place (`python=` a script that serves `/health` as SGLang
does, after 2.5 s), over real HTTP.
"""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest

from ehp_fsm.rollout.errors import EngineLaunchError
from ehp_fsm.rollout.launch import launch_engine, stop_engine

STANDIN = """
import http.server, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])

class Slow(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        time.sleep(2.5 if self.path == "/health" else 0.0)  # SGLang's one-token check
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass

http.server.ThreadingHTTPServer(("127.0.0.1", port), Slow).serve_forever()
"""


def _python(tmp: Path) -> str:
    """An executable that takes `python -m sglang.launch_server ...`'s arguments and runs the
    stand-in with them."""
    script = tmp / "standin.py"
    script.write_text(STANDIN)
    exe = tmp / "python"
    exe.write_text(f'#!/bin/sh\nshift 2\nexec {sys.executable} {script} "$@"\n')
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return str(exe)


@pytest.mark.timeout(60)
def test_an_sglang_engine_slow_to_answer_health_is_taken_as_ready(tmp_path: Path) -> None:
    handle = launch_engine(
        backend="sglang",
        model_path=tmp_path,  # (SGLang's --model-path; the stand-in reads none)
        deadline_s=12.0,
        python=_python(tmp_path),
        log_path=tmp_path / "engine.log",
    )
    try:
        assert handle.process is not None and handle.process.poll() is None
    finally:
        stop_engine(handle, grace_s=2.0)
    assert handle.process.poll() is not None  # (stopped: nothing left running)


@pytest.mark.timeout(60)
def test_an_engine_that_never_answers_still_fails_at_its_deadline(tmp_path: Path) -> None:
    python = _python(tmp_path)
    Path(tmp_path / "standin.py").write_text(STANDIN.replace("2.5 if", "600 if"))
    with pytest.raises(EngineLaunchError, match=r"did not answer /health in 4\.0s"):
        launch_engine(
            backend="sglang",
            model_path=tmp_path,
            deadline_s=4.0,
            python=python,
            log_path=tmp_path / "engine.log",
        )
