"""Property tests' shared set-up: none beyond `tests/conftest.py`'s Hypothesis profiles (the
edge-coverage test runs the role machines in a process of its own)."""
