"""Plans an RL engineer writes from the examples, and whether `ehp-fsm check` says what the run
does with them: Hybrid capacity when engines stop whole, restart TPs no host can hold, and a
`max_hybrids` given with EHP off.

Nothing is faked: `check` is the CLI's own `main`, the run is `ehp-fsm run` in a subprocess.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from ehp_fsm.cli import main
from ehp_fsm.errors import PlanError
from ehp_fsm.plan import load_plan
from ehp_fsm.run.startup import pool_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _plan(
    tmp: Path,
    hosts: dict[str, int],
    engines: list[tuple[str, int]],
    *,
    reserve: int,
    allowed_tp: list[int] | None = None,
    ehp: str = "max_hybrids = 4",
    run: str = "",
) -> Path:
    """A plan in the form of examples/short.toml: a torch Core on h0:g0, the given hosts
    (id → devices) and engines (host, TP), an eager planner; no model or data (`check` reads
    the plan alone)."""
    text = [f'[run]\nname = "review"\nlog = "{tmp}/run/transitions.jsonl"\n{run}']
    for hid, n in hosts.items():
        text.append(f'[[hosts]]\nid = "{hid}"\ngpus = {n}')
    text.append('[core]\ndp = 1\ngpus = ["h0:g0"]')
    for i, (host, tp) in enumerate(engines):
        text.append(f'[[engines]]\nid = "e{i}"\nhost = "{host}"\ntp = {tp}')
    rollout = f"[rollout]\nreserve = {reserve}"
    if allowed_tp is not None:
        rollout += f"\nallowed_tp = {allowed_tp}"
    text.append(rollout)
    text.append("[grpo]\nprompts_per_step = 4\ngroup_size = 4\nsteps = 4")
    text.append(
        "[ehp]\nborrow_threshold = 0.001\nrelease_threshold = 0.0005\ncooldown_s = 0.0\n"
        f"engine_restart_cost_s = 0.0\nrelease_resume_cost_s = 0.0\n{ehp}"
    )
    text.append('[transport]\ncontroller = "tcp://127.0.0.1:*"')
    path = tmp / "plan.toml"
    path.write_text("\n".join(text) + "\n")
    return path


def _ehp_line(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("  ehp: "))


def test_check_says_a_plan_whose_engines_cannot_stop_within_the_reserve_never_borrows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two TP2 engines and a reserve of 3: stopping either (an engine stops whole) leaves 2
    devices serving, below the reserve, so the planner never borrows (the run said "shortfall:
    ... budget 1" at every step and "borrows and returns: none"). `check` counted devices
    (4 - 3 = 1 may stop) and said one Hybrid fits, with one warm worker."""
    plan = _plan(tmp_path, {"h0": 1, "h1": 2, "h2": 2}, [("h1", 2), ("h2", 2)], reserve=3)
    assert main(["check", str(plan)]) == 0
    line = _ehp_line(capsys.readouterr().out)
    assert "at most 1 at once" not in line, line
    assert "no Hybrid can be borrowed while the plan's engines serve: an engine is" in line, line
    assert "[rollout] reserve = 3 of the 4 engine devices keep serving" in line, line
    # the run does start a warm worker for it, and check says so
    assert pool_config(load_plan(plan), tmp_path, tmp_path).max_hybrids == 1
    assert "(the run still starts 1 warm worker for it)" in line, line
    # one TP2 engine, reserve 1: the same, on a single engine
    plan = _plan(tmp_path, {"h0": 1, "h1": 2}, [("h1", 2)], reserve=1, ehp="max_hybrids = 1")
    assert main(["check", str(plan)]) == 0
    assert "no Hybrid can be borrowed while the plan's engines serve: an engine is" in _ehp_line(
        capsys.readouterr().out
    )
    # reserve 2 of the two TP2 engines: one engine stops, two Hybrids fit on its host
    plan = _plan(tmp_path, {"h0": 1, "h1": 2, "h2": 2}, [("h1", 2), ("h2", 2)], reserve=2)
    assert main(["check", str(plan)]) == 0
    line = _ehp_line(capsys.readouterr().out)
    assert "never" not in line and "at most 2 at once" in line, line


def _tp3_plan(tmp: Path) -> Path:
    """A TP3 engine on h1 and a TP1 engine on h2, reserve 2, max_hybrids 5: only the TP1
    engine may stop (the TP3 one would leave 1 device serving), so one Hybrid at once; the
    run warms two workers (4 engine devices - 2 reserved)."""
    return _plan(
        tmp,
        {"h0": 1, "h1": 3, "h2": 1},
        [("h1", 3), ("h2", 1)],
        reserve=2,
        allowed_tp=[1, 3],
        ehp="max_hybrids = 5",
    )


def test_check_counts_hybrids_as_the_planner_places_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`check` said "at most 2 at once ...: 2 warm workers"; the planner places one (the
    slow test below runs it), and the run starts two warm workers, one never used."""
    plan = _tp3_plan(tmp_path)
    assert main(["check", str(plan)]) == 0
    line = _ehp_line(capsys.readouterr().out)
    assert "at most 1 at once" in line, line
    assert pool_config(load_plan(plan), tmp_path, tmp_path).max_hybrids == 2
    assert "the run starts 2 warm workers, as many as the devices could hold: 1 of them" in line, (
        line
    )


@pytest.mark.slow
def test_the_run_borrows_as_many_hybrids_as_check_says(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The plan of the test above, run with a floor of 3 Hybrids (`min_hybrids`, within
    G − Core = 3): it borrows one Hybrid and no more ("shortfall: wanted 3, granted 1"), as
    many as `check` says fit at once, while the two warm workers `check` names were started
    (trainers/worker-1.log and worker-2.log beside the Core's). (An eager planner — thresholds
    far below any ratio — wanted 3 on measured times until those measured the engines' pace:
    on this machine's shared cores the prediction rarely asks for them.)"""
    from tests.run.test_run import session_model

    plan = _tp3_plan(tmp_path)
    plan.write_text(plan.read_text().replace("max_hybrids = 5", "max_hybrids = 5\nmin_hybrids = 3"))
    assert main(["check", str(plan)]) == 0
    line = _ehp_line(capsys.readouterr().out)
    said = re.search(r"at most (\d+) at once.*the run starts (\d+) warm workers", line)
    assert said is not None, line
    assert "at least 3 (min_hybrids" in line and "the run records a shortfall of 2" in line, line
    text = plan.read_text()
    text += (
        f'[model]\npath = "{session_model()}"\nmax_prompt_len = 8\nmax_response_len = 3\n'
        f'[data]\ntrain = "{EXAMPLES}/data/add-0-4.jsonl"\n'
    )
    plan.write_text(text)
    env = {**os.environ, "EHP_TEST_RUN": uuid.uuid4().hex}
    done = subprocess.run(
        [sys.executable, "-m", "ehp_fsm.cli", "run", str(plan)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = tmp_path / "run"
    hybrids = set()
    for line in (run_dir / "transitions.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("machine") == "hybrid_replica":
            hybrids.add(record.get("instance"))
    # the floor borrows as many as fit, and asks for more in vain
    assert len(hybrids) == int(said[1]), (hybrids, line)
    # max_hybrids 5, bounded by the batch: G = 4 groups on a Core of 1 take at most 3 Hybrids
    assert f"wanted 3, granted {said[1]}" in done.stdout, done.stdout[-3000:]
    workers = sorted(p.name for p in (run_dir / "trainers").glob("worker-*.log"))
    assert len(workers) == 1 + int(said[2]), (workers, line)  # the Core's and the warm ones


@pytest.mark.parametrize(
    ("allowed", "why"),
    [
        ([1, 1 << 40], "TP1099511627776 fits on no host"),
        ([3], "TP3 fits on no host"),  # the largest host has 2 devices beside the Core
    ],
)
def test_a_restart_tp_no_host_can_hold_is_refused(
    tmp_path: Path, allowed: list[int], why: str
) -> None:
    """`allowed_tp = [3]` on hosts of at most 2 devices (and 2**40) passed `check`, shown as
    "restart TPs [3]": a returned engine is started on one host's devices, so that TP is
    never started. A TP that fits one host's devices outside the Core is taken."""
    plan = _plan(tmp_path, {"h0": 1, "h1": 2, "h2": 1}, [("h1", 1), ("h2", 1)], reserve=1)
    text = plan.read_text()
    plan.write_text(text.replace("reserve = 1", f"reserve = 1\nallowed_tp = {allowed}"))
    with pytest.raises(PlanError) as err:
        load_plan(plan)
    assert err.value.key == "rollout.allowed_tp"
    assert why in str(err.value) and "no host has more than 2" in str(err.value)
    assert "allowed_tp = [1]" in str(err.value)  # what to write
    plan.write_text(text.replace("reserve = 1", "reserve = 1\nallowed_tp = [1, 2]"))
    assert load_plan(plan).rollout.allowed_tp == (1, 2)
    # the Core's devices are not room for an engine: h0 has 3, two of them the Core's
    plan = _plan(tmp_path, {"h0": 3, "h1": 2}, [("h1", 2)], reserve=1)
    text = plan.read_text().replace('gpus = ["h0:g0"]', 'gpus = ["h0:g0", "h0:g1"]')
    text = text.replace("[core]\ndp = 1", "[core]\ndp = 2")
    plan.write_text(text.replace("reserve = 1", "reserve = 1\nallowed_tp = [3]"))
    with pytest.raises(PlanError, match="no host has more than 2"):
        load_plan(plan)


@pytest.mark.parametrize("value", ["-3", "33", "1000000000000000000000000000000"])
def test_max_hybrids_out_of_range_is_refused_with_ehp_off_too(tmp_path: Path, value: str) -> None:
    """`enabled = false` with `max_hybrids = -3` (or 10**30) passed `check`: a value out of
    its range, nothing said. It is refused as with EHP on; 0 and a value in range pass."""
    for ok in ("0", "5"):
        plan = _plan(
            tmp_path,
            {"h0": 1, "h1": 2, "h2": 1},
            [("h1", 1), ("h1", 1), ("h2", 1)],
            reserve=2,
            ehp=f"enabled = false\nmax_hybrids = {ok}",
        )
        assert not load_plan(plan).ehp.enabled
    plan.write_text(plan.read_text().replace("max_hybrids = 5", f"max_hybrids = {value}"))
    with pytest.raises(PlanError) as err:
        load_plan(plan)
    assert err.value.key == "ehp.max_hybrids"
    assert "is outside 0..32" in str(err.value) and "EHP off" in str(err.value)


@pytest.mark.parametrize(
    ("where", "key", "said", "fix"),
    [
        (
            "[grpo]",
            "max_hybrids",
            "not a key of [grpo]: it is a key of [ehp]",
            "move it under [ehp]",
        ),
        ("[ehp]", "steps", "not a key of [ehp]: it is a key of [grpo]", "move it under [grpo]"),
        ("[rollout]", "tp", "it is a key of [core] or [[engines]]", "the one you meant"),
        (
            "[deadlines.run]",
            "starting",
            "not a key of [deadlines.run]: it is a key of [deadlines.rollout_engine]",
            "move it under [deadlines.rollout_engine]",
        ),
        ("[[engines]]", "reserve", "not a key of [[engines]]", "move it under [rollout]"),
    ],
)
def test_a_key_in_the_wrong_table_is_refused_naming_its_table(
    tmp_path: Path, where: str, key: str, said: str, fix: str
) -> None:
    """`max_hybrids = 2` written under [grpo] was refused as "not a known key. Fix: check the
    spelling in the README": the spelling was right, the table wrong, and the README had to be
    searched for where it goes."""
    plan = _plan(tmp_path, {"h0": 1, "h1": 2, "h2": 1}, [("h1", 1), ("h2", 1)], reserve=1)
    text = plan.read_text()
    head = where if where != "[[engines]]" else '[[engines]]\nid = "e0"'
    assert head in text or where == "[deadlines.run]", where
    line = f"{key} = 2"
    text = text.replace(head, f"{head}\n{line}", 1) if head in text else text + f"{where}\n{line}\n"
    plan.write_text(text)
    with pytest.raises(PlanError) as err:
        load_plan(plan)
    assert said in err.value.why and fix in err.value.fix, err.value


def test_the_tables_named_are_every_key_the_reader_asks_for() -> None:
    """The map behind "it is a key of [ehp]" is the plan's schema: the keys the reader asks for
    on the example plans, `[data]`'s and `[simulate]`'s (tests/core/test_every_key.py's walk)."""
    from ehp_fsm.plan import _table_keys
    from tests.core.test_every_key import schema_keys

    schema = set()
    for dotted in schema_keys():
        table, _, key = dotted.rpartition(".")
        head = f"[[{table[:-2]}]]" if table.endswith("[]") else f"[{table}]"
        schema.add((head, key))
    tables = _table_keys()
    named = {(t, k) for t, keys in tables.items() for k in keys}
    named -= {(t, k) for t, k in named if t in ("the top level", "[deadlines]")}
    assert named == schema
    assert set(tables["the top level"]) == {t.strip("[]").split(".")[0] for t, _ in schema}
    assert set(tables["[deadlines]"]) == {
        t.strip("[]").split(".")[1] for t, _ in schema if t.startswith("[deadlines.")
    }


@pytest.mark.parametrize(
    ("key", "table", "value", "name"),
    [
        ("log", "[run]", "$HOME/runs/x/transitions.jsonl", "'$HOME'"),
        ("revisions", "[run]", "/shared/${USER}/revisions", "'${USER}'"),
        ("curve_keys", "[transport]", "$KEYS", "'$KEYS'"),  # as examples/slurm's script reads
        ("path", "[model]", "$SCRATCH/models/tiny", "'$SCRATCH'"),
        ("train", "[data]", "$DATA/prompts.jsonl", "'$DATA'"),
    ],
)
def test_a_shell_variable_in_a_path_is_refused_as_a_tilde_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, key: str, table: str, value: str, name: str
) -> None:
    """`log = "$HOME/runs/x/transitions.jsonl"` passed `check`, shown as
    `<cwd>/$HOME/runs/x/...`: nothing expands a variable in a plan, and the run made a folder
    called `$HOME` (`~` is refused for that reason). Refused now, naming the variable and,
    where it is set, the path it would mean."""
    monkeypatch.setenv("HOME", "/home/me")
    monkeypatch.setenv("KEYS", "/home/me/.ehp-fsm/keys")
    monkeypatch.delenv("DATA", raising=False)
    plan = _plan(tmp_path, {"h0": 1, "h1": 2, "h2": 1}, [("h1", 1), ("h2", 1)], reserve=1)
    text = plan.read_text()
    if key == "log":
        text = text.replace(f'log = "{tmp_path}/run/transitions.jsonl"', "")
    line = f'{key} = "{value}"'
    if key == "curve_keys":
        text = text.replace('"tcp://127.0.0.1:*"', '"tcp://127.0.0.1:*"\ncurve_keys = "$KEYS"')
        text = text.replace("[transport]", "[transport]\nallow_non_loopback = true")
    elif table in text:
        text = text.replace(table, f"{table}\n{line}", 1)
    else:
        text += f"{table}\n{line}\n"
    plan.write_text(text)
    with pytest.raises(PlanError) as err:
        load_plan(plan)
    assert err.value.key == f"{table.strip('[]')}.{key}", err.value
    assert f"holds {name}, which is not expanded here" in err.value.why, err.value
    if key == "log":
        assert "e.g. '/home/me/runs/x/transitions.jsonl'" in err.value.why
    if key == "train":  # not set: no path to suggest
        assert "e.g." not in err.value.why
    # a `$` that names no variable (`$1`) is a character of the name, and taken
    plan.write_text(text.replace(value, value.replace("$", "cost$1-")))
    if key == "path":  # (the folder is missing: refused for that, not for the `$`)
        with pytest.raises(PlanError, match="is not a directory"):
            load_plan(plan)
    else:
        load_plan(plan)


@pytest.mark.parametrize(
    ("gpus", "device", "taken"),
    [
        (["h1:g5", "h1:g7"], "cpu", False),  # beyond the agent's 2 slots
        (["h1:g1", "h1:g0"], "cpu", True),  # the same slots, in another order
        (["h1:gpu0", "h1:gpu1"], "cpu", False),
        (["h1:g01", "h1:g1"], "cpu", False),  # `g01` is not `g1`
        (["a", "b"], "cpu", False),
        (["h1:g4", "h1:g5"], "cuda", True),  # CUDA devices 4 and 5 of the node
        (["h1:gpu4", "h1:gpu5"], "cuda", False),
    ],
)
def test_a_host_gpu_list_holds_only_ids_its_agent_has(
    tmp_path: Path, gpus: list[str], device: str, taken: bool
) -> None:
    """`[[hosts]] gpus = ["h1:g5", "h1:g7"]` passed `check`; the run then failed at its start:
    "agent h1 refused the launch: {'reason': 'unknown_gpus', 'detail': "['h1:g5'] not in
    ['h1:g0', 'h1:g1']"}" — the agent names its devices `ID:g<k>` (`detect_inventory`, here
    with the `--slots N` the run starts a CPU host's agent with)."""
    from ehp_fsm.runtime.agent import detect_inventory

    plan = _plan(tmp_path, {"h0": 1, "h1": 2, "h2": 1}, [("h1", 1), ("h1", 1)], reserve=1)
    text = plan.read_text().replace('id = "h1"\ngpus = 2', f'id = "h1"\ngpus = {gpus}')
    if device == "cuda":  # SGLang engines on a CUDA host, EHP off: what the run accepts there
        text = text.replace(f"gpus = {gpus}", f'gpus = {gpus}\ndevice = "cuda"')
    plan.write_text(text)
    if device == "cpu":
        agent = set(detect_inventory("h1", len(gpus), "cpu")[1])
        assert taken == set(gpus).issubset(agent)
    if taken:
        loaded = load_plan(plan)
        assert {g for e in loaded.engines for g in e.gpus} == set(gpus)
        return
    with pytest.raises(PlanError) as err:
        load_plan(plan)
    assert err.value.key == "hosts[1].gpus", err.value
    assert "is not one the host's agent has" in err.value.why
    assert "write gpus = 2" in err.value.fix


def test_check_says_a_floor_past_the_batch_is_cut_to_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`[ehp] min_hybrids` past the groups a step has beside the Core is cut to them, as
    `max_hybrids` is (each replica trains whole groups; `planner._floor`): `check` says so,
    and the policy the planner gets keeps the floor the plan wrote."""
    plan = _plan(
        tmp_path,
        {"h0": 1, "h1": 4},
        [("h1", 1)] * 4,
        reserve=1,
        ehp="max_hybrids = 4\nmin_hybrids = 4",
    )
    assert main(["check", str(plan)]) == 0
    line = _ehp_line(capsys.readouterr().out)
    assert "at least 4 (min_hybrids" in line, line
    assert "cut to 3: 4 groups a step ([grpo] prompts_per_step) beside the Core's 1" in line, line
    assert load_plan(plan).planner_policy().min_hybrids == 4
    plan.write_text(plan.read_text().replace("min_hybrids = 4", "min_hybrids = 5"))
    assert main(["check", str(plan)]) == 2
    assert "`ehp.min_hybrids`" in capsys.readouterr().err
