"""A small driver for engine scenarios in tests: names the common event sequences once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ehp_fsm import Event, Orchestrator, load_plan
from ehp_fsm.core.transition import Accepted, Outcome, Rejected

LOCAL_PLAN = Path(__file__).resolve().parent / "plan.toml"


def identity(host: str, token: str, pid: int = 100, start: float = 5.0) -> dict[str, Any]:
    return {"host": host, "pid": pid, "start_time": start, "token": token}


class Scenario:
    def __init__(
        self,
        log_path: Path | None = None,
        *,
        checkpoint_every: int | None = None,
        forget_finished: bool = True,
    ) -> None:
        """`checkpoint_every`: write a checkpoint line after every that many events (from the
        first event after the plan's inventory), whatever the world's size. `forget_finished`:
        the orchestrator's (False: its checkpoints list every instance, as before schema 4)."""
        off: dict[str, Any] = {} if forget_finished else {"forget_finished": False}
        self.engine = Orchestrator.from_plan(
            load_plan(LOCAL_PLAN), log_path=log_path, check=True, **off
        )
        if checkpoint_every is not None and self.engine.log is not None:
            self.engine.log.checkpoint_every = checkpoint_every
            self.engine.log.checkpoint_events_per_instance = 0.0
        self.now = 1.0

    @property
    def world(self) -> Any:
        return self.engine.world

    def fire(self, machine: str, instance: str, name: str, **payload: Any) -> Outcome:
        self.now += 1.0
        return self.engine.handle(Event(machine, instance, name, self.now, payload))

    def ok(self, machine: str, instance: str, name: str, **payload: Any) -> Accepted:
        out = self.fire(machine, instance, name, **payload)
        assert isinstance(out, Accepted), out.reason  # type: ignore[union-attr]
        return out

    def no(self, machine: str, instance: str, name: str, **payload: Any) -> str:
        out = self.fire(machine, instance, name, **payload)
        assert isinstance(out, Rejected), f"{machine} {instance} {name} was accepted"
        return out.reason

    def state(self, machine: str, instance: str) -> str:
        inst = self.world.get(machine, instance)
        assert inst is not None
        return str(inst.state)

    def state_of_engine(self, eid: str) -> str:
        return self.state("rollout_engine", eid)

    def publish(self, revision: int) -> None:
        rid = f"r{revision}"
        self.ok("revision", rid, "save", revision=revision, step=revision - 1)
        self.ok("revision", rid, "saved", checksum="c", path=f"/rev/{revision}")
        self.ok("revision", rid, "publish")

    def serving_engine(self, eid: str = "e0", gpu: str = "h1:g0", host: str = "h1") -> None:
        if self.world.globals["revision"] < 1:
            self.publish(1)
        self.ok("rollout_engine", eid, "launch", host=host, gpus=[gpu], tp=1, token=f"t-{eid}")
        self.ok("rollout_engine", eid, "healthy", identity=identity(host, f"t-{eid}"))
        self.ok("rollout_engine", eid, "installed", revision=self.world.globals["revision"])

    def reserve_engine(self) -> None:
        """Serve e2 on h2:g0: the plan's rollout reserve (1 GPU), so that another engine may be
        drained (the core refuses a drain that leaves fewer GPUs serving than the reserve)."""
        self.serving_engine("e2", "h2:g0", "h2")

    def stop_engine(self, eid: str = "e0", host: str = "h1") -> None:
        self.ok("rollout_engine", eid, "drain")
        self.ok("rollout_engine", eid, "drained")
        self.ok("rollout_engine", eid, "exited", identity=identity(host, f"t-{eid}"))

    def confirm_free(self, gpu: str, owner: str) -> None:
        self.ok("gpu", gpu, "confirm_free", owner=owner, processes_exited=True, memory_free=True)

    def ready_hybrid(self, hid: str = "x0", gpu: str = "h1:g0", host: str = "h1") -> None:
        self.ok("hybrid_replica", hid, "request")
        self.ok("hybrid_replica", hid, "allocate", host=host, gpus=[gpu])
        self.ok("hybrid_replica", hid, "launch", token=f"t-{hid}")
        self.ok("hybrid_replica", hid, "launched", identity=identity(host, f"t-{hid}", pid=200))
        self.ok("hybrid_replica", hid, "loaded", version=self.world.globals["core_version"])

    def completed_groups(self, n: int, engine: str = "e0", prefix: str = "g") -> list[str]:
        ids = [f"{prefix}{i}" for i in range(n)]
        rev = self.world.globals["revision"]
        for g in ids:
            self.ok("request", g, "enqueue", prompt="1+1=")
            self.ok("request", g, "dispatch", engine=engine)
            self.ok("request", g, "complete", engine=engine, revision=rev)
        return ids
