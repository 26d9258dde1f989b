"""Run a role state machine in a fresh Python process: how each role test runs its machine, and
checks both its invariants and that it accepts every edge it is responsible for
(`RoleMachine.required_edges`; `test_edge_coverage.py` checks that the roles together are
responsible for every edge of every spec).

Why a fresh process: what Hypothesis generates depends on which of the project's modules the
process has imported. Hypothesis (6.170 here) mixes into its draws the constants it finds in
the source of every local module in `sys.modules` (its `providers._get_local_constants`), so a
derandomized run draws differently once another module is loaded. In a pytest worker that had
imported `ehp_fsm.cli` (`test_embedded_api.py` does), a HybridReplicas run never accepted
`reload` (8,464 edge acceptances against 9,234 in a fresh process), so coverage read from the
workers depended on how the tests were spread over them. (Found 2026-12-06: importing
`ehp_fsm.cli` alone, with no test run, changes the HybridReplicas run.) Until 2026-12-06 the
role tests also ran in the workers and a coverage test ran all seven again in a fresh process
(~70 s of CPU twice in CI); now each runs once, here.

Some edges are rare: a 120-example derandomized run misses a Hybrid's `reload`, its `deadline`
while ready and `fail` while active, and a completed request's `expire`; the `ci` profile's
number of examples reaches them all.

`python -m tests.property.role_edges EXAMPLES RANDOM MODULE:CLASS` runs the role machine
`CLASS` of `MODULE` derandomized with EXAMPLES examples, then (RANDOM > 0) with RANDOM random
ones, and prints one JSON line: `[[machine, state, event, count], ...]`, the edges the
derandomized run accepted (so the coverage does not depend on the random run).
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from ehp_fsm.specfiles import load_specs
from tests.property import strategies

ROOT = Path(__file__).resolve().parents[2]


def _run(role: type[strategies.RoleMachine], examples: int, *, derandomize: bool) -> None:
    run_state_machine_as_test(
        role,
        settings=settings(
            role.TestCase.settings,
            derandomize=derandomize,
            max_examples=examples,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


def main(argv: list[str]) -> None:
    examples, random_examples, spec = int(argv[0]), int(argv[1]), argv[2]
    module, name = spec.split(":")
    role = getattr(importlib.import_module(module), name)
    _run(role, examples, derandomize=True)
    accepted = dict(strategies.ROLE_EDGES[name])
    if random_examples > 0:
        _run(role, random_examples, derandomize=False)
    print(json.dumps([[*edge, n] for edge, n in accepted.items()]))


def check_role(role: type[strategies.RoleMachine]) -> None:
    """Run `role` in a fresh process, derandomized with the `ci` profile's number of examples
    (and, under a random profile, that profile's number of random examples after it): every
    invariant holds, and every edge of `role.required_edges` is accepted. On a miss, the
    coverage report (how often each required edge was accepted) and the edges never
    accepted."""
    ci = settings.get_profile("ci")
    now = settings.default
    random_examples = 0 if now is None or now.derandomize else now.max_examples
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.property.role_edges",
            str(ci.max_examples),
            str(random_examples),
            f"{role.__module__}:{role.__name__}",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-6000:]
    seen: Counter[tuple[str, str, str]] = Counter()
    for m, s, e, n in json.loads(done.stdout.splitlines()[-1]):
        seen[(m, s, e)] += n
    need = role.required_edges(load_specs())
    report = "\n".join(f"  {seen[e]:6d}  {e}" for e in sorted(need))
    missing = sorted(need - set(seen))
    assert not missing, f"{role.__name__} never accepted: {missing}\ncoverage:\n{report}"


if __name__ == "__main__":
    main(sys.argv[1:])
