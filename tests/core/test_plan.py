"""Plan parsing: the shipped plans load; each bad plan is refused with its TOML key path."""

from __future__ import annotations

import copy
import tomllib
from pathlib import Path
from typing import Any

import pytest

from ehp_fsm.errors import PlanError
from ehp_fsm.plan import MAX_GROUP_SIZE, load_plan, parse_plan

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TEST_PLAN = Path(__file__).resolve().parent / "plan.toml"
LOCAL: dict[str, Any] = tomllib.loads(TEST_PLAN.read_text())


def refuse(mutate: Any) -> PlanError:
    doc = copy.deepcopy(LOCAL)
    mutate(doc)
    with pytest.raises(PlanError) as info:
        parse_plan(doc, file="plan.toml")
    assert str(info.value).startswith("plan.toml: plan key")
    return info.value


def test_shipped_plans_load() -> None:
    load_plan(EXAMPLES / "local.toml")
    local = load_plan(TEST_PLAN)
    assert local.core.replicas == ("core:0", "core:1")
    assert local.grpo.global_batch == 64
    assert local.world_config()["inventory"]["h1:g0"] == "h1"
    gpu = load_plan(EXAMPLES / "gpu-4x8.toml")
    assert len(gpu.inventory) == 32 and gpu.ehp.replica_size == 2
    assert {e.tp for e in gpu.engines} == {1, 2, 4}
    assert gpu.rollout_gpus == 24


def test_a_plan_saved_with_a_byte_order_mark_loads_as_without(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A plan a Windows editor saved as "UTF-8 with BOM" was "not valid TOML (Invalid
    statement (at line 1, column 1)). Fix: fix the syntax" in `check` and every command
    that loads a plan; the mark is no part of the plan, and it loads as the same plan."""
    from ehp_fsm.cli import main

    for source in (EXAMPLES / "local.toml", TEST_PLAN):  # (the last is checked below)
        text = source.read_text(encoding="utf-8")
        plain, marked = tmp_path / "plain.toml", tmp_path / "marked.toml"
        plain.write_text(text, encoding="utf-8")
        marked.write_bytes(b"\xef\xbb\xbf" + text.encode())
        assert load_plan(marked) == load_plan(plain)
    assert main(["check", str(marked)]) == 0, capsys.readouterr().err
    assert "valid; 7 machine specs checked" in capsys.readouterr().out


def test_replica_size_must_be_core_replica_shape() -> None:
    err = refuse(lambda d: d["ehp"].update(replica_size=2))
    assert err.key == "ehp.replica_size" and "TP1×PP1×CP1 = 1" in err.why


def test_engine_spanning_hosts() -> None:
    def mutate(d: dict[str, Any]) -> None:
        d["hosts"][1]["gpus"] = 3
        d["engines"][0].update(tp=2, gpus=["h1:g0", "h2:g0"])

    err = refuse(mutate)
    assert err.key == "engines[0].gpus" and "never spans hosts" in err.why


def test_engine_exceeding_host_gpus() -> None:
    err = refuse(lambda d: d["engines"][2].update(tp=4))
    assert err.key == "engines[2].tp" and "exceeds host h2's 1 GPUs" in err.why


def test_gpu_used_twice() -> None:
    err = refuse(lambda d: d["engines"][1].update(gpus=["h1:g0"]))
    assert err.key == "engines[1].gpus" and "used twice: by engine e0" in err.why


def test_reserve_larger_than_rollout_gpus() -> None:
    err = refuse(lambda d: d["rollout"].update(reserve=4))
    assert err.key == "rollout.reserve" and "3 rollout GPUs" in err.why


def test_global_batch_not_whole_groups() -> None:
    err = refuse(lambda d: d["grpo"].update(global_batch=60))
    assert err.key == "grpo.global_batch" and "whole groups" in err.why
    assert "global_batch = 64" in err.fix


def test_a_group_of_one_sample_is_refused_it_would_train_nothing() -> None:
    err = refuse(lambda d: d["grpo"].update(group_size=1, global_batch=8))
    assert err.key == "grpo.group_size" and "advantage" in err.why
    assert "group_size = 2 or more" in err.fix
    two = copy.deepcopy(LOCAL)
    two["grpo"].update(group_size=2, global_batch=16)
    assert parse_plan(two).grpo.global_batch == 16


def test_a_group_past_the_cap_is_refused_saying_why() -> None:
    """`group_size = 100000000` passed `check`, and `simulate` grew for minutes until a
    MemoryError traceback: a group's samples are drawn and held together."""
    for size in (MAX_GROUP_SIZE + 1, 100_000_000, 1 << 40):
        err = refuse(lambda d, n=size: d["grpo"].update(group_size=n))
        assert err.key == "grpo.group_size" and f"largest {MAX_GROUP_SIZE:,}" in err.why
        assert "real groups are 4 to 64" in err.why and f"2..{MAX_GROUP_SIZE}" in err.fix
    err = refuse(lambda d: d["grpo"].update(group_size=0))
    assert err.key == "grpo.group_size" and f"1..{MAX_GROUP_SIZE}" in err.why
    big = copy.deepcopy(LOCAL)
    big["grpo"].update(group_size=MAX_GROUP_SIZE, prompts_per_step=2)
    assert parse_plan(big).grpo.group_size == MAX_GROUP_SIZE


def test_core_gpu_count_must_match_layout() -> None:
    err = refuse(lambda d: d["core"].update(dp=3))
    assert err.key == "core.gpus" and "needs 3 GPUs" in err.why


def test_unknown_host_for_engine() -> None:
    err = refuse(lambda d: d["engines"][0].update(host="h9"))
    assert err.key == "engines[0].host"


def test_hysteresis_required() -> None:
    err = refuse(lambda d: d["ehp"].update(release_threshold=2.0))
    assert err.key == "ehp.release_threshold" and "hysteresis" in err.why


def test_typo_is_an_unknown_key() -> None:
    err = refuse(lambda d: d["grpo"].update(group_sise=8))
    assert err.key == "grpo.group_sise"


def test_wrong_type_names_the_key() -> None:
    err = refuse(lambda d: d["grpo"].update(steps="many"))
    assert err.key == "grpo.steps" and "'many'" in err.why


def test_non_loopback_controller_needs_opt_in_and_keys() -> None:
    err = refuse(lambda d: d["transport"].update(controller="tcp://10.0.0.1:5555"))
    assert err.key == "transport.controller"
    err = refuse(
        lambda d: d["transport"].update(controller="tcp://0.0.0.0:1", allow_non_loopback=True)
    )
    assert err.key == "transport.curve_keys"


def test_relative_curve_keys_start_at_the_plans_folder_as_model_and_data_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plan's inputs are found where the plan is, whatever the current directory."""
    text = (EXAMPLES / "gpu-4x8.toml").read_text()
    assert 'curve_keys = "keys/"' in text  # the shipped example uses a relative folder
    (tmp_path / "plans").mkdir()
    plan_file = tmp_path / "plans" / "gpu.toml"
    plan_file.write_text(text)
    monkeypatch.chdir(tmp_path)
    plan = load_plan(plan_file)
    assert plan.transport.curve_keys == str(tmp_path / "plans" / "keys")
    absolute = text.replace('curve_keys = "keys/"', f'curve_keys = "{tmp_path / "k"}"')
    plan_file.write_text(absolute)
    assert load_plan(plan_file).transport.curve_keys == str(tmp_path / "k")


def test_missing_required_section_key() -> None:
    err = refuse(lambda d: d["core"].pop("gpus"))
    assert err.key == "core.gpus" and "required" in err.why


def test_duplicate_engine_id() -> None:
    err = refuse(lambda d: d["engines"][1].update(id="e0"))
    assert err.key == "engines[1].id"


def test_deadline_must_be_positive() -> None:
    err = refuse(lambda d: d.update(deadlines={"hybrid_replica": {"loading": 0}}))
    assert err.key == "deadlines.hybrid_replica.loading"


def test_the_runs_own_waits_come_from_the_plan() -> None:
    doc = copy.deepcopy(LOCAL)
    doc["deadlines"] = {"run": {"agents_connect": 5, "rollout": 7.5, "generate": 9, "health": 2}}
    plan = parse_plan(doc)
    waits = plan.run_deadlines
    assert (waits.agents_connect, waits.rollout, waits.generate) == (5.0, 7.5, 9.0)
    # the `/health` probe after a `/generate` with no answer is bounded by the plan (it was a
    # dispatcher default, 5 s, that no plan could change)
    from ehp_fsm.run.startup import RolloutSettings

    dispatch = RolloutSettings.of(plan).dispatch
    assert (dispatch.generate_timeout_s, dispatch.probe_timeout_s) == (9.0, 2.0)
    assert parse_plan(copy.deepcopy(LOCAL)).run_deadlines.agents_connect == 60.0
    assert parse_plan(copy.deepcopy(LOCAL)).run_deadlines.health == 5.0
    err = refuse(lambda d: d.update(deadlines={"run": {"generate": 0}}))
    assert err.key == "deadlines.run.generate"
    err = refuse(lambda d: d.update(deadlines={"run": {"health": -1}}))
    assert err.key == "deadlines.run.health"
    err = refuse(lambda d: d.update(deadlines={"run": {"connect": 1}}))
    assert err.key == "deadlines.run.connect"


def test_a_prompt_limit_in_data_is_refused_it_is_the_models() -> None:
    err = refuse(lambda d: d.update(data={"train": "x.jsonl", "max_prompt_len": 4}))
    assert err.key == "data.max_prompt_len" and "[model] max_prompt_len" in str(err)


def test_a_revisions_path_must_name_a_directory() -> None:
    doc = copy.deepcopy(LOCAL)
    doc["run"]["revisions"] = "/shared/revisions"
    assert parse_plan(doc).revisions == "/shared/revisions"
    err = refuse(lambda d: d["run"].update(revisions=" "))
    assert err.key == "run.revisions"


def test_unreadable_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="cannot be read"):
        load_plan(tmp_path / "missing.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[core\n")
    with pytest.raises(PlanError, match="not valid TOML"):
        load_plan(broken)


def test_a_plan_file_that_cannot_be_used_is_not_named_as_a_plan_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`ehp-fsm check nosuch.toml` said "nosuch.toml: plan key `<file>` is invalid: because
    nosuch.toml cannot be read": a file that cannot be read (or is not TOML) is no key of the
    plan. `run` said the same."""
    from ehp_fsm.cli import main

    missing = tmp_path / "nosuch.toml"
    for command in ("check", "run"):
        assert main([command, str(missing)]) == 2
        err = capsys.readouterr().err
        assert (
            f"the plan {missing} cannot be used: because it cannot be read (No such file or "
            "directory). Fix: check the path: give a plan's TOML file" in err
        ), err
        assert "plan key" not in err, err
    broken = tmp_path / "broken.toml"
    broken.write_text("[core\n")
    with pytest.raises(PlanError) as invalid:
        load_plan(broken)
    said = str(invalid.value)
    assert said.startswith(f"the plan {broken} cannot be used: because it is not valid TOML"), said
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff")
    with pytest.raises(PlanError, match="cannot be used: because it is not UTF-8 text") as text:
        load_plan(binary)
    assert text.value.key == "<file>" and text.value.path == str(binary)
    # a key of the plan is still named as one
    bad = tmp_path / "bad.toml"
    bad.write_text('[core]\ntp = "two"\n')
    with pytest.raises(PlanError, match=r"bad.toml: plan key `hosts` is invalid"):
        load_plan(bad)


# -- what a review found the parser accepting or crashing on --------------------------------


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_number_that_is_not_finite_is_refused(value: float) -> None:
    err = refuse(lambda d: d.setdefault("ehp", {}).update(cooldown_s=value))
    assert err.key == "ehp.cooldown_s" and "finite" in str(err)


@pytest.mark.parametrize(
    ("mutate", "key"),
    [
        (lambda d: d["core"].update(gpus=[["h0:g0"], "h0:g1"]), "core.gpus"),
        (lambda d: d["engines"][0].update(gpus=[{"id": "h1:g0"}]), "engines[0].gpus"),
    ],
)
def test_gpu_ids_that_are_not_strings_are_refused(mutate: Any, key: str) -> None:
    assert refuse(mutate).key == key  # raised TypeError (unhashable) before


def test_what_the_planner_or_the_pool_would_refuse_is_refused_by_the_plan() -> None:
    assert refuse(lambda d: d.setdefault("ehp", {}).update(max_hybrids=-1)).key == (
        "ehp.max_hybrids"
    )
    assert refuse(lambda d: d.setdefault("ehp", {}).update(max_hybrids=33)).key == (
        "ehp.max_hybrids"
    )
    assert refuse(lambda d: d.setdefault("rollout", {}).update(allowed_tp=[True])).key == (
        "rollout.allowed_tp"
    )


def test_ehp_on_that_may_start_no_hybrid_is_refused() -> None:
    err = refuse(lambda d: d["ehp"].update(enabled=True, max_hybrids=0))
    assert err.key == "ehp.max_hybrids" and "enabled = true" in err.why
    assert "enabled = false" in err.fix and "max_hybrids = 1" in err.fix
    off = copy.deepcopy(LOCAL)
    off["ehp"].update(enabled=False, max_hybrids=0)  # the Core alone: what runs is what it says
    assert parse_plan(off).planner_policy().max_hybrids == 0


def test_the_plan_limit_on_hybrids_is_the_pools() -> None:
    from ehp_fsm.plan import MAX_HYBRIDS
    from ehp_fsm.training.pool_protocol import MAX_WARM_WORKERS

    assert MAX_HYBRIDS == MAX_WARM_WORKERS


def test_a_plan_that_is_not_utf8_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "latin1.toml"
    bad.write_bytes("[run]\nname = 'caf\u00e9'\n".encode("latin-1"))
    with pytest.raises(PlanError, match="not UTF-8"):
        load_plan(bad)


@pytest.mark.parametrize("host", ["127.evil.example", "127.0.0.1.nip.io", "localhost.example"])
def test_a_name_that_only_looks_loopback_is_not_loopback(host: str) -> None:
    err = refuse(lambda d: d["transport"].update(controller=f"tcp://{host}:5555"))
    assert err.key == "transport.controller"


@pytest.mark.parametrize(
    ("controller", "why"),
    [
        ("tcp://127.0.0.1:99999", "port '99999' is not 1..65535"),  # ZeroMQ bound 34463
        ("tcp://127.0.0.1", "names no port"),  # refused by ZeroMQ once the run had started
        ("tcp://127.0.0.1:abc", "port 'abc'"),
        ("inproc://ctl", "reaches only this process"),  # the agents waited 60 s in vain
        ("ipc://", "not tcp://ADDR:PORT or ipc://PATH"),
    ],
)
def test_a_controller_the_agents_cannot_reach_is_refused(controller: str, why: str) -> None:
    err = refuse(lambda d: d["transport"].update(controller=controller))
    assert err.key == "transport.controller" and why in str(err), str(err)


@pytest.mark.parametrize("eid", ["", "e/../../2", "e" * 65, "e\x1b[31m2", "-e"])
def test_an_engine_id_its_agent_cannot_name_a_file_after_is_refused(eid: str) -> None:
    """The agent names an engine's log file after its id: `e/../../2` passed `check` and its
    launch failed (the run then waited out the engines' start deadline)."""
    err = refuse(lambda d: d["engines"][0].update(id=eid))
    assert err.key == "engines[0].id" and "must be 1..64 letters" in str(err), str(err)


@pytest.mark.parametrize("key", ["hosts", "engines"])
def test_an_id_ending_in_a_newline_is_refused(key: str) -> None:
    """The id pattern ended in `$`, which also matches before a final newline: a host id
    `"h2\\n"` (and an engine id `"e0\\n"`) passed `check`, whose summary then broke its
    lines at it (`h2` / `×1 cpu`), and went on to the agent's command line, its state folder
    and the key file names. The agent's and `ehp-fsm keys`' own checks took it too."""
    from ehp_fsm.plan import engine_id_problem, host_id_problem
    from ehp_fsm.runtime.errors import KeyFileError
    from ehp_fsm.runtime.keys import _check_name

    err = refuse(lambda d: d[key][0].update(id=d[key][0]["id"] + "\n"))
    assert err.key == f"{key}[0].id" and "must be 1..64 letters" in str(err), str(err)
    assert host_id_problem("h2\n") is not None and engine_id_problem("e0\n") is not None
    with pytest.raises(KeyFileError):
        _check_name("h2\n")


def test_a_gpu_listed_twice_by_one_host_is_named_so() -> None:
    err = refuse(lambda d: d["hosts"][1].update(gpus=["h1:g0", "h1:g0"]))
    assert err.key == "hosts[1].gpus" and "listed twice by host 'h1'" in str(err), str(err)


def test_a_host_or_engine_id_used_twice_and_an_undeclared_host_are_named() -> None:
    err = refuse(lambda d: d["hosts"][1].update(id=d["hosts"][0]["id"]))
    assert err.key == "hosts[1].id" and "is used twice" in str(err), str(err)
    err = refuse(lambda d: d["engines"][1].update(id=d["engines"][0]["id"]))
    assert err.key == "engines[1].id" and "is used twice" in str(err), str(err)
    err = refuse(lambda d: d["engines"][0].update(host="nowhere"))
    assert err.key == "engines[0].host" and "'nowhere' is not declared" in str(err), str(err)


def test_loopback_addresses_are_loopback() -> None:
    for controller in (
        "tcp://127.0.0.2:5555",
        "tcp://[::1]:5555",
        "tcp://localhost:1",
        "tcp://127.0.0.1:*",
        "ipc:///tmp/ehp-ctl",
    ):
        doc = copy.deepcopy(LOCAL)
        doc["transport"]["controller"] = controller
        parse_plan(doc, file="plan.toml")


def test_a_misspelt_key_is_refused_naming_the_key_it_is_near() -> None:
    """`group_sise` or `[rewards]` was refused with "check the spelling in the README" only."""
    err = refuse(lambda d: d["grpo"].update(group_sise=4))
    assert err.key == "grpo.group_sise" and "did you mean `group_size`?" in err.fix
    err = refuse(lambda d: d.update(rewards={"function": "exact_match"}))
    assert err.key == "rewards" and "did you mean `reward`?" in err.fix
    err = refuse(lambda d: d.update(zzz=1))  # nothing near: no guess
    assert err.key == "zzz" and "did you mean" not in err.fix
