"""Shared pytest set-up: Hypothesis profiles (deterministic in CI); the edge-coverage test last."""

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=300,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=50, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# Logs written by tests are unkeyed (golden logs compare byte for byte); tests that key a log's
# hash chain pass the key explicitly or set EHP_LOG_KEY with monkeypatch.
os.environ.pop("EHP_LOG_KEY", None)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-architecture model written by `ehp-fsm init-model`'s function (random
    weights from seed 0; its token ids are the built-in task's, so synthetic groups fit it)."""
    from tests.rollout.hf import make_model

    return make_model(tmp_path_factory.mktemp("model") / "tiny-qwen3")
