"""`ehp-fsm simulate`: the real controller in virtual time — determinism, replay, EHP on/off,
faults. Only the far edge is simulated (agents, engine processes, trainer ranks: no GPU
cluster can be part of a test); the machines, the loop, the planner, decision execution and the
dispatcher are the run's own."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from ehp_fsm.cli import main
from ehp_fsm.plan import MAX_PROMPTS_PER_STEP, MAX_SEED, load_plan
from ehp_fsm.replay import check_receipt, replay
from ehp_fsm.sim.cluster import MAX_GPUS, MAX_GROUPS, ScaleError, scale
from ehp_fsm.sim.output import compare, summary
from ehp_fsm.sim.story import SimResult, Simulation, StepFigure

HERE = Path(__file__).parent
HEAVY = HERE / "train_heavy.toml"
GPU_PLAN = HERE.parents[1] / "examples" / "gpu-4x8.toml"
SRC = HERE.parents[1] / "src"


def _sim(tmp: Path, name: str, **kw: object) -> Simulation:
    plan = load_plan(HEAVY)
    args: dict[str, object] = {"seed": 3, "faults": "heavy", "ehp": True, "steps": 12}
    args.update(kw)
    return Simulation(plan, log_path=tmp / name / "transitions.jsonl", **args)  # type: ignore[arg-type]


def test_same_seed_same_log_byte_for_byte_and_another_seed_differs(tmp_path: Path) -> None:
    a = _sim(tmp_path, "a").run()
    b = _sim(tmp_path, "b").run()
    c = _sim(tmp_path, "c", seed=4).run()
    bytes_a = Path(a.log).read_bytes()
    assert bytes_a == Path(b.log).read_bytes()
    assert bytes_a != Path(c.log).read_bytes()
    assert a.borrows, "the training-bound plan borrows"
    assert sum(a.faults_seen.values()) > 0, "heavy faults strike within 12 steps"


def test_same_log_in_another_process_with_another_string_hash_seed(tmp_path: Path) -> None:
    """Nothing in the run depends on set or dict order of strings (PYTHONHASHSEED differs)."""
    here = _sim(tmp_path, "here").run()
    code = (
        "import sys; from pathlib import Path; from ehp_fsm.plan import load_plan; "
        "from ehp_fsm.sim.story import Simulation; "
        f"Simulation(load_plan({str(HEAVY)!r}), seed=3, faults='heavy', ehp=True, steps=12, "
        f"log_path=Path({str(tmp_path / 'there.jsonl')!r})).run()"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(SRC)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
    assert Path(here.log).read_bytes() == (tmp_path / "there.jsonl").read_bytes()


def test_the_log_replays_and_matches_the_receipt(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    code = main(
        [
            "simulate",
            str(HEAVY),
            "--steps",
            "10",
            "--faults",
            "heavy",
            "--seed",
            "1",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "time to 10 steps" in text and "invariant checks" in text
    progress = [line for line in text.splitlines() if line.startswith("step ")]
    # the first step, then every step the plan's length divides into 20, each with its wall time
    # and (but the last) the estimate of what is left — a cluster-sized run takes minutes
    assert [line.split()[1] for line in progress] == [f"{s}/10" for s in range(1, 11)], text
    assert all(" wall " in line and " left" in line for line in progress[:-1]), progress
    assert " wall " in progress[-1] and " left" not in progress[-1], progress
    for name in ("transitions.jsonl", "summary.txt", "timeline.png", "receipt.json"):
        assert (out / name).is_file(), name
    # 32 GPUs: one line per GPU as well, and the line that lists what was written says so
    assert (out / "timeline-gpus.png").is_file() and (out / "timeline-gpus.svg").is_file()
    assert "summary.txt,timeline.png,timeline-gpus.{png,svg},receipt.json}" in text, text
    receipt = json.loads((out / "receipt.json").read_text())
    result = replay(out / "transitions.jsonl")
    check_receipt(result, receipt)  # raises unless the log ends where the receipt says
    assert result.transitions == receipt["transitions"]
    assert receipt["last_step"] == 10 and receipt["revision"] == 11


def test_ehp_both_compares_the_same_seed_off_and_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(["simulate", str(HEAVY), "--steps", "15", "--ehp", "both", "--out", str(tmp_path)])
        == 0
    )
    text = capsys.readouterr().out
    assert "EHP off vs on" in text
    assert "  time to 15 steps " in text, text  # it said "time to S steps"
    speed = float(text.split("EHP speed-up to 15 steps: ")[1].split("×")[0])
    assert speed > 1.2, text  # training-bound: borrowed GPUs shorten the steps
    off = json.loads((tmp_path / "ehp-off" / "receipt.json").read_text())
    on = json.loads((tmp_path / "ehp-on" / "receipt.json").read_text())
    assert on["steps_s"] < off["steps_s"]
    assert (tmp_path / "comparison.txt").is_file()


def test_rollout_bound_plan_borrows_nothing(tmp_path: Path) -> None:
    """gpu-4x8 with its documented default costs is rollout-bound: the planner holds."""
    r = Simulation(load_plan(GPU_PLAN), seed=0, steps=8, log_path=tmp_path / "t.jsonl").run()
    assert r.borrows == [] and len(r.figures) == 8
    assert sum(f.rollout_s for f in r.figures) > sum(f.train_s for f in r.figures)


def _records(log: str) -> list[dict[str, object]]:
    """The log's records after its header, without their hash chain (it covers the header)."""
    lines = Path(log).read_text().splitlines()[1:]
    return [{k: v for k, v in json.loads(x).items() if k != "chain"} for x in lines]


def test_ehp_on_that_borrows_nothing_runs_as_ehp_off(tmp_path: Path) -> None:
    """EHP on costs nothing when the planner holds: the same records at the same times. The
    planner's turn waits for every engine's install before it decides; the next step's groups
    went out only after it, so the engines that installed first sat idle until the last one
    (busy with a long group) had: at 64 hosts, step 5 ended 0.36 s later (0.995× at 1,024)."""
    plan = scale(load_plan(GPU_PLAN), 64)
    off = Simulation(plan, seed=0, ehp=False, steps=5, log_path=tmp_path / "off.jsonl").run()
    on = Simulation(plan, seed=0, ehp=True, steps=5, log_path=tmp_path / "on.jsonl").run()
    assert on.borrows == []
    assert [f.end for f in on.figures] == [f.end for f in off.figures]
    assert _records(on.log) == _records(off.log)


def test_scale_repeats_hosts_and_scales_what_is_per_cluster() -> None:
    plan = load_plan(GPU_PLAN)
    big = scale(plan, 8)
    assert [h.id for h in big.hosts] == ["n0", "n1", "n2", "n3", "n0.1", "n1.1", "n2.1", "n3.1"]
    assert big.core.dp == 2 * plan.core.dp and len(big.engines) == 2 * len(plan.engines)
    assert big.grpo.prompts_per_step == 2 * plan.grpo.prompts_per_step
    assert big.rollout.reserve == 2 * plan.rollout.reserve
    assert len(set(big.inventory)) == len(big.inventory) == 64
    assert scale(plan, 4) is plan
    with pytest.raises(ScaleError, match=r"hosts hold no rollout engine|not whole Core replicas"):
        scale(plan, 1)


def test_bad_arguments_are_refused_with_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", str(HEAVY), "--steps", "0"]) == 2
    assert "--steps 0 is not a number of steps" in capsys.readouterr().err
    assert main(["simulate", str(HEAVY), "--hosts", "0"]) == 2
    assert "--hosts 0" in capsys.readouterr().err
    assert main(["simulate", str(HEAVY), "--hosts", "-1"]) == 2
    assert "--hosts -1 is not a number of hosts" in capsys.readouterr().err
    # seeds are a plan's [run] seeds, 0..MAX_SEED (a negative one ran before)
    assert main(["simulate", str(HEAVY), "--seed", "-5"]) == 2
    err = capsys.readouterr().err
    assert "--seed -5 is not a seed" in err and f"give --seed within 0..{MAX_SEED}" in err
    assert main(["simulate", str(HEAVY), "--seed", str(MAX_SEED + 1)]) == 2
    assert "is not a seed" in capsys.readouterr().err
    assert main(["simulate", str(HEAVY), "--seed", str(MAX_SEED), "--seeds", "2"]) == 2
    assert "--seeds 1 or fewer" in capsys.readouterr().err
    # a hunt keeps no output and runs one mode: --out and --ehp both were silently ignored
    assert main(["simulate", str(HEAVY), "--seeds", "2", "--out", "x"]) == 2
    err = capsys.readouterr().err
    assert "--seeds (a fault hunt) with --out" in err and "Fix: drop --out\n" in err, err
    assert main(["simulate", str(HEAVY), "--seeds", "2", "--ehp", "both"]) == 2
    err = capsys.readouterr().err  # (its fix said "drop --out" too, to a command without one)
    assert "Fix: give --ehp on or off with --seeds\n" in err, err
    assert main(["simulate", str(HEAVY), "--seeds", "2", "--ehp", "both", "--out", "x"]) == 2
    assert "Fix: drop --out and give --ehp on or off" in capsys.readouterr().err
    # a typo in the size is refused before anything is built (it took the machine's memory)
    assert main(["simulate", str(HEAVY), "--hosts", "100000000"]) == 2
    err = capsys.readouterr().err
    assert "bounded at 131,072 GPUs" in err and "or fewer" in err


def test_a_group_past_the_cap_is_refused_by_check_and_simulate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`[grpo] group_size = 100000000` passed `check`; `simulate` then grew its memory for
    minutes and died with a MemoryError traceback in `sim/costs.py`."""
    plan = tmp_path / "big-group.toml"
    text = HEAVY.read_text().replace("group_size = 8", "group_size = 100000000")
    plan.write_text(text.replace("prompts_per_step = 64", "prompts_per_step = 4"))
    for command in ("check", "simulate"):
        assert main([command, str(plan)]) == 2
        err = capsys.readouterr().err
        assert "plan key `grpo.group_size` is invalid" in err, err
        assert "past the largest 65,536" in err and "Traceback" not in err, err


def test_groups_a_step_past_the_caps_are_refused_by_check_and_simulate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`[grpo] prompts_per_step = 10000000` passed `check`; a run of it wrote 5.9 GB of log and
    grew to 11 GB before its first sample, and answered SIGTERM after ~8 minutes. The plan's
    cap is 65,536 groups a step; `--hosts` multiplies them, so the simulator bounds the scaled
    plan's groups too, naming the largest --hosts that fits."""
    plan = tmp_path / "many-groups.toml"
    for prompts in (MAX_PROMPTS_PER_STEP + 1, 10_000_000):
        plan.write_text(
            HEAVY.read_text().replace("prompts_per_step = 64", f"prompts_per_step = {prompts}")
        )
        for command in ("check", "simulate"):
            assert main([command, str(plan)]) == 2
            err = capsys.readouterr().err
            assert "plan key `grpo.prompts_per_step` is invalid" in err, err
            assert "past the largest 65,536" in err and "Traceback" not in err, err
            assert f"within 1..{MAX_PROMPTS_PER_STEP}" in err, err
    # at the plan's cap: it parses, and 4 hosts of 65,536 groups scale to at most 16 hosts
    plan.write_text(HEAVY.read_text().replace("prompts_per_step = 64", "prompts_per_step = 65536"))
    widest = load_plan(plan)
    assert widest.grpo.prompts_per_step == MAX_PROMPTS_PER_STEP
    assert main(["simulate", str(plan), "--hosts", "1024"]) == 2
    err = capsys.readouterr().err
    assert "makes the plan's 65,536 groups a step on 4 hosts 16,777,216 groups a step" in err, err
    assert f"bounded at {MAX_GROUPS:,} groups a step" in err and "--hosts 16 or fewer" in err, err
    assert scale(widest, 16).grpo.prompts_per_step == MAX_GROUPS
    with pytest.raises(ScaleError, match="--hosts 16 or fewer"):
        scale(widest, 17)
    # the simulator's largest cluster of the GPU example is within the bound
    gpu = load_plan(GPU_PLAN)
    assert scale(gpu, MAX_GPUS // 8).grpo.prompts_per_step == MAX_GROUPS


def test_silent_agents_are_quarantined_and_reconciled(tmp_path: Path) -> None:
    """Agents fall silent (their GPUs quarantined, their reports held) and come back (their
    GPUs reconciled as `runtime.reconcile` does); every invariant holds and the log replays."""
    plan_path = tmp_path / "silent.toml"
    plan_path.write_text(
        HEAVY.read_text() + "agent_silence_per_hour = 2.0\nagent_silence_s = 20.0\n"
    )
    r = Simulation(
        load_plan(plan_path), seed=2, faults="on", steps=15, log_path=tmp_path / "t.jsonl"
    ).run()
    assert r.faults_seen.get("agent_silence", 0) >= 2, r.faults_seen
    text = (tmp_path / "t.jsonl").read_text()
    assert '"event":"quarantine"' in text and '"event":"reconcile_owned"' in text
    assert replay(tmp_path / "t.jsonl").transitions == r.transitions


def test_ehp_on_needs_a_plan_that_allows_a_hybrid(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A plan of `enabled = false` may say `max_hybrids = 0`: `--ehp on` ran it at its own size
    as the EHP-off run again (never a borrow) and, with --hosts, allowed 1 Hybrid per copy."""
    text = GPU_PLAN.read_text().replace("enabled = true", "enabled = false")
    plan_path = tmp_path / "off.toml"
    plan_path.write_text(text.replace("max_hybrids = 5", "max_hybrids = 0"))
    assert scale(load_plan(plan_path), 8).ehp.max_hybrids == 0
    for args in (["--ehp", "both"], ["--hosts", "8", "--ehp", "on"]):  # (its default: off)
        assert (
            main(["simulate", str(plan_path), "--steps", "1", *args, "--out", str(tmp_path)]) == 2
        )
        err = capsys.readouterr().err
        assert "max_hybrids = 0" in err and "give --ehp off" in err, err
    assert scale(load_plan(GPU_PLAN), 8).ehp.max_hybrids == 10


def test_a_short_comparison_shows_the_times_its_speed_up_is_of() -> None:
    """0.01 h is 36 s: two short runs were both "0.01 h" above a speed-up of 0.716×, and 0.04
    GPU-hours were "0.0" beside "0.1". Under 0.1 h both columns are in seconds."""

    def result(ehp: bool, end: float) -> SimResult:
        figure = StepFigure(step=1, rollout_s=1.0, train_s=1.0, end=end, hybrids=0, retried=0)
        return SimResult(
            plan="p",
            hosts=3,
            gpus=4,
            steps=1,
            seed=0,
            ehp=ehp,
            faults="off",
            virtual_s=end + 3.0,
            train_start=3.0,
            figures=[figure],
        )

    off, on = result(False, 36.1), result(True, 49.2)
    table = compare(off, on)
    assert "time to 1 steps             33.1 s      46.2 s" in table, table
    assert "GPU-hours                   0.0434      0.0580" in table, table
    assert "EHP speed-up to 1 steps: 0.716×" in table, table
    assert "time to 1 steps: 33.1 s (virtual; whole run 39.1 s)" in summary(off)
    assert "GPU-hours: 0.0434;" in summary(off)
    # a long run keeps hours, and both columns one unit
    off, on = result(False, 3600.0), result(True, 200.0)
    assert "time to 1 steps             1.00 h      0.05 h" in compare(off, on)
    assert "GPU-hours: 4.00;" in summary(off)
    # the steps' time in its own unit, not the whole run's ("0.03 h" for 103.3 s)
    short_steps = replace(result(False, 106.3), virtual_s=400.0)
    assert "time to 1 steps: 103.3 s (virtual; whole run 0.11 h)" in summary(short_steps)
    assert f"GPU-hours: {8192 * 2.5:,.1f};" in summary(replace(off, gpus=8192, virtual_s=9000.0))


def test_the_seed_is_the_plans_unless_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--seed` defaulted to 0 whatever the plan's `[run] seed` said: the plan's seed went
    unused. Now it is the default; `--seed` still wins (and the hunt's reproduce command names
    the seed it ran)."""
    import io

    from ehp_fsm.sim.command import simulate

    plan = replace(load_plan(HEAVY), seed=7)
    for given, seen in ((None, 7), (2, 2)):
        out = io.StringIO()
        code = simulate(
            plan,
            plan_path=str(HEAVY),
            hosts=None,
            steps=1,
            seed=given,
            ehp="off",
            faults="off",
            seeds=None,
            out_dir=str(tmp_path / f"out{given}"),
            out=out,
        )
        assert code == 0
        assert f"seed {seen}," in out.getvalue(), out.getvalue()
        receipt = json.loads((tmp_path / f"out{given}" / "receipt.json").read_text())
        assert receipt["seed"] == seen


def test_scale_keeps_the_floor_within_the_scaled_max_hybrids() -> None:
    """`--hosts N` scales `max_hybrids` with the hosts, and `min_hybrids` as well, within it: a
    floor of 4 on a plan scaled to half its hosts was left at 4 over a `max_hybrids` of 2, and
    the planner refused its policy after the first step."""
    plan = load_plan(GPU_PLAN)
    floored = dataclasses.replace(plan, ehp=dataclasses.replace(plan.ehp, min_hybrids=4))
    half = scale(floored, 2)
    assert (half.ehp.max_hybrids, half.ehp.min_hybrids) == (2, 2)
    half.planner_policy()  # (raised "policy.min_hybrids ... above max_hybrids")
    double = scale(floored, 8)
    assert (double.ehp.max_hybrids, double.ehp.min_hybrids) == (10, 8)
