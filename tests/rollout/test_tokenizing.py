"""Where and how far `text` prompts are tokenized: not on the threads the rest of the server
shares, and never refused by a length guess when the tokenizer has no vocabulary to bound it.

A real engine (`EngineCore` over the tiny model) behind its real HTTP app, served by uvicorn in
this process (`inprocess.serving`) so the test can fill its event loop's default thread pool —
the pool weight installs run on — with tasks that wait on an Event.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from ehp_fsm.data.dataset import MIN_CHARS_PER_TOKEN
from ehp_fsm.rollout.engine import EngineCore, _max_text_chars
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


class WordTokenizer:
    """A real word-level tokenizer (`tokenizers`' WordLevel model, split on spaces) with long
    words, exposing what the engine calls — and no `get_vocab`, as a tokenizer may lack one."""

    WORDS = tuple(f"{w}-{'x' * 20}" for w in ("alpha", "beta", "gamma", "delta"))

    def __init__(self) -> None:
        from tokenizers import Tokenizer, models, pre_tokenizers

        vocab = {"<unk>": 3} | {w: 4 + i for i, w in enumerate(self.WORDS)}
        self._tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        self._tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()

    def __call__(self, text: str) -> Any:
        return SimpleNamespace(input_ids=self._tok.encode(text).ids)


def test_a_tokenizer_without_a_vocabulary_refuses_text_by_its_tokens_only(
    tiny_model: Path,
) -> None:
    """Without `get_vocab` the engine assumed 16 characters per token and refused a longer
    text before tokenizing it: 40 words of 25–26 characters (1,069 characters, 40 tokens) were
    "too long" for a 64-token context they fit in. Now such a text is tokenized (off the event
    loop) and refused by its token count only."""
    core = EngineCore()
    assert core.update_weights_from_disk(str(tiny_model))[0]
    tok = WordTokenizer()
    with pytest.raises(AttributeError):
        tok.get_vocab()  # type: ignore[attr-defined]
    served = core._served
    assert served is not None and served.context_length == 64
    core._served = replace(
        served, encoder=tok, max_text_chars=_max_text_chars(tok, served.context_length)
    )
    fits = " ".join(WordTokenizer.WORDS[i % 4] for i in range(40))
    over = " ".join(WordTokenizer.WORDS[i % 4] for i in range(64))
    assert len(fits) > 64 * MIN_CHARS_PER_TOKEN
    sp = {"max_new_tokens": 2, "temperature": 0}
    try:
        with serving(create_app(core)) as url, httpx.Client(base_url=url, timeout=60) as http:
            r = http.post("/generate", json={"text": fits, "sampling_params": sp})
            assert r.status_code == 200, r.text
            assert r.json()["meta_info"]["prompt_tokens"] == 40
            r = http.post("/generate", json={"text": over, "sampling_params": sp})
            assert r.status_code == 400, r.text
            assert "prompt of 64 tokens is too long" in r.json()["error"]["message"]
    finally:
        core.shutdown()
