"""What the run tells its user about the cluster while it trains: moves and failures.

A planner decision is a move in flight until it is done: a borrow until the Hybrid it makes
trains, a return until every engine it restarts serves again. `MoveTracker` holds those in
flight, records each finished one as a `Move` with its latency from the decision, and says so on
the progress display. `FailureWatch` names each engine or Hybrid that failed, once. `step_status`
is the per-step status line: reward, loss, revision, Core and active Hybrids, the GPUs by role,
and the capacity shortfall the planner reports.

Knows: the world's machines as read-only state, the run's figures and progress display. Does not
know: how a move is decided or carried out (`job`, the planner, the machines), nor what a failure
does to the step (`job`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ehp_fsm.core.world import World
from ehp_fsm.report.progress import Move, Progress, RunFigures, StepStatus
from ehp_fsm.run.decisions import CarriedOut
from ehp_fsm.run.step import StepDone
from ehp_fsm.runtime.agent_link import LongStalls
from ehp_fsm.runtime.reconcile import AgentInfo
from ehp_fsm.training.task import GroupSamples, exact_rate, mean_reward


@dataclass
class Pending:
    decided_at: float
    kind: str
    detail: str
    step: int
    engines: list[str] = field(default_factory=list)  # a return: the engines restarted
    hybrid: str = ""  # a borrow: the Hybrid it starts; a return: the Hybrid that leaves


class MoveTracker:
    """The planner's moves in flight, from the decision to the move done."""

    def __init__(self, figures: RunFigures, progress: Progress) -> None:
        self.figures = figures
        self.progress = progress
        self.pending: list[Pending] = []

    def add(self, pending: Pending) -> None:
        self.pending.append(pending)

    def track(self, done: CarriedOut, step: int) -> None:
        """The moves a carried-out decision started: a borrow per Hybrid it requests (from the
        engines drained for it, or free GPUs), a return per Hybrid it makes leave, or one for
        the engines it restarts on free GPUs when no Hybrid leaves."""
        now = time.monotonic()
        for it in done.borrows:
            src = [e for e, gpus in done.drained.items() if set(gpus) & set(it.gpus)]
            what = f"{', '.join(src)} drained" if src else "free GPUs"
            self.add(Pending(now, "borrow", what, step, hybrid=it.instance))
        for hid in done.leaves:
            self.add(
                Pending(
                    now, "return", f"hybrid {hid}", step, engines=list(done.restarts), hybrid=hid
                )
            )
        if done.restarts and not done.leaves:
            self.add(Pending(now, "return", "free GPUs", step, engines=list(done.restarts)))

    def returns(self) -> list[Pending]:
        return [p for p in self.pending if p.kind == "return"]

    def unfinished(self, returns: list[Pending], step: int, since: float, why: str) -> None:
        """`returns` still pending when the run gave up waiting: recorded with `why`."""
        for p in returns:
            if p in self.pending:
                self.pending.remove(p)
                self.figures.moves.append(
                    Move(
                        kind="return",
                        step=step,
                        latency_s=time.monotonic() - since,
                        detail=f"{p.detail}: its GPUs did not serve rollout again ({why})",
                    )
                )

    def watch_returns(self, world: World) -> None:
        """A planner return is done when every engine it restarts serves (installed current);
        one that restarts none (the end of a run) when its Hybrid has left and the Hybrid's
        GPUs are free (their finalizer confirmed)."""
        for p in list(self.pending):
            if p.kind != "return" or not (p.engines or p.hybrid):
                continue
            if p.engines:
                states = [world.get("rollout_engine", e) for e in p.engines]
                if not all(s is not None and s.state == "serving" for s in states):
                    continue
                what, said = (
                    f"{', '.join(p.engines)} serving",
                    f"{', '.join(p.engines)} serve again",
                )
            else:
                unconfirmed = _left_and_settled(world, p.hybrid)
                if unconfirmed is None:
                    continue
                what = "GPUs free (the run ends: no engine restarted)"
                said = f"hybrid {p.hybrid}'s {what}"
                if unconfirmed:  # nothing to wait for: only a silent agent can free them
                    what = (
                        f"left; GPUs {', '.join(unconfirmed)} quarantined (their host's agent "
                        "is silent: not confirmed free)"
                    )
                    said = f"hybrid {p.hybrid} {what}"
            self.pending.remove(p)
            latency = time.monotonic() - p.decided_at
            self.figures.moves.append(
                Move(
                    kind="return",
                    step=self.figures.last_step,
                    latency_s=latency,
                    detail=f"{p.detail} -> {what}",
                )
            )
            self.progress.message(f"return: {said} {latency:.2f} s after the decision")

    def moved(self, kind: str, hid: str, step: int) -> None:
        """The pending move of `kind` for Hybrid `hid` is done: it trains from `step`. (The
        move of a Hybrid that failed before it trained is never done, and never shown.)"""
        for p in self.pending:
            if p.kind == kind and p.hybrid == hid:
                self.pending.remove(p)
                latency = time.monotonic() - p.decided_at
                detail = f"{p.detail} -> hybrid {hid}"
                self.figures.moves.append(
                    Move(kind=kind, step=step, latency_s=latency, detail=detail)
                )
                self.progress.message(
                    f"step {step}: hybrid {hid} trains {latency:.2f} s after the decision"
                )
                return


def _left_and_settled(world: World, hid: str) -> list[str] | None:
    """None while Hybrid `hid` has not left or a GPU of its is not settled; else the GPUs of
    its that are quarantined (their host's agent went silent: only that agent's return can
    free them), empty when every one is free. A return waited for quarantined GPUs: at the end
    of a run whose Hybrid's host lost its agent, 210 s for nothing."""
    h = world.get("hybrid_replica", hid)
    if h is None or h.state not in world.specs["hybrid_replica"].terminal:
        return None
    quarantined = []
    for g in h.get("gpus") or ():
        gpu = world.get("gpu", str(g))
        if gpu is None or gpu.state not in ("free", "quarantined"):
            return None
        if gpu.state == "quarantined":
            quarantined.append(str(g))
    return quarantined


class FailureWatch:
    """Shows every engine or Hybrid that failed (a dead process, a missed deadline) once, and
    every host agent that falls silent (once a silence; again when it answers)."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.seen: set[str] = set()
        self.silent: set[str] = set()
        self.stalls = 0  # own long stalls named
        #: until every engine serves (the run's start, which an engine's failure ends: it
        #: said "the run goes on without it", and the run stopped right after)
        self.starting = True

    def watch_agents(self, agents: Mapping[str, AgentInfo]) -> None:
        """A host whose agent fell silent (kill -9 of the agent, a lost machine) was not
        named until the run's end (its exit 1), though its GPUs were quarantined at once."""
        for host, info in agents.items():
            if info.silent and host not in self.silent:
                self.silent.add(host)
                self.progress.message(
                    f"host {host}: its agent went silent; its GPUs are quarantined (nothing there "
                    "is started, stopped or reassigned until it answers again); the run goes on"
                )
            elif not info.silent and host in self.silent:
                self.silent.discard(host)
                self.progress.message(f"host {host}: its agent answers again")

    def watch_stalls(self, stalls: LongStalls) -> None:
        """Name each stall of the run's own process as long as an agent's silence window
        (`AgentLink.long_stalls`): a SIGSTOP, a paused VM, swapping. It took every agent for
        silent before (their GPUs quarantined), and said so of them."""
        last = stalls.last
        if stalls.count > self.stalls and last is not None:
            self.stalls = stalls.count
            self.progress.message(
                f"the run's own process did not turn for {last.away_s:.1f} s (stopped, a paused "
                "VM, swapping, or a call that blocked its loop): that time is not counted "
                "against its agents' heartbeats or its commands' deadlines"
            )

    def watch(self, world: World) -> None:
        for machine in ("rollout_engine", "hybrid_replica"):
            for inst in world.of(machine).values():
                key = f"{machine}:{inst.id}"
                if inst.state == "failed" and key not in self.seen:
                    self.seen.add(key)
                    reason = inst.get("reason") or "failed"
                    if reason != "shutdown":
                        self.progress.message(
                            f"{machine} {inst.id} failed: {reason}"
                            + ("" if self.starting else "; the run goes on without it")
                        )


def record_step(
    figures: RunFigures,
    step: int,
    done: StepDone,
    samples: Sequence[GroupSamples],
    rollout_s: float,
) -> None:
    """Add a step that stood to the run's figures (and the failure it recovered from)."""
    if done.first_failure_at is not None:
        figures.moves.append(
            Move(
                kind="failed",
                step=step,
                latency_s=time.monotonic() - done.first_failure_at,
                detail=f"{'; '.join(done.retried)}; step retried on the Core",
            )
        )
    for replica in done.result.lost:  # died after the reduction: nothing retried
        why = done.result.lost_why.get(replica)
        figures.moves.append(
            Move(
                kind="failed",
                step=step,
                latency_s=0.0,
                detail=f"hybrid {replica.split(':', 1)[1]} died after the gradient reduction"
                f"{'' if why is None else f' ({why})'}; its gradient counted, the step stands",
            )
        )
    figures.rollout_s += rollout_s
    figures.training_s += done.result.wall_s
    figures.rewards.append(mean_reward(samples))
    figures.exact.append(exact_rate(samples))
    figures.last_step, figures.final_revision = step, step + 1
    figures.step_metrics.append(done.result.metrics.to_dict())
    lags: dict[int, int] = {}
    for g in samples:  # the weights that trained step s are revision s
        lags[step - g.revision] = lags.get(step - g.revision, 0) + 1
        total, count = figures.by_revision.get(g.revision, (0.0, 0))
        figures.by_revision[g.revision] = (total + sum(g.rewards), count + len(g.rewards))
    figures.staleness.append(lags)


def step_status(
    world: World, figures: RunFigures, *, step: int, steps: int, loss: float, core: int
) -> StepStatus:
    """The status line after `step`: the figures so far and the cluster as the world has it."""
    roles: dict[str, int] = {}
    for gpu in world.of("gpu").values():
        owner = gpu.get("owner")
        role = owner.split(":")[0] if gpu.state == "owned" and owner else gpu.state
        roles[role] = roles.get(role, 0) + 1
    cap = world.get("capacity", "grp")
    short = cap.get("shortfall") if cap is not None else None
    hybrids = sum(1 for h in world.of("hybrid_replica").values() if h.state == "active")
    note = ""
    if figures.step_metrics:
        m, lags = figures.step_metrics[-1], figures.staleness[-1]
        stale = " ".join(f"{lag}:{n}" for lag, n in sorted(lags.items()))
        note = (
            f"objective: clip {m['clip_fraction']:.1%}  ratio {m['ratio_mean']:.3f}"
            f"/{m['ratio_max']:.3f}  kl {m['approx_kl']:.1e}"
            + (f"  ref kl {m.get('ref_kl', 0.0):.1e}" if figures.kl_reference else "")
            + f"   staleness {stale}"
        )
    return StepStatus(
        step=step,
        steps=steps,
        reward=figures.rewards[-1],
        exact=figures.exact[-1],
        loss=loss,
        revision=figures.final_revision,
        core=core,
        hybrids=hybrids,
        gpu_roles=roles,
        shortfall=(
            f"wanted {short['wanted']}, granted {short['granted']}: {short['reason']}"
            if short
            else None
        ),
        note=note,
    )
