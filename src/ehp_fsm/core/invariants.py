"""Safety invariants of a world, checked after every accepted step in tests and in debug mode.

`check_invariants(world)` returns the list of violations (empty when the world is sound):
one owner per GPU (no GPU listed by two live holders, every listed GPU owned by its holder, every
owned GPU listed by its live owner, the Core's GPUs owned by the Core only), the ledger adds up
to the inventory, every Hybrid allocation is complete and on one host, engines never serve an
uninstalled or non-current revision, and every claimed group is held by exactly one step that
is computing, reducing or stepping (no group claimed twice, none claimed by no step), and every
dispatched group is in flight on a live (non-terminal) engine.
"""

from __future__ import annotations

from ehp_fsm.core.guards import BUSY_STEP_STATES
from ehp_fsm.core.world import World

#: A holder's name as a GPU's `owner` gives it: `engine:<id>`, `hybrid:<id>`.
HOLDERS = {"rollout_engine": "engine", "hybrid_replica": "hybrid"}
NEEDS_OWNER = frozenset({"owned", "releasing"})  # GPU states that name their owner
#: The states in which an engine or Hybrid holds the GPUs it lists.
HOLDS_GPUS = {
    "rollout_engine": frozenset(
        {"starting", "installing", "serving", "updating", "draining", "stopping"}
    ),
    "hybrid_replica": frozenset(
        {"allocated", "launching", "loading", "ready", "active", "leaving"}
    ),
}


def check_invariants(world: World, *, indexed: bool = False) -> list[str]:
    """The violations of `world` (see the module docstring). `indexed`: the group checks read
    only the claimed and dispatched groups from `world.index` (kept by `World.apply`) instead
    of every group the run ever made — what a run checks after every event, whose cost would
    otherwise grow with the run's length. The same problems either way for a world written
    through `apply` (`tests.property.strategies.index_problems` compares them)."""
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
        if g.state in NEEDS_OWNER and owner is None:
            problems.append(f"GPU {g.id} is {g.state} without an owner")
        if g.state == "free" and owner is not None:
            problems.append(f"GPU {g.id} is free but names owner {owner}")
    listed: dict[str, str] = {}
    for machine, prefix in HOLDERS.items():
        for inst in world.of(machine).values():
            if inst.state not in HOLDS_GPUS[machine]:
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
    core = world.core_gpu_set or frozenset(world.config.get("core_gpus") or ())
    for g in gpus.values():
        owner = g.get("owner")
        if g.id in core and owner is not None and owner != "core":
            problems.append(f"Core GPU {g.id} is owned by {owner}")
        if g.state == "owned" and owner == "core" and g.id not in core:
            problems.append(f"GPU {g.id} is owned by the Core but is not in its layout")
        if g.state == "owned" and owner != "core" and listed.get(g.id) != owner:
            problems.append(f"GPU {g.id} is owned by {owner}, which does not hold it (a leak)")
    claims: dict[str, str] = {}
    for st in world.of("training_step").values():
        if st.state not in BUSY_STEP_STATES:  # the states in which a step holds its groups
            continue
        for gid in st.get("groups") or ():
            if gid in claims:
                problems.append(f"group {gid} is held by steps {claims[gid]} and {st.id}")
            claims[str(gid)] = st.id
    requests = world.of("request")
    if indexed:
        for rid in sorted(world.index.groups["claimed"]):
            if rid not in claims:
                problems.append(f"group {rid} is claimed but no training step holds it")
        for gid, sid in claims.items():
            r = requests.get(gid)
            if r is None:
                problems.append(f"step {sid} holds group {gid}, which does not exist")
            elif r.state != "claimed":
                problems.append(f"step {sid} holds group {gid}, which is {r.state}")
        dispatched = [
            r
            for rid in sorted(world.index.groups["dispatched"])
            if (r := requests.get(rid)) is not None
        ]
    else:
        for r in requests.values():
            held_by = claims.pop(r.id, None)
            if r.state == "claimed" and held_by is None:
                problems.append(f"group {r.id} is claimed but no training step holds it")
            if r.state != "claimed" and held_by is not None:
                problems.append(f"step {held_by} holds group {r.id}, which is {r.state}")
        for gid, sid in claims.items():
            problems.append(f"step {sid} holds group {gid}, which does not exist")
        dispatched = [r for r in requests.values() if r.state == "dispatched"]
    engines = world.of("rollout_engine")
    engine_terminal = world.specs["rollout_engine"].terminal
    for r in dispatched:
        eid = r.get("engine")
        e = engines.get(eid) if type(eid) is str else None
        if e is None or e.state in engine_terminal:
            problems.append(
                f"group {r.id} is dispatched to engine {eid!r}, which is "
                f"{e.state if e is not None else 'unknown'}"
            )
    current = world.globals.get("revision", 0)
    for e in world.of("rollout_engine").values():
        if e.state == "serving" and e.get("installed") != current:
            problems.append(
                f"engine {e.id} serves revision {e.get('installed')}, current is {current}"
            )
    return problems
