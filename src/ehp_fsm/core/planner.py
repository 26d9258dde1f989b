"""The global resource planner (GRP): how many Hybrid replicas, and which GPUs move — pure.

What it knows: `decide(view=, metrics=, policy=, state=, now=)` turns a world snapshot, metrics,
the plan's EHP policy and the planner's own memory into a `Decision` (wanted, granted, ordered
actions, a shortfall record exactly when wanted > granted, the reason, and the world version it
was computed from). `validate_decision(decision, view)` says why a decision must not be applied
to a world (stale version, or an action whose precondition no longer holds).

What it does not know: clocks, I/O, logging, randomness, torch, or how actions are carried out.
The executor turns each action into machine events; the machines' guards re-check each one.

The decision rule:
1. Signal. ratio = train_seconds / rollout_seconds. ratio >= borrow_threshold: borrow;
   ratio <= release_threshold: return; in between: hold (the hysteresis band). A borrow is held
   back while rollout is saturated (queue or active pressure >= saturation_pressure, or any
   rejected request). A signal that would reverse the last change is held back until that change
   has settled (`PlannerState.blocks`: cooldown_s + engine_restart_s when the change stopped or
   restarted engines, + release_resume_s otherwise). Held signals are "hold", never a shortfall.
2. Wanted: the count the step-time prediction picks (`ehp_fsm.core.planner_predict`: training
   time scales with the largest share of the fixed batch one replica trains, ceil(G/replicas);
   rollout time with 1/serving GPUs; the step takes the longer of the two when rollout overlaps
   training, else their sum; basis: the measured step's Core + active Hybrids and serving
   engines, counting engines starting or installing as serving next step). Current = replicas
   requested, joining (allocated..ready) or active; the prediction for holding is Core +
   current replicas.
   borrow: the count in current..max_hybrids with the least predicted step time (equal times:
   the most replicas, so fewer carry the largest share), rollout GPUs lost estimated at the
   average cost of the largest allocation that fits. The move is made only when the exact
   allocation for that count (capped at what fits) is predicted to beat holding; otherwise
   wanted = current and nothing moves. A shortfall is recorded when wanted > granted.
   return: the number n of replicas to return (in the order of 4) with the least predicted step
   time, fewest on equal times, counting every GPU the return would restart; n may be 0 (free
   GPUs still restart) and nothing moves unless the prediction beats holding.
   hold: the current count, capped at `max_hybrids` (the excess returns).
   The reason names the predicted step of holding and of the move. With the steps left known
   (`Metrics.steps_left`), a move is made only when the time it saves a step, times the steps
   left, exceeds its cost: `release_resume_s` for a borrow, `engine_restart_s` for a return
   (whose engines serve only after their restart).
3. Borrow. Budget = serving GPUs - rollout_reserve, in physical GPUs: only `serving` engines
   count, and stopping an engine costs all of its GPUs. Allocation follows
   `ehp_fsm.core.planner_alloc` (free GPUs first, complete one-host sets, least capacity lost,
   fewest stranded). Every stopped engine feeds a replica of the same decision; if no complete
   set fits, nothing stops. If failures alone put serving GPUs below the reserve, nothing is
   borrowed (not even free GPUs) and the shortfall says so.
4. Return. Replicas leave least-progressed first: requested, then joining (CancelJoin), then
   active (StopHybrid), by id. Their GPUs still `owned` (not quarantined or failed) — plus, on a
   return signal, every free GPU — restart as engines per host with
   `planner_alloc.partition_tps` (fewest stranded GPUs; smallest allowed TP when rollout is
   saturated, largest otherwise).
5. Floor (`PlannerPolicy.min_hybrids`, cut to G - Core replicas): while fewer Hybrids are
   current and a return's cooldown does not hold it back, the decision borrows up to the floor
   by the allocation of 3 — whatever the signal and the prediction say — with a shortfall for
   what does not fit; a return never keeps fewer than the floor (`return_all`, at the run's
   end, keeps none).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from ehp_fsm.core.planner_alloc import (
    HostAllocation,
    ViewIndex,
    allocate_replicas,
    free_by_host,
    index_view,
    partition_tps,
)
from ehp_fsm.core.planner_model import (
    HYBRID_CURRENT,
    HYBRID_JOINING,
    Action,
    CancelJoin,
    ClusterView,
    CoreLayout,
    Decision,
    EngineView,
    GpuView,
    HybridView,
    Metrics,
    PlannerInputError,
    PlannerPolicy,
    PlannerState,
    RestartEngine,
    Shortfall,
    StartHybrid,
    StopEngine,
    StopHybrid,
)
from ehp_fsm.core.planner_predict import Prediction, StepModel

__all__ = [
    "Action",
    "CancelJoin",
    "ClusterView",
    "CoreLayout",
    "Decision",
    "EngineView",
    "GpuView",
    "HybridView",
    "Metrics",
    "PlannerInputError",
    "PlannerPolicy",
    "PlannerState",
    "RestartEngine",
    "Shortfall",
    "StartHybrid",
    "StopEngine",
    "StopHybrid",
    "decide",
    "rollout_gpus",
    "serving_gpus",
    "validate_decision",
]

_PROGRESS = {state: rank for rank, state in enumerate(HYBRID_CURRENT)}
_JOINING = frozenset(("requested", *HYBRID_JOINING))
_ENGINE_ACTIONS = (StopEngine, RestartEngine)


def serving_gpus(view: ClusterView) -> int:
    """Physical GPUs of `serving` engines that are `owned` by them (what rollout really has)."""
    return index_view(view).serving_gpus


def rollout_gpus(view: ClusterView) -> int:
    """The GPUs a step's rollout time is measured on (`StepModel.rollout_gpus`): the `owned`
    GPUs of the engines serving or briefly updating to a new revision."""
    return _served_and_coming(view, index_view(view).not_owned)[0]


def decide(
    *,
    view: ClusterView,
    metrics: Metrics,
    policy: PlannerPolicy,
    state: PlannerState,
    now: float,
) -> Decision:
    """Compute the decision for `view`. Same arguments, same decision."""
    _check_inputs(view, policy, state, now)
    index = index_view(view)
    rs = policy.replica_size
    for h in index.current:
        if h.gpu_ids and len(h.gpu_ids) != rs:
            raise PlannerInputError(
                f"hybrids[{h.hybrid_id}].gpu_ids",
                f"it holds {len(h.gpu_ids)} GPUs, not replica_size {rs}",
                "reconcile the replica before planning",
            )
    current = len(index.current)
    signal, why, saturated = _signal(metrics, policy, state, now)
    floor = _floor(view, policy)
    if signal == "borrow" and policy.max_hybrids > current:
        basis = _basis(view, index, metrics, policy)
        d = _borrow(view, index, policy, state, now, current, why, basis, metrics)
        if d.granted >= floor or state.blocks("borrow", now):
            return d
        return _floor_borrow(
            view, index, policy, state, now, current, floor, why, wanted=max(floor, d.wanted)
        )
    if current < floor and not state.blocks("borrow", now):
        return _floor_borrow(view, index, policy, state, now, current, floor, why)
    if signal == "return":
        basis = _basis(view, index, metrics, policy)
        wanted, include_free, why = _return_count(
            index, policy, saturated, current, why, basis, metrics, floor
        )
    else:
        wanted, include_free = min(current, policy.max_hybrids), False
        if current > wanted:
            why += f"; {current} replicas exceed max_hybrids {policy.max_hybrids}"
        elif signal == "borrow":
            why += f"; already at max_hybrids {policy.max_hybrids}"
    actions = _return(index, current - wanted, include_free, policy, saturated)
    direction = "return" if actions else ("hold" if signal == "borrow" else signal)
    return _decision(
        view, index, policy, state, now, direction, current, wanted, wanted, actions, None, why
    )


def return_all(
    *,
    view: ClusterView,
    policy: PlannerPolicy,
    state: PlannerState,
    now: float,
    restart_engines: bool = True,
) -> Decision:
    """Every Hybrid returns, by the same actions a planned return takes: joins not done are
    cancelled, active replicas leave at the step boundary, and their GPUs come back as engines
    of the allowed TPs (the largest that fit). At the end of a run that then stops every
    engine (`ehp-fsm run`, `ehp-fsm simulate`), `restart_engines=False` leaves the GPUs free
    instead: starting an engine only to stop it costs the engine's whole start (SGLang: a
    minute or more) and gives nothing."""
    _check_inputs(view, policy, state, now)
    index = index_view(view)
    current = len(index.current)
    actions = _return(index, current, False, policy, False)
    why = "end of run: every Hybrid returns"
    if not restart_engines:
        actions = tuple(a for a in actions if not isinstance(a, RestartEngine))
        why += "; its GPUs stay free (the run stops every engine)"
    return _decision(view, index, policy, state, now, "return", current, 0, 0, actions, None, why)


def _check_inputs(
    view: ClusterView, policy: PlannerPolicy, state: PlannerState, now: float
) -> None:
    if not math.isfinite(now):
        raise PlannerInputError(
            "now", f"it is {now!r}", "pass the caller's clock as a finite float"
        )
    if view.core.replica_size != policy.replica_size:
        raise PlannerInputError(
            "policy.replica_size",
            f"it is {policy.replica_size} but the Core replica size is {view.core.replica_size}",
            "a Hybrid replica has the Core replica's shape; make them equal",
        )
    if state.last_change_at is not None and now < state.last_change_at:
        raise PlannerInputError(
            "now",
            f"{now} is before the last change at {state.last_change_at}",
            "pass a monotonic clock",
        )


def _signal(
    metrics: Metrics, policy: PlannerPolicy, state: PlannerState, now: float
) -> tuple[str, str, bool]:
    """(signal, reason, saturated) per steps 1 of the module rule."""
    ratio = metrics.train_rollout_ratio
    pressure = max(metrics.queue_pressure, metrics.active_pressure)
    saturated = pressure >= policy.saturation_pressure or metrics.rejected > 0
    if ratio >= policy.borrow_threshold:
        signal = "borrow"
        why = f"train/rollout time ratio {ratio:.4g} >= borrow threshold {policy.borrow_threshold}"
    elif ratio <= policy.release_threshold:
        signal = "return"
        why = (
            f"train/rollout time ratio {ratio:.4g} <= release threshold {policy.release_threshold}"
        )
    else:
        signal = "hold"
        why = (
            f"train/rollout time ratio {ratio:.4g} is inside the hysteresis band "
            f"({policy.release_threshold}, {policy.borrow_threshold})"
        )
    if signal == "borrow" and saturated:
        signal = "hold"
        why += (
            f"; but rollout is saturated (pressure {pressure:.4g} vs "
            f"{policy.saturation_pressure}, {metrics.rejected} rejected): nothing is borrowed"
        )
    if signal != "hold" and state.blocks(signal, now):
        until = (state.last_change_at or 0.0) + state.settle_s
        why += (
            f"; but the last change ({state.last_direction} at t={state.last_change_at}) "
            f"settles until t={until}: cooldown, holding"
        )
        signal = "hold"
    return signal, why, saturated


class _Basis:
    """The measured step as a `StepModel`, and what holding leads to: Core + current replicas
    train, and the engines serving now or about to (starting, installing) serve."""

    __slots__ = ("core", "hold", "hold_gpus", "model")

    def __init__(self, model: StepModel, core: int, current: int, hold_gpus: int) -> None:
        self.model = model
        self.core = core
        self.hold_gpus = hold_gpus
        self.hold = model.predict(core + current, hold_gpus)


_SERVED = frozenset(("serving", "updating"))
_COMING = frozenset(("starting", "installing"))


def _basis(view: ClusterView, index: ViewIndex, metrics: Metrics, policy: PlannerPolicy) -> _Basis:
    """What the measured step ran on: Core plus the active Hybrids trained (joining ones had not
    joined yet), and the `owned` GPUs of the engines serving (or briefly updating) rolled out."""
    active = sum(1 for h in index.current if h.state == "active")
    served, coming = _served_and_coming(view, index.not_owned)
    core = view.core.replicas
    model = StepModel(
        train_s=metrics.train_seconds,
        rollout_s=metrics.rollout_seconds,
        train_replicas=core + active,
        rollout_gpus=served,
        groups=policy.groups_per_step,
        overlapped=policy.rollout_overlaps_training,
    )
    return _Basis(model, core, len(index.current), served + coming)


def _served_and_coming(view: ClusterView, not_owned: set[str]) -> tuple[int, int]:
    """`owned` GPUs of the engines serving (or briefly updating), and of those starting or
    installing."""
    served = coming = 0
    for e in view.engines:
        if e.state in _SERVED or e.state in _COMING:
            n = e.tp - (len(not_owned.intersection(e.gpu_ids)) if not_owned else 0)
            if e.state in _SERVED:
                served += n
            else:
                coming += n
    return served, coming


def _floor(view: ClusterView, policy: PlannerPolicy) -> int:
    """The Hybrids the plan keeps at least (`min_hybrids`), no more than the batch has groups
    for beside the Core (each replica trains whole groups: `_borrow`'s `top`)."""
    groups = policy.groups_per_step
    if groups <= 0:
        return policy.min_hybrids
    return max(0, min(policy.min_hybrids, groups - view.core.replicas))


def _floor_borrow(
    view: ClusterView,
    index: ViewIndex,
    policy: PlannerPolicy,
    state: PlannerState,
    now: float,
    current: int,
    floor: int,
    why: str,
    *,
    wanted: int | None = None,
) -> Decision:
    """Borrow up to the plan's floor (`min_hybrids`) whatever the prediction says: as many as
    fit within the rollout reserve, a shortfall for the rest (of `wanted`, when the prediction
    asked for more than the floor)."""
    wanted = floor if wanted is None else wanted
    serving = index.serving_gpus
    budget = serving - policy.rollout_reserve
    rs = policy.replica_size
    allocs: list[HostAllocation] = []
    if budget >= 0:
        allocs = list(allocate_replicas(index, floor - current, budget, rs))
    granted = current + sum(len(a.replicas) for a in allocs)
    why += f"; {current} Hybrid(s) is below the plan's min_hybrids {floor}: borrowing up to it"
    shortfall = None
    if granted < wanted:
        shortfall = Shortfall(
            wanted=wanted,
            granted=granted,
            reason=f"min_hybrids {floor}: no more complete one-host sets of {rs} GPUs while "
            f"{policy.rollout_reserve} physical GPUs keep serving (serving {serving})",
        )
    actions = tuple(_borrow_actions(allocs, rs))
    direction = "borrow" if actions else "hold"
    return _decision(
        view,
        index,
        policy,
        state,
        now,
        direction,
        current,
        wanted,
        granted,
        actions,
        shortfall,
        why,
    )


def _best_borrow(basis: _Basis, current: int, top: int, fits: int, lost: int) -> int:
    """The count in current..top with the least predicted step time; equal times: the most
    replicas (the same largest share carried by fewer of them, so a slow replica is less likely
    to hold the step). Up to the `fits` replicas the largest allocation yields, each costs
    rollout the allocation's average (`lost` GPUs in all); past it, a count is what the metrics
    would ask for if capacity were there: it costs no more rollout (a shortfall, not a move)."""
    best, best_s = current, basis.hold.step_s
    model, core, gpus = basis.model, basis.core, basis.hold_gpus
    per = lost / fits if fits else 0.0
    for c in range(current + 1, top + 1):
        after = gpus - (per * (c - current) if c <= current + fits else lost)
        p = model.predict(core + c, max(after, 0.0))
        if p.step_s < best_s or (p.step_s == best_s and best != current):
            best, best_s = c, p.step_s
    return best


def _borrow(
    view: ClusterView,
    index: ViewIndex,
    policy: PlannerPolicy,
    state: PlannerState,
    now: float,
    current: int,
    why: str,
    basis: _Basis,
    metrics: Metrics,
) -> Decision:
    serving = index.serving_gpus
    budget = serving - policy.rollout_reserve
    rs = policy.replica_size
    allocs: list[HostAllocation] = []
    if budget < 0:
        short = (
            f"serving rollout GPUs ({serving}) are below the rollout reserve "
            f"({policy.rollout_reserve}) after failures; nothing is borrowed"
        )
    else:
        allocs = list(allocate_replicas(index, policy.max_hybrids - current, budget, rs))
        short = (
            f"no host can yield another complete one-host set of {rs} GPUs from free GPUs and "
            f"whole serving engines while {policy.rollout_reserve} physical GPUs keep serving "
            f"(serving {serving}, budget {budget})"
        )
    fits = sum(len(a.replicas) for a in allocs)
    lost = sum(len(g) for a in allocs for g in a.stop_gpus)
    # no more replicas than the batch has groups: each replica trains whole groups, and the
    # step's partition refuses a replica with none (equal predicted times picked the most
    # replicas: G = 2 on a Core of 1 borrowed 2 Hybrids, and the next step failed)
    groups = basis.model.groups
    top = policy.max_hybrids if groups <= 0 else min(policy.max_hybrids, groups - basis.core)
    wanted = _best_borrow(basis, current, max(top, current), fits, lost)
    hold = basis.hold
    if wanted == current:
        why += f"; predicted step {hold.describe()} holding: no count of Hybrids shortens it"
        return _decision(
            view, index, policy, state, now, "hold", current, current, current, (), None, why
        )
    target = min(wanted, current + fits)
    if current < target < current + fits:
        allocs = list(allocate_replicas(index, target - current, budget, rs))
    granted = current + sum(len(a.replicas) for a in allocs)
    lost = sum(len(g) for a in allocs for g in a.stop_gpus)
    moved = basis.model.predict(basis.core + granted, basis.hold_gpus - lost)
    if granted > current and moved.step_s >= hold.step_s:
        why += (
            f"; predicted step {hold.describe()} holding, {moved.describe()} with the "
            f"{granted - current} Hybrid(s) that fit: nothing is borrowed"
        )
        return _decision(
            view, index, policy, state, now, "hold", current, current, current, (), None, why
        )
    if granted > current and (
        unpaid := _unpaid(hold.step_s - moved.step_s, metrics, policy.release_resume_s)
    ):
        why += f"; borrowing {granted - current} Hybrid(s) {unpaid}: nothing is borrowed"
        return _decision(
            view, index, policy, state, now, "hold", current, current, current, (), None, why
        )
    actions = _borrow_actions(allocs, rs) if granted > current else []
    shortfall = (
        Shortfall(wanted=wanted, granted=granted, reason=short) if granted < wanted else None
    )
    why += (
        f"; predicted step {hold.describe()} holding, {moved.describe()} with {granted} "
        f"Hybrid(s); wanted {wanted}, granted {granted}"
    )
    direction = "borrow" if actions else "hold"
    return _decision(
        view,
        index,
        policy,
        state,
        now,
        direction,
        current,
        wanted,
        granted,
        tuple(actions),
        shortfall,
        why,
    )


def _unpaid(gain_s: float, metrics: Metrics, cost_s: float) -> str | None:
    """Why a move predicted to save `gain_s` a step does not pay for its `cost_s` over the steps
    left (None: it pays, or the steps left are unknown). A return's engines serve only after
    their restart (`engine_restart_s`); a borrow's switch costs `release_resume_s`. Near the
    end of a run a move that cannot earn its cost back only delays the end (a return decided
    before the last step restarted an engine the run then waited for and stopped)."""
    left = metrics.steps_left
    if left is None or gain_s * left > cost_s:
        return None
    return (
        f"would save {gain_s:.4g} s a step over the {left} step(s) left, not more than its "
        f"cost of {cost_s:.4g} s"
    )


def _borrow_actions(allocs: Iterable[HostAllocation], rs: int) -> list[Action]:
    actions: list[Action] = []
    for alloc in allocs:
        host = alloc.host
        for e, gpu_ids in zip(alloc.stops, alloc.stop_gpus, strict=True):
            actions.append(
                StopEngine(
                    engine_id=e.engine_id,
                    host=e.host,
                    gpu_ids=gpu_ids,
                    reason=f"borrow: TP{e.tp} engine yields {e.tp} GPU(s) on {host}",
                )
            )
        reason = f"borrow: complete set of {rs} GPUs on {host}"
        for gpu_ids, after in zip(alloc.replicas, alloc.waits, strict=True):
            actions.append(
                StartHybrid(host=host, gpu_ids=gpu_ids, after_stops=after, reason=reason)
            )
    return actions


def _return_count(
    index: ViewIndex,
    policy: PlannerPolicy,
    saturated: bool,
    current: int,
    why: str,
    basis: _Basis,
    metrics: Metrics,
    floor: int,
) -> tuple[int, bool, str]:
    """(replicas to keep, whether free GPUs restart, reason): the number n of replicas to
    return, in `_return`'s order, with the least predicted step time (fewest on equal times),
    counting the GPUs the return restarts as engines (the leaving replicas' and every free
    GPU). When no return, not even of 0 replicas with the free GPUs restarted, beats holding,
    nothing moves. No more than `current - floor` return (the plan's `min_hybrids`)."""
    regained = _regained(index, _leaving(index, current), policy, saturated)
    regained = regained[: max(0, current - floor) + 1]
    model, core, gpus = basis.model, basis.core, basis.hold_gpus
    hold = basis.hold
    best: Prediction = hold
    best_n = 0
    for n, back in enumerate(regained):
        p = model.predict(core + current - n, gpus + back)
        if p.step_s < best.step_s:
            best, best_n = p, n
    if best is hold:
        why += f"; predicted step {hold.describe()} holding: no return shortens it"
        return current, False, why
    if unpaid := _unpaid(hold.step_s - best.step_s, metrics, policy.engine_restart_s):
        why += f"; returning {best_n} of {current} Hybrid(s) {unpaid}: nothing is returned"
        return current, False, why
    why += (
        f"; predicted step {hold.describe()} holding, {best.describe()} returning {best_n} "
        f"of {current} Hybrid(s)"
    )
    return current - best_n, True, why


def _leaving(index: ViewIndex, n: int) -> list[HybridView]:
    """The n replicas a return takes, least progressed first, then by id."""
    return sorted(index.current, key=lambda h: (_PROGRESS[h.state], h.hybrid_id))[:n]


def _regained(
    index: ViewIndex, leaving: list[HybridView], policy: PlannerPolicy, saturated: bool
) -> list[int]:
    """GPUs a return-signal decision restarts as engines when the first n of `leaving` return,
    for n = 0..len(leaving): `_return`'s arithmetic (per host, the free GPUs plus the owned GPUs
    of the leaving replicas, cut by `partition_tps`), one replica at a time."""
    allowed = policy.allowed_engine_tps

    def engines_of(n: int) -> int:
        return sum(partition_tps(n, allowed, saturated))

    pools = {host: len(free) for host, free in free_by_host(index).items()}
    total = sum(engines_of(n) for n in pools.values())
    out = [total]
    not_owned = index.not_owned
    for h in leaving:
        back = sum(1 for g in h.gpu_ids if g not in not_owned)
        if back:
            before = pools.get(h.host, 0)
            pools[h.host] = before + back
            total += engines_of(before + back) - engines_of(before)
        out.append(total)
    return out


def _return(
    index: ViewIndex, n: int, include_free: bool, policy: PlannerPolicy, saturated: bool
) -> tuple[Action, ...]:
    leaving = _leaving(index, n)
    actions: list[Action] = []
    pools: dict[str, list[str]] = {}
    owner_of: dict[str, str] = {}
    not_owned = index.not_owned
    for h in leaving:
        gpu_ids = tuple(sorted(h.gpu_ids))
        if h.state in _JOINING:
            why = f"return: cancel the pending join ({h.state}) first, freeing its GPUs"
            actions.append(
                CancelJoin(hybrid_id=h.hybrid_id, host=h.host, gpu_ids=gpu_ids, reason=why)
            )
        else:
            why = "return: leave at the next step boundary"
            actions.append(
                StopHybrid(hybrid_id=h.hybrid_id, host=h.host, gpu_ids=gpu_ids, reason=why)
            )
        # Only GPUs the replica really holds come back; quarantined or failed ones stay out.
        back = [g for g in gpu_ids if g not in not_owned]
        if back:
            pools.setdefault(h.host, []).extend(back)
            owner_of.update(dict.fromkeys(back, h.hybrid_id))
    if include_free:
        for host, free in free_by_host(index).items():
            pools.setdefault(host, []).extend(free)
    shape = "smallest" if saturated else "largest"
    reasons: dict[int, str] = {}
    for host in sorted(pools):
        pool = sorted(pools[host])
        start = 0
        for tp in partition_tps(len(pool), policy.allowed_engine_tps, saturated):
            gpu_ids = tuple(pool[start : start + tp])
            start += tp
            after = tuple(sorted({owner_of[g] for g in gpu_ids if g in owner_of}))
            reason = reasons.get(tp)
            if reason is None:
                reason = reasons[tp] = (
                    f"return: TP{tp} ({shape} allowed TP that fits the measured load)"
                )
            actions.append(
                RestartEngine(host=host, gpu_ids=gpu_ids, tp=tp, after_hybrids=after, reason=reason)
            )
    return tuple(actions)


def _decision(
    view: ClusterView,
    index: ViewIndex,
    policy: PlannerPolicy,
    state: PlannerState,
    now: float,
    direction: str,
    current: int,
    wanted: int,
    granted: int,
    actions: tuple[Action, ...],
    shortfall: Shortfall | None,
    why: str,
) -> Decision:
    stopped = sum(len(a.gpu_ids) for a in actions if isinstance(a, StopEngine))
    next_state = state
    if actions:
        touches_engines = any(isinstance(a, _ENGINE_ACTIONS) for a in actions)
        cost = policy.engine_restart_s if touches_engines else policy.release_resume_s
        next_state = PlannerState(
            last_change_at=now, last_direction=direction, settle_s=policy.cooldown_s + cost
        )
    return Decision(
        based_on_version=view.version,
        now=now,
        direction=direction,
        current=current,
        wanted=wanted,
        granted=granted,
        actions=actions,
        shortfall=shortfall,
        reason=why,
        serving_gpus=index.serving_gpus,
        serving_gpus_after=index.serving_gpus - stopped,
        next_state=next_state,
    )


# --------------------------------------------------------------------------- validation


def validate_decision(decision: Decision, view: ClusterView) -> str | None:
    """Why `decision` must not be applied to `view`, or None when it may be.

    A decision computed from another world version is stale: the executor recomputes instead of
    applying it. At the same version, every action's precondition is re-checked as well.
    """
    if decision.based_on_version != view.version:
        return (
            f"stale decision: computed from world version {decision.based_on_version}, the "
            f"world is at version {view.version}; recompute it from the current world"
        )
    gpus = {g.gpu_id: g for g in view.gpus}
    engines = {e.engine_id: e for e in view.engines}
    hybrids = {h.hybrid_id: h for h in view.hybrids}
    stopping = {a.engine_id for a in decision.actions if isinstance(a, StopEngine)}
    leaving = {a.hybrid_id for a in decision.actions if isinstance(a, CancelJoin | StopHybrid)}
    claimed: set[str] = set()
    for a in decision.actions:
        if isinstance(a, StopEngine):
            e = engines.get(a.engine_id)
            if e is None or e.state != "serving":
                return f"{a.key}: engine is {e.state if e else 'unknown'}, not serving"
            if any(gpus[g].owner != e.owner or gpus[g].state != "owned" for g in e.gpu_ids):
                return f"{a.key}: not every GPU of the engine is owned by it"
        elif isinstance(a, CancelJoin | StopHybrid):
            h = hybrids.get(a.hybrid_id)
            ok = _JOINING if isinstance(a, CancelJoin) else {"active"}
            if h is None or h.state not in ok:
                return f"{a.key}: replica is {h.state if h else 'unknown'}"
        else:
            if isinstance(a, StartHybrid):
                size, freeing, by = view.core.replica_size, set(a.after_stops), "engine:"
                if not freeing <= stopping:
                    return f"{a.key}: waits for engines this decision does not stop"
            else:
                size, freeing, by = a.tp, set(a.after_hybrids), "hybrid:"
                if not freeing <= leaving:
                    return f"{a.key}: waits for replicas this decision does not release"
            if len(a.gpu_ids) != size:
                return f"{a.key}: {len(a.gpu_ids)} GPUs, need a complete set of {size}"
            for gid in a.gpu_ids:
                g = gpus.get(gid)
                if g is None or g.host != a.host:
                    return f"{a.key}: GPU {gid} is not on host {a.host}"
                if gid in claimed:
                    return f"{a.key}: GPU {gid} is claimed twice"
                claimed.add(gid)
                freed_here = g.state == "owned" and any(g.owner == by + x for x in freeing)
                if g.state != "free" and not freed_here:
                    return f"{a.key}: GPU {gid} is {g.state} ({g.owner}), not free or freed here"
    return None
