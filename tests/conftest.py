"""Shared pytest set-up: Hypothesis profiles (deterministic in CI)."""

import os

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
