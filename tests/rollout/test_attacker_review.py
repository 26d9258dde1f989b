"""The embedded engine's HTTP API against bodies built to be expensive or unreadable.

A real uvicorn server (the engine's own `uvicorn_config`) on a real socket serves the engine's
app; the bodies are sent with httpx as raw bytes. Nothing is faked. The engine has no model
installed unless a test installs the tiny one: every body here is refused before a model would
be read.

- A list whose entries are of the wrong kind cost one pydantic error per entry (per branch of a
  union), each listed in the refusal: 2 MB of `{"input_ids": [[1], 2, 1, 1, ...]}` held the event
  loop for 10 s and took 1.4 GB. Now a list is checked up to its first wrong entry.
- A body nested too deep, holding an integer of over 4300 digits, or not UTF-8 was answered by
  FastAPI's bare `{"detail": "There was an error parsing the body"}`: no cause, no fix, not
  SGLang's error shape.
- `/resume_memory_occupation` with an unknown tag resumed nothing and answered 200.
- A client that asked for a large answer and read none of it was waited for for good, holding
  the answer and the connection (no read deadline or keep-alive timeout applies while an answer
  is being written). Now it is dropped once it has taken no byte for `write_s`; a slow reader is
  served whole. A route answering 20 MB stands in for a large `/generate` answer.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.responses import Response

from ehp_fsm.rollout.engine import EngineCore
from ehp_fsm.rollout.server import create_app
from tests.rollout.inprocess import serving

JSON = {"content-type": "application/json"}
ENTRIES = 100_000  # wrong entries after the first: ~200 kB of body


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    """The engine's app over an engine with nothing installed."""
    with serving(create_app(EngineCore())) as base:
        yield base


def post(url: str, path: str, body: bytes) -> httpx.Response:
    return httpx.post(f"{url}{path}", content=body, headers=JSON, timeout=120)


def _wrong_entries(head: str, wrong: str) -> bytes:
    """`head` (a JSON list's first entry, the kind the field's other branch takes), then
    `ENTRIES` entries `wrong`."""
    return f"[{head}{f',{wrong}' * ENTRIES}]".encode()


LISTS = [
    ("/generate", "input_ids", "[1]", "1"),
    ("/generate", "text", '"a"', "1"),
    ("/generate", "rid", '"a"', "1"),
    ("/generate", "return_logprob", "true", "2"),  # 1 is a bool to pydantic's lax mode
    ("/generate", "sampling_params", "{}", "1"),
    ("/generate", "token_ids_logprob", "[1]", "1"),
    ("/release_memory_occupation", "tags", '"weights"', "1"),
]


@pytest.mark.parametrize(("path", "field", "head", "wrong"), LISTS, ids=[c[1] for c in LISTS])
def test_a_list_of_wrong_entries_is_refused_at_its_first(
    url: str, path: str, field: str, head: str, wrong: str
) -> None:
    """Traced allocations while the server (a thread of this process) answers: one error per
    entry took ~70 MB per 100k entries (and ~1 s of the event loop); one error takes none."""
    body = b'{"%s": %s}' % (field.encode(), _wrong_entries(head, wrong))
    tracemalloc.start()
    try:
        r = post(url, path, body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 30 << 20, f"{peak / 2**20:.0f} MiB traced for one refusal"
    assert r.status_code == 400, r.text[:300]
    message = r.json()["error"]["message"]
    assert message.startswith("invalid request body: ") and field in message, message[:300]
    assert message.count(field) <= 4, message[:300]  # the first wrong entry per branch only
    assert httpx.get(f"{url}/get_load", timeout=30).json()[0]["num_reqs"] == 0


@pytest.mark.parametrize(
    ("body", "cause"),
    [
        (b'{"input_ids": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests"),
        (b'{"rid": [' * 50_000 + b"]}" * 50_000, "nests"),
        (b'{"input_ids": [1, ' + b"9" * 5000 + b"]}", "digits"),
        (b'{"text": "\xff\xfe"}', "UTF-8"),
    ],
    ids=["deep-list", "deep-object", "huge-int", "not-utf8"],
)
def test_a_body_json_cannot_read_is_refused_saying_why(url: str, body: bytes, cause: str) -> None:
    r = post(url, "/generate", body)
    assert r.status_code == 400, r.text[:300]
    message = r.json()["error"]["message"]  # SGLang's shape, not {"detail": ...}
    assert message.startswith("invalid request body: ") and cause in message, message
    assert ": send " in message, message  # and what to do
    assert httpx.get(f"{url}/get_load", timeout=30).status_code == 200


def test_routing_errors_keep_fastapis_answer(url: str) -> None:
    """404 and 405 stay as FastAPI (and so SGLang) answer them."""
    assert httpx.get(f"{url}/nowhere", timeout=30).json() == {"detail": "Not Found"}
    r = httpx.get(f"{url}/generate", timeout=30)
    assert (r.status_code, r.json()) == (405, {"detail": "Method Not Allowed"})


def test_a_valid_body_still_parses(tiny_model: Path) -> None:
    """The fail-fast lists take what they took: a batch of ids, rids and log-prob flags."""
    core = EngineCore()
    ok, message, _ = core.update_weights_from_disk(str(tiny_model))
    assert ok, message
    with serving(create_app(core)) as base:
        body = {
            "input_ids": [[1, 4, 5], [6, 13]],
            "rid": ["a", "b"],
            "return_logprob": [True, False],
            # ignore_eos: two tokens whatever is sampled (an EOS drawn first ended it at one)
            "sampling_params": [{"max_new_tokens": 2, "ignore_eos": True}, {"max_new_tokens": 1}],
        }
        r = post(base, "/generate", json.dumps(body).encode())
        assert r.status_code == 200, r.text
        got = r.json()
        assert [g["meta_info"]["id"] for g in got] == ["a", "b"]
        assert len(got[0]["meta_info"]["output_token_logprobs"]) == 2
        r = post(base, "/generate", b'{"text": ["1 2", "3"], "sampling_params": {"n": 1}}')
        assert r.status_code == 200 and len(r.json()) == 2, r.text


def test_resuming_an_unknown_tag_is_refused_and_changes_nothing(url: str) -> None:
    """It answered 200 "memory resumed" having resumed nothing (a typo of `weights`): the install
    after it was then refused for weights still released."""
    assert post(url, "/release_memory_occupation", b'{"tags": ["weights"]}').status_code == 200
    try:
        r = post(url, "/resume_memory_occupation", b'{"tags": ["weight"]}')
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert "unknown memory tags ['weight']" in message and "nothing was resumed" in message
        assert httpx.get(f"{url}/model_info", timeout=30).json()["released"] == ["weights"]
        r = post(url, "/release_memory_occupation", b'{"tags": ["kv"]}')
        assert r.status_code == 400 and "nothing was released" in r.json()["error"]["message"]
    finally:
        assert post(url, "/resume_memory_occupation", b"{}").status_code == 200
    assert httpx.get(f"{url}/model_info", timeout=30).json()["released"] == []


BIG = 20 << 20  # past what the kernel's socket buffers and the transport's high-water mark hold


@contextlib.contextmanager
def big_server(write_s: float) -> Iterator[int]:
    """The engine's app with a route answering `BIG` bytes, served with a `write_s` deadline on
    answers left unread: its port."""
    app = create_app(EngineCore())
    body = b"x" * BIG

    async def big() -> Response:
        return Response(body, media_type="application/octet-stream")

    app.add_api_route("/big", big)
    with serving(app, write_s=write_s) as base:
        yield int(base.rsplit(":", 1)[1])


def _ask_big(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"GET /big HTTP/1.1\r\nHost: e\r\n\r\n")
    return sock


def _read_all(sock: socket.socket, got: int = 0) -> tuple[int, str]:
    """Bytes read (`got` before) until the whole answer came or the server ended the
    connection, and how it ended."""
    sock.settimeout(10)
    while True:
        try:
            chunk = sock.recv(1 << 20)
        except ConnectionResetError:
            return got, "reset"
        except TimeoutError:
            return got, "open"
        if not chunk:
            return got, "closed"
        got += len(chunk)
        if got > BIG:  # the whole answer: head and body
            return got, "served"


def test_a_client_that_reads_none_of_its_answer_is_dropped() -> None:
    write_s = 0.5
    with big_server(write_s) as port, contextlib.ExitStack() as stack:
        idle = [stack.enter_context(_ask_big(port)) for _ in range(3)]
        time.sleep(6 * write_s)  # dropped by now: the old engine kept all three, answer and all
        with socket.create_connection(("127.0.0.1", port), timeout=10) as other:
            other.sendall(b"GET /get_load HTTP/1.1\r\nHost: e\r\nConnection: close\r\n\r\n")
            assert other.recv(12) == b"HTTP/1.1 200"
        ends = [_read_all(sock) for sock in idle]
    assert all(end in ("reset", "closed") and got < BIG for got, end in ends), ends


def test_a_client_reading_slowly_gets_its_whole_answer() -> None:
    """Each byte taken restarts the clock: a client taking 4 kB every 0.2 s for three deadlines
    of 1 s (room for this process to be descheduled) is kept, then reads the rest at its own
    pace and has the whole answer."""
    with big_server(1.0) as port, _ask_big(port) as sock:
        sock.settimeout(10)
        got = 0
        for _ in range(15):
            time.sleep(0.2)
            chunk = sock.recv(4096)
            assert chunk, f"the connection was closed after {got} bytes"
            got += len(chunk)
        got, end = _read_all(sock, got)
    assert end == "served", (got, end)
