"""Drive the ehp-fsm engine from another scheduler: feed events, perform the commands it returns.

This is the whole embedding API: `Orchestrator.from_plan(plan, log_path=..., check=True)`,
`engine.handle(Event(machine, instance, name, time, payload))` → `Accepted` (with `.commands` to
perform) or `Rejected` (with `.reason`; nothing changed). Here a toy "scheduler" borrows one
rollout engine's GPU for a Hybrid replica and gives it back; the agent replies that a real
cluster would send (process up, process exited, memory free) are played by the loop itself.

    python examples/embed.py [LOG]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from ehp_fsm import Accepted, Event, Orchestrator, load_plan
from ehp_fsm.replay import replay

PLAN = Path(__file__).resolve().parent / "local.toml"


def main(log_path: str) -> int:
    engine = Orchestrator.from_plan(load_plan(PLAN), log_path=log_path, check=True)
    clock = time.time

    def send(machine: str, instance: str, name: str, **payload: object) -> Accepted:
        out = engine.handle(Event(machine, instance, name, clock(), payload))
        if not isinstance(out, Accepted):
            raise SystemExit(f"refused: {out.reason}")
        for cmd in out.commands:  # a real scheduler would perform these
            print(f"  command {cmd.kind:<18} {cmd.machine}:{cmd.instance} {dict(cmd.args)}")
        return out

    def pid_of(n: int) -> dict[str, object]:
        return {"host": "h1", "pid": 4000 + n, "start_time": 1000.0 + n, "token": f"t{n}"}

    print("publish revision 1 and start engine e0 on h1:g0 (install before serve)")
    send("revision", "r1", "save", revision=1, step=0)
    send("revision", "r1", "saved", path="/revisions/1")
    send("revision", "r1", "publish")
    send("rollout_engine", "e0", "launch", host="h1", gpus=["h1:g0"], tp=1, token="t0")
    send("rollout_engine", "e0", "healthy", identity=pid_of(0))
    send("rollout_engine", "e0", "installed", revision=1)
    print("start e1 and e2: the plan's rollout reserve is 2 GPUs, and only a third may stop")
    for n, (eid, gpu) in enumerate([("e1", "h1:g1"), ("e2", "h2:g0")], start=5):
        ident = {**pid_of(n), "host": gpu.split(":")[0]}
        send("rollout_engine", eid, "launch", host=ident["host"], gpus=[gpu], tp=1, token=f"t{n}")
        send("rollout_engine", eid, "healthy", identity=ident)
        send("rollout_engine", eid, "installed", revision=1)

    print("a guard at work: a stop confirmation for a recycled pid is refused")
    recycled = {**pid_of(0), "start_time": 99.0}
    send("rollout_engine", "e0", "drain")
    send("rollout_engine", "e0", "drained")
    out = engine.handle(Event("rollout_engine", "e0", "exited", clock(), {"identity": recycled}))
    print(f"  refused: {out.reason}")  # type: ignore[union-attr]

    print("borrow: e0 exits, its GPU is confirmed free, a Hybrid takes it and joins")
    send("rollout_engine", "e0", "exited", identity=pid_of(0))
    send("gpu", "h1:g0", "confirm_free", owner="engine:e0", processes_exited=True, memory_free=True)
    send("hybrid_replica", "x0", "request")
    send("hybrid_replica", "x0", "allocate", host="h1", gpus=["h1:g0"])
    send("hybrid_replica", "x0", "launch", token="t1")
    send("hybrid_replica", "x0", "launched", identity=pid_of(1))
    send("hybrid_replica", "x0", "loaded", version=0)
    send("hybrid_replica", "x0", "activate")

    print("return: the Hybrid leaves at a step boundary and the GPU goes back to rollout")
    send("hybrid_replica", "x0", "leave")
    send("hybrid_replica", "x0", "exited", identity=pid_of(1))
    send("gpu", "h1:g0", "confirm_free", owner="hybrid:x0", processes_exited=True, memory_free=True)
    send("rollout_engine", "e3", "launch", host="h1", gpus=["h1:g0"], tp=1, token="t2")
    send("rollout_engine", "e3", "healthy", identity=pid_of(2))
    send("rollout_engine", "e3", "installed", revision=1)
    engine.close()

    result = replay(log_path)
    print(
        f"{result.transitions} transitions verified; h1:g0 owned by "
        f"{result.world.get('gpu', 'h1:g0').get('owner')}"
    )  # type: ignore[union-attr]
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "runs/embed/transitions.jsonl"))
