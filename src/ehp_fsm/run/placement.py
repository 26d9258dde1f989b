"""Where the run trains, and who launches each trainer lane.

A Core lane (one data-parallel rank: `replica_gpus` devices, all on one host — the plan refuses
a lane across hosts) trains on the host of its devices; a Hybrid on the host it is borrowed on.
A lane whose host's agent runs on the run's machine is launched by the trainer pool itself; one
whose host's agent runs on another machine is launched there by that agent (`remote_core`: the
pool's `remote_core`; `remote_lenders`: the pool's `remote_warm` lanes).

With local agents every host is this machine. With `--agents external` (Slurm), each agent
reports the machine it runs on (`hostname` in its inventory, or `EHP_MACHINE`); an agent that
reported none is taken to be on the run's machine.

A lane on another machine reads and writes the run's shared files: Core rank 0 saves every
revision into `[run] revisions` (which the run and the engines read) and the Core's resume
states into `resume/` beside `[run] log`, and every rank meets the others through Gloo's
rendezvous files beside `[run] revisions`. `unshared` refuses a plan that leaves the revisions
in the run directory when a lane runs elsewhere; the run then holds every write of Core rank 0
to what it sees on its own machine (`job`).

Knows: the plan's hosts, the Core's devices, `[ehp] enabled`, `[run] revisions`. Does not
know: processes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from ehp_fsm.errors import EhpError
from ehp_fsm.plan import Plan


def core_lane_hosts(plan: Plan) -> tuple[str, ...]:
    """The host of each Core lane (DP rank `i`: the Core's devices `i * replica_gpus ..`)."""
    c = plan.core
    return tuple(plan.host_of(c.gpus[i * c.replica_gpus]) for i in range(c.dp))


def lending_hosts(plan: Plan) -> list[str]:
    """With EHP on, the hosts a Hybrid may be borrowed on: those with a device outside the
    Core (in plan order; a Core host with devices to spare is one too)."""
    if not plan.ehp.enabled:
        return []
    core = set(plan.core.gpus)
    return [h.id for h in plan.hosts if any(g not in core for g in h.gpus)]


def hybrid_slots(plan: Plan) -> dict[str, int]:
    """Each lending host (`lending_hosts`) → how many Hybrid replicas it can hold at once: its
    devices outside the Core, `replica_size` each (a Hybrid runs on the host it borrows on)."""
    core = set(plan.core.gpus)
    hosts = {h.id: h for h in plan.hosts}
    size = plan.ehp.replica_size
    return {h: sum(g not in core for g in hosts[h].gpus) // size for h in lending_hosts(plan)}


def hybrids_at_once(plan: Plan) -> int:
    """How many Hybrid replicas can run at once: those that fit beside the Core on the lending
    hosts (`hybrid_slots`), and no more than the devices a borrow may take hold — the free ones
    and the engines' beyond `[rollout] reserve` (a drain below it is refused)."""
    spare = len(plan.inventory) - len(plan.core.gpus) - plan.rollout.reserve
    return min(sum(hybrid_slots(plan).values()), spare // plan.ehp.replica_size)


def local_warm_lanes(plan: Plan, lenders: Sequence[str]) -> int:
    """The pool's `max_hybrids`: warm lanes on this machine for the lending hosts whose agents
    are here (not in `lenders`), as many as Hybrids can run on them at once, at most
    `max_hybrids` (five warm workers, each a process holding the model, were started where
    one could ever be borrowed)."""
    fits = sum(n for h, n in hybrid_slots(plan).items() if h not in lenders)
    return min(plan.ehp.max_hybrids, fits, hybrids_at_once(plan))


def _elsewhere(machines: Mapping[str, str | None], host: str, here: str) -> bool:
    return machines.get(host) not in (None, here)


def remote_core(
    plan: Plan, machines: Mapping[str, str | None], here: str
) -> tuple[str | None, ...]:
    """The pool's `remote_core`: for each Core lane, its host when that host's agent is on
    another machine than `here` (its agent launches the lane), else None (the pool does);
    () when every lane is the pool's."""
    out = tuple(h if _elsewhere(machines, h, here) else None for h in core_lane_hosts(plan))
    return out if any(h is not None for h in out) else ()


def remote_lenders(plan: Plan, machines: Mapping[str, str | None], here: str) -> list[str]:
    """The hosts a Hybrid may be borrowed on whose agent is on another machine than `here`:
    their warm workers are launched by that agent (in plan order)."""
    return [h for h in lending_hosts(plan) if _elsewhere(machines, h, here)]


def remote_warm_lanes(plan: Plan, lenders: Sequence[str]) -> tuple[str, ...]:
    """The pool's `remote_warm`: for each remote lending host, as many warm lanes as Hybrids it
    can hold at once (its devices outside the Core, `replica_size` each), at most `max_hybrids`
    — so every borrow the planner may choose finds an idle lane on its host."""
    slots = hybrid_slots(plan)
    out: list[str] = []
    for h in plan.hosts:
        if h.id in lenders:
            out += [h.id] * min(plan.ehp.max_hybrids, slots.get(h.id, 0))
    return tuple(out)


def local_lenders(plan: Plan, lenders: Sequence[str]) -> bool:
    """Whether a Hybrid may be borrowed on a host of the run's own machine (the pool then
    launches `local_warm_lanes` warm lanes there itself)."""
    return any(h not in lenders for h in lending_hosts(plan))


def unshared(plan: Plan, core: Sequence[str | None], lenders: Sequence[str]) -> str | None:
    """Why the run cannot have lanes on other machines (`core`: the pool's `remote_core`,
    `lenders`: `remote_lenders`) with this plan's paths, or None: without `[run] revisions`
    the revisions and Gloo's rendezvous files stay in the run directory, which is the run's."""
    hosts = sorted({h for h in core if h is not None} | set(lenders))
    if not hosts or plan.revisions is not None:
        return None
    ranks = [i for i, h in enumerate(core) if h is not None]
    writes = " and Core rank 0 saves every revision there" if 0 in ranks else ""
    return (
        f"trainer lanes run on other machines (hosts {', '.join(hosts)}), and [run] revisions is "
        f"not set: the revisions and Gloo's rendezvous files would be in the run directory of "
        f"this machine, which those lanes read{writes}"
    )


def unseen_write(path: Path, what: str, key: str, host: str | None) -> EhpError | None:
    """The error when `what`, which Core rank 0 (`host`: its host when its agent launched it on
    another machine, else None) reported written to `path`, is not there on this machine: the
    path is not shared, so the run and the engines cannot read it. None when it is there."""
    if path.exists():
        return None
    where = f"on host {host}, another machine" if host is not None else "on this machine"
    return EhpError(
        f"{what} is not at {path} on the run's machine",
        f"Core rank 0 ({where}) wrote it there, and the run reads it there: the path is not on "
        "a file system both machines see",
        f"set {key} to a path every node sees (a shared file system)",
    )
