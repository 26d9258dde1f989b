"""The engine's HTTP app served by real uvicorn on a real socket inside the test process, for
tests that must reach into it while it serves: block its event loop's default thread pool, hold
its tokenizer at a gate. Served as the engine process serves it (`server.uvicorn_config`).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI

from ehp_fsm.rollout.server import uvicorn_config


@contextlib.contextmanager
def serving(app: FastAPI, **config: Any) -> Iterator[str]:
    """`app` served on a free local port until the block ends: its base URL. `config`: more
    of `uvicorn_config`'s arguments (e.g. `read_s`)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, "warning", **config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        assert not thread.is_alive(), "the server did not stop"


class Gate:
    """Wraps a tokenizer (the engine's prompt encoder): each call says it started, then waits
    until the gate opens, then tokenizes with the real tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.entered = threading.Event()
        self.open = threading.Event()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.entered.set()
        assert self.open.wait(timeout=120), "the gate was never opened"
        return self.tokenizer(*args, **kwargs)
