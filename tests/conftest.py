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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The edge-coverage test goes last: it reads the edges the role tests of every xdist worker
    recorded, and runs a role machine itself only where that role's test has not run yet (under
    `--dist worksteal` a test at the end runs once both workers are through their share, so the
    role machines are not run twice; by their order in the folder alone it ran early in the
    second worker's share, and ran all seven again: ~100 s of CPU in CI)."""
    last = [i for i in items if i.nodeid.startswith("tests/property/test_zz_edge_coverage.py")]
    if last:
        items[:] = [i for i in items if i not in last] + last
