"""`transport.curve = "local"`: a one-machine run makes CURVE keys for its own agents (one per
host id, bound to it) and the whole run takes the authenticated path — the controller's CURVE
server refuses any agent that does not present its own host's key, so a run that ends clean
proves every agent authenticated (the run that shows it is
`test_run.py::test_run_borrows_returns_and_ends_clean`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ehp_fsm.errors import PlanError
from ehp_fsm.plan import load_plan
from tests.run.test_run import plan_text


def curve_plan(tmp: Path, transport_extra: str) -> Path:
    log = tmp / "run" / "transitions.jsonl"
    text = plan_text(log, 2).replace(
        'controller = "tcp://127.0.0.1:*"', f'controller = "tcp://127.0.0.1:*"\n{transport_extra}'
    )
    assert transport_extra in text
    path = tmp / "plan.toml"
    path.write_text(text)
    return path


def test_local_curve_is_refused_beside_keys_or_a_non_loopback_plane(tmp_path: Path) -> None:
    for extra in ('curve = "local"\ncurve_keys = "k"', 'curve = "on"'):
        with pytest.raises(PlanError, match=r"transport\.curve"):
            load_plan(curve_plan(tmp_path, extra))
    assert load_plan(curve_plan(tmp_path, 'curve = "local"')).transport.curve == "local"


# A run with `curve = "local"` ending clean (exit 0, `clean_controller`, every agent exited 0,
# no process left) with a key per host id in `keys/hosts.json`: the borrow-and-verify run of
# `test_run.py::test_run_borrows_returns_and_ends_clean` takes the authenticated path (one run
# carries both).
