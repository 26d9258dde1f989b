"""Where the run trains. The Core's ranks are started by `ehp-fsm run` itself, as processes of
the machine it runs on, so every host holding Core devices must be that machine. A Hybrid
trains on the host it is borrowed on: the warm workers for a lending host on another machine
are launched there by that host's agent (`remote_lenders`; the pool's `remote_warm` lanes), and
those of lending hosts on the run's machine by the pool itself.

With local agents every host is this machine. With `--agents external` (Slurm), each agent
reports the machine it runs on (`hostname` in its inventory, or `EHP_MACHINE`), and the run
refuses to start training when a Core host's agent is on another machine, naming the host, both
machines and what to change.

Knows: the plan's hosts, the Core's devices, `[ehp] enabled`. Does not know: processes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from ehp_fsm.plan import Plan

CORE_WHY: Final = "it holds Core devices"
HYBRID_WHY: Final = "EHP is on and a Hybrid may be borrowed on its devices"


def training_hosts(plan: Plan) -> dict[str, str]:
    """host id -> why the run may train on it (in plan order)."""
    core = set(plan.core.gpus)
    core_hosts = {plan.host_of(g) for g in core}
    out: dict[str, str] = {}
    for h in plan.hosts:
        if h.id in core_hosts:
            out[h.id] = CORE_WHY
        elif plan.ehp.enabled and any(g not in core for g in h.gpus):
            out[h.id] = HYBRID_WHY
    return out


@dataclass(frozen=True)
class Misplaced:
    """A training host whose agent runs on another machine than the run."""

    host: str
    why: str  # why the run trains there (`training_hosts`)
    machine: str  # where its agent runs

    def describe(self, here: str) -> str:
        return (
            f"host {self.host!r} ({self.why}) has its agent on machine {self.machine!r}, but "
            f"the trainer pool runs on this machine ({here!r})"
        )


def misplaced(plan: Plan, machines: Mapping[str, str | None], here: str) -> list[Misplaced]:
    """The Core hosts whose agent reported another machine than `here` (`machines`: host id
    -> the `hostname` its agent reported; an agent that reported none is not judged)."""
    out = []
    for host, why in training_hosts(plan).items():
        machine = machines.get(host)
        if why == CORE_WHY and machine is not None and machine != here:
            out.append(Misplaced(host=host, why=why, machine=machine))
    return out


def remote_lenders(plan: Plan, machines: Mapping[str, str | None], here: str) -> list[str]:
    """The hosts a Hybrid may be borrowed on whose agent is on another machine than `here`:
    their warm workers are launched by that agent (in plan order)."""
    return [
        host
        for host, why in training_hosts(plan).items()
        if why == HYBRID_WHY and machines.get(host) not in (None, here)
    ]


def remote_warm_lanes(plan: Plan, lenders: list[str]) -> tuple[str, ...]:
    """The pool's `remote_warm`: for each remote lending host, as many warm lanes as Hybrids it
    can hold at once (its devices outside the Core, `replica_size` each), at most `max_hybrids`
    — so every borrow the planner may choose finds an idle lane on its host."""
    core = set(plan.core.gpus)
    out: list[str] = []
    for h in plan.hosts:
        if h.id in lenders:
            fits = sum(g not in core for g in h.gpus) // plan.ehp.replica_size
            out += [h.id] * min(plan.ehp.max_hybrids, fits)
    return tuple(out)


def local_lenders(plan: Plan, lenders: list[str]) -> bool:
    """Whether a Hybrid may be borrowed on a host of the run's own machine (the pool then
    launches `max_hybrids` warm lanes there itself)."""
    return any(why == HYBRID_WHY and h not in lenders for h, why in training_hosts(plan).items())


def placement_fix(found: list[Misplaced]) -> str:
    """What to change, for the error naming `found`."""
    fixes = []
    core = sorted({m.machine for m in found if m.why == CORE_WHY})
    if core:
        node = repr(core[0]) if len(core) == 1 else "one node (the Core's devices span several)"
        fixes.append(f"start `ehp-fsm run` on {node}, where the Core's devices are")
    return "; ".join(fixes)
