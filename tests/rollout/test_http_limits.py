"""The embedded engine's HTTP server against clients that send too much or never finish.

A real uvicorn server (the engine's own `uvicorn_config`, its read deadline cut to 0.5 s) on a
real socket, serving the engine's app over an engine with nothing installed (no model is needed
to read a request); one route is added that answers after 1 s, to show a request being answered
is not cut. The clients are raw sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import socket
import time
from collections.abc import Iterator

import pytest

from ehp_fsm.rollout.engine import EngineCore
from ehp_fsm.rollout.http_limits import (
    MAX_BODY_BYTES,
    MAX_CONNECTIONS,
    REQUEST_READ_S,
    max_connections,
)
from ehp_fsm.rollout.server import create_app
from tests.rollout.inprocess import serving as in_process

READ_S = 0.3
GET = b"GET /get_load HTTP/1.1\r\nHost: e\r\n\r\n"
GET_CLOSE = b"GET /get_load HTTP/1.1\r\nHost: e\r\nConnection: close\r\n\r\n"


@contextlib.contextmanager
def serving(read_s: float, **config: int) -> Iterator[int]:
    """The engine's app over an empty engine (plus `/slow`), served by uvicorn as the engine
    serves it (`uvicorn_config`, and `config`) with a `read_s` read deadline, on a free port:
    its number."""
    core = EngineCore()
    app = create_app(core)

    async def slow() -> dict[str, bool]:
        await asyncio.sleep(2 * READ_S)
        return {"slow": True}

    app.add_api_route("/slow", slow)
    with in_process(app, read_s=read_s, **config) as url:
        yield int(url.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    """A server whose read deadline is `READ_S`."""
    with serving(READ_S) as p:
        yield p


@pytest.fixture(scope="module")
def roomy_port() -> Iterator[int]:
    """A server with the engine's own read deadline (a 32 MB body may take a while to send on
    a busy machine)."""
    with serving(REQUEST_READ_S) as p:
        yield p


def response(sock: socket.socket) -> bytes:
    """One whole HTTP response from `sock` (status line, headers and its Content-Length body)."""
    got = b""
    while b"\r\n\r\n" not in got:
        got += sock.recv(65536)
    head, _, body = got.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes `sock` (EOF) within `seconds`, reading out what it says."""
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass  # (cut with a reset: what it was sent went unread)
    return True


@pytest.mark.parametrize(
    "sent",
    [
        b"",
        b"POST /generate HTTP/1.1\r\nHost: e\r\n",
        b"POST /generate HTTP/1.1\r\nHost: e\r\nContent-Length: 100\r\n\r\n{",
        b"POST /generate HTTP/1.1\r\nHost: e\r\nTransfer-Encoding: chunked\r\n\r\n1\r\n{\r\n",
    ],
    ids=["nothing", "half-headers", "half-body", "half-chunked"],
)
def test_a_request_that_never_ends_is_cut_and_others_are_served(port: int, sent: bytes) -> None:
    """uvicorn waits for a request for ever: a connection that sent half a request, or
    nothing, was held for good (20 s and counting here; enough of them take every file
    descriptor). Now it is closed at the deadline, and other clients are served meanwhile."""
    with socket.create_connection(("127.0.0.1", port)) as idle:
        idle.sendall(sent)
        with socket.create_connection(("127.0.0.1", port)) as other:
            other.sendall(GET)
            other.settimeout(5)
            assert response(other).startswith(b"HTTP/1.1 200 ")
        # at its own deadline (READ_S), not the engine's default (REQUEST_READ_S): the bound
        # between them leaves room for a loaded machine
        assert closed_within(idle, REQUEST_READ_S / 3)


def test_slow_answers_and_idle_keep_alive_are_not_cut(port: int) -> None:
    """The deadline covers reading a request: an answer that takes longer than it, and a
    keep-alive connection idle for longer than it between two requests, are kept."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(5)
        sock.sendall(b"GET /slow HTTP/1.1\r\nHost: e\r\n\r\n")
        assert response(sock).endswith(b'{"slow":true}')
        time.sleep(2 * READ_S)
        sock.sendall(GET)
        assert response(sock).startswith(b"HTTP/1.1 200 ")


def exchange(port: int, sent: bytes) -> bytes:
    """Send `sent` on a connection of its own; everything the engine answers until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(sent)
        got = b""
        try:
            while chunk := sock.recv(65536):
                got += chunk
        except TimeoutError:
            pass
        return got


def test_a_body_over_the_limit_is_refused_before_it_is_parsed(roomy_port: int) -> None:
    """The body was read and parsed whole whatever its size, on the event loop: a 100 MB
    `/generate` held every other request (a health probe too) for 7 s and took 440 MB. Now a
    declared size over the limit is refused (413) without reading the body, and a chunked body
    that passes it is refused as soon as it does (its last chunk is left unfinished: nothing the
    engine has not read is on the socket when it closes). A chunked body under it is served."""
    post = b"POST /generate HTTP/1.1\r\nHost: e\r\nContent-Type: application/json\r\n"
    t0 = time.monotonic()
    got = exchange(roomy_port, post + b"Content-Length: %d\r\n\r\n" % (MAX_BODY_BYTES + 1))
    assert got.startswith(b"HTTP/1.1 413 "), got[:200]
    assert time.monotonic() - t0 < 2.0
    assert b"at most %d bytes" % MAX_BODY_BYTES in got
    step = 1 << 20
    sizes = [step] * (MAX_BODY_BYTES // step)
    body = b"".join(b"%x\r\n" % n + b" " * n + b"\r\n" for n in sizes) + b"1\r\n "
    got = exchange(roomy_port, post + b"Transfer-Encoding: chunked\r\n\r\n" + body)
    assert got.startswith(b"HTTP/1.1 413 "), got[:200]
    small = b'{"rid": "r1"}'
    got = exchange(
        roomy_port,
        b"POST /abort_request HTTP/1.1\r\nHost: e\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n"
        b"Connection: close\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(small), small),
    )
    assert got.startswith(b"HTTP/1.1 200 "), got[:200]


def test_connections_past_the_cap_are_cut_as_they_come_and_the_rest_served() -> None:
    """Anyone who reaches the port may connect without a key: 19,990 idle connections took
    every file descriptor the engine had, and its weight installs failed ("Too many open
    files"). Past the cap (`http_limits.max_connections`, here 8) a new connection is cut as it
    is accepted; the open ones are served, and a place freed is taken again."""
    with serving(REQUEST_READ_S, connections=8) as p, contextlib.ExitStack() as stack:
        held = [stack.enter_context(socket.create_connection(("127.0.0.1", p))) for _ in range(7)]
        with socket.create_connection(("127.0.0.1", p)) as last:  # the 8th: served
            last.sendall(GET)
            last.settimeout(5)
            assert response(last).startswith(b"HTTP/1.1 200 ")
            with socket.create_connection(("127.0.0.1", p)) as over:  # the 9th: cut
                assert closed_within(over, 5.0)
        held[0].sendall(GET)  # a held one is served
        held[0].settimeout(5)
        assert response(held[0]).startswith(b"HTTP/1.1 200 ")
        deadline = time.monotonic() + 5  # the 8th's place, freed, is taken again
        # (cut, "" — the server had not yet seen the 8th close — or served)
        while True:
            with contextlib.suppress(ConnectionResetError):
                if exchange(p, GET_CLOSE).startswith(b"HTTP/1.1 200 "):
                    break
            assert time.monotonic() < deadline, "a freed place was not taken again"
            time.sleep(0.05)


def test_the_cap_leaves_most_descriptors_to_the_engine() -> None:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    cap = max_connections()
    assert 32 <= cap <= MAX_CONNECTIONS
    if soft != resource.RLIM_INFINITY and soft >= 128:
        assert cap <= soft // 4
