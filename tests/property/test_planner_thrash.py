"""The planner never thrashes on a cluster whose step times follow its model exactly.

The far edge is faked on purpose: a synthetic cluster (`tests.planner.cluster.apply_decision`,
then every new Hybrid joins and every restarted engine serves by the next step) whose measured
times are the model's — training a*ceil(G/N) on N replicas (Core + active Hybrids: the batch
partition's largest share), rollout b/S on S serving GPUs, the step their max when they overlap
and their sum otherwise. Random Core sizes, engine TPs, replica sizes, per-group training cost,
rollout cost, policies. `decide` runs in a closed loop on it with the workload unchanged.

Property: every move the planner makes shortens the true step (so is not worse than holding),
hence the cluster never comes back to a configuration it left — no borrow is undone by a return
to where it started, no return by a borrow — and it settles: the last decisions hold. The old
planner (borrow `max_hybrids`, return all) fails it: one borrow makes rollout the bottleneck.
"""

from __future__ import annotations

import dataclasses
import math

from hypothesis import event, given
from hypothesis import strategies as st

from ehp_fsm.core.planner import (
    ClusterView,
    Metrics,
    PlannerPolicy,
    PlannerState,
    decide,
)
from tests.planner.cluster import ClusterBuilder, apply_decision

ROUNDS = 24


@dataclasses.dataclass(frozen=True)
class Workload:
    groups: int
    train_s_per_group: float
    rollout_gpu_s: float
    overlapped: bool

    def step(self, view: ClusterView) -> tuple[float, float, float]:
        """(train, rollout, step) seconds of the next step on `view`, as measured."""
        replicas = view.core.replicas + sum(1 for h in view.hybrids if h.state == "active")
        gpus = sum(e.tp for e in view.engines if e.state == "serving")
        train = self.train_s_per_group * math.ceil(self.groups / replicas)
        rollout = self.rollout_gpu_s / gpus if gpus else math.inf
        return train, rollout, max(train, rollout) if self.overlapped else train + rollout


@st.composite
def loops(draw: st.DrawFn) -> tuple[ClusterView, PlannerPolicy, Workload]:
    rs = draw(st.sampled_from((1, 2, 4)))
    core = draw(st.integers(1, 4))
    b = ClusterBuilder(replica_size=rs, core_replicas=core)
    b.host("core")
    b.core("core", core * rs)
    for i in range(draw(st.integers(1, 4))):
        host = f"h{i}"
        b.host(host)
        left = 8
        while left > 0:
            tp = draw(st.sampled_from([t for t in (1, 2, 4, 8) if t <= left]))
            b.engine(host, tp)
            left -= tp
    b.host("lent")  # Hybrids borrowed earlier (so that returns are drawn too)
    for _ in range(draw(st.integers(0, 8 // rs))):
        b.hybrid("lent", state="active")
    view = b.build()
    total = sum(e.tp for e in view.engines)
    release = draw(st.floats(0.3, 1.0))
    policy = PlannerPolicy(
        rollout_reserve=draw(st.integers(0, total // 2)),
        replica_size=rs,
        allowed_engine_tps=(1, 2, 4, 8),
        borrow_threshold=release + draw(st.floats(0.05, 1.5)),
        release_threshold=release,
        cooldown_s=draw(st.sampled_from((0.0, 30.0))),
        engine_restart_s=20.0,
        release_resume_s=2.0,
        max_hybrids=draw(st.integers(8 // rs, 16)),
        groups_per_step=(groups := draw(st.integers(core, 96))),
        rollout_overlaps_training=(overlapped := draw(st.booleans())),
    )
    # Rollout cost from the first step's train/rollout ratio, mostly past a threshold.
    per_group = draw(st.floats(0.05, 5.0))
    replicas = core + sum(1 for h in view.hybrids if h.state == "active")
    ratio = draw(st.one_of(st.floats(0.05, 0.8), st.floats(1.5, 20.0), st.floats(0.05, 20.0)))
    work = Workload(
        groups=groups,
        train_s_per_group=per_group,
        rollout_gpu_s=per_group * math.ceil(groups / replicas) * total / ratio,
        overlapped=overlapped,
    )
    return view, policy, work


def _settle(view: ClusterView) -> ClusterView:
    """By the next step every new Hybrid trains and every restarted engine serves."""
    return dataclasses.replace(
        view,
        version=view.version + 1,
        hybrids=tuple(
            dataclasses.replace(h, state="active") if h.state == "allocated" else h
            for h in view.hybrids
        ),
        engines=tuple(
            dataclasses.replace(e, state="serving") if e.state == "starting" else e
            for e in view.engines
        ),
    )


def _shape(view: ClusterView) -> tuple[int, tuple[tuple[str, int], ...]]:
    """A configuration: active Hybrids and the serving engines' (host, TP) multiset."""
    hybrids = sum(1 for h in view.hybrids if h.state == "active")
    return hybrids, tuple(sorted((e.host, e.tp) for e in view.engines if e.state == "serving"))


@given(loops())
def test_the_planner_in_a_closed_loop_only_makes_moves_that_shorten_the_step(
    loop: tuple[ClusterView, PlannerPolicy, Workload],
) -> None:
    view, policy, work = loop
    state, now = PlannerState(), 0.0
    seen = {_shape(view)}
    moves: list[str] = []
    held_since = 0
    for i in range(ROUNDS):
        train, rollout, step = work.step(view)
        metrics = Metrics(train_seconds=train, rollout_seconds=rollout)
        d = decide(view=view, metrics=metrics, policy=policy, state=state, now=now)
        state, now = d.next_state, now + step
        if not d.actions:
            continue
        held_since = i + 1
        view = _settle(apply_decision(view, d)[0])
        after = work.step(view)[2]
        moves.append(d.direction)
        # The move is not worse than holding — it is strictly better: the step shortens.
        assert after < step, (d.direction, step, after, d.reason)
        # So the cluster never comes back to where it was (no borrow undone by a return).
        shape = _shape(view)
        assert shape not in seen, (moves, d.reason)
        seen.add(shape)
    event(f"moves={len(moves)}: {'/'.join(moves[:4])}")
    # It settles: the last rounds (past any cooldown) hold.
    assert held_since <= ROUNDS - 4, moves
