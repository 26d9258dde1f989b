"""Every edge of every spec is reached: each (state, event) a spec accepts (its create edge
and every expanded source of every transition) is accepted at least once by the role state
machines in the `ci` profile.

Named to run after the role tests of this directory: the runs of each role test that ran in
this process under the `ci` profile count as they are; every other role machine (another
profile, a single file) this test runs itself with the `ci` profile's settings, so its answer
is the same everywhere; a role test that ran in another pytest-xdist worker left its edges in a
file of this test run (`conftest.py`), read here instead of running it again. Derandomized,
a role machine's runs are the same wherever they run. On failure it prints the coverage report
(how often each edge was accepted) and the edges never accepted."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from ehp_fsm.specfiles import load_specs
from tests.property import strategies
from tests.property.conftest import is_ci
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


def test_every_spec_edge_is_accepted_by_the_property_tests(role_edges_dir: Path) -> None:
    ci = settings.get_profile("ci")
    for role in ROLES:
        name = role.__name__
        recorded = role_edges_dir / f"{name}.json"  # by its test in another xdist worker
        if is_ci(role.TestCase.settings):
            if name in strategies.RAN:
                continue  # its test ran in this process with the `ci` profile: its runs count
            if recorded.is_file():
                rows = json.loads(recorded.read_text())
                strategies.ROLE_EDGES[name] = Counter({(m, s, e): n for m, s, e, n in rows})
                continue
        strategies.ROLE_EDGES.pop(name, None)
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
    seen: Counter[tuple[str, str, str]] = Counter()
    for role in ROLES:
        seen.update(strategies.ROLE_EDGES[role.__name__])
    report = "\n".join(f"  {seen[e]:6d}  {e}" for e in sorted(edges))
    missing = sorted(edges - set(seen))
    assert not missing, f"never accepted: {missing}\ncoverage:\n{report}"
