"""What the run's start-up waits for: an engine that failed before serving ends the wait at
once, named with its reason (the run waited out the engines' start deadline, 180 s by default,
and then said only that the engines "did not start serving")."""

from __future__ import annotations

from pathlib import Path

from ehp_fsm import Event, Orchestrator, load_plan
from ehp_fsm.run.job import ended_engines, engines_not_serving

SHORT = Path(__file__).resolve().parents[2] / "examples" / "short.toml"


def test_an_engine_that_failed_before_serving_is_named_with_its_reason(tmp_path: Path) -> None:
    orch = Orchestrator.from_plan(load_plan(SHORT), log_path=tmp_path / "t.jsonl", check=True)
    try:
        for k, (eid, gpu) in enumerate((("e0", "h1:g0"), ("e1", "h1:g1"), ("e2", "h2:g0"))):
            payload = {"host": gpu.split(":")[0], "gpus": [gpu], "tp": 1, "token": f"t{k}"}
            out = orch.handle(Event("rollout_engine", eid, "launch", time=1.0, payload=payload))
            assert out.accepted, out.reason
        assert ended_engines(orch.world) == {}  # starting: they may still serve
        why = "launch failed on h2: FileNotFoundError: [Errno 2] No such file or directory"
        out = orch.handle(Event("rollout_engine", "e2", "fail", time=2.0, payload={"reason": why}))
        assert out.accepted, out.reason
        assert ended_engines(orch.world) == {"e2": why}
    finally:
        orch.close()


def test_the_start_ups_error_names_the_engine_the_logs_and_a_fix() -> None:
    """kill -9 of an engine just after it served, while another still started: the run said
    "a rollout engine failed before serving: e2 (... in state serving): because see
    .../agents/*.log" (no reason, no fix, and the engine's own log is not there)."""
    why = "process exited unexpectedly (code -9) in state serving"
    logs = "see run/agents/<host>/logs/ (each engine's output) and run/agents/<host>.log"
    said = str(engines_not_serving({"e2": why}, None, logs, resume=False))
    assert said.startswith(
        "a rollout engine failed while the run started, before every engine served: "
        f"e2 ({why}): because the run trains only once every engine of the plan serves"
    ), said
    assert said.endswith(f"Fix: {logs} for the cause, fix it, then start the run again"), said
    said = str(engines_not_serving({}, 180.0, logs, resume=True))
    assert said.startswith("rollout engines did not all start serving within 180 s"), said
    assert said.endswith("then start `ehp-fsm run PLAN --resume` again"), said


def test_an_engine_failing_at_the_start_is_not_said_to_be_done_without(tmp_path: Path) -> None:
    """While the run starts, an engine's failure ends the run ("the run trains only once every
    engine serves"): its line said "the run goes on without it" first. Once every engine
    served, the run does go on without one that fails, and says so."""
    import io

    from ehp_fsm.report.progress import Progress
    from ehp_fsm.run.watch import FailureWatch

    orch = Orchestrator.from_plan(load_plan(SHORT), log_path=tmp_path / "t.jsonl", check=True)
    out = io.StringIO()
    watch = FailureWatch(Progress(out, live=False))
    try:
        for k, (eid, gpu) in enumerate((("e0", "h1:g0"), ("e2", "h2:g0"))):
            payload = {"host": gpu.split(":")[0], "gpus": [gpu], "tp": 1, "token": f"t{k}"}
            launched = orch.handle(
                Event("rollout_engine", eid, "launch", time=1.0, payload=payload)
            )
            assert launched.accepted, launched.reason
        fail = {"reason": "deadline"}
        assert orch.handle(Event("rollout_engine", "e2", "fail", time=2.0, payload=fail)).accepted
        watch.watch(orch.world)
        assert "rollout_engine e2 failed: deadline" in out.getvalue()
        assert "goes on without it" not in out.getvalue(), out.getvalue()
        watch.starting = False  # every engine served: the run goes on
        assert orch.handle(Event("rollout_engine", "e0", "fail", time=3.0, payload=fail)).accepted
        watch.watch(orch.world)
        assert "rollout_engine e0 failed: deadline; the run goes on without it" in out.getvalue()
    finally:
        orch.close()
