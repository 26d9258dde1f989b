"""The dispatcher's judgement of an engine's answer (`dispatch.judge_answer`) is the same as its
definition (`dispatch._judge_each`: each check over every sample, in order) on any answer:
the one-pass path it takes first may only ever return what the definition returns.

Answers are built as `GenerateResult.from_json` builds them from SGLang's JSON (rids absent,
right, wrong or out of order; samples aborted or not; weight versions absent, integer or not,
equal or not; per-token spans of one or several versions), with the bias towards well-formed
answers a real engine gives, so both paths are taken. Nothing is faked: these are pure
functions of the answer.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from ehp_fsm.rollout.client import GenerateResult
from ehp_fsm.rollout.dispatch import _judge_each, judge_answer

PREFIX = "g7.2."


FAULTS = [
    "rid none",
    "rid next",
    "rid other",
    "rid attempt",
    "abort",
    "abort message",
    "no reason",
    "version other",
    "version none",
    "spans one",
    "spans same",
    "spans mixed",
    "spans empty",
]


@st.composite
def answers(draw: st.DrawFn) -> tuple[list[GenerateResult], int]:
    """n samples, most of them well formed, each with at most a few faults."""
    n = draw(st.integers(1, 5))
    count = draw(st.sampled_from([n] * 6 + [n - 1, n + 1]))
    version = draw(st.sampled_from(["3"] * 6 + ["04", "x", "-1", "3.0", None]))
    out = []
    for i in range(max(0, count)):
        faults = draw(st.lists(st.sampled_from(FAULTS), max_size=2)) if draw(st.booleans()) else []
        rid: str | None = f"{PREFIX}{i}"
        reason: dict[str, Any] | None = {"type": draw(st.sampled_from(["stop", "length"]))}
        v = version
        meta: dict[str, Any] = {}
        for f in faults:
            if f.startswith("rid"):
                rid = {"none": None, "next": f"{PREFIX}{i + 1}", "other": "other"}.get(
                    f[4:], f"g7.1.{i}"
                )
            elif f == "abort":
                reason = {"type": "abort"}
            elif f == "abort message":
                reason = {"type": "abort", "message": "paused"}
            elif f == "no reason":
                reason = None
            elif f == "version other":
                v = draw(st.sampled_from(["4", "y", "03"]))
            elif f == "version none":
                v = None
            elif f == "spans one":
                meta["weight_versions"] = [{"version": v or "3", "start": 0, "end": 2}]
            elif f == "spans same":
                meta["weight_versions"] = [
                    {"version": v or "3", "start": 0, "end": 1},
                    {"version": v or "3", "start": 1, "end": 2},
                ]
            elif f == "spans mixed":
                meta["weight_versions"] = [
                    {"version": "3", "start": 0, "end": 1},
                    {"version": "4", "start": 1, "end": 2},
                ]
            else:
                meta["weight_versions"] = []
        meta.update(id=rid, finish_reason=reason, weight_version=v)
        out.append(GenerateResult.from_json({"text": "", "output_ids": [1, 2], "meta_info": meta}))
    return out, n


@settings(max_examples=400, deadline=None)
@given(answers())
def test_judge_answer_is_its_definition(answer: tuple[list[GenerateResult], int]) -> None:
    outputs, n = answer
    assert judge_answer(outputs, PREFIX, n) == _judge_each(outputs, PREFIX, n)


def test_both_paths_are_taken() -> None:
    """A well-formed answer is accepted with its revision; each kind of fault is named."""
    ok = [
        GenerateResult.from_json(
            {"output_ids": [1], "meta_info": {"id": f"{PREFIX}{i}", "weight_version": "3"}}
        )
        for i in range(3)
    ]
    assert judge_answer(ok, PREFIX, 3) == 3
    assert judge_answer(ok[:2], PREFIX, 3) == _judge_each(ok[:2], PREFIX, 3)
    assert "not ['g7.2.0'" in str(judge_answer(ok[:2], PREFIX, 3))
    swapped = [ok[1], ok[0], ok[2]]
    assert "engine answered samples" in str(judge_answer(swapped, PREFIX, 3))
