"""The flow tests' base model: the session's tiny Hugging Face model (`tiny_model_dir`)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir: Path) -> Path:
    return tiny_model_dir
