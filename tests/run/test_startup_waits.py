"""What the run's start-up waits for: an engine that failed before serving ends the wait at
once, named with its reason (the run waited out the engines' start deadline, 180 s by default,
and then said only that the engines "did not start serving")."""

from __future__ import annotations

from pathlib import Path

from ehp_fsm import Event, Orchestrator, load_plan
from ehp_fsm.run.job import ended_engines

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
