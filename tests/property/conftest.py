"""Role-machine edge coverage shared between pytest-xdist workers.

`test_zz_edge_coverage.py` needs every role machine's accepted edges under the `ci` profile. A
role test that ran in another worker leaves them in a file of this test run (keyed by xdist's
`testrun_uid`), so the coverage test reads them instead of running that role machine again
(derandomized, its runs are the same wherever they ran)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from tests.property import strategies


def is_ci(s: settings) -> bool:
    ci = settings.get_profile("ci")
    return bool(s.derandomize and s.max_examples >= ci.max_examples)


@pytest.fixture(scope="session")
def role_edges_dir(tmp_path_factory: pytest.TempPathFactory, testrun_uid: str) -> Path:
    """A folder all workers of this test run share (the base temp's parent under xdist)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if base.name.startswith("popen-gw") else base
    path = shared / f"role-edges-{testrun_uid}"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(autouse=True)
def _share_role_edges(request: pytest.FixtureRequest, role_edges_dir: Path) -> Iterator[None]:
    yield
    if not request.node.nodeid.startswith("tests/property/test_machine_"):
        return
    cls = request.cls
    if cls is None or not is_ci(getattr(cls, "settings", settings())):
        return
    for name in strategies.RAN:
        rows = [[*edge, n] for edge, n in sorted(strategies.ROLE_EDGES[name].items())]
        tmp = role_edges_dir / f".{name}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(rows))
        os.replace(tmp, role_edges_dir / f"{name}.json")
