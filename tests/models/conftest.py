"""One tiny Qwen3 model per test session (writing one costs ~1 s)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ehp_fsm.models.tiny import init_model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("tiny") / "qwen3", arch="qwen3", seed=7)
