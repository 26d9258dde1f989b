"""`ehp-fsm run PLAN`: a real GRPO job with live borrowing and return.

The story, in the order it happens:
1. Start: the controller (a loop whose transition log is the run's write-ahead log, and its
   agent link), one agent per host, the trainer pool (Core ranks + warm Hybrid workers, one Gloo
   world), and the loop's other performers (publisher, dispatcher, engine clients, warm Hybrids,
   trainer, planner decisions). Revision 1 is published; every engine installs it before it
   serves.
2. Each step: rollout collects G complete groups; ready Hybrids join at the boundary; one step
   through the training_step machine (`step.run_step`) trains and publishes a revision.
3. Between steps the planner decides from the measured times; its decision goes through the
   loop (`decisions.Decisions`): drain → stop → finalizer → Hybrid on a warm worker → load →
   join at a boundary; and back.
4. The end: a "return all" decision takes the same path; then everything the run owns stops and
   the summary, timeline and receipt are written (`ending.finish`), whatever happened before.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TextIO

from ehp_fsm.core.execution import cluster_view
from ehp_fsm.core.planner import decide, return_all
from ehp_fsm.core.planner_model import Decision, Metrics, PlannerState
from ehp_fsm.errors import EhpError
from ehp_fsm.plan import Plan
from ehp_fsm.policy import PolicyConfig
from ehp_fsm.report.progress import Move, Progress, RunFigures
from ehp_fsm.rollout.revisions import RevisionStore
from ehp_fsm.run import ending
from ehp_fsm.run.decisions import Decisions
from ehp_fsm.run.hybrids import WarmHybrids
from ehp_fsm.run.startup import (
    Cluster,
    clear_run_dir,
    log_beside,
    publish_initial,
    rollout_shell,
    spawn_agent,
    spawn_pool,
)
from ehp_fsm.run.step import Trainer, run_step
from ehp_fsm.run.watch import FailureWatch, MoveTracker, Pending, step_status
from ehp_fsm.runtime.controller import Controller
from ehp_fsm.runtime.identity import new_launch_token
from ehp_fsm.shell.loop import Performer
from ehp_fsm.task import ArithmeticTask, exact_rate, mean_reward

__all__ = ["Job", "RunError", "run"]

AGENTS_CONNECT_S = 60.0  # every host agent connects and reconciles within this, or the run stops
SERVE_S = 120.0  # every engine of the plan serves within this after the launch
RETURN_S = 150.0  # the end-of-run return: Hybrids gone and their engines serving


class RunError(EhpError):
    """The job could not go on (a Core trainer died, no engine came up, ...)."""


class Job:
    def __init__(
        self, plan: Plan, out: TextIO, *, live: bool | None, verify: bool, steps: int | None
    ) -> None:
        self.plan, self.out, self.verify = plan, out, verify
        self.steps = steps if steps is not None else plan.grpo.steps
        self.cluster = Cluster(plan=plan, run_dir=Path(plan.log).resolve().parent)
        self.figures = RunFigures()
        self.progress = Progress(out, live=live)
        self.task = ArithmeticTask(seed=plan.seed)
        self.policy = PolicyConfig()
        self.task.check_config(self.policy)
        self.memory = PlannerState()
        self.moves = MoveTracker(self.figures, self.progress)
        self.failures = FailureWatch(self.progress)
        self.started = time.monotonic()
        self.stop_requested = False

    # -- 1. start ------------------------------------------------------------------------------
    def start(self) -> None:
        c, plan = self.cluster, self.plan
        clear_run_dir(c.run_dir)
        c.logfile = log_beside(c.run_dir)
        store = RevisionStore(c.run_dir / "revisions")
        pool = c.pool = spawn_pool(plan, self.policy, store.root, c.run_dir)
        ctl = c.ctl = Controller.start(plan, log_path=plan.log)
        c.agents = [spawn_agent(plan, h, ctl.endpoint.endpoint, c.run_dir) for h in plan.hosts]
        hosts = {h.id for h in plan.hosts}
        if not self.until(
            lambda: hosts <= {a for a, i in ctl.agents.items() if i.reconciled}, AGENTS_CONNECT_S
        ):
            raise RunError(
                f"the host agents did not connect within {AGENTS_CONNECT_S:g} s",
                f"see {c.run_dir / 'agents'}/*.log",
            )
        loop = ctl.loop
        c.rollout = rollout_shell(loop, store, self.task, plan)
        disp = c.rollout.dispatcher
        c.hybrids = WarmHybrids(loop, pool)
        records = c.run_dir / "verify" / "records" if self.verify else None
        c.trainer = Trainer(
            loop,
            pool,
            batch_of=lambda ids: self.task.build_batch([g.samples for g in disp.results(ids)]),
            records=records,
        )
        c.decisions = Decisions(loop, drain=disp.drain_engine)
        performers: tuple[Performer, ...] = (
            c.rollout.connections,
            c.rollout.publisher,
            disp,
            c.hybrids,
            c.trainer,
            c.decisions,
        )
        for performer in performers:
            loop.add(performer)
        publish_initial(c.rollout.publisher, self.policy, plan.seed)
        ctl.launch_engines(lambda _eid: new_launch_token())
        if not self.until(lambda: self.serving() == len(plan.engines), SERVE_S):
            raise RunError(
                f"rollout engines did not start serving within {SERVE_S:g} s",
                f"see {c.run_dir / 'agents'}/*.log",
            )
        self.say(
            f"ehp-fsm run {plan.name}: {len(plan.engines)} engines "
            f"serving revision 1; training {self.steps} steps"
        )

    # -- 2. the step loop ----------------------------------------------------------------------
    def train(self) -> None:
        c, g = self.cluster, self.plan.grpo
        assert c.ctl and c.rollout and c.hybrids and c.trainer  # started
        disp = c.rollout.dispatcher
        for step in range(1, self.steps + 1):
            if self.stop_requested:
                break
            t0 = time.monotonic()
            disp.fill(2 * g.prompts_per_step)
            if not self.until(lambda: len(disp.completed_groups()) >= g.prompts_per_step, 300.0):
                if self.stop_requested:
                    break
                raise RunError(f"rollout did not produce {g.prompts_per_step} groups in 300 s")
            rollout_s = time.monotonic() - t0
            for hid in c.hybrids.join_ready():
                self.moves.moved("borrow", hid, step)
            ids = disp.completed_groups(g.prompts_per_step)
            samples = [r.samples for r in disp.results(ids)]
            done = run_step(
                c.ctl.loop,
                c.trainer,
                c.rollout.publisher,
                step=step,
                groups=ids,
                group_size=g.group_size,
                say=self.say,
            )
            if done.first_failure_at is not None:
                self.figures.moves.append(
                    Move(
                        kind="failed",
                        step=step,
                        latency_s=time.monotonic() - done.first_failure_at,
                        detail=f"{'; '.join(done.retried)}; step retried on the Core",
                    )
                )
            f = self.figures
            f.rollout_s += rollout_s
            f.training_s += done.result.wall_s
            f.rewards.append(mean_reward(samples))
            f.exact.append(exact_rate(samples))
            f.last_step, f.final_revision = step, step + 1
            if self.plan.ehp.enabled and step < self.steps:
                self.plan_next(step, done.result.wall_s, rollout_s)
            self.progress.update(
                step_status(
                    c.ctl.world,
                    f,
                    step=step,
                    steps=self.steps,
                    loss=done.result.loss,
                    core=self.plan.core.dp,
                )
            )

    # -- 3. the planner between steps ----------------------------------------------------------
    def plan_next(self, step: int, train_s: float, rollout_s: float) -> None:
        c = self.cluster
        assert c.ctl and c.rollout
        # Decide from a settled world: right after a publication every engine is `updating`
        # (out of routing) for a moment, which the planner would rightly count as no rollout.
        self.until(lambda: not c.rollout.publisher.busy(), 30.0)  # type: ignore[union-attr]
        d = decide(
            view=cluster_view(c.ctl.world),
            metrics=Metrics(train_seconds=max(train_s, 1e-6), rollout_seconds=max(rollout_s, 1e-6)),
            policy=self.plan.planner_policy(),
            state=self.memory,
            now=c.ctl.now(),
        )
        cap = c.ctl.world.get("capacity", "grp")
        if not d.actions and d.shortfall is None and cap is not None and cap.state == "steady":
            self.memory = d.next_state  # nothing to do, nothing to clear: no record
            return
        if self.carry_out(d, step) and d.actions:
            self.say(f"step {step}: planner {d.summary()}")

    def carry_out(self, d: Decision, step: int) -> bool:
        """Post the decision through the loop; track its borrows and returns as moves."""
        assert self.cluster.decisions is not None
        done = self.cluster.decisions.carry_out(d)
        if done is None:
            return False  # stale: the next step recomputes from the current world
        self.memory = d.next_state
        now = time.monotonic()
        for it in done.borrows:  # from the engines on its GPUs, or free GPUs
            src = [e for e, gpus in done.drained.items() if set(gpus) & set(it.gpus)]
            what = f"{', '.join(src)} drained" if src else "free GPUs"
            self.moves.add(Pending(now, "borrow", what, step, hybrid=it.instance))
        for hid in done.leaves:
            self.moves.add(
                Pending(now, "return", f"hybrid {hid}", step, engines=list(done.restarts))
            )
        return True

    # -- 4. the end ----------------------------------------------------------------------------
    def return_all(self) -> None:
        """Every Hybrid returns at this step boundary, by a decision like any other."""
        ctl = self.cluster.ctl
        if ctl is None or not any(
            h.state not in ctl.world.specs["hybrid_replica"].terminal
            for h in ctl.world.of("hybrid_replica").values()
        ):
            return
        d = return_all(
            view=cluster_view(ctl.world),
            policy=self.plan.planner_policy(),
            state=self.memory,
            now=ctl.now(),
        )
        t0 = time.monotonic()
        if not self.carry_out(d, self.figures.last_step):
            raise RunError("the end-of-run return was refused as stale")
        returns = [p for p in self.moves.pending if p.kind == "return"]
        if not self.until(lambda: not any(p in self.moves.pending for p in returns), RETURN_S):
            why = "a stop was requested" if self.stop_requested else f"not within {RETURN_S:g} s"
            for p in returns:
                if p in self.moves.pending:
                    self.figures.moves.append(
                        Move(
                            kind="return",
                            step=self.figures.last_step,
                            latency_s=time.monotonic() - t0,
                            detail=f"{p.detail}: its GPUs did not serve rollout again ({why})",
                        )
                    )
        self.until(
            lambda: not self.cluster.rollout or not self.cluster.rollout.publisher.busy(), 60.0
        )

    # -- the loop's turns ----------------------------------------------------------------------
    def until(self, pred: Callable[[], bool], timeout_s: float) -> bool:
        """Turn the loop until `pred()` holds (True), the time is up or a stop is requested."""
        ctl = self.cluster.ctl
        assert ctl is not None
        end = time.monotonic() + timeout_s
        while not pred():
            if time.monotonic() > end or self.stop_requested:
                return False
            ctl.tick(0.02)
            self.failures.watch(ctl.world)
            self.moves.watch_returns(ctl.world)
        return True

    def serving(self) -> int:
        assert self.cluster.ctl is not None
        engines = self.cluster.ctl.world.of("rollout_engine").values()
        return sum(1 for e in engines if e.state == "serving")

    def say(self, text: str) -> None:
        self.progress.message(text)


def run(
    plan: Plan,
    *,
    out: TextIO = sys.stdout,
    live: bool | None = None,
    verify: bool = False,
    steps: int | None = None,
) -> int:
    """Run `plan`; the exit status: 0 when every step ran and everything stopped cleanly, 1 on
    a failure (or an unclean stop, or `verify` not passing), 128 + the signal's number when a
    signal stopped the run early (cleanly: the receipt says how far it got) — never 0, so a
    pipeline does not take an interrupted run for a finished one."""
    if steps is not None and steps < 1:
        raise RunError(f"--steps {steps} is not a number of steps", fix="give --steps 1 or more")
    job = Job(plan, out, live=live, verify=verify, steps=steps)
    stopped_by: list[int] = []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        job.stop_requested = True
        stopped_by.append(signum)
        job.say(f"signal {signal.Signals(signum).name}: stopping cleanly")

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    error: BaseException | None = None
    try:
        job.start()
        job.train()
        if not job.stop_requested:
            job.return_all()
    except BaseException as exc:  # the receipt and summary are written whatever happened
        error = exc
    finally:
        try:
            receipt = ending.finish(
                job.cluster,
                job.figures,
                error=error,
                interrupted=job.stop_requested,
                verify=verify,
                out=out,
                say=job.say,
                started=job.started,
            )
        finally:
            for s, h in old.items():
                signal.signal(s, h)
    if isinstance(error, KeyboardInterrupt):
        return 128 + signal.SIGINT
    if error is not None:
        raise error
    if verify and not (receipt.get("verify") or {}).get("passed", False):
        return 1
    if not receipt.get("clean_controller", False):
        return 1
    return 128 + stopped_by[0] if stopped_by else 0
