"""The SGLang client against an engine that answers a byte at a time.

The engine is a raw socket server in a thread (a misbehaving engine is the far edge: a real one
cannot be made to trickle on cue); the client is the real one, over real HTTP.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from ehp_fsm.rollout import EngineUnreachable, SGLangClient


@pytest.fixture
def trickling() -> Iterator[str]:
    """The URL of an engine that sends its answer's head, then one byte of its body every
    0.1 s (the 100 bytes the head announces would take 10 s)."""
    srv = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def serve() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.recv(65536)
            head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n"
            conn.sendall(head + b"\r\n")
            for _ in range(100):
                if done.wait(0.1):
                    return
                try:
                    conn.sendall(b" ")
                except OSError:
                    return

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    done.set()
    thread.join(timeout=5)
    srv.close()


def test_an_answer_that_trickles_in_fails_the_call_at_its_timeout(trickling: str) -> None:
    """httpx's timeout bounds each wait for a byte: a `/generate` with a 0.5 s timeout waited
    the whole 10 s of a trickled answer (a dispatcher thread held as long as the engine liked).
    Now the timeout bounds the whole call."""
    with SGLangClient(trickling) as client:
        t0 = time.monotonic()
        with pytest.raises(
            EngineUnreachable, match=r"no whole answer within the timeout \(0\.5 s\)"
        ):
            client.generate(input_ids=[1, 2], timeout_s=0.5)
        assert time.monotonic() - t0 < 5.0  # not the trickle's 10 s (room for a loaded machine)
