"""A world-driven borrow/return script for the runtime system tests (and its subprocess mode).

`Driver.advance(goal)` looks at the controller's world and fires the next event towards the goal,
the way an embedding run loop would: it never remembers what it did, so it resumes from any
world — after a process was killed, an agent restarted, or the controller recovered from its log.

Goals (on the borrowed slot `h1:g0`):
  "serving"  — a serving engine on h1:g0 (the start, and the end of a return)
  "borrowed" — an active Hybrid on h1:g0 (its engine drained and stopped, GPU confirmed free)

The far edge is faked here, and only here: `install` is answered with `installed` after a real
HTTP GET of the engine's `/model_info` (stand-in engines have no HTTP endpoint: answered at
once), `pause_generation` with `drained`, `load_state` with `loaded` at the Core's version.
Everything else — agents, processes, sockets, identities, stops, finalizers — is real.

Subprocess mode (the controller-kill and clean-shutdown tests):
    python -m tests.runtime_system.driver --plan P --log L --bind EP --stop-at PHASE
prints `REACHED <phase>` when the world reaches PHASE (or, for `borrow:POINT` / `return:POINT`,
at the first tick after the kill point's transition was logged in that phase: `killpoints`) and
keeps ticking until killed, or until SIGTERM (clean shutdown: exit 0).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from ehp_fsm.core.transition import Command
from ehp_fsm.plan import load_plan
from ehp_fsm.runtime import TransportConfig
from ehp_fsm.runtime.controller import Controller, install_signal_handlers
from tests.runtime_system.killpoints import KillPoint, Trigger

SLOT, HOST = "h1:g0", "h1"
TEST_TRANSPORT = TransportConfig(
    retry_interval_s=0.1, deadline_s=10.0, heartbeat_interval_s=0.25, missed_heartbeats=8
)


def _alive(ctl: Controller, machine: str, states: tuple[str, ...]) -> list[Any]:
    return sorted(
        (
            i
            for i in ctl.world.of(machine).values()
            if i.state in states and SLOT in (i.get("gpus") or ())
        ),
        key=lambda i: i.id,
    )


def install(ctl: Controller, command: Command) -> None:
    ident = command.args.get("identity") or {}
    url = ident.get("url")
    if url:
        with httpx.Client(timeout=5.0) as client:
            client.get(f"{url}/model_info").raise_for_status()
    ctl.event("rollout_engine", command.instance, "installed", revision=command.args["revision"])


def drained(ctl: Controller, command: Command) -> None:
    ctl.event("rollout_engine", command.instance, "drained")


def loaded(ctl: Controller, command: Command) -> None:
    ctl.event("hybrid_replica", command.instance, "loaded", version=command.args["version"])


class Driver:
    def __init__(self, ctl: Controller, *, prefix: str = "") -> None:
        self.ctl = ctl
        self.ids = itertools.count()
        self.prefix = prefix or f"r{int(time.time() * 1000) % 100000}"
        ctl.on("install", install)
        ctl.on("pause_generation", drained)
        ctl.on("load_state", loaded)

    def new_id(self, kind: str) -> str:
        return f"{kind}{self.prefix}{next(self.ids)}"

    def setup(self) -> None:
        """Revision 1 published, the plan's engines launched (once)."""
        w = self.ctl.world
        if w.globals["revision"] < 1:
            self.ctl.event("revision", "r1", "save", revision=1, step=0)
            self.ctl.event("revision", "r1", "saved", checksum="c", path="/rev/1")
            self.ctl.event("revision", "r1", "publish")
        self.ctl.launch_engines(lambda eid: self.new_id("t"))
        if w.get("request", "g0") is None:
            for g in ("g0", "g1"):
                self.ctl.event("request", g, "enqueue", prompt="1+1=")

    def redrive(self) -> None:
        """Commands for the embedding code are not in any agent's memory: after a crash the
        run loop performs them again from the world."""
        c = self.ctl
        for e in list(c.world.of("rollout_engine").values()):
            if e.state == "installing" and e.get("identity"):
                install(
                    c,
                    Command(
                        "install",
                        "rollout_engine",
                        e.id,
                        {"revision": c.world.globals["revision"], "identity": e.get("identity")},
                    ),
                )
            elif e.state == "draining":
                c.event("rollout_engine", e.id, "drained")
        for h in list(c.world.of("hybrid_replica").values()):
            if h.state == "loading":
                c.event("hybrid_replica", h.id, "loaded", version=c.world.globals["core_version"])

    def dispatch_groups(self) -> None:
        """Keep the queued groups on serving engines (a drain or a death requeues them)."""
        c = self.ctl
        serving = sorted(
            e.id for e in c.world.of("rollout_engine").values() if e.state == "serving"
        )
        if not serving:
            return
        for r in list(c.world.of("request").values()):
            if r.state == "queued":
                c.event("request", r.id, "dispatch", engine=serving[0])

    def reached(self, goal: str) -> bool:
        return reached(self.ctl, goal)

    def advance(self, goal: str) -> None:
        c, w = self.ctl, self.ctl.world
        self.redrive()
        self.dispatch_groups()
        gpu = w.get("gpu", SLOT)
        engines = _alive(
            c,
            "rollout_engine",
            ("starting", "installing", "serving", "updating", "draining", "stopping"),
        )
        hybrids = _alive(
            c,
            "hybrid_replica",
            ("requested", "allocated", "launching", "loading", "ready", "active", "leaving"),
        )
        if goal == "borrowed":
            for e in engines:
                if e.state == "serving":
                    c.event("rollout_engine", e.id, "drain", reason="borrow")
            for h in hybrids:
                if h.state == "ready":
                    c.event("hybrid_replica", h.id, "activate")
            if not engines and not hybrids and gpu.state == "free":
                hid = self.new_id("x")
                c.event("hybrid_replica", hid, "request", reason="borrow")
                c.event("hybrid_replica", hid, "allocate", host=HOST, gpus=[SLOT])
                c.event("hybrid_replica", hid, "launch", token=self.new_id("t"))
        elif goal == "serving":
            for h in hybrids:
                if h.state == "active":
                    c.event("hybrid_replica", h.id, "leave")
                elif h.state in ("requested", "allocated", "launching", "loading", "ready"):
                    c.event("hybrid_replica", h.id, "cancel", reason="return")
            if not engines and not hybrids and gpu.state == "free":
                c.event(
                    "rollout_engine",
                    self.new_id("e"),
                    "launch",
                    host=HOST,
                    gpus=[SLOT],
                    tp=1,
                    token=self.new_id("t"),
                )

    def drive(self, goal: str, timeout_s: float, on_tick: Any = None) -> None:
        end = time.monotonic() + timeout_s
        while not self.reached(goal):
            if time.monotonic() > end:
                raise AssertionError(
                    f"goal {goal!r} not reached in {timeout_s}s: "
                    f"{ledger(self.ctl)}; {states(self.ctl)}"
                )
            self.advance(goal)
            self.ctl.tick(0.02)
            if on_tick is not None:
                on_tick()


def ledger(ctl: Controller) -> dict[str, tuple[str, Any]]:
    return {g.id: (g.state, g.get("owner")) for g in ctl.world.of("gpu").values()}


def states(ctl: Controller) -> dict[str, str]:
    out = {}
    for m in ("rollout_engine", "hybrid_replica", "request"):
        out.update({f"{m}:{i.id}": i.state for i in ctl.world.of(m).values()})
    return out


def reached(ctl: Controller, goal: str) -> bool:
    if goal == "serving":
        return bool(_alive(ctl, "rollout_engine", ("serving",)))
    return bool(_alive(ctl, "hybrid_replica", ("active",)))


PHASES = {
    # phase → predicate over the world (the controller is killed right when it holds). A fast
    # stand-in can go through `stopping`/`leaving` within one tick, between two looks: the phase
    # also counts as reached right after it (stopped), or the driver would wait forever.
    "engine_stopping": lambda c: any(
        e.state in ("stopping", "stopped") for e in c.world.of("rollout_engine").values()
    ),
    "hybrid_leaving": lambda c: any(
        h.state in ("leaving", "stopped") for h in c.world.of("hybrid_replica").values()
    ),
    "borrowed": lambda c: reached(c, "borrowed"),
}


def wait_agents(ctl: Controller, hosts: list[str], timeout_s: float = 30.0) -> None:
    ok = ctl.run_until(
        lambda c: all(h in c.agents and c.agents[h].reconciled for h in hosts), timeout_s
    )
    assert ok, f"agents {hosts} did not reconcile: {ctl.agents}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--plan", required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--bind", required=True)
    p.add_argument("--hosts", default="h1,h2")
    p.add_argument(
        "--stop-at",
        required=True,
        help=f"one of {sorted(PHASES)}, or PHASE:POINT, a kill point (`killpoints`) of the "
        "controller: borrow:start, return:gpu:release, ...",
    )
    args = p.parse_args(argv)
    if args.stop_at in PHASES:
        trigger, reached_phase = None, PHASES[args.stop_at]
    else:
        phase_name, _, point = args.stop_at.partition(":")
        kp = KillPoint(victim="controller", phase=phase_name, point=point, seed=-1)
        trigger, reached_phase = Trigger(kp, Path(args.log)), None
    ctl = Controller.start(
        load_plan(args.plan), log_path=args.log, bind=args.bind, transport=TEST_TRANSPORT
    )
    install_signal_handlers(ctl)
    d = Driver(ctl, prefix="p")
    wait_agents(ctl, args.hosts.split(","), 60.0)
    d.setup()
    goals = ["serving", "borrowed", "serving"]
    stage = {3: "serve", 2: "borrow", 1: "return"}  # len(goals) → the phase being driven
    begun = False

    def at_stop() -> bool:
        nonlocal begun
        if trigger is None:
            assert reached_phase is not None
            return bool(reached_phase(ctl))
        if not begun and stage[len(goals)] == trigger.kp.phase:
            trigger.begin()
            begun = True
        return begun and trigger.poll()

    announced = False
    while not ctl.shutdown_requested:
        if not announced:
            if d.reached(goals[0]) and len(goals) > 1:
                goals.pop(0)
            if at_stop():
                print(f"REACHED {args.stop_at}", flush=True)
                announced = True
            else:
                d.advance(goals[0])
        ctl.tick(0.02)
    ok = ctl.shutdown(timeout_s=60.0)
    print(f"SHUTDOWN {'clean' if ok else 'timeout'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
