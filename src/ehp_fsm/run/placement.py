"""Where the run trains: the trainer pool (Core ranks and warm Hybrid workers) is started by
`ehp-fsm run` itself, as processes of the machine it runs on. So every host whose devices the
run trains on must be that machine: the hosts of the Core's devices, and — with EHP on — every
host whose devices a Hybrid may be borrowed from (any device outside the Core). A Hybrid
borrowed on another node would otherwise train on the run's node while the ledger says it owns
the other node's devices: the plan would not be what runs.

With local agents every host is this machine. With `--agents external` (Slurm), each agent
reports the machine it runs on (`hostname` in its inventory), and the run refuses to start
training when a training host's agent is on another machine, naming the host, both machines
and what to change. Hybrid workers launched by other nodes' agents are not built (issue 15).

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
    """The training hosts whose agent reported another machine than `here` (`machines`: host id
    -> the `hostname` its agent reported; an agent that reported none is not judged)."""
    out = []
    for host, why in training_hosts(plan).items():
        machine = machines.get(host)
        if machine is not None and machine != here:
            out.append(Misplaced(host=host, why=why, machine=machine))
    return out


def placement_fix(found: list[Misplaced]) -> str:
    """What to change, for the error naming `found`."""
    fixes = []
    core = sorted({m.machine for m in found if m.why == CORE_WHY})
    if core:
        node = repr(core[0]) if len(core) == 1 else "one node (the Core's devices span several)"
        fixes.append(f"start `ehp-fsm run` on {node}, where the Core's devices are")
    if any(m.why == HYBRID_WHY for m in found):
        fixes.append(
            "set [ehp] enabled = false for a run across nodes (Hybrid workers on other nodes "
            "than the run's are not built), or keep EHP within the run's node"
        )
    return "; ".join(fixes)
