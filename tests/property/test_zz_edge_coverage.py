"""Every edge of every spec is reached: each (state, event) a spec accepts (its create edge
and every expanded source of every transition) is accepted at least once by the role state
machines in the `ci` profile.

Named to run after the role tests of this directory: when they all ran in this session under
the `ci` profile, their runs are the report; otherwise (another profile, a single file, another
order) this test runs every role machine itself with the `ci` profile's settings, so its
answer is the same everywhere. On failure it prints the coverage report (how often each edge
was accepted) and the edges never accepted."""

from __future__ import annotations

from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from ehp_fsm.specfiles import load_specs
from tests.property import strategies
from tests.property.test_machine_capacity import CapacityDecisions
from tests.property.test_machine_gpu import GpuLedger
from tests.property.test_machine_hybrid_replica import HybridReplicas
from tests.property.test_machine_request import Requests
from tests.property.test_machine_revision import Revisions
from tests.property.test_machine_rollout_engine import RolloutEngines
from tests.property.test_machine_training_step import TrainingSteps

ROLES = (
    CapacityDecisions,
    GpuLedger,
    HybridReplicas,
    Requests,
    Revisions,
    RolloutEngines,
    TrainingSteps,
)


def _is_ci(s: settings) -> bool:
    ci = settings.get_profile("ci")
    return s.derandomize and s.max_examples >= ci.max_examples


def test_every_spec_edge_is_accepted_by_the_property_tests() -> None:
    ran_here = {r.__name__ for r in ROLES} <= strategies.RAN and all(
        _is_ci(r.TestCase.settings) for r in ROLES
    )
    if not ran_here:
        strategies.ACCEPTED_EDGES.clear()
        ci = settings.get_profile("ci")
        for role in ROLES:
            run_state_machine_as_test(
                role,
                settings=settings(
                    role.TestCase.settings,
                    derandomize=True,
                    max_examples=ci.max_examples,
                    database=None,
                ),
            )
    edges = strategies.spec_edges(load_specs())
    seen = strategies.ACCEPTED_EDGES
    report = "\n".join(f"  {seen[e]:6d}  {e}" for e in sorted(edges))
    missing = sorted(edges - set(seen))
    assert not missing, f"never accepted: {missing}\ncoverage:\n{report}"
