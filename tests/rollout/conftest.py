"""Fixtures for the rollout tests: a tiny Hugging Face model (one per session), a revision store
with two revisions of it, and launched engines.

Engines are real `python -m ehp_fsm.rollout.server` processes on real sockets. The contract
suite runs against a real SGLang server instead when `EHP_SGLANG_URL` is set (then
`EHP_SGLANG_MODEL_PATH` names the model folder `/update_weights_from_disk` reloads).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ehp_fsm.rollout import (
    RevisionStore,
    SGLangClient,
    launch_engine,
    stop_engine,
)

from .hf import revision_state


def make_store(root: Path, base: Path, revisions: tuple[int, ...] = (1, 2)) -> RevisionStore:
    store = RevisionStore(root)
    for r in revisions:
        store.save(revision=r, step=r, state_dict=revision_state(base, r), base=base)
    return store


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir: Path) -> Path:
    """The session's tiny Hugging Face model (the root conftest's `tiny_model_dir`)."""
    return tiny_model_dir


@pytest.fixture
def store(tmp_path: Path, tiny_model: Path) -> RevisionStore:
    return make_store(tmp_path / "revisions", tiny_model)


@dataclass(frozen=True)
class Target:
    """What the contract suite runs against."""

    kind: str  # "embedded" | "sglang"
    url: str
    install_path: str  # a folder /update_weights_from_disk accepts
    other_install_path: str  # a second one (embedded: a different revision)
    long_params: dict[str, object]  # sampling params for a request that stays in flight ~1 s+


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Target]:
    url = os.environ.get("EHP_SGLANG_URL")
    if url:
        model = os.environ.get("EHP_SGLANG_MODEL_PATH")
        if not model:
            pytest.fail("EHP_SGLANG_URL is set but EHP_SGLANG_MODEL_PATH is not")
        yield Target(
            kind="sglang",
            url=url,
            install_path=model,
            other_install_path=model,
            long_params={"max_new_tokens": 4000, "ignore_eos": True, "temperature": 1.0},
        )
        return
    store = make_store(tmp_path_factory.mktemp("contract-revisions"), tiny_model)
    handle = launch_engine(model_path=store.path(1), decode_delay_ms=40.0)
    try:
        yield Target(
            kind="embedded",
            url=handle.url,
            install_path=str(store.path(1)),
            other_install_path=str(store.path(2)),
            long_params={"max_new_tokens": 28, "ignore_eos": True, "temperature": 1.0},
        )
    finally:
        stop_engine(handle)


@pytest.fixture
def client(target: Target) -> Iterator[SGLangClient]:
    with SGLangClient(target.url, timeout_s=10.0, generate_timeout_s=120.0) as c:
        yield c
