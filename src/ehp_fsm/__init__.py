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

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # at run time each is imported when first asked for (`__getattr__`)
    from ehp_fsm.core.transition import Accepted, Command, Rejected
    from ehp_fsm.core.world import Event, Instance, World
    from ehp_fsm.embedded import EventError, Orchestrator, OrchestratorError
    from ehp_fsm.errors import EhpError, PlanError, ReplayDivergence, SpecError
    from ehp_fsm.plan import Plan, load_plan

#: Where each public name lives. They are imported on first use, not with the package: every
#: submodule import runs this file first, and `ehp-fsm` (`ehp_fsm.cli`) handles a Ctrl-C only
#: once it runs — importing the embedding API here (~0.2 s: the log's structlog, msgspec) was
#: a window at the start of every command where a Ctrl-C printed a traceback.
_EXPORTS = {
    "Accepted": "ehp_fsm.core.transition",
    "Command": "ehp_fsm.core.transition",
    "Rejected": "ehp_fsm.core.transition",
    "Event": "ehp_fsm.core.world",
    "Instance": "ehp_fsm.core.world",
    "World": "ehp_fsm.core.world",
    "EventError": "ehp_fsm.embedded",
    "Orchestrator": "ehp_fsm.embedded",
    "OrchestratorError": "ehp_fsm.embedded",
    "EhpError": "ehp_fsm.errors",
    "PlanError": "ehp_fsm.errors",
    "ReplayDivergence": "ehp_fsm.errors",
    "SpecError": "ehp_fsm.errors",
    "Plan": "ehp_fsm.plan",
    "load_plan": "ehp_fsm.plan",
}


def __getattr__(name: str) -> object:
    """A public name, imported from its module the first time it is asked for. `Engine` was
    the embedding API's name before 0.2 ("engine" now means a rollout engine only); it still
    imports, with a warning, for code written against the old name."""
    if name == "Engine":
        import warnings

        warnings.warn(
            "ehp_fsm.Engine is now ehp_fsm.Orchestrator (the same class)",
            DeprecationWarning,
            stacklevel=2,
        )
        return __getattr__("Orchestrator")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ehp_fsm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # asked once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


__all__ = [
    "Accepted",
    "Command",
    "EhpError",
    "Event",
    "EventError",
    "Instance",
    "Orchestrator",
    "OrchestratorError",
    "Plan",
    "PlanError",
    "Rejected",
    "ReplayDivergence",
    "SpecError",
    "World",
    "load_plan",
]
