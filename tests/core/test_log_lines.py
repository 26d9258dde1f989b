"""`TransitionLog.write` encodes each record as a `_Line` struct; its bytes must be those of the
record dict in the order `logger.info(event, **rest)` renders it (what the log wrote before,
and what `outcome_records` describes), for any record: ids and reasons with any characters,
times int or float, causes or none, payloads nested with mappings, read-only mappings, tuples,
non-string keys and values JSON cannot hold (rendered by the fallback, as `repr`).
"""

from __future__ import annotations

import io
import json
from types import MappingProxyType
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from ehp_fsm.core.transition import Command, Record, Rejected
from ehp_fsm.core.world import Event
from ehp_fsm.translog import CHAIN_SUFFIX, TransitionLog, plain, plain_effects

leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.builds(object),  # no JSON form: the renderer's fallback writes its repr
)


def _proxy(d: dict[str, Any]) -> Any:
    return MappingProxyType(d)


values = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(st.text(max_size=5), inner, max_size=3),
        st.dictionaries(st.text(max_size=5), inner, max_size=3).map(_proxy),
        st.dictionaries(st.integers(0, 9), inner, max_size=2),
    ),
    max_leaves=8,
)
payloads = st.dictionaries(st.text(max_size=6), values, max_size=4)
texts = st.text(max_size=10)
commands = st.builds(Command, texts, texts, texts, payloads.map(_proxy))


@st.composite
def outcomes(draw: st.DrawFn) -> Rejected:
    n = draw(st.integers(1, 4))
    records = tuple(
        Record(
            draw(texts),
            draw(texts),
            draw(texts),
            draw(texts),
            draw(texts),
            draw(st.booleans()),
            draw(texts),
            tuple(draw(st.lists(commands, max_size=2))),
            None if i == 0 else draw(st.integers(0, i - 1)),
            draw(payloads.map(_proxy) | payloads),
        )
        for i in range(n)
    )
    time = draw(st.floats(0, 1e9) | st.integers(0, 10**9))
    ev = Event("m", "i", "e", time, {}, draw(texts))
    return Rejected(ev, "why", records)


def _as_dict(outcome: Rejected, first: int, i: int) -> dict[str, Any]:
    """The record dict as `write` built it before `_Line` (the reference)."""
    r = outcome.records[i]
    return {
        "seq": first + i,
        "time": outcome.event.time,
        "machine": r.machine,
        "instance": r.instance,
        "source": r.source,
        "dest": r.dest,
        "accepted": r.accepted,
        "reason": r.reason,
        "effects": plain_effects(r.commands) if r.commands else [],
        "correlation": outcome.event.correlation,
        "cause": None if r.cause is None else first + r.cause,
        "payload": plain(r.payload),
        "event": r.event,
    }


@settings(max_examples=80, deadline=None)
@given(st.lists(outcomes(), min_size=1, max_size=3))
def test_lines_are_the_record_dicts(batch: list[Rejected]) -> None:
    buf = io.BytesIO()
    log = TransitionLog(buf, checkpoint_every=None, flush_each=False)
    firsts = [log.write(o) for o in batch]
    log.flush()
    lines = buf.getvalue().splitlines()
    want = [
        log._encode_record(_as_dict(o, first, i))
        for o, first in zip(batch, firsts, strict=True)
        for i in range(len(o.records))
    ]
    assert len(lines) == len(want)
    for line, w in zip(lines, want, strict=True):
        assert line[:-CHAIN_SUFFIX] + b"}" == w
        json.loads(line)  # and each line is one JSON object
