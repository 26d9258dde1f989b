"""Every edge of every spec is some role's to accept: each (state, event) a spec accepts (its
create edge and every expanded source of every transition) is in the `required_edges` of one of
the role machines, and each role test (`role_edges.check_role`) checks that its machine accepts
all of its own. Nothing is run here: the role tests run each machine once."""

from __future__ import annotations

from ehp_fsm.specfiles import load_specs
from tests.property import strategies
from tests.property.test_machine_capacity import CapacityDecisions
from tests.property.test_machine_gpu import GpuLedger
from tests.property.test_machine_hybrid_replica import HybridReplicas
from tests.property.test_machine_request import Requests
from tests.property.test_machine_revision import Revisions
from tests.property.test_machine_rollout_engine import RolloutEngines
from tests.property.test_machine_training_step import TrainingSteps

ROLES: tuple[type[strategies.RoleMachine], ...] = (
    CapacityDecisions,
    GpuLedger,
    HybridReplicas,
    Requests,
    Revisions,
    RolloutEngines,
    TrainingSteps,
)


def test_every_spec_edge_is_some_role_s_to_accept() -> None:
    specs = load_specs()
    edges = strategies.spec_edges(specs)
    owned = set().union(*(role.required_edges(specs) for role in ROLES))
    assert owned <= edges
    assert sorted(edges - owned) == []
    # every machine is some role's focus, and the cascade-only edges are a role's too
    assert {m for role in ROLES for m in role.FOCUS} == set(specs)
    assert {(m, e) for m, _, e in owned} >= set(strategies.CASCADE_ONLY)
