"""A process's failure as the log keeps it: bounded, its start and its end (the cause)."""

from __future__ import annotations

from ehp_fsm.runtime.reconcile import _bounded


def test_a_long_launch_failure_keeps_its_start_and_its_cause() -> None:
    """An engine's launch failure ends with its log's last lines, where the cause is: cut at
    300 characters it read "... the weights of /tmp/pu/models/mixtra" and the cause was gone."""
    reason = "launch failed on h1: Failed to update weights from /m: " + "x" * 400 + " the cause"
    kept = _bounded(reason)
    assert len(kept) <= 300
    assert kept.startswith("launch failed on h1: Failed to update weights")
    assert kept.endswith(" the cause") and " […] " in kept
    assert _bounded("short") == "short"
