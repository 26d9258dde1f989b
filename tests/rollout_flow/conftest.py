"""One tiny Hugging Face model per session: the base every flow test's revisions are made from."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.rollout.hf import make_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("tiny-model") / "qwen3")
