"""ehp-fsm: explicit state-machine orchestration for Elastic Hybrid Parallelism (EHP).

Layout (the folders are the architecture):

- `ehp_fsm.core` — the functional core: machine specs (`spec`), the world (`world`), the pure
  step function (`transition.step`), named guards and effects, safety invariants, the planner
  and the batch partition. No clock, randomness, sockets or logging.
- `ehp_fsm.embedded` — `Orchestrator`: the core plus its transition log, for embedding in any
  scheduler (feed events, get back commands).
- `ehp_fsm.plan` — plan files into frozen, validated dataclasses.
- `ehp_fsm.addresses` — the loopback rule for control-plane endpoints (standard library only,
  so the plan loader and the embedding API import no control plane).
- `ehp_fsm.translog` / `ehp_fsm.replay` — the JSON-lines transition log and its verifier.
- `ehp_fsm.reference` — the specs as `transitions` machines: diagrams and reference semantics.
- `ehp_fsm.shell` — the one loop: the only door into the orchestrator, one performer per
  command route.
- `ehp_fsm.models`, `ehp_fsm.data` — Hugging Face models (tiny generated ones, loading,
  revisions as HF directories); prompts from JSONL, rewards, the run's task.
- `ehp_fsm.training`, `ehp_fsm.backends` — torch and Megatron-Core training paths, the GRPO
  objective.
- `ehp_fsm.rollout` — the embedded rollout engine, revision store and SGLang client.
- `ehp_fsm.runtime` — the ZeroMQ control plane: agents, the agent link, the controller.
- `ehp_fsm.run` — `ehp-fsm run`: the job's story and the performers it adds to the loop.
- `ehp_fsm.cli` — the `ehp-fsm` command.
"""

from ehp_fsm.core.transition import Accepted, Command, Rejected
from ehp_fsm.core.world import Event, Instance, World
from ehp_fsm.embedded import EventError, Orchestrator
from ehp_fsm.errors import EhpError, PlanError, ReplayDivergence, SpecError
from ehp_fsm.plan import Plan, load_plan


def __getattr__(name: str) -> object:
    """`Engine` was the embedding API's name before 0.2 ("engine" now means a rollout engine
    only); it still imports, with a warning, for code written against the old name."""
    if name == "Engine":
        import warnings

        warnings.warn(
            "ehp_fsm.Engine is now ehp_fsm.Orchestrator (the same class)",
            DeprecationWarning,
            stacklevel=2,
        )
        return Orchestrator
    raise AttributeError(f"module 'ehp_fsm' has no attribute {name!r}")


__all__ = [
    "Accepted",
    "Command",
    "EhpError",
    "Event",
    "EventError",
    "Instance",
    "Orchestrator",
    "Plan",
    "PlanError",
    "Rejected",
    "ReplayDivergence",
    "SpecError",
    "World",
    "load_plan",
]
