"""The spec checker rejects each kind of bad spec with the file, the key and a fix."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from ehp_fsm.core.effects import EFFECTS
from ehp_fsm.core.guards import GUARDS
from ehp_fsm.core.spec import parse_spec
from ehp_fsm.errors import SpecError
from ehp_fsm.specfiles import MACHINES, load_spec_file, load_specs, spec_dir

GOOD: dict[str, Any] = {
    "machine": "toy",
    "initial": "idle",
    "terminal": ["done"],
    "states": {"idle": "waiting", "busy": "working", "done": "finished"},
    "create": {"event": "make", "guards": [], "effects": []},
    "transitions": [
        {"event": "go", "source": "idle", "dest": "busy", "guards": ["host_given"]},
        {"event": "finish", "source": "busy", "dest": "done", "effects": ["record_reason"]},
        {"event": "fail", "source": "*", "dest": "done"},
    ],
}


def parse(doc: dict[str, Any]) -> Any:
    return parse_spec(doc, file="toy.toml", guards=GUARDS.keys(), effects=EFFECTS.keys())


def bad(mutate: Any) -> SpecError:
    doc = copy.deepcopy(GOOD)
    mutate(doc)
    with pytest.raises(SpecError) as info:
        parse(doc)
    assert info.value.file == "toy.toml"
    assert "Fix:" in str(info.value)
    return info.value


def test_good_spec_parses_and_expands_wildcards() -> None:
    spec = parse(copy.deepcopy(GOOD))
    assert spec.table[("idle", "fail")].dest == "done"
    assert spec.table[("busy", "fail")].dest == "done"
    assert ("done", "fail") not in spec.table  # '*' never covers terminal states
    assert spec.allowed_events("idle") == ("go", "fail")


def test_unreachable_state() -> None:
    err = bad(lambda d: d["states"].update(orphan="never entered"))
    assert err.key == "states.orphan" and "unreachable" in err.why


def test_non_terminal_dead_end() -> None:
    def mutate(d: dict[str, Any]) -> None:
        d["states"]["stuck"] = "no way out"
        d["transitions"].append({"event": "jam", "source": "idle", "dest": "stuck"})
        d["transitions"][2]["source"] = ["idle", "busy"]

    err = bad(mutate)
    assert err.key == "states.stuck" and "dead end" in err.why


def test_two_transitions_for_same_state_and_event() -> None:
    err = bad(lambda d: d["transitions"].append({"event": "go", "source": "idle", "dest": "done"}))
    assert err.key == "transitions[3]" and "('idle', 'go')" in err.why


def test_wildcard_overlap_is_ambiguous_too() -> None:
    err = bad(lambda d: d["transitions"].append({"event": "go", "source": "*", "dest": "done"}))
    assert "second transition" in err.why


def test_unknown_guard() -> None:
    err = bad(lambda d: d["transitions"][0].update(guards=["no_such_guard"]))
    assert err.key == "transitions[0].guards" and "no_such_guard" in err.why


def test_unknown_effect() -> None:
    err = bad(lambda d: d["create"].update(effects=["launch_rockets"]))
    assert err.key == "create.effects" and "launch_rockets" in err.why


@pytest.mark.parametrize(
    ("mutate", "key"),
    [
        (lambda d: d["transitions"][0].update(dest="nowhere"), "transitions[0].dest"),
        (lambda d: d["transitions"][0].update(source="nowhere"), "transitions[0].source"),
        (lambda d: d.update(initial="nowhere"), "initial"),
        (lambda d: d.update(terminal=["nowhere"]), "terminal[0]"),
    ],
)
def test_unknown_state(mutate: Any, key: str) -> None:
    err = bad(mutate)
    assert err.key == key and "not declared" in err.why


def test_terminal_state_with_an_exit() -> None:
    err = bad(
        lambda d: d["transitions"].append({"event": "again", "source": "done", "dest": "idle"})
    )
    assert "terminal" in err.why


def test_unknown_key_is_a_typo() -> None:
    err = bad(lambda d: d["transitions"][0].update(gaurds=["host_given"]))
    assert err.key == "transitions[0].gaurds"


def test_missing_create_table() -> None:
    err = bad(lambda d: d.pop("create"))
    assert err.key == "create"


def test_transition_may_not_reuse_create_event() -> None:
    err = bad(
        lambda d: d["transitions"].append({"event": "make", "source": "busy", "dest": "idle"})
    )
    assert "create event" in err.why


def test_every_shipped_spec_loads() -> None:
    specs = load_specs()
    assert sorted(specs) == sorted(MACHINES)
    for spec in specs.values():
        # every role ends somewhere, except the singleton planner record
        assert bool(spec.terminal) == (spec.name != "capacity"), spec.name


def test_file_name_must_match_machine(tmp_path: Path) -> None:
    text = (spec_dir() / "gpu.toml").read_text()
    wrong = tmp_path / "ledger.toml"
    wrong.write_text(text)
    with pytest.raises(SpecError, match=r"machine 'gpu' is in file ledger\.toml"):
        load_spec_file(wrong)


def test_invalid_toml_names_the_file(tmp_path: Path) -> None:
    broken = tmp_path / "gpu.toml"
    broken.write_text("machine = ")
    with pytest.raises(SpecError, match="not valid TOML"):
        load_spec_file(broken)
