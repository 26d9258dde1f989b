"""The specs compiled into `transitions` machines: diagrams, markup and reference semantics.

`to_machine(spec, condition)` builds a `transitions.Machine` (auto_transitions=False, so no
`to_<state>()` can bypass a guard) whose transitions carry one condition per guard, each asking
`condition(guard_name, event_data)`. The differential property test drives it beside the engine;
`mermaid(spec)` renders the diagram `ehp-fsm spec --format mermaid` prints. Creation is modelled
as a pseudo-state `<new>` with the create event, so the diagram shows how instances come to be.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transitions import EventData, Machine
from transitions.extensions import GraphMachine

from ehp_fsm.core.spec import NEW, MachineSpec

Condition = Callable[[str, EventData], bool]
NEW_STATE = "new"  # `<new>` is not a valid identifier in mermaid


class ReferenceModel:
    """The model object a `transitions` machine drives (it gains `state` and trigger methods)."""

    state: str


def _named_condition(name: str, condition: Condition) -> Callable[[EventData], bool]:
    def check(event_data: EventData) -> bool:
        return condition(name, event_data)

    check.__name__ = name  # diagrams show the guard's name
    return check


def to_machine(
    spec: MachineSpec,
    condition: Condition | None = None,
    *,
    model: Any = None,
    graph: bool = False,
) -> Machine:
    cond = condition or (lambda _name, _ed: True)
    states = [NEW_STATE, *spec.states]
    transitions = []
    for t in (spec.create, *spec.transitions):
        transitions.append(
            {
                "trigger": t.event,
                "source": NEW_STATE if t.source == NEW else t.source,
                "dest": t.dest,
                "conditions": [_named_condition(g, cond) for g in t.guards],
            }
        )
    cls = GraphMachine if graph else Machine
    kwargs: dict[str, Any] = (
        {"graph_engine": "mermaid", "show_conditions": True, "title": spec.name} if graph else {}
    )
    return cls(
        model=model if model is not None else ReferenceModel(),
        states=states,
        transitions=transitions,
        initial=NEW_STATE,
        auto_transitions=False,
        send_event=True,
        ignore_invalid_triggers=False,
        **kwargs,
    )


def mermaid(spec: MachineSpec) -> str:
    """A mermaid `stateDiagram-v2` of the spec, guards shown as [conditions]."""
    model = ReferenceModel()
    to_machine(spec, model=model, graph=True)
    graph = model.get_graph()  # type: ignore[attr-defined]
    text: str = graph.draw(None)
    # `transitions` writes the title as a bare front-matter line, which mermaid's YAML front
    # matter ignores (no title drawn): as the `title:` key it reads
    bare = f"---\n{spec.name}\n---\n"
    if text.startswith(bare):
        text = f"---\ntitle: {spec.name}\n---\n" + text[len(bare) :]
    terminal = "\n".join(f"  {s} --> [*]" for s in sorted(spec.terminal))
    return text.rstrip() + ("\n" + terminal if terminal else "") + "\n"


def text_table(spec: MachineSpec) -> str:
    """A plain-text listing: states with meanings, then every transition with guards/effects."""
    lines = [f"machine {spec.name}: {' '.join(spec.description.split())}", "", "states:"]
    width = max(len(s) for s in spec.states)
    for s, meaning in spec.states.items():
        marks = ("initial " if s == spec.initial else "") + (
            "terminal" if s in spec.terminal else ""
        )
        lines.append(f"  {s:<{width}}  {meaning}" + (f"  [{marks.strip()}]" if marks else ""))
    lines += ["", "transitions:"]
    for t in (spec.create, *spec.transitions):
        g = f"  if {', '.join(t.guards)}" if t.guards else ""
        e = f"  do {', '.join(t.effects)}" if t.effects else ""
        lines.append(f"  {t.source} --{t.event}--> {t.dest}{g}{e}")
    return "\n".join(lines) + "\n"
