"""The end of a run: Hybrids return, everything this run owns stops, and the run is written up.

`return_all` hands every active Hybrid's GPUs back to rollout at the last step boundary (the
Hybrid leaves, its GPUs' finalizers confirm, an engine is launched on each and serves the newest
revision). `finish` runs whatever happened before it — a clean end, an error, Ctrl-C/SIGTERM, or
a start-up that never completed — and stops what exists: the dispatcher and publisher, the
Hybrids (on the run's warm workers, not behind an agent), the controller, the trainer pool and
the agents. With `--verify` it saves the final state and repeats the training Core-only on the
recorded batches. It then writes the summary, the GPU timeline and `receipt.json` beside the log.

Knows: what a `Job` holds once started (any part may be missing after a failed start-up), the
receipt's keys, where the summary, timeline and verify records go. Does not know: the step loop,
the planner, or how the pieces were started (`job`, `startup`).
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ehp_fsm.core.world import Event
from ehp_fsm.report.progress import Move, render_summary
from ehp_fsm.report.timeline import draw_timeline, role_intervals
from ehp_fsm.rollout.client import SGLangClient
from ehp_fsm.runtime.identity import new_launch_token
from ehp_fsm.training.verify import verify_run

if TYPE_CHECKING:
    from ehp_fsm.run.job import Job


def return_all(job: Job) -> None:
    """Hybrids leave at this step boundary; their GPUs go back to rollout as engines that
    install the newest revision before they serve. The latency runs from the leave to the
    returned engine serving."""
    ctl = job.ctl
    for h in list(ctl.world.of("hybrid_replica").values()):
        if h.state != "active":
            continue
        t0 = time.monotonic()
        job.fire(Event("hybrid_replica", h.id, "leave", ctl.now()))
        hid = h.id
        freed = job.until(lambda hid=hid: all(g.state == "free" for g in _gpus_of(job, hid)), 30.0)
        for gid in h.get("gpus") or ():
            gpu = ctl.world.get("gpu", gid)
            host = gpu.get("host") if gpu is not None else h.get("host")
            job.fire(
                Event(
                    "rollout_engine",
                    job.new_id("engine"),
                    "launch",
                    ctl.now(),
                    {"host": host, "gpus": [gid], "tp": 1, "token": new_launch_token()},
                )
            )
        serving = freed and job.until(lambda: job.serving() >= len(job.plan.engines), 120.0)
        if serving:
            detail = f"hybrid {hid} -> engine serving"
        elif not freed:
            detail = f"hybrid {hid}: its GPUs were not confirmed free within 30 s"
        else:
            detail = f"hybrid {hid}: the engines on its GPUs did not serve within 120 s"
        job.figures.moves.append(
            Move(
                kind="return",
                step=job.figures.last_step,
                latency_s=time.monotonic() - t0,
                detail=detail,
            )
        )
    job.until(lambda: not job.pub.busy(), 60.0)


def _attempt(action: Any) -> Exception | None:
    """Run `action()`; the exception it raised, if any (shutdown goes on regardless)."""
    try:
        action()
    except Exception as exc:
        return exc
    return None


def _gpus_of(job: Job, hid: str) -> list[Any]:
    h = job.ctl.world.get("hybrid_replica", hid)
    return [job.ctl.world.get("gpu", g) for g in (h.get("gpus") or ())] if h else []


def finish(job: Job, error: BaseException | None) -> dict[str, Any]:
    """Stop everything the run owns, write the summary, timeline and receipt; return the
    receipt. Safe after a start-up that stopped half-way: only what exists is stopped."""
    figures = job.figures
    figures.wall_s = time.monotonic() - job.started
    receipt: dict[str, Any] = {
        "plan": job.plan.name,
        "error": repr(error) if error else None,
        "interrupted": job.stop_requested,
    }
    if hasattr(job, "ctl"):
        ctl = job.ctl
        receipt["last_step"] = figures.last_step
        receipt["last_revision"] = ctl.world.globals.get("revision")
        receipt["stopped"] = [f"{m}:{i}" for m, i, _ in ctl.owned_processes()]
        receipt["engine_revisions"] = engine_revisions(job.clients)
        # Whatever fails to close, the rest is still stopped; the receipt says what failed.
        receipt["shutdown_errors"] = [
            f"{name}: {exc!r}"
            for name, close in (("dispatcher", job.disp.close), ("publisher", job.pub.close))
            if (exc := _attempt(close)) is not None
        ]
        # Hybrids live on this run's warm workers, not behind an agent: end them here so
        # their GPUs' finalizers are confirmed before the controller waits for the rest.
        spec = ctl.world.specs["hybrid_replica"]
        for h in list(ctl.world.of("hybrid_replica").values()):
            if h.state not in spec.terminal:
                ctl.event("hybrid_replica", h.id, "fail", reason="shutdown")
        job.leases.drain()
        receipt["clean_controller"] = ctl.shutdown(timeout_s=30.0)
    final_state = job.run_dir / "verify" / "ehp-state"
    if hasattr(job, "pool"):
        if job.verify and error is None and figures.last_step > 0:
            saved = job.pool.save_state(final_state)
            receipt["verify_state"] = str(saved)
        receipt["killed_trainers"] = job.pool.shutdown(timeout_s=10.0)
    for a in job.agents:
        with contextlib.suppress(ProcessLookupError):
            a.send_signal(signal.SIGTERM)
    receipt["agents_exit"] = [wait_exit(a) for a in job.agents]
    if job.verify and receipt.get("verify_state") == str(final_state):
        receipt["verify"] = verify_final(job, final_state)
    summary = render_summary(figures)
    job.out.write(summary)
    (job.run_dir / "summary.txt").write_text(summary)
    if Path(job.plan.log).exists():
        paths = draw_timeline(
            role_intervals(job.plan.log),
            job.run_dir / "timeline",
            title=f"ehp-fsm run {job.plan.name}: GPU roles",
        )
        receipt["timeline"] = [str(p) for p in paths]
    receipt["moves"] = [
        {"kind": m.kind, "step": m.step, "latency_s": m.latency_s, "detail": m.detail}
        for m in figures.moves
    ]
    receipt["rewards"] = figures.rewards
    receipt["exact"] = figures.exact
    receipt["time_s"] = {
        "rollout": figures.rollout_s,
        "training": figures.training_s,
        "wall": figures.wall_s,
    }
    receipt["log"] = job.plan.log
    (job.run_dir / "receipt.json").write_text(json.dumps(receipt, indent=2, default=str))
    job.out.write(f"log: {job.plan.log}\nreceipt: {job.run_dir / 'receipt.json'}\n")
    job.out.flush()
    return receipt


def verify_final(job: Job, final_state: Path) -> dict[str, Any]:
    """Repeat the training Core-only on the recorded batches and compare, tensor by tensor."""
    job.progress.message("verify: repeating the run Core-only on the same rollout data")
    replayed, report = verify_run(
        job.run_dir / "verify" / "records",
        final_state,
        config=job.pool.config,
        work_dir=job.run_dir / "verify" / "replay",
    )
    for line in report.lines():
        job.progress.message(line)
    return {
        "passed": report.passed,
        "mode": report.mode,
        "lines": report.lines(),
        "replay_seconds": replayed.seconds,
        "hybrid_steps": replayed.hybrid_steps,
    }


def engine_revisions(clients: dict[str, SGLangClient]) -> dict[str, str | None]:
    """The weight version each attached engine reports (or why it could not be asked)."""
    out = {}
    for eid, client in clients.items():
        try:
            out[eid] = client.weight_version()
        except Exception as exc:
            out[eid] = f"unreachable: {exc}"
    return out


def wait_exit(p: subprocess.Popen[bytes]) -> int | None:
    """The exit code of `p`, killing it if it has not ended within 15 s of being asked."""
    try:
        return p.wait(15)
    except subprocess.TimeoutExpired:
        p.kill()
        return p.wait(5)
