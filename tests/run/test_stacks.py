"""`kill -USR1` stack dumps (`ehp_fsm.stacks`): every thread's stack, and a process that keeps
running however often it is asked — with busy threads sending on real ZeroMQ sockets, the case in
which faulthandler's dump once crashed a run (SIGSEGV, a thread inside ZeroMQ's send)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time

from ehp_fsm.stacks import format_stacks


def _parked_here(ready: threading.Event, done: threading.Event) -> None:
    ready.set()
    done.wait(10)


def test_every_thread_is_shown_most_recent_call_first() -> None:
    ready, done = threading.Event(), threading.Event()
    t = threading.Thread(target=_parked_here, args=(ready, done), name="parked", daemon=True)
    t.start()
    ready.wait(10)
    try:
        text = format_stacks()
    finally:
        done.set()
        t.join(10)
    assert text.startswith("Current thread ") and "most recent call first" in text, text
    mine, theirs = text.split("\nThread ", 1)
    assert "test_every_thread_is_shown_most_recent_call_first" in mine
    assert "(parked)" in theirs and "_parked_here" in theirs, theirs
    # most recent first: the wait comes before the function that called it
    assert theirs.index(", in wait") < theirs.index(", in _parked_here"), theirs


_BUSY = textwrap.dedent(
    """
    import sys, threading, time, zmq
    from ehp_fsm.stacks import install
    install(sys.stderr.fileno())
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    def send():
        push = ctx.socket(zmq.PUSH)
        push.connect(f"tcp://127.0.0.1:{port}")
        while True:
            push.send(b"x" * 256)
    def recv():
        while True:
            pull.recv()
    for f in (send, send, recv):
        threading.Thread(target=f, daemon=True).start()
    print("ready", flush=True)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 60:
        sum(range(1000))
    """
)


def test_a_process_with_busy_zeromq_threads_survives_many_dumps() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _BUSY],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        for _ in range(150):
            proc.send_signal(signal.SIGUSR1)
            time.sleep(0.01)
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.3)
        assert proc.poll() is None  # still running after every dump
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=30)
    assert err.count("Current thread") >= 10, err[-2000:]  # (pending signals coalesce)
    assert "in send" in err and "in recv" in err, err[-2000:]
