"""Run role state machines and print the edges they accepted, for `test_zz_edge_coverage.py`.

`python -m tests.property.role_edges EXAMPLES MODULE:CLASS ...` runs each role machine of
`tests/property/MODULE.py` derandomized with EXAMPLES examples, in this fresh process (see the
coverage test for why), and prints one JSON line: `[[machine, state, event, count], ...]`.
"""

from __future__ import annotations

import importlib
import json
import sys

from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from tests.property import strategies


def main(argv: list[str]) -> None:
    examples = int(argv[0])
    for spec in argv[1:]:
        module, name = spec.split(":")
        role = getattr(importlib.import_module(f"tests.property.{module}"), name)
        run_state_machine_as_test(
            role,
            settings=settings(
                role.TestCase.settings,
                derandomize=True,
                max_examples=examples,
                deadline=None,
                database=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )
    edges = strategies.ROLE_EDGES
    print(json.dumps([[*edge, n] for name in edges for edge, n in edges[name].items()]))


if __name__ == "__main__":
    main(sys.argv[1:])
