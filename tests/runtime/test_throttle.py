"""`LogThrottle`: what strangers can make the run log, at a bounded rate (fake clock)."""

from __future__ import annotations

import pytest

from ehp_fsm.throttle import MAX_KINDS, LogThrottle


def test_a_burst_per_kind_then_counted_and_the_count_said_with_the_next_record() -> None:
    t = [0.0]
    th = LogThrottle(burst=3, window_s=10.0, clock=lambda: t[0])
    assert [th.let("a") for _ in range(5)] == [{}, {}, {}, None, None]
    assert th.let("b") == {}  # kinds are apart
    t[0] = 9.9
    assert th.let("a") is None
    t[0] = 10.0  # a new window: the next record says what was left out
    assert th.let("a") == {"suppressed": 3}
    assert th.let("a") == {}


def test_kinds_past_the_bound_share_one_window() -> None:
    th = LogThrottle(burst=1, window_s=60.0, clock=lambda: 0.0)
    for i in range(MAX_KINDS):
        assert th.let(f"k{i}") == {}
    assert th.let("new-1") == {}  # the shared window's first
    assert th.let("new-2") is None
    assert len(th._windows) == MAX_KINDS + 1


def test_a_throttle_that_lets_nothing_through_is_refused() -> None:
    with pytest.raises(ValueError, match="burst 0"):
        LogThrottle(burst=0)
