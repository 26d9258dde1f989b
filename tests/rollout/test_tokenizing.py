"""Where `text` prompts are tokenized: not on the threads the rest of the server shares.

A real engine (`EngineCore` over the tiny model) behind its real HTTP app, served by uvicorn in
this process (`inprocess.serving`) so the test can fill its event loop's default thread pool —
the pool weight installs run on — with tasks that wait on an Event.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import pytest

from ehp_fsm.rollout.engine import EngineCore
from ehp_fsm.rollout.server import create_app

from .inprocess import serving

pytestmark = [pytest.mark.timeout(120)]


def test_tokenizing_is_not_stuck_behind_the_default_thread_pool(tiny_model: Path) -> None:
    """Tokenizing ran on the loop's default pool, shared with weight installs: a long install
    (or several) held text prompts back, and a long text held installs back. Now text is
    tokenized on threads of its own: with every default-pool thread held (32 tasks: no
    default pool has more threads), a text prompt is still answered; the threads end with the
    server."""
    core = EngineCore()
    assert core.update_weights_from_disk(str(tiny_model))[0]
    app = create_app(core)
    gate = threading.Event()

    async def hold_the_default_pool() -> dict[str, int]:
        loop = asyncio.get_running_loop()
        for _ in range(32):
            loop.run_in_executor(None, gate.wait)  # each waits until the gate is set
        return {"held": 32}

    app.add_api_route("/hold", hold_the_default_pool, methods=["POST"])
    try:
        with serving(app) as url, httpx.Client(base_url=url, timeout=30) as http:
            assert http.post("/hold").status_code == 200
            try:
                sp = {"max_new_tokens": 2, "temperature": 0}
                r = http.post("/generate", json={"text": "12+3=", "sampling_params": sp})
                assert r.status_code == 200, r.text
                assert r.json()["meta_info"]["prompt_tokens"] == 6
                r = http.post("/generate", json={"input_ids": [1, 4], "sampling_params": sp})
                assert r.status_code == 200, r.text
            finally:
                gate.set()
    finally:
        gate.set()
        core.shutdown()
    deadline = time.monotonic() + 30
    while any(t.name.startswith("ehp-tokenize") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the tokenizing threads outlived the server"
        time.sleep(0.05)
