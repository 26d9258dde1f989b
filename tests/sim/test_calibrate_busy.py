"""The engine throughput `fit_costs` fits: tokens over the time an engine had a group in flight
and was not installing — the simulation charges installs on their own, so time spent installing
with groups in flight must not be counted as decoding too (it made the simulated steps of the
calibration run ~25 % long)."""

from __future__ import annotations

import pytest

from ehp_fsm.errors import EhpError
from ehp_fsm.sim.calibrate import _busy, _overlap, _union


def test_union_merges_overlapping_and_touching_spans() -> None:
    assert _union([(5.0, 6.0), (0.0, 2.0), (1.0, 3.0), (3.0, 4.0)]) == [(0.0, 4.0), (5.0, 6.0)]


def test_overlap_of_two_interval_lists() -> None:
    assert _overlap([(0.0, 4.0), (5.0, 9.0)], [(3.0, 6.0), (8.5, 20.0)]) == pytest.approx(2.5)
    assert _overlap([(0.0, 1.0)], [(2.0, 3.0)]) == 0.0


def test_install_time_with_groups_in_flight_is_not_decoding() -> None:
    spans = {"e0": [(0.0, 6.0), (4.0, 10.0)], "e1": [(0.0, 2.0)]}
    installs = {"e0": [(4.0, 6.0), (20.0, 21.0)], "e1": [(5.0, 6.0)]}  # e1 idle while installing
    assert _busy(spans, installs) == pytest.approx((10.0 - 2.0) + 2.0)
    assert _busy(spans, {}) == pytest.approx(12.0)


def test_no_completed_group_is_refused() -> None:
    with pytest.raises(EhpError, match="no completed groups"):
        _busy({"e0": [(1.0, 1.0)]}, {})
