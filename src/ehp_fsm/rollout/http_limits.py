"""What the embedded engine's HTTP server refuses to read or to wait for.

uvicorn and FastAPI (SGLang's stack) set no bound on either: a body is read and parsed whole
whatever its size, on the event loop that serves every other client, and a connection that
sends half a request (or nothing), or takes none of its answer, is kept for good. Two guards,
one per layer:

- `BodyLimit`, ASGI middleware: a body over its limit is answered 413 in SGLang's error shape
  before anything parses it (a declared Content-Length over it without reading a byte);
- `read_deadline_protocol(s)`, uvicorn's h11 protocol with a deadline: a connection that has not
  sent one whole request (line, headers and body) within `s` seconds of its first byte (or of
  connecting) is closed. A request being answered is never cut: the deadline covers reading;
- and, in the same protocol, a connection whose answer waits in the engine's buffer while the
  client takes none of it for `write_s` seconds is dropped with it: uvicorn waited for such a
  client for good, the answer held in its buffer (five clients that asked for 20 MB each and
  read nothing were all still connected 21 s later, past every other deadline). A client
  reading slowly is never cut: any byte taken restarts the clock;
- and a cap on open connections (`max_connections`): one past it is cut as it is accepted.
  Anyone who reaches the port can open connections without a key: 19,990 idle ones took every
  file descriptor the engine had, and its weight installs failed ("Too many open files") while
  asyncio logged a traceback per refused accept (30 MB of engine log in 40 s). The cap leaves
  three quarters of the descriptors to the engine's own files; the run's client opens at most
  100 connections to an engine. The warnings of these guards are logged at a bounded rate.

Knows: ASGI messages, uvicorn's h11 protocol class. Does not know: the engine's endpoints.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import resource
import struct
import termios
from typing import Any, Final

import h11
from fastapi.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from ehp_fsm.throttle import LogThrottle

#: The largest request body the engine reads (SGLang sets none). JSON is parsed on the event
#: loop: a 100 MB body held every other request (a health probe too) for 7 s.
MAX_BODY_BYTES: Final = 32 << 20
#: How long a connection may take to send one whole request.
REQUEST_READ_S: Final = 30.0
#: How long a client may take none of an answer the engine could not hand to the socket at once.
ANSWER_UNREAD_S: Final = 30.0
#: The most connections open at once, at most (`max_connections`).
MAX_CONNECTIONS: Final = 4096
_READING: Final = (h11.IDLE, h11.SEND_BODY)  # the client's states while a request is incomplete
log = logging.getLogger("uvicorn.error")
_throttle = LogThrottle()  # what any client can make the engine log
#: The ioctl that reads a TCP socket's unsent bytes (Linux's SIOCOUTQ; None elsewhere).
_OUTQ: Final = getattr(termios, "TIOCOUTQ", None)


class BodyLimit:
    """ASGI middleware: a request whose body is over `limit` bytes is answered 413 (SGLang's
    error shape) before anything parses it; one that declares more in its Content-Length is
    refused without reading a byte of it. The body (read here, up to the limit) is handed on
    whole; what the client sends afterwards (its disconnect) passes through. A client that
    leaves before its body is complete is not answered (no one would read it)."""

    def __init__(self, app: Any, *, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > self.limit:  # h11 refuses a bad one first
            what = declared.decode("latin-1")[:24] + " bytes declared"
            await self._too_large(scope, send, what)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left half-way
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                await self._too_large(scope, send, f"over {size} bytes sent")
                return
            if not message.get("more_body", False):
                break
        pending = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay() -> Any:
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Any, send: Any, what: str) -> None:
        message = (
            f"the request body is too large ({what}): the engine reads at most {self.limit} "
            "bytes; send fewer or shorter prompts per request"
        )
        response = JSONResponse({"error": {"message": message}}, status_code=413)
        response.headers["connection"] = "close"  # the rest of the body is never read
        await response(scope, _no_receive, send)


def max_connections() -> int:
    """The cap on open connections: a quarter of this process's open-file limit, within
    32..`MAX_CONNECTIONS`."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(32, min(MAX_CONNECTIONS, soft // 4))


def _warn(kind: str, message: str, *args: object) -> None:
    if (extra := _throttle.let(kind)) is None:
        return
    if extra:
        message += " (%d more such left out of this log)"
        args = (*args, extra["suppressed"])
    log.warning(message, *args)


async def _no_receive() -> Any:
    return {"type": "http.disconnect"}


class _ReadDeadline(H11Protocol):
    """uvicorn's h11 protocol; a connection whose request is not whole `read_s` seconds after
    it connected, or after the first byte of a request, is closed; one whose client takes no
    byte of a pending answer for `write_s` seconds is dropped (see the module docstring)."""

    read_s: float = REQUEST_READ_S
    write_s: float = ANSWER_UNREAD_S
    max_connections: int = MAX_CONNECTIONS
    _cut: bool = False  # over the cap: aborted as it came
    _deadline: asyncio.TimerHandle | None = None
    _stalled: asyncio.TimerHandle | None = None  # runs while writing is paused
    _unsent: int = 0  # bytes waiting in the transport when `_stalled` was set

    def pause_writing(self) -> None:
        """The transport's buffer is over its high-water mark: the client is not keeping up."""
        super().pause_writing()
        if self._stalled is None:
            self._unsent = self._unsent_bytes()
            self._stalled = self.loop.call_later(self.write_s, self._check_unread)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel_stalled()

    def _check_unread(self) -> None:
        """`write_s` after writing paused, or after the client last took a byte: drop the
        connection if it took none since, else look again in `write_s`."""
        self._stalled = None
        if self.transport.is_closing():
            return
        unsent = self._unsent_bytes()
        if unsent < self._unsent:  # reading, slowly: watch on
            self._unsent = unsent
            self._stalled = self.loop.call_later(self.write_s, self._check_unread)
            return
        peer = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        _warn(
            "unread",
            "%s took none of its answer (%d bytes waiting) for %g s: connection dropped",
            peer,
            unsent,
            self.write_s,
        )
        self.transport.abort()  # close() would wait for the buffer to be sent: for ever

    def _unsent_bytes(self) -> int:
        """The answer's bytes the client has not taken: the transport's buffer, and the
        socket's send queue where the kernel tells (Linux's SIOCOUTQ). The buffer alone moves
        only when the kernel frees half of a queue that may hold megabytes: a client reading
        steadily but slowly looked idle for minutes."""
        unsent = self.transport.get_write_buffer_size()
        sock = self.transport.get_extra_info("socket")
        if sock is not None and _OUTQ is not None:
            with contextlib.suppress(OSError):  # not a TCP socket: its buffer alone
                unsent += struct.unpack("i", fcntl.ioctl(sock.fileno(), _OUTQ, b"\0" * 4))[0]
        return unsent

    def _cancel_stalled(self) -> None:
        if self._stalled is not None:
            self._stalled.cancel()
            self._stalled = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.max_connections:
            self._cut = True
            transport.abort()
            _warn(
                "cap",
                "%d connections open, the engine's cap: a new one was cut as it came",
                len(self.connections),
            )
            return
        super().connection_made(transport)
        self._deadline = self.loop.call_later(self.read_s, self._expired)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.trailing_data[0]:  # a pipelined request, begun: its clock runs
            self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._cut:
            return  # (never counted, nothing started)
        self._cancel()
        self._cancel_stalled()
        super().connection_lost(exc)

    def _watch(self) -> None:
        """The deadline runs while a request is begun and not whole; an idle keep-alive
        connection is uvicorn's keep-alive timeout's."""
        if self.conn.their_state not in _READING:
            self._cancel()
        elif self._deadline is None:
            self._deadline = self.loop.call_later(self.read_s, self._expired)

    def _cancel(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.conn.their_state in _READING and not self.transport.is_closing():
            peer = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
            _warn(
                "unsent",
                "%s sent no whole request within %g s: connection closed",
                peer,
                self.read_s,
            )
            self.transport.close()


def read_deadline_protocol(
    read_s: float = REQUEST_READ_S,
    write_s: float = ANSWER_UNREAD_S,
    connections: int | None = None,
) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol class (`uvicorn.Config(http=...)`) with a `read_s` deadline on
    requests, a `write_s` one on answers left unread, and a cap of `connections` open at once
    (default `max_connections()`)."""
    cap = max_connections() if connections is None else connections
    return type(
        "ReadDeadlineH11Protocol",
        (_ReadDeadline,),
        {"read_s": read_s, "write_s": write_s, "max_connections": cap},
    )
