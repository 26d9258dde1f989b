"""The SGLang client against an engine that answers a byte at a time.

The engine is a raw socket server in a thread (a misbehaving engine is the far edge: a real one
cannot be made to trickle on cue); the client is the real one, over real HTTP.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from ehp_fsm.rollout import EngineUnreachable, SGLangClient
from ehp_fsm.rollout.client import KEEPALIVE_S


@contextlib.contextmanager
def _serving(serve: Callable[[socket.socket, threading.Event], None]) -> Iterator[str]:
    """`serve(server socket, done)` in a thread; yields the URL; on exit sets `done`."""
    srv = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()
    thread = threading.Thread(target=serve, args=(srv, done), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    finally:
        done.set()
        thread.join(timeout=5)
        srv.close()


@pytest.fixture
def trickling() -> Iterator[str]:
    """The URL of an engine that sends its answer's head, then one byte of its body every
    0.1 s (the 100 bytes the head announces would take 10 s)."""

    def serve(srv: socket.socket, done: threading.Event) -> None:
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

    with _serving(serve) as url:
        yield url


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


@pytest.fixture
def closing_idle() -> Iterator[str]:
    """The URL of an engine whose keep-alive is 5 s, at its most unlucky: a request on a
    connection idle for 4.5 s or more meets the engine closing it (no answer), as uvicorn's
    close crosses a request sent just as its keep-alive ends. A request on a fresh connection,
    or on one used within 4.5 s, gets `{"ok": true}`."""
    answer = b'{"ok": true}'
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"

    def serve_one(conn: socket.socket, done: threading.Event) -> None:
        with conn:
            last = time.monotonic()
            while not done.is_set():
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                if time.monotonic() - last >= 4.5:
                    return  # closed as the request came in
                conn.sendall(head % len(answer) + answer)
                last = time.monotonic()

    def serve(srv: socket.socket, done: threading.Event) -> None:
        srv.settimeout(0.1)
        while not done.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=serve_one, args=(conn, done), daemon=True).start()

    with _serving(serve) as url:
        yield url


def test_a_connection_near_the_engines_keep_alive_is_not_reused(closing_idle: str) -> None:
    """The client kept an idle connection 5 s, as long as the engine (uvicorn's keep-alive,
    which SGLang keeps): a call 4.6 s after the last reused it as the engine closed it, and
    failed with "Server disconnected without sending a response" (a dispatch lost, an install
    failed, an engine taken for dead). Now an idle connection is kept for `KEEPALIVE_S`."""
    assert KEEPALIVE_S < 4.5
    with SGLangClient(closing_idle) as client:
        assert client._call("GET", "/health").json() == {"ok": True}
        time.sleep(4.6)
        assert client._call("GET", "/health").json() == {"ok": True}
