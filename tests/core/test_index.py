"""The world's index (`core.index`) answers what the scans answer, at every call of the guards
that read it — inside steps, with their pending changes — and after every applied step, through
a simulated run with heavy faults (engine and Hybrid deaths, silent agents, borrows and returns:
drains, failures, requeues and GPU hand-overs). In those runs the guards are asked at the root of
a step (no pending change), so a hypothesis test adds any pending step on top of any applied
ones, as a guard inside a cascade would see the world. The random-event property tests check the
index after each of their events (`tests.property.strategies.index_problems`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ehp_fsm.core import effects, guards
from ehp_fsm.core.index import Index
from ehp_fsm.core.transition import View
from ehp_fsm.core.world import Instance, World
from ehp_fsm.plan import load_plan
from ehp_fsm.sim.story import RunStopped, Simulation
from ehp_fsm.specfiles import load_specs
from tests.property.strategies import index_problems

HEAVY = Path(__file__).parents[1] / "sim" / "train_heavy.toml"


@pytest.mark.parametrize("seed", [1, 2])
def test_index_answers_as_the_scans_through_a_faulty_run(
    seed: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: Counter[str] = Counter()
    inflight, rollout, apply = guards.inflight_requests, guards.rollout_gpus, World.apply

    def inflight_checked(view: View, engine_id: str) -> list[str]:
        calls["inflight"] += 1
        got = inflight(view, engine_id)
        assert got == guards.inflight_requests_scan(view, engine_id), (engine_id, view.changes)
        return got

    def rollout_checked(view: View, *, without: str | None = None) -> int:
        calls["rollout"] += 1
        got = rollout(view, without=without)
        assert got == guards.rollout_gpus_scan(view, without=without), (without, view.changes)
        return got

    def apply_checked(
        world: World, changes: Mapping[tuple[str, str], Instance], globals_: Mapping[str, Any]
    ) -> None:
        apply(world, changes, globals_)
        calls["apply"] += 1
        if calls["apply"] % 7 == 0 or any(m == "rollout_engine" for m, _ in changes):
            assert index_problems(world) == []

    monkeypatch.setattr(guards, "inflight_requests", inflight_checked)
    monkeypatch.setattr(effects, "inflight_requests", inflight_checked)
    monkeypatch.setattr(guards, "rollout_gpus", rollout_checked)
    monkeypatch.setattr(World, "apply", apply_checked)
    plan = load_plan(HEAVY)
    sim = Simulation(plan, seed=seed, faults="heavy", steps=6, log_path=tmp_path / "t.jsonl")
    try:
        result = sim.run()
        assert result.borrows  # the planner moved GPUs: drains and reserve checks ran
    except RunStopped:
        pass  # a step failed on every attempt: the run stops as `ehp-fsm run` would
    assert calls["inflight"] > 0 and calls["rollout"] > 0, calls
    assert index_problems(sim.orch.world) == []


def test_a_world_written_behind_apply_is_seen_until_reindexed() -> None:
    """The check can fail: an instance written around `World.apply` leaves the index behind."""
    world = World(load_specs(), {"inventory": {"h:g0": "h"}})
    world.instances["request"]["g0"] = Instance(
        "request", "g0", "dispatched", {"engine": "e0", "revision": 1}
    )
    assert any("inflight" in p for p in index_problems(world))
    world.reindex()
    assert index_problems(world) == []
    assert world.index.inflight == Index.build(world.instances).inflight == {"e0": {"g0"}}


_GPUS = [f"h{h}:g{g}" for h in range(2) for g in range(3)]
_ENGINES = ["e0", "e1", "e2"]
_request = st.builds(
    lambda iid, state, engine: Instance("request", iid, state, {"engine": engine}),
    st.sampled_from(["g0", "g1", "g2", "g3"]),
    st.sampled_from(["queued", "dispatched", "completed"]),
    st.sampled_from([*_ENGINES, None, 7]),
)
_gpu = st.builds(
    lambda iid, state, owner: Instance("gpu", iid, state, {"host": iid[:2], "owner": owner}),
    st.sampled_from(_GPUS),
    st.sampled_from(["free", "owned", "releasing"]),
    st.sampled_from([*(f"engine:{e}" for e in _ENGINES), "core", "hybrid:x1", None]),
)
_engine = st.builds(
    lambda iid, state, gpus: Instance("rollout_engine", iid, state, {"gpus": gpus}),
    st.sampled_from(_ENGINES),
    st.sampled_from(["starting", "installing", "serving", "updating", "draining", "stopped"]),
    st.lists(st.sampled_from(_GPUS), max_size=4),
)
_change = st.one_of(_request, _gpu, _engine)


_BASE = {
    (i.machine, i.id): i
    for e, state, gpus in [
        ("e0", "serving", ["h0:g0", "h0:g1"]),
        ("e1", "updating", ["h1:g0"]),
        ("e2", "installing", ["h1:g1", "h1:g2"]),
    ]
    for i in [
        Instance("rollout_engine", e, state, {"gpus": gpus}),
        *(Instance("gpu", g, "owned", {"host": g[:2], "owner": f"engine:{e}"}) for g in gpus),
        Instance("request", f"g-{e}", "dispatched", {"engine": e}),
    ]
}


@settings(max_examples=300)
@given(st.lists(st.lists(_change, min_size=1, max_size=4), max_size=6), st.lists(_change))
def test_index_and_pending_changes_answer_as_the_scans(
    steps: list[list[Instance]], pending: list[Instance]
) -> None:
    """Any instances applied step by step, then any pending step on top (as a guard inside a
    cascade sees it): the kept index equals a rebuilt one, and both guards answer as their
    scans for every engine — the pending engines, GPUs and requests included."""
    world = World(load_specs(), {"inventory": dict.fromkeys(_GPUS, "h")})
    world.apply(_BASE, {})  # three engines serving rollout on GPUs they own, to start from
    for changes in steps:
        world.apply({(i.machine, i.id): i for i in changes}, {})
    assert index_problems(world) == []
    view = View(world, {(i.machine, i.id): i for i in pending})
    for eid in [None, *_ENGINES, "nowhere"]:
        if eid is not None:
            assert guards.inflight_requests(view, eid) == guards.inflight_requests_scan(view, eid)
        assert guards.rollout_gpus(view, without=eid) == guards.rollout_gpus_scan(view, without=eid)


def test_the_indexed_invariant_check_finds_what_the_full_scan_finds() -> None:
    """A run checks the invariants after every event with `indexed=True` (only the claimed and
    dispatched groups, from the index): on a world with group violations written through
    `World.apply`, it reports exactly what the full scan reports."""
    from ehp_fsm.core.invariants import check_invariants

    world = World(load_specs(), {"inventory": {"h:g0": "h"}})
    world.apply(
        {
            ("request", "g-lost"): Instance("request", "g-lost", "claimed", {}),
            ("request", "g-done"): Instance("request", "g-done", "consumed", {}),
            ("request", "g-far"): Instance("request", "g-far", "dispatched", {"engine": "e9"}),
            ("training_step", "step-1"): Instance(
                "training_step", "step-1", "computing", {"groups": ["g-done", "g-none"]}
            ),
        },
        {},
    )
    full = check_invariants(world)
    assert sorted(check_invariants(world, indexed=True)) == sorted(full)
    for needle in (
        "g-lost is claimed",
        "g-done, which is consumed",
        "g-none, which does not exist",
        "g-far is dispatched to engine 'e9'",
    ):
        assert any(needle in p for p in full), full
