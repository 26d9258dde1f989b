"""The simulation's world stays the size of the cluster: consumed groups and finished training
steps leave it (`Watch.forget_consumed`, `Watch.forget_finished_steps`) while the invariants that
needed them still hold and replay — which keeps them — still verifies the log. Nothing is
faked: the real core, loop and dispatcher under the simulated edge."""

from __future__ import annotations

import math
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ehp_fsm.core.world import Instance
from ehp_fsm.plan import load_plan, simulate_costs
from ehp_fsm.replay import replay
from ehp_fsm.rollout.client import GenerateResult
from ehp_fsm.sim.costs import Costs, _lognormvariate, _seed
from ehp_fsm.sim.rollout import SimTask, _Answer, _Results
from ehp_fsm.sim.story import Simulation
from ehp_fsm.sim.watch import EventChecks, GroupIds
from ehp_fsm.training.task import GroupSamples, Scored

HEAVY = Path(__file__).parent / "train_heavy.toml"


@given(
    st.lists(
        st.one_of(
            st.integers(0, 5000).map(lambda n: f"g{n}"),
            st.text(max_size=4),
            st.sampled_from(["g\u0663", "g\u00b2", "g\uff13"]),  # digits int() reads, or not
        )
    )
)
def test_group_ids_is_a_set(ids: list[str]) -> None:
    """The bitmap answers as a set would, for `g<n>` ids and any other string (`g01`, `g`,
    `g` and a digit of another script); `add` says whether the id was new."""
    got, want = GroupIds(), set()
    for gid in ids:
        assert (gid in got) == (gid in want)
        assert got.add(gid) == (gid not in want)
        want.add(gid)
        assert len(got) == len(want)
    probe = [*ids, "g0", "g01", "g", "x7", "g5001", "g3", "g\u0663"]
    assert [p in got for p in probe] == [p in want for p in probe]


def test_the_world_does_not_grow_with_steps_and_the_log_still_replays(tmp_path: Path) -> None:
    sim = Simulation(
        load_plan(HEAVY), seed=3, faults="heavy", steps=10, log_path=tmp_path / "t.jsonl"
    )
    r = sim.run()
    world = sim.orch.world
    g = sim.plan.grpo.prompts_per_step
    assert len(world.of("request")) <= 3 * g, "consumed groups left the world"
    assert all(s.state not in ("done", "failed") for s in world.of("training_step").values())
    checks = sim.watch.checks
    assert checks is not None and len(checks.consumed) == 10 * g
    rep = replay(r.log)
    assert rep.transitions == r.transitions
    assert len(rep.world.of("request")) > 10 * g, "replay keeps every group, as the run does"


def test_a_group_under_a_consumed_id_is_a_duplicate(tmp_path: Path) -> None:
    """Forgetting a consumed group must not let its id be used again unseen."""
    sim = Simulation(load_plan(HEAVY), seed=3, steps=1, log_path=tmp_path / "t.jsonl")
    checks = EventChecks(sim.orch.world)
    sim.orch.close()  # never run: only its world is used
    checks.consumed.add("g7")
    out: list[str] = []
    checks._request(Instance("request", "g7", "queued", {}), out)
    assert out == ["group g7 is queued again after it was consumed (a duplicate)"]
    checks.finished_steps.add("step-1")
    out = []
    checks._step(Instance("training_step", "step-1", "collecting", {}), out)
    assert out == ["training step step-1 is collecting again after it finished"]


@given(st.integers(-(2**70), 2**70), st.floats(0.0, 3.0), st.floats(0.0, 10.0))
def test_the_inlined_draws_are_the_librarys(seed: int, sigma: float, mu: float) -> None:
    """`Costs` re-seeds one generator per group and inlines `lognormvariate`: the same numbers
    as a fresh `random.Random(seed)` and the library's method."""
    mine = random.Random()
    _seed(mine, seed)
    lib = random.Random(seed)
    assert [_lognormvariate(mine.random, mu, sigma) for _ in range(8)] == [
        lib.lognormvariate(mu, sigma) for _ in range(8)
    ]


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**20), st.integers(0, 50))
def test_response_lengths_are_drawn_as_before(index: int, seed: int) -> None:
    """A group's lengths: its own `random.Random`, n log-normal draws, rounded and capped."""
    plan = load_plan(HEAVY)
    spec = simulate_costs(plan)
    costs = Costs(spec, seed=seed, faults="on", group_size=plan.grpo.group_size)
    for i in (index, index + 1, 17, 123_456):
        rng = random.Random(seed * 1_000_003 + i)
        mu, cap = math.log(spec.response_median_tokens), spec.response_max_tokens
        want = [
            max(1, min(cap, round(rng.lognormvariate(mu, spec.response_sigma))))
            for _ in range(plan.grpo.group_size)
        ]
        assert costs.response_lengths(i) == want


def test_a_simulated_answer_is_the_clients_results() -> None:
    """`_Answer` builds, without the dataclass's `__init__`, what the constructor builds: one
    result per sample, rid `{gid}.{attempt}.{i}`, as many zero tokens as its length up to 8."""
    results = _Results()
    woken: list[int] = []
    dispatcher = SimpleNamespace(
        config=SimpleNamespace(group_size=3), _results=results, _woken=lambda: woken.append(1)
    )
    _Answer(dispatcher, "g7", 1, "e2", [2, 9, 1], "4")()  # type: ignore[arg-type]
    got = results.get_nowait()
    assert (got.group_id, got.attempt, got.engine, woken) == ("g7", 1, "e2", [1])
    for i, (sample, tokens) in enumerate(zip(got.outputs, [(0, 0), (0,), (0,)], strict=True)):
        want = GenerateResult(
            rid=f"g7.1.{i}",
            text="",
            output_ids=tokens,
            output_logprobs=None,
            finish_reason={"type": "length"},
            weight_version="4",
            raw={},
        )
        assert sample == want and sample.__dict__ == want.__dict__ and not sample.aborted


def test_simulated_scores_are_the_constructors() -> None:
    """`SimTask.score_group` builds, without the dataclass's `__init__`, what the constructor
    builds (its checks cannot fail there), and an empty group still gets the constructor's
    error."""
    got = SimTask().score_group(5, [(0, 0), (0,)], None, revision=3)
    want = GroupSamples(
        group_index=5,
        question=SimTask().question(5),
        completions=((0, 0), (0,)),
        scores=(Scored(reward=0.0, exact=False, well_formed=True),) * 2,
        revision=3,
    )
    assert got == want and got.__dict__ == want.__dict__
    with pytest.raises(ValueError, match="no completions"):
        SimTask().score_group(6, [], revision=3)


def test_a_slow_factor_of_one_is_no_slow_host() -> None:
    """`slow_node_factor = 1.0` (a slow host at full speed) was counted as `slow_hosts N` among
    the faults injected."""
    from dataclasses import replace

    plan = load_plan(HEAVY)
    spec = replace(simulate_costs(plan), slow_node_fraction=1.0)
    hosts = [f"h{i}" for i in range(8)]
    assert len(Costs(spec, seed=0, faults="on", group_size=4).slow_hosts(hosts)) == 8
    one = replace(spec, slow_node_factor=1.0)
    assert Costs(one, seed=0, faults="on", group_size=4).slow_hosts(hosts) == {}
