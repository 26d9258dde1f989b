"""`ehp-fsm check` and `ehp-fsm run` agree: a plan `check` accepts passes every validation the
run makes when it starts, and a plan it refuses is refused with a `PlanError` (key and reason),
never a traceback.

Hypothesis mutates a valid plan (host ids, GPU counts, transport sizes, batch sizes, seeds,
heartbeats, and any leaf replaced by a value of another type). For each document: either
`parse_plan` raises `PlanError`, or the run's own start-up checks all pass — the agent's config
for every host (its host-id check), the endpoints' `TransportConfig` built from the plan
(the transport's message-size and heartbeat limits), `Plan.world_config()`,
`Orchestrator.from_plan` (the world's inventory built) and the planner's policy. Nothing here
starts a process or a socket, so the ci profile's examples take a few seconds.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ehp_fsm.embedded import Orchestrator
from ehp_fsm.errors import PlanError
from ehp_fsm.plan import load_plan, parse_plan
from ehp_fsm.runtime.agent import AgentConfig
from ehp_fsm.runtime.controller import transport_config

BASE: dict[str, Any] = {
    "run": {"name": "agree", "seed": 0},
    "hosts": [{"id": "h0", "gpus": 1}, {"id": "h1", "gpus": 2}],
    "core": {"dp": 1, "gpus": ["h0:g0"]},
    "engines": [{"id": "e0", "host": "h1", "tp": 1}, {"id": "e1", "host": "h1", "tp": 1}],
    "rollout": {"reserve": 1},
    "grpo": {"prompts_per_step": 2, "group_size": 2, "steps": 1},
    "ehp": {"max_hybrids": 1},
    "transport": {"controller": "tcp://127.0.0.1:5555", "heartbeat_s": 0.5},
}

HOST_IDS = st.one_of(
    st.sampled_from(["h1", "node-01", "a.b_c", "", ":", "h1:g0", "a/b", "../x", "a b", "é"]),
    st.text(max_size=80),
    st.integers(0, 10).map(lambda n: "x" * (60 + n)),
)
BIG_INTS = st.one_of(
    st.integers(-3, 3),
    st.sampled_from([512, 1023, 1024, 4096, 4097, 1 << 20, 1 << 30, (1 << 30) + 1, 1 << 31]),
    st.sampled_from([10**9, 2**63 - 1, 2**63, 2**64, 2**70]),
)
NUMBERS = st.one_of(
    BIG_INTS, st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1e-9, 1e300])
)
ANY_VALUE = st.one_of(
    NUMBERS,
    st.booleans(),
    st.text(max_size=8),
    st.lists(st.integers(0, 3), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
#: (path, values): the places a user gets wrong, with values that tempt each limit.
TARGETED = [
    (("hosts", 1, "id"), HOST_IDS),
    (("hosts", 1, "gpus"), BIG_INTS),
    (("hosts", 0, "gpus"), BIG_INTS),
    (("transport", "max_message_bytes"), BIG_INTS),
    (("transport", "heartbeat_s"), NUMBERS),
    (("grpo", "prompts_per_step"), BIG_INTS),
    (("grpo", "group_size"), BIG_INTS),
    (("grpo", "steps"), BIG_INTS),
    (("grpo", "max_staleness"), BIG_INTS),
    (("run", "seed"), BIG_INTS),
    (("engines", 0, "tp"), BIG_INTS),
    (("core", "dp"), BIG_INTS),
    (("ehp", "max_hybrids"), BIG_INTS),
    (("ehp", "cooldown_s"), NUMBERS),
    (("rollout", "reserve"), BIG_INTS),
    (("transport", "curve"), st.sampled_from(["off", "local", "on", ""])),
]
LEAVES = [path for path, _ in TARGETED] + [
    ("run", "name"),
    ("core", "gpus"),
    ("engines", 1, "host"),
    ("rollout", "allowed_tp"),
    ("transport", "controller"),
    ("hosts",),
    ("engines",),
    ("grpo",),
]


def put(doc: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    """Set the leaf at `path`, unless an earlier mutation replaced a table on the way."""
    node: Any = doc
    for part in path[:-1]:
        in_table = isinstance(node, dict) and part in node
        in_list = isinstance(node, list) and isinstance(part, int) and part < len(node)
        if not (in_table or in_list):
            return
        node = node[part]
    last = path[-1]
    if isinstance(node, dict) or (
        isinstance(node, list) and isinstance(last, int) and last < len(node)
    ):
        node[last] = value


@st.composite
def plans(draw: st.DrawFn) -> dict[str, Any]:
    doc = copy.deepcopy(BASE)
    for _ in range(draw(st.integers(0, 3))):
        if draw(st.booleans()):
            path, values = draw(st.sampled_from(TARGETED))
            value = draw(values)
            if path == ("hosts", 1, "id") and draw(st.booleans()):
                # keep the rest of the plan pointing at the renamed host
                for e in doc["engines"] if isinstance(doc["engines"], list) else ():
                    if isinstance(e, dict) and e.get("host") == "h1":
                        e["host"] = value
            put(doc, path, value)
        else:
            put(doc, draw(st.sampled_from(LEAVES)), draw(ANY_VALUE))
    return doc


def run_start_checks(doc: dict[str, Any]) -> None:
    """What `ehp-fsm run` validates as it starts, after the plan loaded."""
    plan = parse_plan(doc)
    transport = transport_config(plan)  # the controller's and the agents' endpoints
    for h in plan.hosts:
        AgentConfig(
            controller=plan.transport.controller,
            host_id=h.id,
            slots=len(h.gpus),
            device=h.device,
            transport=transport,
        )
    plan.world_config()
    plan.planner_policy()
    Orchestrator.from_plan(plan)


@given(plans())
def test_check_refuses_exactly_what_the_run_would_refuse(doc: dict[str, Any]) -> None:
    try:
        parse_plan(doc)
    except PlanError:
        return  # refused with a key and a reason
    run_start_checks(doc)  # accepted: the run's own checks must pass too


def test_the_base_plan_is_valid() -> None:
    run_start_checks(copy.deepcopy(BASE))


def test_deeply_nested_toml_is_a_plan_error(tmp_path: Path) -> None:
    path = tmp_path / "deep.toml"
    path.write_text("a = " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(PlanError, match="too deeply"):
        load_plan(path)
