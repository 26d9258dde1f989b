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
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ehp_fsm.core.planner_alloc import partition_tps
from ehp_fsm.core.world import Event, World
from ehp_fsm.report.progress import Move, render_summary
from ehp_fsm.report.timeline import draw_timeline, role_intervals
from ehp_fsm.rollout.client import SGLangClient
from ehp_fsm.runtime.identity import new_launch_token
from ehp_fsm.training.verify import verify_run

if TYPE_CHECKING:
    from ehp_fsm.run.job import Job


def return_all(job: Job, *, free_s: float = 30.0, serve_s: float = 120.0) -> None:
    """Hybrids leave at this step boundary; their GPUs go back to rollout as engines of the
    plan's allowed TPs (`rollout.allowed_tp`, as few engines as fit) that install the newest
    revision before they serve. The latency runs from the leave to those engines serving; the
    move says which wait failed when one did (GPUs not free within `free_s`, engines not
    serving within `serve_s`, or a stop requested meanwhile)."""
    ctl = job.ctl
    for h in list(ctl.world.of("hybrid_replica").values()):
        if h.state != "active":
            continue
        t0 = time.monotonic()
        hid, gpus = h.id, tuple(h.get("gpus") or ())
        job.fire(Event("hybrid_replica", hid, "leave", ctl.now()))
        freed = job.until(lambda gpus=gpus: _all_in(job, "gpu", gpus, "free"), free_s)
        launched = _launch_engines(job, gpus) if freed and not job.stop_requested else []
        serving = bool(launched) and job.until(
            lambda launched=launched: _all_in(job, "rollout_engine", launched, "serving"),
            serve_s,
        )
        if serving:
            detail = f"hybrid {hid} -> {', '.join(launched)} serving"  # as a planner return
        elif job.stop_requested:
            detail = f"hybrid {hid}: a stop was requested before its GPUs served rollout again"
        elif not freed:
            detail = f"hybrid {hid}: its GPUs were not confirmed free within {free_s:g} s"
        elif not launched:
            detail = f"hybrid {hid}: no engine launch on its GPUs was accepted (see the log)"
        else:
            engines = ", ".join(launched)
            detail = f"hybrid {hid}: engine {engines} did not serve within {serve_s:g} s"
        job.figures.moves.append(
            Move(
                kind="return",
                step=job.figures.last_step,
                latency_s=time.monotonic() - t0,
                detail=detail,
            )
        )
    job.until(lambda: not job.pub.busy(), 60.0)


def _launch_engines(job: Job, gpus: tuple[str, ...]) -> list[str]:
    """Launch engines on `gpus` (free), per host, cut into the plan's allowed TPs (the fewest
    engines that strand the fewest GPUs, as the planner's own returns do); the ids of the
    launches the engine accepted."""
    ctl = job.ctl
    allowed = tuple(sorted(set(job.plan.rollout.allowed_tp)))
    by_host: dict[str, list[str]] = {}
    for gid in gpus:
        gpu = ctl.world.get("gpu", gid)
        if gpu is not None:
            by_host.setdefault(str(gpu.get("host")), []).append(gid)
    launched = []
    for host, on_host in sorted(by_host.items()):
        on_host.sort()
        start = 0
        for tp in partition_tps(len(on_host), allowed, prefer_small=False):
            eid = job.new_id("engine")
            payload = {
                "host": host,
                "gpus": on_host[start : start + tp],
                "tp": tp,
                "token": new_launch_token(),
            }
            start += tp
            if job.fire(Event("rollout_engine", eid, "launch", ctl.now(), payload)).accepted:
                launched.append(eid)
    return launched


def _all_in(job: Job, machine: str, ids: Sequence[str], state: str) -> bool:
    """Every instance `ids` of `machine` exists and is in `state`."""
    world = job.ctl.world
    return all((inst := world.get(machine, i)) is not None and inst.state == state for i in ids)


def _attempt(action: Any) -> Exception | None:
    """Run `action()`; the exception it raised, if any (shutdown goes on regardless)."""
    try:
        action()
    except Exception as exc:
        return exc
    return None


def _end_hybrids(job: Job) -> None:
    """Hybrids live on this run's warm workers, not behind an agent: end them here so their
    GPUs' finalizers are confirmed before the controller waits for the rest."""
    ctl = job.ctl
    spec = ctl.world.specs["hybrid_replica"]
    for h in list(ctl.world.of("hybrid_replica").values()):
        if h.state not in spec.terminal:
            ctl.event("hybrid_replica", h.id, "fail", reason="shutdown")
    if hasattr(job, "leases"):
        job.leases.drain()


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
    # Whatever fails to close, the rest is still stopped; the receipt says what failed.
    errors: list[str] = []
    receipt["shutdown_errors"] = errors
    if hasattr(job, "ctl"):
        ctl = job.ctl
        receipt["last_step"] = figures.last_step
        receipt["last_revision"] = ctl.world.globals.get("revision")
        receipt["asked_to_stop"] = [f"{m}:{i}" for m, i, _ in ctl.owned_processes()]
        receipt["engine_revisions"] = engine_revisions(job.clients, ctl.world)
        # The rollout shell exists only once the agents connected (see `Job.start`).
        for name, attr in (("dispatcher", "disp"), ("publisher", "pub")):
            if hasattr(job, attr) and (exc := _attempt(getattr(job, attr).close)) is not None:
                errors.append(f"{name}: {exc!r}")
        job.shell_closed = True  # what the controller still commands of them is dropped
        if (exc := _attempt(lambda: _end_hybrids(job))) is not None:
            errors.append(f"hybrids: {exc!r}")
        try:
            receipt["clean_controller"] = ctl.shutdown(timeout_s=30.0)
        except Exception as exc:
            receipt["clean_controller"] = False
            errors.append(f"controller: {exc!r}")
        # hosts where some process was not confirmed stopped (its GPU still releasing)
        receipt["unconfirmed_hosts"] = ctl.unconfirmed_hosts()
    for client in getattr(job, "clients", {}).values():
        if (failed := _attempt(client.close)) is not None:
            errors.append(f"engine client: {failed!r}")
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


_SERVES = frozenset({"installing", "serving", "updating"})


def engine_revisions(clients: dict[str, SGLangClient], world: World) -> dict[str, str | None]:
    """The weight version each serving engine reports (or why it could not be asked); an
    engine that is leaving or gone (draining or stopping for a borrow, stopped, failed) will
    serve nothing more and is not listed."""
    out = {}
    for eid, client in clients.items():
        inst = world.get("rollout_engine", eid)
        if inst is None or inst.state not in _SERVES:
            continue
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
