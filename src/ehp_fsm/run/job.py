"""`ehp-fsm run PLAN`: a real GRPO job with live borrowing and return.

The story, in the order it happens:
1. The plan is validated; a bad plan fails here, before anything starts.
2. The controller starts (its transition log is the run's write-ahead log), one agent per host
   (subprocesses in local mode), the trainer pool (Core ranks + warm Hybrid workers, one Gloo
   world), and the rollout engines through the agents — each installs revision 1 (the initial
   weights) before it serves.
3. Each step: rollout collects G complete groups (the dispatcher), the training_step machine
   partitions them over the live replicas of the current membership epoch, the pool computes the
   sample-weighted step, and the publisher installs the new revision on every serving engine.
4. Between steps the planner decides from the measured rollout/training times; its decision is
   logged against the world version and carried out through the machines (drain → stop →
   finalizer → Hybrid on a warm worker → load state → join at the boundary; and back).
5. At the end (or on Ctrl-C / SIGTERM): Hybrids return, the summary, the GPU timeline and a
   shutdown receipt are written beside the log, every process this run owns is stopped.

This module holds the story: start-up in order (its pieces are in `startup`), the routing of
commands to whoever performs them, the step loop, one step through the training_step machine,
and the planner between steps. What the user is told about moves and failures is in `watch`;
the end of the run (return, stop, summary, receipt, --verify) is in `ending`.
"""

from __future__ import annotations

import contextlib
import itertools
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import structlog

from ehp_fsm.core.batch import partition_groups
from ehp_fsm.core.execution import Intent, cluster_view, decision_events, ready_events
from ehp_fsm.core.planner import decide
from ehp_fsm.core.planner_model import Metrics, PlannerState
from ehp_fsm.core.transition import Accepted, Command, Outcome, Rejected
from ehp_fsm.core.world import Event
from ehp_fsm.errors import EhpError
from ehp_fsm.plan import Plan
from ehp_fsm.policy import PolicyConfig
from ehp_fsm.report.progress import Move, Progress, RunFigures
from ehp_fsm.rollout.client import SGLangClient
from ehp_fsm.rollout.revisions import RevisionStore
from ehp_fsm.run import ending
from ehp_fsm.run.hybrids import HybridLeases
from ehp_fsm.run.startup import (
    clear_run_dir,
    job_adam,
    log_beside,
    publish_initial,
    rollout_shell,
    spawn_agent,
    spawn_pool,
)
from ehp_fsm.run.watch import FailureWatch, MoveTracker, Pending, step_status
from ehp_fsm.runtime.controller import Controller
from ehp_fsm.runtime.identity import new_launch_token
from ehp_fsm.task import ArithmeticTask, exact_rate, mean_reward
from ehp_fsm.training.pool import PoolError, PoolFailure, StepResult
from ehp_fsm.training.verify import record_step

__all__ = ["Job", "RunError", "job_adam", "run"]

log = structlog.get_logger("ehp_fsm.run")

AGENTS_CONNECT_S = 60.0  # every host agent connects and reconciles within this, or the run stops


class RunError(EhpError):
    """The job could not go on (a Core trainer died, no engine came up, ...)."""


@dataclass
class Job:
    plan: Plan
    out: TextIO
    live: bool | None = None
    verify: bool = False
    steps: int | None = None
    figures: RunFigures = field(default_factory=RunFigures)
    stop_requested: bool = False

    def __post_init__(self) -> None:
        self.run_dir = Path(self.plan.log).resolve().parent
        self.progress = Progress(self.out, live=self.live)
        self.task = ArithmeticTask(seed=self.plan.seed)
        self.policy = PolicyConfig()
        self.task.check_config(self.policy)
        self.agents: list[subprocess.Popen[bytes]] = []
        self.memory = PlannerState()
        self.intents: list[Intent] = []
        self.ids = itertools.count(1)
        self.moves = MoveTracker(self.figures, self.progress)
        self.failures = FailureWatch(self.progress)
        self.clients: dict[str, SGLangClient] = {}
        self.started = time.monotonic()
        self.stopped: list[str] = []
        self._failure_note = ""
        self.shell_closed = False  # set by `finish` once the dispatcher and publisher closed

    # -- start ---------------------------------------------------------------------------------
    def start(self) -> None:
        clear_run_dir(self.run_dir)
        self._structlog_before = structlog.get_config()  # given back by `close_logs`
        self._logfile = log_beside(self.run_dir)
        store_root = self.run_dir / "revisions"
        self.store = RevisionStore(store_root)
        self.pool = spawn_pool(self.plan, self.policy, store_root, self.run_dir)
        self.ctl = Controller.start(self.plan, log_path=self.plan.log)
        endpoint = self.ctl.endpoint.endpoint
        for h in self.plan.hosts:
            self.agents.append(spawn_agent(self.plan, h, endpoint, self.run_dir))
        hosts = {h.id for h in self.plan.hosts}
        if not self.ctl.run_until(
            lambda c: hosts <= {a for a, i in c.agents.items() if i.reconciled}, AGENTS_CONNECT_S
        ):
            raise RunError(
                f"the host agents did not connect within {AGENTS_CONNECT_S:g} s",
                f"see {self.run_dir / 'agents'}/*.log",
            )
        self.pub, self.disp = rollout_shell(self.ctl, self.store, self.task, self.plan)
        self.leases = HybridLeases(self.ctl, self.pool)
        for kind in ("install", "generate", "pause_generation", "abort_request", "delete_revision"):
            self.ctl.on(kind, self._perform)
        self.ctl.on("compute", lambda _c, _cmd: None)  # the job calls the pool itself
        self.ctl.claim_machine("hybrid_replica", self.leases.command)
        publish_initial(self.pub, self.policy, self.plan.seed)
        self.ctl.launch_engines(lambda _eid: new_launch_token())
        self.route()
        if not self.until(lambda: self.serving() == len(self.plan.engines), 120.0):
            raise RunError(
                "rollout engines did not start serving within 120 s",
                f"see {self.run_dir / 'agents'}/*.log",
            )
        self.progress.message(
            f"ehp-fsm run {self.plan.name}: {len(self.plan.engines)} engines "
            f"serving revision 1; training {self.total_steps} steps"
        )

    @property
    def total_steps(self) -> int:
        return self.steps if self.steps is not None else self.plan.grpo.steps

    # -- plumbing ------------------------------------------------------------------------------
    def _perform(self, _ctl: Controller, cmd: Command) -> None:
        if self.shell_closed:  # shutting down: requests are abandoned, engines are stopping
            log.info("command_dropped_at_shutdown", kind=cmd.kind, instance=cmd.instance)
            return
        self._attach(cmd)
        self._route_rest(self.disp.perform(self.pub.perform([cmd])))

    def _attach(self, cmd: Command) -> None:
        if cmd.machine != "rollout_engine" or cmd.instance in self.clients:
            return
        inst = self.ctl.world.get("rollout_engine", cmd.instance)
        url = (inst.get("identity") or {}).get("url") if inst is not None else None
        if url:
            client = SGLangClient(url, timeout_s=10.0, generate_timeout_s=60.0)
            self.clients[cmd.instance] = client
            self.pub.attach(cmd.instance, client)
            self.disp.attach(cmd.instance, client)

    def _route_rest(self, rest: list[Command]) -> None:
        for cmd in rest:
            self.ctl.dispatch(cmd)

    def route(self) -> None:
        """Hand every collected command to whoever performs it, until none is left."""
        for _ in range(100):
            cmds = self.pub.take_commands() + self.disp.take_commands()
            self.leases.drain()
            if not cmds and not self.leases.later:
                return
            for cmd in cmds:
                self._attach(cmd)
            self._route_rest(self.disp.perform(self.pub.perform(cmds)))

    def tick(self, timeout_s: float = 0.02) -> None:
        self.ctl.tick(timeout_s)
        self.failures.watch(self.ctl.world)
        self.moves.watch_returns(self.ctl.world)
        self.disp.pump(0.0)
        self.pub.poll(0.0)
        self.route()
        events, self.intents = ready_events(self.intents, self.ctl.world, self.ctl.now())
        for ev in events:
            self.fire(ev)
        for eid in list(self.clients):
            inst = self.ctl.world.get("rollout_engine", eid)
            if inst is not None and inst.state in ("stopped", "failed"):
                self.pub.detach(eid)
                self.disp.detach(eid)
                self.clients.pop(eid).close()

    def fire(self, ev: Event) -> Outcome:
        """Handle `ev` on the controller's clock, then route what it commands."""
        out = self.ctl.handle(
            Event(ev.machine, ev.instance, ev.name, self.ctl.now(), ev.payload, ev.correlation)
        )
        self.route()
        return out

    def until(self, pred: Any, timeout_s: float) -> bool:
        """Tick until `pred()` holds (True), the time is up or a stop is requested (False)."""
        end = time.monotonic() + timeout_s
        while not pred():
            if time.monotonic() > end or self.stop_requested:
                return False
            self.tick(0.02)
        return True

    def serving(self) -> int:
        return sum(1 for e in self.ctl.world.of("rollout_engine").values() if e.state == "serving")

    # -- the loop ------------------------------------------------------------------------------
    def train(self) -> None:
        g = self.plan.grpo
        for step in range(1, self.total_steps + 1):
            if self.stop_requested:
                break
            t0 = time.monotonic()
            self.disp.fill(2 * g.prompts_per_step)
            if not self.until(
                lambda: len(self.disp.completed_groups()) >= g.prompts_per_step, 300.0
            ):
                if self.stop_requested:
                    break
                raise RunError(f"rollout did not produce {g.prompts_per_step} groups in 300 s")
            rollout_s = time.monotonic() - t0
            joined = self.leases.activate_ready()
            for hid in joined:
                self.moves.moved("borrow", hid, step)
            result, groups = self._train_step(step)
            train_s = result.wall_s
            self.figures.rollout_s += rollout_s
            self.figures.training_s += train_s
            self.figures.rewards.append(mean_reward(groups))
            self.figures.exact.append(exact_rate(groups))
            self.figures.last_step = step
            self._plan(step, train_s, rollout_s)
            self._show(step, result.loss)

    def _train_step(self, step: int) -> tuple[StepResult, list[Any]]:
        """One optimizer step through the training_step machine. A Hybrid that dies during the
        step — also inside the gradient all-reduce: the pool then re-forms its Gloo world
        without it — fails its machine (epoch + 1, GPU to the finalizer), the step fails (the
        ledger names it missing, the groups go back, the optimizer did not step), and the step
        is retried on the replicas still live. A dead Core trainer ends the run with the reason:
        the Core holds the only authoritative optimizer state, there is nothing to fall back on."""
        failed_at: float | None = None
        for attempt in range(3):
            sid = f"step-{step}" if attempt == 0 else f"step-{step}.{attempt}"
            result = self._attempt_step(step, sid)
            if isinstance(result, tuple):
                for replica in result[0].lost:  # died after the reduction: the step stands
                    hid = replica.split(":", 1)[1]
                    self.progress.message(
                        f"step {step}: Hybrid {hid} died after the gradient reduction "
                        "(its gradient counted); the run goes on without it"
                    )
                    self.ctl.event("hybrid_replica", hid, "fail", reason="died after reduction")
                    with contextlib.suppress(PoolError):
                        self.pool.deactivate(replica)
                    self.route()
                if failed_at is not None:
                    self.figures.moves.append(
                        Move(
                            kind="failed",
                            step=step,
                            latency_s=time.monotonic() - failed_at,
                            detail=f"{self._failure_note}; step retried on the Core",
                        )
                    )
                return result
            replica = result.replica or ""
            if result.broken_world or not replica.startswith("hybrid:"):
                raise RunError(f"training step {step} failed: {result}")
            failed_at = failed_at or time.monotonic()
            hid = replica.split(":", 1)[1]
            reform = self.pool.reforms[-1] if self.pool.reforms else None
            inside = reform is not None and reform.dead == (result.rank,)
            self._failure_note = f"hybrid {hid} died" + (
                f" inside the {reform.op} collective (world re-formed in "
                f"{reform.seconds * 1000:.0f} ms)"
                if inside and reform is not None
                else f" ({result.reason})"
            )
            self.progress.message(
                f"step {step}: Hybrid {hid} failed ({result.reason}: "
                f"{result.detail}); retrying the step on the Core"
            )
            self.ctl.event("hybrid_replica", hid, "fail", reason=str(result))
            with contextlib.suppress(PoolError):
                self.pool.deactivate(replica)
            self.route()
        raise RunError(f"training step {step} failed three times")

    def _attempt_step(self, step: int, sid: str) -> tuple[StepResult, list[Any]] | PoolFailure:
        g = self.plan.grpo
        ids = self.disp.completed_groups(g.prompts_per_step)
        live = self.pool.live_replicas()
        epoch = self.ctl.world.globals["epoch"]
        part = partition_groups(
            groups=[int(i[1:]) for i in ids],
            live=dict.fromkeys(live, 1),
            group_size=g.group_size,
            step=step,
            epoch=epoch,
        )
        self._must(self.ctl.event("training_step", sid, "begin", step=step))
        partition = {r: [f"g{x}" for x in gs] for r, gs in part.assignments}
        self._must(
            self.ctl.event("training_step", sid, "partition", groups=ids, partition=partition)
        )
        groups = [c.samples for c in self.disp.results(ids)]
        batch = self.task.build_batch(groups)
        if self.verify:
            record_step(
                self.run_dir / "verify" / "records",
                step=step,
                epoch=epoch,
                partition={r: part.groups_of(r) for r in part.replicas},
                batch=batch,
            )
        result = self.pool.step(
            step=step, epoch=epoch, partition=part, batch=batch, revision=step + 1
        )
        if isinstance(result, PoolFailure):
            self.ctl.event("training_step", sid, "fail", reason=str(result))
            self.route()
            return result
        self._must(
            self.ctl.event("training_step", sid, "delivered", replicas=list(result.replicas))
        )
        self._must(self.ctl.event("training_step", sid, "reduced"))
        self._must(self.ctl.event("training_step", sid, "stepped", version=result.version))
        if result.publish_error is not None:  # the step stands; its revision was not saved
            self._save_again(step, result.publish_error)
        self.pub.register_saved(step + 1)
        self.pub.publish(step + 1)
        self.route()
        self._must(self.ctl.event("training_step", sid, "published", revision=step + 1))
        self.figures.final_revision = step + 1
        self.pub.retire_unreferenced()  # a file that will not go is in pub.stats.retire_errors
        return result, groups

    def _save_again(self, step: int, why: str) -> None:
        """Save the Core's weights as the step's revision once more (the first try, inside the
        step, failed after the optimizer stepped); stop the run if that fails too: the engines
        cannot be given the new weights."""
        self.progress.message(f"step {step}: revision {step + 1} was not saved ({why}); again")
        again = self.pool.publish(step + 1, step=step)
        if isinstance(again, PoolFailure):
            raise RunError(
                f"revision {step + 1} could not be saved after step {step}",
                f"{why}; the second try: {again}",
                "free space under the revision store (or fix its permissions) and start again",
            )

    def _must(self, out: Outcome) -> Outcome:
        if isinstance(out, Rejected):
            raise RunError(f"the engine refused a step of the job: {out.reason}")
        self.route()
        return out

    # -- EHP -----------------------------------------------------------------------------------
    def _plan(self, step: int, train_s: float, rollout_s: float) -> None:
        if not self.plan.ehp.enabled or step >= self.total_steps:
            return
        # Decide from a settled world: right after a publication every engine is `updating`
        # (out of routing) for a moment, which the planner would rightly count as no rollout.
        self.until(lambda: not self.pub.busy(), 30.0)
        d = decide(
            view=cluster_view(self.ctl.world),
            metrics=Metrics(train_seconds=max(train_s, 1e-6), rollout_seconds=max(rollout_s, 1e-6)),
            policy=self.plan.planner_policy(),
            state=self.memory,
            now=self.ctl.now(),
        )
        cap = self.ctl.world.get("capacity", "grp")
        if not d.actions and d.shortfall is None and cap is not None and cap.state == "steady":
            self.memory = d.next_state  # nothing to do, nothing to clear: no record
            return
        events, intents = decision_events(d, self.ctl.now(), self.new_id)
        first = self.ctl.handle(events[0])
        if not isinstance(first, Accepted):
            return  # stale: the next step recomputes from the current world
        self.memory = d.next_state
        now = time.monotonic()
        drained = {  # engine id -> its GPUs, read before the drain
            ev.instance: set(self._gpus("rollout_engine", ev.instance))
            for ev in events[1:]
            if ev.machine == "rollout_engine" and ev.name == "drain"
        }
        for ev in events[1:]:
            if ev.machine == "rollout_engine" and ev.name == "drain":
                self.disp.drain_engine(ev.instance)
                self.route()
            else:
                self.fire(ev)
        restarts = [it.instance for it in intents if it.kind == "launch_engine"]
        for it in intents:
            if it.kind == "allocate":  # a borrow: from the engines on its GPUs, or free GPUs
                src = [e for e, gpus in drained.items() if gpus & set(it.gpus)]
                what = f"{', '.join(src)} drained" if src else "free GPUs"
                self.moves.add(Pending(now, "borrow", what, step, hybrid=it.instance))
            elif it.kind == "leave":
                self.moves.add(
                    Pending(now, "return", f"hybrid {it.instance}", step, engines=restarts)
                )
        self.intents += intents
        if d.actions:
            self.progress.message(f"step {step}: planner {d.summary()}")

    def _gpus(self, machine: str, iid: str) -> tuple[str, ...]:
        inst = self.ctl.world.get(machine, iid)
        return tuple(inst.get("gpus") or ()) if inst is not None else ()

    def new_id(self, kind: str) -> str:
        n = next(self.ids)
        return {"hybrid": f"x{n}", "engine": f"r{n}"}.get(kind) or new_launch_token()

    def _show(self, step: int, loss: float) -> None:
        self.progress.update(
            step_status(
                self.ctl.world,
                self.figures,
                step=step,
                steps=self.total_steps,
                loss=loss,
                core=self.plan.core.dp,
            )
        )

    # -- the end -------------------------------------------------------------------------------
    def close_logs(self) -> None:
        """Close `controller.log` and give structlog back the configuration it had before the
        run (a scheduler that embeds `run` keeps its own logging)."""
        if hasattr(self, "_logfile"):
            structlog.configure(**self._structlog_before)
            self._logfile.close()

    def return_all(self) -> None:
        """Hybrids leave at this step boundary and come back as serving engines (`ending`)."""
        ending.return_all(self)

    def finish(self, error: BaseException | None) -> dict[str, Any]:
        """Stop all this run owns; write the summary, timeline and receipt (`ending`)."""
        return ending.finish(self, error)


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
        job.progress.message(f"signal {signal.Signals(signum).name}: stopping cleanly")

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
            receipt = job.finish(error)
        finally:
            job.close_logs()
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
