"""Planner inputs are validated with what/why/fix messages; bad worlds are never planned on."""

from __future__ import annotations

import dataclasses

import pytest

from ehp_fsm.core.planner import (
    ClusterView,
    CoreLayout,
    Decision,
    EngineView,
    GpuView,
    PlannerInputError,
    PlannerState,
    Shortfall,
    decide,
)
from ehp_fsm.errors import EhpError
from tests.planner.cluster import ClusterBuilder, metrics, policy


def _view(**overrides: object) -> ClusterView:
    base: dict[str, object] = {
        "version": 0,
        "hosts": ("a",),
        "gpus": (GpuView(gpu_id="g0", host="a", state="owned", owner="engine:e0"),),
        "engines": (EngineView(engine_id="e0", host="a", tp=1, gpu_ids=("g0",), state="serving"),),
        "hybrids": (),
        "core": CoreLayout(replicas=1, replica_size=1),
    }
    base.update(overrides)
    return ClusterView(**base)  # type: ignore[arg-type]


def test_a_gpu_listed_by_two_live_holders_is_rejected() -> None:
    e1 = EngineView(engine_id="e1", host="a", tp=1, gpu_ids=("g0",), state="starting")
    e0 = EngineView(engine_id="e0", host="a", tp=1, gpu_ids=("g0",), state="serving")
    with pytest.raises(PlannerInputError, match="two owners") as err:
        _view(engines=(e0, e1))
    assert isinstance(err.value, EhpError)
    assert "Fix:" in str(err.value)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"hosts": ("b",)}, "not in hosts"),
        ({"gpus": (GpuView(gpu_id="g0", host="a", state="owned", owner="engine:zz"),)}, "zz"),
        ({"gpus": (GpuView(gpu_id="g0", host="a", state="free"),)}, "listed|owner"),
        ({"hosts": ("a", "a")}, "twice"),
    ],
)
def test_inconsistent_snapshots_are_rejected(overrides: dict[str, object], match: str) -> None:
    with pytest.raises(PlannerInputError, match=match):
        _view(**overrides)


def test_a_free_gpu_with_an_owner_is_rejected() -> None:
    with pytest.raises(PlannerInputError, match="free GPU has no owner"):
        GpuView(gpu_id="g", host="a", state="free", owner="core")


def test_an_engine_must_list_tp_gpus() -> None:
    with pytest.raises(PlannerInputError, match="TP2 engine lists 1"):
        EngineView(engine_id="e", host="a", tp=2, gpu_ids=("g",), state="serving")


def test_a_policy_without_a_hysteresis_band_is_rejected() -> None:
    with pytest.raises(PlannerInputError, match="hysteresis"):
        policy(borrow_threshold=1.0, release_threshold=1.0)


def test_a_policy_whose_replica_size_differs_from_the_core_is_rejected() -> None:
    b = ClusterBuilder(replica_size=2)
    b.host("a")
    b.engine("a", 2)
    with pytest.raises(PlannerInputError, match="Core replica size"):
        decide(
            view=b.build(),
            metrics=metrics(1, 1),
            policy=policy(replica_size=4),
            state=PlannerState(),
            now=0.0,
        )


def test_time_going_backwards_is_rejected() -> None:
    b = ClusterBuilder()
    b.host("a")
    state = PlannerState(last_change_at=50.0, last_direction="borrow", settle_s=1.0)
    with pytest.raises(PlannerInputError, match="monotonic"):
        decide(view=b.build(), metrics=metrics(1, 1), policy=policy(), state=state, now=10.0)


def test_a_decision_records_a_shortfall_exactly_when_wanted_exceeds_granted() -> None:
    b = ClusterBuilder()
    b.host("a")
    d = decide(
        view=b.build(),
        metrics=metrics(20, 5),
        policy=policy(max_hybrids=1),
        state=PlannerState(),
        now=0.0,
    )
    assert d.shortfall == Shortfall(wanted=1, granted=0, reason=d.shortfall.reason)  # type: ignore[union-attr]
    assert d.shortfall is not None
    assert d.shortfall.as_record()["wanted"] == 1
    assert "shortfall" in d.summary()
    # the world's version is named as one ("planner v100" read like a GPU model's name)
    assert d.summary().startswith(f"on world version {d.based_on_version}, "), d.summary()
    with pytest.raises(PlannerInputError, match="exactly when"):
        dataclasses.replace(d, shortfall=None)
    with pytest.raises(PlannerInputError):
        Decision(**{**{f.name: getattr(d, f.name) for f in dataclasses.fields(d)}, "granted": 1})
