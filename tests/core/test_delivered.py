"""`all_delivered` (the training step's `delivered` guard) answers with set lookups; its
definition is the list scans it replaced. Both are compared on random deliveries against random
partitions: missing, extra and repeated replicas, alone and together, and the same reason
wherever the answer is a refusal (which check comes first included)."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from ehp_fsm.core.guards import all_delivered


def _scan(raw: Any, partition: dict[str, Any]) -> str | None:
    """The guard as it was: list scans (the definition)."""
    if not isinstance(raw, list | tuple) or not all(type(r) is str for r in raw):
        return f"payload `replicas` must be a list of replica names, got {raw!r}"
    got = list(raw)
    want = sorted(partition)
    missing = [r for r in want if r not in got]
    if missing:
        return f"deliveries missing from {missing}"
    extra = sorted({r for r in got if r not in want})
    if extra:
        return f"deliveries from {extra}, which are not in the step's partition {want}"
    twice = sorted({r for r in got if got.count(r) > 1})
    if twice:
        return f"deliveries from {twice} are listed more than once"
    return None


class _Ctx:
    """What the guard reads of its `Ctx`: the event's payload and the step's partition."""

    def __init__(self, raw: Any, partition: dict[str, Any]) -> None:
        self.payload = MappingProxyType({"replicas": raw})
        self.inst = MappingProxyType({"partition": partition})


names = st.sampled_from(["core:0", "core:1", "core:2", "hybrid:x1", "hybrid:x2", "hybrid:x10"])


@settings(max_examples=400, deadline=None)
@given(
    want=st.lists(names, max_size=5, unique=True),
    got=st.lists(names, max_size=8),
    as_tuple=st.booleans(),
)
def test_set_lookups_answer_as_the_scans(want: list[str], got: list[str], as_tuple: bool) -> None:
    partition = {r: ["g1"] for r in want}
    raw = tuple(got) if as_tuple else got
    assert all_delivered(_Ctx(raw, partition)) == _scan(raw, partition)  # type: ignore[arg-type]


def test_a_delivery_of_every_replica_once_passes_and_the_rest_are_named() -> None:
    partition = {"core:0": [], "hybrid:x1": []}
    assert all_delivered(_Ctx(["hybrid:x1", "core:0"], partition)) is None  # type: ignore[arg-type]
    twice = all_delivered(_Ctx(["core:0", "hybrid:x1", "core:0"], partition))  # type: ignore[arg-type]
    assert twice == "deliveries from ['core:0'] are listed more than once"
