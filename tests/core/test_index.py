"""The world's index (`core.index`) answers what the scans answer, at every call of the guards
that read it — inside steps, with their pending changes — and after every applied step, through
a simulated run with heavy faults (engine and Hybrid deaths, silent agents, borrows and returns:
drains, failures, requeues and GPU hand-overs at every turn). The random-event property tests
check the same after each of their events (`tests.property.strategies.index_problems`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

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
