"""A minimal fleet shell for the flow tests: real embedded engine processes driven through the
engine's machines, with the dispatcher and the publisher performing their commands, and training
steps driven through the `training_step` machine (the only way a group is claimed or consumed).

The fleet is a performer of the shell's loop for the far edge a real run hands to its agents
(`stop_process`, the GPU finalizer); the publisher and the dispatcher are the run's own
performers. What it fakes: nothing on the engine side (real processes, real HTTP). The
virtual hosts of `examples/local.toml` stand in for machines: every process runs on 127.0.0.1
and reports the plan's host in its identity. The trainer is the far edge: no gradient is
computed — a step's replicas are reported delivered, the step reduced and stepped, and the
published revision is the tiny HF model's weights plus seeded noise — but every one of those
reports goes through the training_step machine and its guards, with the groups partitioned
across the plan's live replicas.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ehp_fsm import Orchestrator, load_plan
from ehp_fsm.core.batch import partition_groups
from ehp_fsm.core.transition import Accepted, Command, Outcome, Rejected
from ehp_fsm.rollout import EngineHandle, RevisionStore, SGLangClient, launch_engine, stop_engine
from ehp_fsm.rollout.dispatch import DispatchConfig, Dispatcher
from ehp_fsm.rollout.publish import PublishConfig, Publisher
from ehp_fsm.shell.loop import ANY, Loop, Route
from ehp_fsm.training.task import ArithmeticTask
from tests.rollout.hf import revision_state

PLAN = Path(__file__).resolve().parents[2] / "examples" / "local.toml"


class Fleet:
    routes: frozenset[Route] = frozenset({(ANY, "stop_process"), (ANY, "confirm_gpu_free")})

    def __init__(
        self, root: Path, *, base: Path, group_size: int = 4, decode_delay_ms: float = 0.0
    ) -> None:
        """`base`: the HF model directory every revision is made from."""
        self.base = base
        self.log_path = root / "transitions.jsonl"
        plan = load_plan(PLAN)
        # The fleet runs two or three engines and borrows one: a rollout reserve of one GPU
        # (the core refuses a drain that leaves fewer serving GPUs than the reserve).
        plan = dataclasses.replace(plan, rollout=dataclasses.replace(plan.rollout, reserve=1))
        orch = Orchestrator.from_plan(plan, log_path=self.log_path, check=True)
        self.loop = Loop(orch, clock=time.monotonic)
        self.store = RevisionStore(root / "revisions")
        self.task = ArithmeticTask()
        self.pub = Publisher(
            self.loop,
            self.store,
            config=PublishConfig(retry_backoff_s=0.1, max_backoff_s=0.3, give_up_after_s=30),
        )
        self.disp = Dispatcher(
            self.loop,
            self.task,
            config=DispatchConfig(group_size=group_size, max_inflight_per_engine=4),
        )
        for performer in (self, self.pub, self.disp):
            self.loop.add(performer)
        self.groups_per_step = int(self.loop.world.config["groups_per_step"])
        self.decode_delay_ms = decode_delay_ms
        self.handles: dict[str, EngineHandle] = {}
        self.clients: dict[str, SGLangClient] = {}
        self.gpus: dict[str, str] = {}
        self.next_rev = 1

    # -- events ----------------------------------------------------------------------------
    def fire(self, machine: str, instance: str, name: str, **payload: Any) -> Outcome:
        return self.loop.event(machine, instance, name, **payload)

    def must(self, machine: str, instance: str, name: str, **payload: Any) -> Accepted:
        out = self.fire(machine, instance, name, **payload)
        assert isinstance(out, Accepted), f"{machine} {instance} {name}: {out.reason}"
        return out

    # -- the fleet's performer side: launches, stops and GPUs --------------------------------
    def perform(self, cmd: Command) -> None:
        if cmd.kind == "stop_process":
            self._stop(cmd.instance)
        elif cmd.kind == "confirm_gpu_free":
            h = self.handles.get(str(cmd.args["owner"]).partition(":")[2])
            gone = h is None or not h.is_alive()
            self.fire(
                "gpu",
                cmd.instance,
                "confirm_free",
                owner=cmd.args["owner"],
                processes_exited=gone,
                memory_free=gone,
            )

    def poll(self, timeout_s: float) -> None:
        return None

    def close(self) -> None:
        return None  # `shutdown` stops the processes

    def identity(self, eid: str) -> dict[str, Any]:
        h = self.handles[eid]
        host = self.gpus[eid].split(":")[0]
        return {"host": host, "pid": h.pid, "start_time": h.start_time, "token": h.launch_token}

    # -- engines ---------------------------------------------------------------------------
    def start_processes(self, eids: list[str]) -> None:
        """Start empty engine processes (no weights) in parallel."""
        with ThreadPoolExecutor(len(eids)) as pool:
            handles = list(
                pool.map(
                    lambda _: launch_engine(decode_delay_ms=self.decode_delay_ms, deadline_s=90.0),
                    eids,
                )
            )
        for eid, h in zip(eids, handles, strict=True):
            self.handles[eid] = h
            self.clients[eid] = SGLangClient(h.url, timeout_s=5.0, generate_timeout_s=60.0)

    def launch(self, eid: str, gpu: str, *, healthy: bool = True) -> None:
        """`launch` (the process must be started), then `healthy` → install-before-serve."""
        self.gpus[eid] = gpu
        h = self.handles[eid]
        host = gpu.split(":")[0]
        out = self.fire(
            "rollout_engine", eid, "launch", host=host, gpus=[gpu], tp=1, token=h.launch_token
        )
        assert out.accepted, out.reason  # type: ignore[union-attr]
        self.pub.attach(eid, self.clients[eid], alive=h.is_alive)
        self.disp.attach(eid, self.clients[eid], alive=h.is_alive)
        if healthy:
            self.healthy(eid)

    def healthy(self, eid: str) -> None:
        out = self.pub.engine_healthy(eid, self.identity(eid))
        assert out.accepted, out.reason  # type: ignore[union-attr]

    def borrow(self, eid: str) -> None:
        """Drain (requeue + pause retract), stop the identified process, `exited`."""
        outs = self.disp.drain_engine(eid)
        assert all(o.accepted for o in outs), [o for o in outs if not o.accepted]

    def _stop(self, eid: str) -> None:
        h = self.handles.get(eid)
        if h is None:
            return
        stop_engine(h, grace_s=5.0)
        inst = self.loop.world.get("rollout_engine", eid)
        if inst is not None and inst.state == "stopping":
            self.fire("rollout_engine", eid, "exited", identity=self.identity(eid))
        self.pub.detach(eid)
        self.disp.detach(eid)

    def kill(self, eid: str) -> None:
        os.kill(self.handles[eid].pid, signal.SIGKILL)
        self.handles[eid].process.wait(timeout=10)

    def state(self, eid: str) -> str:
        inst = self.loop.world.get("rollout_engine", eid)
        assert inst is not None
        return str(inst.state)

    # -- training steps --------------------------------------------------------------------
    def live_replicas(self) -> list[str]:
        """The plan's Core replicas plus the active Hybrids (the replicas of this epoch)."""
        core = [str(r) for r in self.loop.world.config["core_replicas"]]
        active = self.loop.world.of("hybrid_replica").values()
        return core + sorted(f"hybrid:{h.id}" for h in active if h.state == "active")

    def train_step(self, n: int, group_ids: list[str]) -> tuple[list[Accepted], int]:
        """Step `n` over exactly G completed groups: `begin` → `partition` (claims them, across
        the live replicas) → `delivered` → `reduced` → `stepped` (consumes them) → publish a
        new revision → `published`. Returns the accepted outcomes and the revision."""
        sid = f"step-{n}"
        live = self.live_replicas()
        part = partition_groups(
            groups=[int(g[1:]) for g in group_ids],
            live=dict.fromkeys(live, 1),
            group_size=self.disp.config.group_size,
            step=n,
            epoch=int(self.loop.world.globals["epoch"]),
        )
        partition = {r: [f"g{x}" for x in gs] for r, gs in part.assignments}
        outs = [
            self.must("training_step", sid, "begin", step=n),
            self.must("training_step", sid, "partition", groups=group_ids, partition=partition),
        ]
        for gid in group_ids:
            inst = self.loop.world.get("request", gid)
            assert inst is not None and inst.state == "claimed", (gid, inst)
            assert inst.get("claimed_by") == sid
        # a claimed group is consumed only by the step's optimizer step, not by a caller
        direct = self.fire("request", group_ids[0], "consume", step=sid)
        assert isinstance(direct, Rejected), "a direct consume skipped the optimizer step"
        assert "move to publishing" in direct.reason, direct.reason
        outs.append(self.must("training_step", sid, "delivered", replicas=live))
        outs.append(self.must("training_step", sid, "reduced"))
        outs.append(self.must("training_step", sid, "stepped", version=n))
        rev = self.publish(wait=False)
        outs.append(self.must("training_step", sid, "published", revision=rev))
        return outs, rev

    # -- revisions -------------------------------------------------------------------------
    def publish(self, *, wait: bool = True) -> int:
        rev = self.next_rev
        self.next_rev += 1
        out = self.pub.save_and_publish(
            revision=rev,
            step=rev,
            state_dict=revision_state(self.base, rev),
            base=self.base,
        )
        assert out.accepted, out.reason  # type: ignore[union-attr]
        if wait:
            assert self.settle(30.0), "installs did not settle"
        return rev

    def settle(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.pub.poll(timeout_s=0.02)
            if not self.pub.busy():
                return True
        return False

    def pump(self, timeout_s: float = 0.05) -> None:
        self.disp.pump(timeout_s=timeout_s)
        self.pub.poll()

    def wait_completed(self, k: int, timeout_s: float) -> list[str]:
        """Pump the dispatcher *and* the publisher (an engine updating to a new revision takes
        no group until its install is reported) until `k` fresh groups are completed."""
        deadline = time.monotonic() + timeout_s
        while True:
            ids = self.disp.completed_groups(k)
            if len(ids) >= k or time.monotonic() >= deadline:
                return ids
            self.pump(0.02)

    def shutdown(self) -> None:
        self.loop.close()
        for h in self.handles.values():
            stop_engine(h, grace_s=3.0)
        for c in self.clients.values():
            c.close()
