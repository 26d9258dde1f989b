"""Properties of `partition_groups`: coverage, no split, balance, determinism, only live."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ehp_fsm.core.batch import PartitionError, fair_share, partition_groups

replica_ids = st.sampled_from(["core-0", "core-1", "hybrid:a", "hybrid:b", "hybrid:c", "core-2"])
live_maps = st.dictionaries(replica_ids, st.integers(1, 4), min_size=1, max_size=6)
group_ids = st.lists(st.integers(0, 10_000), min_size=1, max_size=64, unique=True)


@given(groups=group_ids, live=live_maps, n=st.integers(1, 8), data=st.data())
def test_partition_covers_each_group_once_on_live_replicas_balanced(groups, live, n, data):
    try:
        p = partition_groups(groups=groups, live=live, group_size=n, step=3, epoch=1)
    except PartitionError:
        # Only refused when some replica cannot get work within its share.
        c = sum(live.values())
        assert len(groups) < len(live) or any(len(groups) * cap < c for cap in live.values())
        return
    assigned = [g for _, gs in p.assignments for g in gs]
    assert sorted(assigned) == sorted(groups)  # every group exactly once
    assert len(assigned) == len(set(assigned))  # never split / duplicated
    assert set(p.replicas) == set(live)  # only live replicas (and all of them)
    assert p.total_samples == len(groups) * n
    c = sum(live.values())
    for r in live:
        share = fair_share(len(groups), live[r], c)
        load = len(p.groups_of(r))
        assert math.floor(share) <= load <= math.ceil(share)  # within one group of its share
        assert load >= 1  # require_work default
    if len(set(live.values())) == 1:
        loads = [len(g) for _, g in p.assignments]
        assert max(loads) - min(loads) <= 1
    # Determinism: any input order gives the same partition.
    shuffled = data.draw(st.permutations(groups))
    items = data.draw(st.permutations(list(live.items())))
    again = partition_groups(groups=shuffled, live=dict(items), group_size=n, step=3, epoch=1)
    assert again == p
    assert sum(p.weight_of(r) for r in p.replicas) == Fraction(1)


@given(groups=group_ids, live=live_maps)
def test_partition_without_required_work_always_exists(groups, live):
    p = partition_groups(
        groups=groups, live=live, group_size=2, step=0, epoch=0, require_work=False
    )
    assert sorted(g for _, gs in p.assignments for g in gs) == sorted(groups)


def test_partition_refuses_fewer_groups_than_replicas():
    with pytest.raises(PartitionError, match="cannot give work to 3 live replicas"):
        partition_groups(
            groups=[1, 2], live={"a": 1, "b": 1, "c": 1}, group_size=4, step=0, epoch=0
        )


def test_partition_refuses_no_live_replica_and_duplicate_groups():
    with pytest.raises(PartitionError, match="no live training replica"):
        partition_groups(groups=[1], live={}, group_size=1, step=0, epoch=0)
    with pytest.raises(PartitionError, match="more than once"):
        partition_groups(groups=[1, 1], live={"a": 1}, group_size=1, step=0, epoch=0)
    with pytest.raises(PartitionError, match="capacity 0"):
        partition_groups(groups=[1], live={"a": 0}, group_size=1, step=0, epoch=0)


def test_partition_example_is_contiguous_and_proportional():
    p = partition_groups(
        groups=range(8),
        live={"core-0": 1, "core-1": 1, "hybrid:h": 2},
        group_size=4,
        step=2,
        epoch=1,
    )
    assert p.assignments == (("core-0", (0, 1)), ("core-1", (2, 3)), ("hybrid:h", (4, 5, 6, 7)))
    assert p.samples_of("hybrid:h") == 16


def test_batch_module_is_pure():
    """The core batch module imports no torch, clock, randomness, logging or I/O."""
    import ast
    import inspect

    import ehp_fsm.core.batch as batch

    tree = ast.parse(inspect.getsource(batch))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported <= {
        "__future__",
        "collections",
        "dataclasses",
        "enum",
        "fractions",
        "ehp_fsm",
    }, imported
