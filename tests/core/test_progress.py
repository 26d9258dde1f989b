"""Progress display: plain lines off a terminal, in-place redraw on one; the summary's figures."""

from __future__ import annotations

import io

from ehp_fsm.report.progress import (
    Move,
    Progress,
    RunFigures,
    StepStatus,
    render_summary,
    sparkline,
)

STATUS = StepStatus(
    step=3,
    steps=10,
    reward=0.25,
    exact=0.125,
    loss=-0.01,
    revision=4,
    core=1,
    hybrids=1,
    gpu_roles={"engine": 2, "hybrid": 1, "core": 1},
    shortfall="wanted 2, granted 1: reserve",
)


def test_plain_lines_when_not_a_terminal() -> None:
    out = io.StringIO()
    p = Progress(out)
    p.update(STATUS)
    p.update(STATUS)
    text = out.getvalue()
    assert "\x1b[" not in text
    assert text.count("\n") == 2
    assert "step 3/10" in text and "hybrid 1" in text and "shortfall: wanted 2" in text


def test_redraws_in_place_on_a_terminal() -> None:
    out = io.StringIO()
    p = Progress(out, live=True)
    p.update(STATUS)
    p.update(STATUS)
    assert "\x1b[3F\x1b[J" in out.getvalue()


def test_summary_lists_moves_and_time_split() -> None:
    f = RunFigures(
        rewards=[0.0, 0.1, 0.2, 0.5],
        exact=[0.0, 0.0, 0.1, 0.3],
        rollout_s=30.0,
        training_s=10.0,
        moves=[Move(kind="borrow", step=4, latency_s=0.8, detail="e1 -> hybrid x0")],
        final_revision=5,
        last_step=4,
        wall_s=41.0,
    )
    text = render_summary(f)
    assert "rollout 30.0s (75%)" in text
    assert "borrow" in text and "800 ms" in text
    assert "final revision 5" in text
    assert sparkline([0.0, 1.0]) == " █"


def test_the_time_split_accounts_for_the_waits_between_steps() -> None:
    """A run whose steps waited a minute for a frozen engine's install: the wait is in the
    split (it gave rollout and training as shares of their own sum: 18 % and 82 %)."""
    f = RunFigures(rollout_s=0.2, training_s=0.9, steps_s=61.6, install_wait_s=60.0, wall_s=95.1)
    line = next(x for x in render_summary(f).splitlines() if x.startswith("time: "))
    assert "rollout 0.2s (0%), training 0.9s (1%)" in line, line
    assert "between steps 60.5s (98%, waiting for installs 60.0s) of the steps' 61.6s" in line
    assert "start-up and end 33.5s; wall 95.1s" in line, line


def test_the_summary_says_why_the_reward_failed_not_only_how_often() -> None:
    """Under `on_error = "zero"` the summary said "reward failures (scored 0, ...): 236" and
    nothing of why: a reward returning None, a bool or a number past float32 looked alike."""
    f = RunFigures(
        rewards=[0.5],
        reward_failures=3,
        reward_failure_kinds={"not_a_number": 2, "non_finite": 1},
        reward_failure_last="prompt '2+3=' (completion 4 of 16: '5'): it returned None, a "
        "NoneType, not a number" + "!" * 400,
    )
    (line,) = [ln for ln in render_summary(f).splitlines() if ln.startswith("reward failures")]
    assert line.startswith(
        'reward failures (scored 0, on_error = "zero"): 3 (non_finite 1, not_a_number 2); '
        "the last: prompt '2+3=' (completion 4 of 16: '5'): it returned None"
    ), line
    assert line.endswith("…") and len(line) < 420, line


def test_a_resumed_runs_summary_says_its_figures_and_reward_failures_are_the_segments() -> None:
    """A resumed run's figures are its segment's (its process measured them; the resume
    removed the summary and receipt of the run it resumed), its last step and revision the
    whole run's. The reward failures read as the whole run's: "reward failures (...): 2" of
    a run resumed after step 9 counted steps 10.. alone. Now the summary says so."""
    f = RunFigures(
        rewards=[0.5, 0.6],
        reward_failures=2,
        reward_failure_kinds={"not_a_number": 2},
        last_step=11,
        final_revision=12,
        resumed_after=9,
    )
    lines = render_summary(f).splitlines()
    assert lines[2] == (
        "resumed after step 9: the figures below are this segment's, steps 10..11, not the "
        "whole run's"
    ), lines
    (line,) = [ln for ln in lines if ln.startswith("reward failures")]
    assert line == (
        'reward failures since the resume after step 9 (scored 0, on_error = "zero"): 2 '
        "(not_a_number 2)"
    ), line
    assert lines[-1] == "last step 11, final revision 12"
    f = RunFigures(last_step=9, final_revision=10, resumed_after=9)  # stopped as it started
    lines = render_summary(f).splitlines()
    assert lines[2] == "resumed after step 9: no step trained since", lines
    assert lines[-1] == "last step 9, final revision 10"
    fresh = render_summary(RunFigures(reward_failures=1)).splitlines()
    assert not any(ln.startswith("resumed") for ln in fresh), fresh
    assert 'reward failures (scored 0, on_error = "zero"): 1' in fresh


def test_with_a_kl_term_the_kl_to_the_reference_is_said_beside_the_approx_kl() -> None:
    """With `kl_coef > 0` the progress line said "kl 9.0e-15" (the k3 KL to the behaviour
    policy) while the KL to the reference, which the loss penalises, was 79.8: only the receipt
    had it (an ML user's find). Both now say it; without a KL term, nothing changes."""
    from pathlib import Path

    from ehp_fsm import Orchestrator, load_plan
    from ehp_fsm.run.watch import step_status

    plan = Path(__file__).resolve().parents[2] / "examples" / "local.toml"
    world = Orchestrator.from_plan(load_plan(plan)).world

    metrics = {
        "tokens": 8.0,
        "clip_fraction": 0.0,
        "ratio_mean": 1.0,
        "ratio_max": 1.0,
        "approx_kl": 9e-15,
        "ref_kl": 79.76,
    }
    for kl_reference in (True, False):
        f = RunFigures(kl_reference=kl_reference, rewards=[0.5], exact=[0.0])
        f.step_metrics.append(metrics)
        f.staleness.append({0: 2})
        status = step_status(world, f, step=1, steps=2, loss=39.8, core=1)
        (line,) = [x for x in render_summary(f).splitlines() if x.startswith("objective")]
        if kl_reference:
            assert "kl 9.0e-15  ref kl 8.0e+01" in status.note, status.note
            assert "KL to the reference 7.98e+01 (last step 7.98e+01)" in line, line
        else:
            assert "ref kl" not in status.note and "reference" not in line, line


def test_a_summary_with_no_move_says_why_when_it_knows() -> None:
    f = RunFigures(unmoved="[ehp] enabled = false: the planner never ran")
    assert "borrows and returns: none — [ehp] enabled = false: the planner never ran" in (
        render_summary(f)
    )
    assert "borrows and returns: none\n" in render_summary(RunFigures())
