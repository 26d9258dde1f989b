"""ehp-fsm: explicit state-machine orchestration for Elastic Hybrid Parallelism (EHP).

Layout (the folders are the architecture):

- `ehp_fsm.core` — the functional core: machine specs (`spec`), the world (`world`), the pure
  step function (`engine`), named guards and effects, safety invariants, the planner and the
  batch partition. No clock, randomness, sockets or logging.
- `ehp_fsm.embedded` — `Engine`: the core plus its transition log, for embedding in any
  scheduler (feed events, get back commands).
- `ehp_fsm.plan` — plan files into frozen, validated dataclasses.
- `ehp_fsm.translog` / `ehp_fsm.replay` — the JSON-lines transition log and its verifier.
- `ehp_fsm.reference` — the specs as `transitions` machines: diagrams and reference semantics.
- `ehp_fsm.training`, `ehp_fsm.backends` — torch and Megatron-Core training paths.
- `ehp_fsm.rollout` — the embedded rollout engine, revision store and SGLang client.
- `ehp_fsm.runtime` — the ZeroMQ control plane between the controller and host agents.
- `ehp_fsm.cli` — the `ehp-fsm` command.
"""

from ehp_fsm.core.engine import Accepted, Command, Rejected
from ehp_fsm.core.world import Event, Instance, World
from ehp_fsm.embedded import Engine
from ehp_fsm.errors import EhpError, PlanError, ReplayDivergence, SpecError
from ehp_fsm.plan import Plan, load_plan

__all__ = [
    "Accepted",
    "Command",
    "EhpError",
    "Engine",
    "Event",
    "Instance",
    "Plan",
    "PlanError",
    "Rejected",
    "ReplayDivergence",
    "SpecError",
    "World",
    "load_plan",
]
