"""Shared pytest set-up: Hypothesis profiles (deterministic in CI)."""

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


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-architecture model written by `ehp-fsm init-model`'s function (random
    weights from seed 0; its token ids are the built-in task's, so synthetic groups fit it)."""
    from ehp_fsm.models.tiny import init_model

    return init_model(tmp_path_factory.mktemp("model") / "tiny-qwen3", seed=0)
