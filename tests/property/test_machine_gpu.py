"""The gpu machine (the GPU ledger) under random events, illegal ones included: foreign owners,
releases by someone else, unconfirmed finalizers, reconciles that do not fit the quarantined
GPU's past, unknown GPUs, events after `failed`. Engines and Hybrids are launched now and then so
that real owners exist. Invariants: see `strategies.Harness` (one owner per GPU, the ledger adds
up, owner changes only through the finalizer, rejected = unchanged, replay == run)."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import rule

from tests.property.role_edges import check_role
from tests.property.strategies import Harness, RoleMachine


class GpuLedger(RoleMachine):
    FOCUS = ("gpu",)
    SUPPORT = ("rollout_engine", "hybrid_replica")

    @rule(gid=st.sampled_from(["h1:g0", "h1:g1", "h2:g0", "h2:g1"]))
    def finalize(self, gid: str) -> None:
        """The owner's agent confirms a releasing GPU free (the finalizer), as it would."""
        g = self.h.world.get("gpu", gid)
        assert g is not None
        self.h.fire(
            "gpu",
            gid,
            "confirm_free",
            {"owner": g.get("owner"), "processes_exited": True, "memory_free": True},
        )


GpuLedger.TestCase.settings = settings(GpuLedger.TestCase.settings, stateful_step_count=30)


def test_the_gpu_ledger_holds_and_accepts_every_edge() -> None:
    """Run in a fresh process (`role_edges.check_role`: why there), derandomized with the `ci`
    profile's examples: every invariant holds and every edge it is responsible for is
    accepted."""
    check_role(GpuLedger)


def test_a_live_owner_cannot_give_its_gpu_back_behind_its_own_back() -> None:
    """Regression (found by this file): `release` by a live engine's name, then the finalizer,
    left the engine holding a free GPU. Now the release waits for the engine to stop."""
    h = Harness()
    try:
        token = h.token("e0")
        launch = {"host": "h1", "gpus": ["h1:g0"], "tp": 1, "token": token}
        assert h.fire("rollout_engine", "e0", "launch", launch).accepted
        out = h.fire("gpu", "h1:g0", "release", {"owner": "engine:e0"})
        assert not out.accepted and "still starting" in out.reason  # type: ignore[union-attr]
        assert h.fire("gpu", "h1:g0", "quarantine").accepted
        assert not h.fire("gpu", "h1:g0", "reconcile_released").accepted
        assert h.fire("gpu", "h1:g0", "reconcile_owned", {"owner": "engine:e0"}).accepted
        assert h.fire("rollout_engine", "e0", "stop").accepted
        assert h.fire("gpu", "h1:g0", "quarantine").accepted
        assert h.fire("rollout_engine", "e0", "fail").accepted  # skips the quarantined GPU
        out = h.fire("gpu", "h1:g0", "reconcile_owned", {"owner": "engine:e0"})
        assert not out.accepted and "gone" in out.reason  # type: ignore[union-attr]
        assert h.fire("gpu", "h1:g0", "reconcile_released").accepted
        confirm = {"owner": "engine:e0", "processes_exited": True, "memory_free": True}
        assert h.fire("gpu", "h1:g0", "confirm_free", confirm).accepted
    finally:
        h.finish()
