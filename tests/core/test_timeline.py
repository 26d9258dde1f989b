"""The GPU-role timeline read from the golden borrow-and-return log."""

from __future__ import annotations

import itertools

from ehp_fsm.report.timeline import role_intervals
from tests.golden.scenarios import HERE


def test_borrowed_gpu_goes_engine_releasing_free_hybrid_and_back() -> None:
    spans = [i for i in role_intervals(HERE / "borrow_and_return.jsonl") if i.gpu == "h1:g1"]
    roles = [i.role for i in spans]
    assert roles == ["free", "engine", "releasing", "free", "hybrid", "releasing", "free", "engine"]
    assert [i.owner for i in spans if i.role == "hybrid"] == ["hybrid:x0"]
    for a, b in itertools.pairwise(spans):
        assert a.end == b.start  # contiguous: the GPU always has exactly one role


def test_core_gpus_stay_core() -> None:
    spans = [i for i in role_intervals(HERE / "borrow_and_return.jsonl") if i.gpu.startswith("h0")]
    assert {i.role for i in spans} == {"core"}
