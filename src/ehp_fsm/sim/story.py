"""One simulated run, told like `run.job`: start, the step loop, the planner between steps, the end.

The story is the run's (`run.job.Job`), in virtual time: revision 1 is published and every
engine installs it before it serves; each step fills the queue (2·G groups), waits for G fresh
completed groups, lets ready Hybrids join at the boundary, partitions the groups over the live
replicas (`core.batch.partition_groups`) and drives the training_step machine (begin →
partition → the trainer's compute → delivered → reduced → stepped → published), retrying on the
replicas still live when a Hybrid dies during the step; between steps the next step's groups
go out, then the planner decides from the measured (virtual) rollout and training times and
`run.decisions.Decisions` carries the decision out through the loop; at the end a `return_all`
decision returns every Hybrid.

Waiting is `until(pred)`: the clock runs the next happening until `pred` holds; nothing left to
happen while waiting is a stall (`SimError`: the controller waits for something that cannot
come — a finding, with the seed that shows it).

Knows: the order of the run. Does not know: how anything is performed (the performers) or what
the rules are (the machines).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Final

from ehp_fsm.core.batch import partition_groups
from ehp_fsm.core.execution import cluster_view
from ehp_fsm.core.planner import return_all
from ehp_fsm.core.planner_model import (
    Decision,
    PlannerState,
    StartHybrid,
    StopEngine,
)
from ehp_fsm.core.planner_predict import RolloutPace, StepTimes
from ehp_fsm.core.transition import Accepted, Outcome
from ehp_fsm.core.world import Event
from ehp_fsm.embedded import InvariantViolation, inventory_events
from ehp_fsm.errors import EhpError
from ehp_fsm.plan import Plan, SimulateSpec, simulate_costs
from ehp_fsm.rollout.dispatch import DispatchConfig
from ehp_fsm.run.decisions import (
    BORROW_ON_THE_WAY,
    Decisions,
    borrows_on_the_way,
    idle,
    idle_once_settled,
    planner_turn,
)
from ehp_fsm.shell.loop import Loop
from ehp_fsm.sim.clock import VirtualClock
from ehp_fsm.sim.collector import StepCollector
from ehp_fsm.sim.costs import Costs
from ehp_fsm.sim.edge import Accounting, Agents, SimTrainer
from ehp_fsm.sim.rollout import SimDispatcher, SimTask
from ehp_fsm.sim.watch import SimOrchestrator, Watch, full_check, would_accept
from ehp_fsm.specfiles import load_specs
from ehp_fsm.translog import TransitionLog

__all__ = ["RunStopped", "SimError", "SimResult", "Simulation"]

STEP: Final = "training_step"
HYBRID: Final = "hybrid_replica"
ENGINE: Final = "rollout_engine"
ATTEMPTS: Final = 3
WAIT_LIMIT_S: Final = 24 * 3600.0  # virtual: a wait longer than a day is a stall
FULL_CHECK_LIMIT: Final = 5_000  # world instances up to which every step boundary is fully checked


class SimError(EhpError):
    """The simulated run could not go on: a stall, or a step the machines refused."""


class WaitTooLong(SimError):
    """A wait of the run's story went past `WAIT_LIMIT_S` of virtual time while things still
    happened (not a stall): the plan's `[simulate]` cost model makes that phase take longer."""

    def __init__(self, what: str, at: float, keys: str) -> None:
        super().__init__(
            f"the simulated run waited more than {WAIT_LIMIT_S / 3600:g} virtual hours for "
            f"{what} (t={at:.1f} s)",
            f"the plan's [simulate] cost model makes it take that long (its keys {keys}), "
            "or a [deadlines.*] shorter than what it bounds fails it each time, or faults "
            "keep undoing it",
            f"check [simulate] {keys} against the plan's [deadlines.*] (`ehp-fsm check "
            "PLAN` shows each key's value and where it comes from)",
        )


class RunStopped(SimError):
    """The run stopped as `ehp-fsm run` would (a step failed on every attempt, a step's
    compute or a step's rollout past its deadline): not a broken invariant — the fault hunt
    counts it and goes on."""


class _Decisions(Decisions):
    """The run's decision executor with deterministic names for new launches."""

    def new_id(self, kind: str) -> str:
        n = next(self._ids)
        return {"hybrid": f"x{n}", "engine": f"r{n}"}.get(kind) or f"tok{n}"

    def poll(self, timeout_s: float) -> None:
        if self.intents:  # the run's poll, skipped when nothing waits (it scans every step)
            super().poll(timeout_s)


@dataclass
class StepFigure:
    step: int
    rollout_s: float
    train_s: float
    end: float
    hybrids: int
    retried: int


@dataclass
class SimResult:
    """What one simulated run measured (virtual seconds unless named `wall`)."""

    plan: str
    hosts: int
    gpus: int
    steps: int
    seed: int
    ehp: bool
    faults: str
    virtual_s: float = 0.0
    train_start: float = 0.0
    gpu_s: dict[str, float] = field(default_factory=dict)
    busy_gpu_s: float = 0.0
    figures: list[StepFigure] = field(default_factory=list)
    borrows: list[float] = field(default_factory=list)  # decision → Hybrid active
    failed_borrows: int = 0  # Hybrids a decision requested that ended before training
    returns: list[float] = field(default_factory=list)  # decision → restarted engine serving
    faults_seen: dict[str, int] = field(default_factory=dict)
    transitions: int = 0
    rejected: int = 0
    checks: int = 0
    wall_s: float = 0.0
    chain: tuple[int, str] | None = None
    log_chain: dict[str, Any] | None = None  # the receipt's (sealed when keyed)
    log: str = ""
    samples: list[tuple[float, tuple[int, ...]]] = field(default_factory=list)  # GPUs per role

    @property
    def steps_s(self) -> float:
        """Virtual time of the training steps: first step's start to the last step's end."""
        return (self.figures[-1].end - self.train_start) if self.figures else 0.0

    @property
    def gpu_hours(self) -> float:
        return self.gpus * self.virtual_s / 3600.0

    @property
    def idle_share(self) -> float:
        total = self.gpus * self.virtual_s
        return 1.0 - self.busy_gpu_s / total if total > 0 else 0.0


class Simulation:
    """See the module docstring."""

    def __init__(
        self,
        plan: Plan,
        *,
        seed: int,
        faults: str = "off",
        ehp: bool = True,
        steps: int | None = None,
        log_path: str | Path,
        check: bool = True,
        say: Callable[[str], None] = lambda _s: None,
    ) -> None:
        plan = replace(plan, seed=seed, ehp=replace(plan.ehp, enabled=ehp))
        self.plan, self.say = plan, say
        self.steps = steps if steps is not None else plan.grpo.steps
        spec: SimulateSpec = simulate_costs(plan)
        self.spec = spec
        self.clock = VirtualClock()
        self.collector: StepCollector | None = None  # set while `run` runs
        self._wall0 = time.perf_counter()  # reset when `run` starts
        self.costs = Costs(spec, seed=seed, faults=faults, group_size=plan.grpo.group_size)
        self.acct = Accounting()
        self.slow = self.costs.slow_hosts([h.id for h in plan.hosts])
        if self.slow:
            self.acct.faults["slow_hosts"] = len(self.slow)
        specs = load_specs()
        config = plan.world_config()
        log = TransitionLog.create(
            log_path,
            config=config,
            specs=specs,
            meta={"plan": plan.name, "source": "simulate", "seed": seed, "faults": faults},
            checkpoint_every=None,  # a checkpoint is the whole world: tens of MB at scale
            flush_each=False,  # nothing outside the process waits on a record: `run` closes it
        )
        # (the simulation drops consumed groups and finished steps itself, `Watch`, and writes
        # no checkpoint: its world forgets nothing else)
        self.orch = SimOrchestrator(
            config, specs=specs, log=log, check=False, forget_finished=False
        )
        records = 0
        for ev in inventory_events(plan, 0.0):
            out = self.orch.handle(ev)
            if not out.accepted:
                raise SimError(f"the plan's inventory does not load ({ev.instance})")
            records += len(out.records)
        self.watch = Watch(self.orch.world, self.clock, check=check)
        self.watch.transitions = records
        self.orch.watch = self.watch
        # the loop reads the clock twice an event: `clock.now()`, without its Python frame
        self.loop = Loop(self.orch, clock=partial(getattr, self.clock, "t"))
        self.watch.fire = self.loop.post
        self.watch.woken = self.wake
        self._turn_at: float | None = None
        self.agents = Agents(
            self.loop,
            self.clock,
            self.costs,
            self.acct,
            slow=self.slow,
            engine_start_s=spec.engine_start_s,
            hybrid_launch_s=spec.hybrid_launch_s,
        )
        self.dispatcher = SimDispatcher(
            self.loop,
            SimTask(),
            config=DispatchConfig(
                group_size=plan.grpo.group_size,
                sampling_seed=seed,
                behaviour_logprobs=False,  # (it trains nothing: its answers carry none)
            ),
            clock=self.clock,
            costs=self.costs,
            acct=self.acct,
            watch=self.watch,
            woken=self.wake,
            slow=self.slow,
        )
        self.dispatcher.busy_until = self.agents.engine_busy  # one decode queue per engine
        host_of = {g: h.id for h in plan.hosts for g in h.gpus}  # `plan.host_of` scans hosts
        core_host = {
            r: host_of[plan.core.gpus[i * plan.core.replica_gpus]]
            for i, r in enumerate(plan.core.replicas)
        }
        self.trainer = SimTrainer(
            self.loop,
            self.clock,
            self.costs,
            self.acct,
            replica_size=plan.ehp.replica_size,
            group_size=plan.grpo.group_size,
            slow=self.slow,
            core_host=core_host,
        )
        self.agents.pool_free_at = lambda: self.trainer.busy_until
        self.decisions = _Decisions(self.loop, drain=self.dispatcher.drain_engine)
        for p in (self.agents, self.dispatcher, self.trainer, self.decisions):
            self.loop.add(p)
        self.memory = PlannerState()
        self.step_times = StepTimes()  # what the planner decides from: recent medians
        self.pace = RolloutPace()  # the rollout phase's length, from the engines' busy time
        self.result = SimResult(
            plan=plan.name,
            hosts=len(plan.hosts),
            gpus=len(plan.inventory),
            steps=self.steps,
            seed=seed,
            ehp=ehp,
            faults=faults,
            log=str(log_path),
        )
        self.pending_borrows: dict[str, float] = {}  # hybrid -> decision time
        self.pending_returns: dict[str, float] = {}  # restarted engine -> decision time
        self.unretired: list[int] = []

    # -- the loop's turns ------------------------------------------------------------------------
    def wake(self) -> None:
        """Something changed: the loop takes its next turn at the next tick (as the run's
        loop does every `tick_s`), once however many things changed before it."""
        if self._turn_at is not None:
            return
        tick = self.spec.tick_s
        self._turn_at = (math.floor(self.clock.now() / tick) + 1) * tick
        self.clock.at(self._turn_at, self._turn)

    def _turn(self) -> None:
        self._turn_at = None
        for p in self.loop.performers:
            p.poll(0.0)
        self._watch_moves()

    def until(self, pred: Callable[[], bool], what: str, limit_s: float = WAIT_LIMIT_S) -> bool:
        """Run the clock until `pred()` holds (True) or `limit_s` virtual seconds pass
        (False). Nothing left to happen while waiting is a stall."""
        done = self.clock.run_until(pred, self.clock.now() + limit_s)
        if done is None:
            raise SimError(f"stalled at t={self.clock.now():.1f} s waiting for {what}")
        return done

    def wait_for(self, pred: Callable[[], bool], what: str, keys: str) -> None:
        """`until(pred)` for a wait that must end: past `WAIT_LIMIT_S` it is `WaitTooLong`,
        naming the `[simulate]` keys that set how long it takes."""
        if not self.until(pred, what):
            raise WaitTooLong(what, self.clock.now(), keys)

    def event(self, machine: str, iid: str, name: str, **payload: Any) -> Outcome:
        return self.loop.post(Event(machine, iid, name, self.clock.now(), payload))

    def must(self, machine: str, iid: str, name: str, **payload: Any) -> Outcome:
        out = self.event(machine, iid, name, **payload)
        if not isinstance(out, Accepted):
            raise SimError(f"the machines refused {machine} {iid} {name}: {out.reason}")
        return out

    # -- 1. start ------------------------------------------------------------------------------
    def start(self) -> None:
        self.publish(1, step=0)
        for e in self.plan.engines:
            self.must(
                ENGINE, e.id, "launch", host=e.host, gpus=list(e.gpus), tp=e.tp, token=f"t-{e.id}"
            )
            self.dispatcher.attach_sim(e.id)
        self._schedule_silence()
        spec = self.orch.world.specs[ENGINE]
        engines = self.orch.world.of(ENGINE)
        self.wait_for(
            lambda: all(e.state == "serving" or e.state in spec.terminal for e in engines.values()),
            "every engine to serve revision 1",
            "engine_start_s, model_gb, install_gb_per_s",
        )
        if not any(e.state == "serving" for e in engines.values()):
            died = self.acct.faults.get("engine_death", 0)
            if died >= len(engines):  # the faults, not the cost model: counted by a hunt
                # (it said "seed N breaks" for a run `ehp-fsm run` stops too; one whose
                # engines all died later in the run was counted, as `RunStopped`)
                raise RunStopped(
                    f"no engine came up: each of the {len(engines)} engines died of a "
                    "simulated GPU fault before it served revision 1",
                    "`ehp-fsm run` stops so too: it trains only once every engine serves",
                    "under these faults that is the run's end; lower [simulate] "
                    "gpu_fault_per_hour (or --faults) for runs that get past the start",
                )
            raise SimError(
                "no engine came up",
                "every engine failed before it served revision 1: a start or an install "
                "longer than its [deadlines.rollout_engine] `starting` or `installing`, or a "
                "GPU fault",
                "compare [simulate] engine_start_s and model_gb / install_gb_per_s with those "
                "deadlines, or lower gpu_fault_per_hour (or --faults)",
            )
        self.result.train_start = self.clock.now()

    def publish(self, revision: int, *, step: int) -> None:
        rid = f"r{revision}"
        self.must("revision", rid, "save", revision=revision, step=step)
        self.must("revision", rid, "saved", checksum=f"sim-{revision}", path=f"sim://{rid}")
        self.must("revision", rid, "publish")
        self.unretired.append(revision)

    def _schedule_silence(self) -> None:
        hosts = [h.id for h in self.plan.hosts]
        wait = self.costs.time_to_silence(len(hosts))
        if wait is None:
            return

        def strike() -> None:
            host = hosts[self.costs.faults.randrange(len(hosts))]
            self.agents.go_silent(host, self.spec.agent_silence_s)
            self._schedule_silence()

        self.clock.after(wait, strike)

    # -- 2. the step loop ----------------------------------------------------------------------
    def train(self) -> None:
        g = self.plan.grpo
        every = max(1, self.steps // 20)
        collector = self.collector
        for step in range(1, self.steps + 1):
            t0 = self.clock.now()
            self.dispatcher.fill(2 * g.prompts_per_step)  # a no-op after the top-up below
            self.wake()
            self.wait_for_rollout(step)
            rollout_s = self.clock.now() - t0
            self.wait_for_borrows()
            self.join_ready()
            ids = self.dispatcher.completed_groups(g.prompts_per_step)
            t1 = self.clock.now()
            retried = self.run_step(step, ids)
            train_s = self.clock.now() - t1
            self.retire()
            self.check_world(f"after step {step}")
            self.watch.forget_finished_steps()
            if collector is not None:
                collector.boundary(step)
            hybrids = sum(1 for h in self.orch.world.of(HYBRID).values() if h.state == "active")
            self.result.figures.append(
                StepFigure(step, rollout_s, train_s, self.clock.now(), hybrids, retried)
            )
            if self.plan.ehp.enabled and step < self.steps:
                # the next step's groups go out before the planner waits for every install,
                # as they do without EHP (`Job.train_steps`)
                self.dispatcher.fill(2 * g.prompts_per_step)
                self.wake()
                self.plan_next(step, train_s, rollout_s)
            if step == 1 or step % every == 0 or step == self.steps:
                self.say(
                    f"step {step}/{self.steps}  t={_hms(self.clock.now())}  rollout "
                    f"{rollout_s:.1f} s  train {train_s:.1f} s  hybrids {hybrids}  "
                    f"transitions {self.watch.transitions}  {self._wall_eta(step)}"
                )

    def _wall_eta(self, step: int) -> str:
        """Wall time so far and, at the pace of the steps done, what the rest will take (a run
        of thousands of hosts takes minutes of CPU per step: say so while it runs)."""
        wall = time.perf_counter() - self._wall0
        if step >= self.steps:
            return f"wall {_duration(wall)}"
        return f"wall {_duration(wall)}, ~{_duration(wall / step * (self.steps - step))} left"

    def wait_for_rollout(self, step: int) -> None:
        """Until G groups are completed — within `[deadlines.run] rollout`, as the run's
        `Job.train_steps` waits (past it the run stops: it waited a virtual day, and blamed
        the cost model, when every engine had failed long before)."""
        g = self.plan.grpo.prompts_per_step
        what = f"{g} completed groups for step {step}"
        keys = (
            "engine_tokens_per_s, sequence_tokens_per_s, response_median_tokens, "
            "response_max_tokens, response_lengths_file"
        )
        deadline = self.plan.run_deadlines.rollout
        if deadline > WAIT_LIMIT_S:
            self.wait_for(self._rollout_done, what, keys)
        elif not self.until(self._rollout_done, what, deadline):
            live = sum(
                1 for e in self.orch.world.of("rollout_engine").values() if e.state == "serving"
            )
            raise RunStopped(
                f"rollout did not produce {g} groups for step {step} in {deadline:g} s "
                f"([deadlines.run] rollout; t={self.clock.now():.1f} s, {live} engines serving)",
                "`ehp-fsm run` stops so too",
                "under faults with no engine left serving, that is the run's end; else raise "
                f"[deadlines.run] rollout, or check [simulate] {keys}",
            )

    def _rollout_done(self) -> bool:
        """G completed groups fresh enough to train on (the cheap count first)."""
        g = self.plan.grpo.prompts_per_step
        return len(self.watch.completed) >= g and len(self.dispatcher.completed_groups(g)) >= g

    def check_world(self, when: str) -> None:
        """The run's own invariants over the whole world (`core.invariants`), at each step
        boundary while the world is small enough for an O(world) pass to be cheap."""
        world = self.orch.world
        if self.watch.checks is None or sum(map(len, world.instances.values())) > FULL_CHECK_LIMIT:
            return
        problems = full_check(world)
        if problems:
            raise InvariantViolation(Event("capacity", "grp", when, self.clock.now()), problems)

    def wait_for_borrows(self) -> None:
        """At the boundary, the borrows on their way become ready (or fail) first, as the
        run's `Job.wait_for_borrows` (`run.decisions.BORROW_ON_THE_WAY`)."""
        world = self.orch.world
        left = borrows_on_the_way(world)
        if not left:
            return
        limit = sum(self.plan.deadlines[HYBRID][s] for s in BORROW_ON_THE_WAY)

        def arrived() -> bool:  # a Hybrid never goes back on its way while this waits
            while left and not borrows_on_the_way(world, left[-1:]):
                left.pop()
            return not left

        self.until(arrived, f"{len(left)} borrows on their way", limit)

    def join_ready(self) -> None:
        """At the boundary every ready Hybrid joins (a stale one reloads first, as the run's
        `WarmHybrids.join_ready`: it joins at a later boundary once loaded)."""
        world = self.orch.world
        for inst in sorted(world.of(HYBRID).values(), key=lambda h: h.id):
            if inst.state != "ready":
                continue
            if inst.get("loaded_version") != world.globals["core_version"]:
                self.event(HYBRID, inst.id, "reload")
                continue
            self.event(HYBRID, inst.id, "activate")

    def run_step(self, step: int, groups: list[str]) -> int:
        """One optimizer step (tried again on the replicas still live when a Hybrid dies in
        it); the revision is published before it returns. Returns the failed attempts."""
        world = self.orch.world
        for attempt in range(ATTEMPTS):
            sid = f"step-{step}" if attempt == 0 else f"step-{step}.{attempt}"
            hybrids = sorted(h.id for h in world.of(HYBRID).values() if h.state == "active")
            live = [*world.config["core_replicas"], *(f"hybrid:{h}" for h in hybrids)]
            part = partition_groups(
                groups=[int(x[1:]) for x in groups],
                live=dict.fromkeys(live, 1),
                group_size=self.plan.grpo.group_size,
                step=step,
                epoch=int(world.globals["epoch"]),
            )
            partition = {r: [f"g{x}" for x in gs] for r, gs in part.assignments}
            self.must(STEP, sid, "begin", step=step)
            self.must(STEP, sid, "partition", groups=list(groups), partition=partition)
            self.wait_for(
                partial(self._computed_or_given_up, sid),
                f"{sid}'s compute",
                "train_s_per_sample, optimizer_s, model_gb, reduce_gb_per_s, save_gb_per_s",
            )
            if sid not in self.trainer.results:  # failed by its `computing` deadline
                computing = self.plan.deadlines[STEP]["computing"]
                raise RunStopped(
                    f"training step {step} was given up: its computation did not end within "
                    f"[deadlines.training_step] computing ({computing:g} s)",
                    "`ehp-fsm run` stops so too (it does not retry a step past its deadline)",
                    "raise [deadlines.training_step] computing, or lower [simulate] "
                    "train_s_per_sample / optimizer_s (or raise reduce_gb_per_s / "
                    "save_gb_per_s)",
                )
            if self.trainer.results.pop(sid):
                self.publish(step + 1, step=step)
                self.must(STEP, sid, "published", revision=step + 1)
                return attempt
            inst = world.get(STEP, sid)
            if inst is not None and inst.state not in ("failed", "done"):
                self.event(STEP, sid, "fail", reason="a replica died during the step")
        raise RunStopped(
            f"training step {step} failed {ATTEMPTS} times",
            "a Hybrid died in each attempt",
            "under faults `ehp-fsm run` stops so too; else lower the fault rates of [simulate]",
        )

    def _computed_or_given_up(self, sid: str) -> bool:
        """Whether step `sid`'s result is in, or its `computing` deadline failed it first (the
        run gives up such a step; waiting on, the simulation waited a virtual day)."""
        if sid in self.trainer.results:
            return True
        inst = self.orch.world.get(STEP, sid)
        return inst is not None and inst.state == "failed"

    def retire(self) -> None:
        current = int(self.orch.world.globals["revision"])
        keep = []
        for rev in self.unretired:
            probe = Event("revision", f"r{rev}", "retire", self.clock.now())
            if rev < current and would_accept(self.orch.world, probe):
                self.event("revision", f"r{rev}", "retire")
            elif rev <= current:
                keep.append(rev)
        self.unretired = keep

    # -- 3. the planner between steps ----------------------------------------------------------
    def plan_next(self, step: int, train_s: float, rollout_s: float) -> None:
        """As the run's `Job.plan_next`: a decision with nothing to do is taken at once; a move
        waits for the engines to install the new revision and is decided again."""
        world = self.orch.world
        view = cluster_view(world, inflight=self.watch.load(world.of(ENGINE)))
        decide_on = planner_turn(
            view,
            pace=self.pace,
            step_times=self.step_times,
            dispatched=self.dispatcher.pace(),
            groups=self.plan.grpo.prompts_per_step,
            train_s=train_s,
            rollout_s=rollout_s,
            steps_left=self.steps - step,
            policy=self.plan.planner_policy(),
            state=self.memory,
            now=self.clock.now,
        )
        d = decide_on(view)
        updating = self.watch.updating
        if updating and not idle_once_settled(d, world, view, decide_on):
            self.until(lambda: not updating, "the engines to install the new revision", 30.0)
            d = decide_on(cluster_view(world, inflight=self.watch.load(world.of(ENGINE))))
        if idle(d, world):
            self.memory = d.next_state
            return
        self.carry_out(d)

    def carry_out(self, d: Decision) -> bool:
        self._check_borrow(d)
        done = self.decisions.carry_out(d)
        if done is None:
            return False
        self.memory = d.next_state
        now = self.clock.now()
        for b in done.borrows:
            self.pending_borrows[b.instance] = now
        for r in done.restarts:
            self.pending_returns[r] = now
        self.watch.moved = True  # look at the new pending ones on the next turn
        return True

    def _check_borrow(self, d: Decision) -> None:
        """Every engine a decision stops feeds a Hybrid of the same decision whose GPUs are a
        complete one-host set (nothing stops before that set is known)."""
        starts = [a for a in d.actions if isinstance(a, StartHybrid)]
        world = self.orch.world
        for a in d.actions:
            if not isinstance(a, StopEngine):
                continue
            e = world.get(ENGINE, a.engine_id)
            gpus = set(e.get("gpus") or ()) if e is not None else set()
            ok = any(
                s.host == a.host
                and gpus & set(s.gpu_ids)
                and len(s.gpu_ids) == self.plan.ehp.replica_size
                for s in starts
            )
            if not ok:
                raise InvariantViolation(
                    Event("capacity", "grp", "decided", self.clock.now()),
                    [f"decision stops engine {a.engine_id} without a complete allocation it feeds"],
                )

    def _watch_moves(self) -> None:
        """Borrows that became active and returned engines serving, timed. Only on a turn
        after some engine or Hybrid changed (or a decision added to the pending ones): with
        1,280 borrows pending at 1,024 hosts, a scan on every turn was 1–3 % of a run."""
        if not self.watch.moved:
            return
        self.watch.moved = False
        world, now = self.orch.world, self.clock.now()
        for hid, t in list(self.pending_borrows.items()):
            h = world.get(HYBRID, hid)
            if h is None:
                continue
            if h.state == "active":
                self.result.borrows.append(now - t)
                del self.pending_borrows[hid]
            elif h.state in world.specs[HYBRID].terminal:  # (a deadline, a fault): unsaid
                self.result.failed_borrows += 1
                del self.pending_borrows[hid]
        for eid, t in list(self.pending_returns.items()):
            e = world.get(ENGINE, eid)
            if e is None:
                continue
            if e.state == "serving":
                self.result.returns.append(now - t)
                del self.pending_returns[eid]
                self.dispatcher.attach_sim(eid)
            elif e.state in world.specs[ENGINE].terminal:
                del self.pending_returns[eid]

    # -- 4. the end ----------------------------------------------------------------------------
    def return_all(self) -> None:
        world = self.orch.world
        spec = world.specs[HYBRID]
        if any(h.state not in spec.terminal for h in world.of(HYBRID).values()):
            d = return_all(
                view=cluster_view(world, inflight=self.watch.load(world.of(ENGINE))),
                policy=self.plan.planner_policy(),
                state=self.memory,
                now=self.clock.now(),
                restart_engines=False,  # as the run: its GPUs stay free, every engine stops
            )
            if not self.carry_out(d):
                raise SimError("the end-of-run return was refused as stale")
        hybrids = world.of(HYBRID)
        self.until(
            lambda: (
                not self.decisions.pending()
                and not self.pending_returns
                and all(h.state in spec.terminal for h in hybrids.values())
            ),
            "every Hybrid to return (and earlier returns' engines to serve)",
            3600.0,
        )

    def run(self) -> SimResult:
        t0 = self._wall0 = time.perf_counter()
        try:
            with StepCollector() as self.collector:
                self.start()
                self.train()
                self.return_all()
            self.collector = None
            self.watch.integrate()
            problems = full_check(self.orch.world)
            if problems:
                raise InvariantViolation(
                    Event("capacity", "grp", "end", self.clock.now()), problems
                )
        finally:
            self.result.wall_s = time.perf_counter() - t0
            self._fill_result()
            self.orch.close()
        return self.result

    def _fill_result(self) -> None:
        r = self.result
        r.virtual_s = self.clock.now()
        r.gpu_s = dict(self.watch.gpu_s)
        r.busy_gpu_s = self.acct.busy_gpu_s
        r.faults_seen = dict(self.acct.faults)
        r.rejected = self.watch.rejected
        r.transitions = self.watch.transitions
        r.checks = self.watch.checks.checked if self.watch.checks is not None else 0
        r.chain = self.orch.chain_head
        r.log_chain = self.orch.log_chain
        r.samples = self.watch.samples


def _duration(seconds: float) -> str:
    """Wall time for a person: seconds, then minutes, then hours."""
    if seconds < 90:
        return f"{seconds:.1f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
